"""`ray job submit` against a real head node on 127.0.0.1: ingest and train run as jobs, and the
drift command's retraining job runs ingest → train → promote-if-better."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from app import registry
from app.broker import free_port
from app.cluster import SERVE_ENV
from app.config import ProduceConfig, Settings
from app.produce import produce
from app.snapshot import list_manifests

from conftest import ROOT, TEST_IMAGE_SIZE, child_env

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def head_node(tmp_path_factory):
    """`ray start --head --block` in its own process group, stopped by that group's PID."""
    dashboard_port = free_port()
    temp_dir = f"/tmp/argus-ray-{uuid.uuid4().hex[:6]}"  # short: Ray's socket paths have a length limit
    env = child_env(PATH=f"{VENV_BIN}:{os.environ['PATH']}", RAY_USAGE_STATS_ENABLED="0", **SERVE_ENV)
    process = subprocess.Popen(
        [
            str(VENV_BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={free_port()}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            "--num-cpus=2",
            # Every listening port explicit: other Ray instances on the machine hold the defaults.
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=open(tmp_path_factory.mktemp("head") / "ray-start.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard_port}"
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, f"ray start --head exited: {process.args}"
        try:
            JobSubmissionClient(address).list_jobs()
            break
        except Exception:
            assert time.monotonic() < deadline, "the head node's job server never answered"
            time.sleep(1)
    yield address
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_for_job(address: str, job_id: str, timeout_s: float = 600) -> str:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    deadline = time.monotonic() + timeout_s
    while (status := client.get_job_status(job_id)) not in {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.STOPPED,
    }:
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(2)
    assert status == JobStatus.SUCCEEDED, client.get_job_logs(job_id)[-4000:]
    return client.get_job_logs(job_id)


def submit(address: str, *command: str) -> str:
    """`ray job submit --working-dir . --no-wait -- python -m app ...`, as the README shows."""
    result = subprocess.run(
        [
            str(VENV_BIN / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            "--no-wait",
            "--",
            "python",
            "-m",
            "app",
            *command,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return next(
        line.split("'")[1]
        for line in (result.stdout + result.stderr).splitlines()
        if "submitted successfully" in line
    )


@pytest.mark.slow
def test_ingest_and_train_as_jobs_then_a_retraining_job(head_node, broker, tmp_path):
    settings = Settings(
        bootstrap_servers=broker,
        topic=f"t-{uuid.uuid4().hex[:8]}",
        storage=str(tmp_path / "data"),
        image_size=TEST_IMAGE_SIZE,
        model="cnn",
        partitions=2,
    )
    produce(
        settings,
        ProduceConfig(synthetic=240, seed=8, source_image_size=TEST_IMAGE_SIZE),
        settings.kafka_connection(),
    )
    common = [
        "--bootstrap-servers",
        broker,
        "--topic",
        settings.topic,
        "--storage",
        settings.storage,
        "--image-size",
        str(TEST_IMAGE_SIZE),
        "--model",
        "cnn",
    ]
    logs = wait_for_job(head_node, submit(head_node, "ingest", *common))
    assert "snapshot snap-" in logs
    assert sum(m.records + m.dlq for m in list_manifests(settings)) == 240

    wait_for_job(head_node, submit(head_node, "train", *common, "--epochs", "2", "--num-workers", "2"))
    first = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    assert first == "1"

    from app.drift import submit_retraining

    card = registry.load(settings.tracking_uri, settings.model_name, first).card
    job = submit_retraining(dataclasses.replace(settings, ray_address=head_node), card)
    logs = wait_for_job(head_node, job)
    assert "nothing new to ingest" in logs and "registered argus-behavior v2" in logs
    comparison = re.search(r"test slice: v2 ([0-9.]+) (?:>|<=) champion v1 ([0-9.]+)", logs)
    assert comparison, logs[-3000:]
    new, old = map(float, comparison.groups())
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == (
        "2" if new > old else "1"
    )

    # Federated fine-tuning as a job: Flower's clients run on the job's cluster, which outlives it.
    logs = wait_for_job(
        head_node,
        submit(
            head_node,
            "federate",
            *common,
            "--rounds",
            "1",
            "--clients",
            "2",
            "--clients-per-round",
            "2",
            "--init-from",
            "champion",
        ),
    )
    assert "registered v3" in logs and "after 1 rounds" in logs, logs[-3000:]
    loaded = registry.load(settings.tracking_uri, settings.model_name, "3")
    assert loaded.card.training_kind == "federated"
    from ray.job_submission import JobSubmissionClient

    assert len(JobSubmissionClient(head_node).list_jobs()) == 4  # the head node still serves
