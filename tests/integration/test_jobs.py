"""`ray job submit` against a real head node on 127.0.0.1: every stage runs as a job (ingest, train,
federate, watch, serve --detach, drift, promote), and the drift command's retraining job runs
ingest → train → promote-if-better."""

from __future__ import annotations

import dataclasses
import re
import uuid

import pytest
from ray.job_submission import JobSubmissionClient

from app import registry
from app.config import ProduceConfig, Settings
from app.data.produce import produce
from app.data.snapshot import SnapshotStore
from app.net import free_port
from app.serve.rollout import wait_for_rollout

from conftest import TEST_IMAGE_SIZE
from ray_nodes import submit, wait_for_job
from served import sequential


@pytest.mark.slow
@pytest.mark.timeout(1200)
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
    job = submit(head_node, "ingest", *common)
    logs = wait_for_job(head_node, job)
    assert "snapshot snap-" in logs
    # Its driver joined the job's cluster (Ray gives it RAY_ADDRESS) rather than starting a Ray of its
    # own: the head's GCS knows the driver of this submission only then.
    assert JobSubmissionClient(head_node).get_job_info(job).driver_info is not None
    assert sum(m.records + m.dlq for m in SnapshotStore.at(settings.uri()).manifests()) == 240

    wait_for_job(head_node, submit(head_node, "train", *common, "--epochs", "2", "--num-workers", "2"))
    first = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    assert first == "1"

    from app.ops.drift import submit_retraining

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

    # The long-lived watch as a job: it ingests what arrived since and stops after one micro-batch.
    produce(
        settings,
        ProduceConfig(synthetic=60, seed=9, source_image_size=TEST_IMAGE_SIZE),
        settings.kafka_connection(),
    )
    logs = wait_for_job(head_node, submit(head_node, "watch", *common, "--max-ticks", "1"))
    assert "watch stopped after" in logs, logs[-3000:]
    assert 240 < sum(m.records + m.dlq for m in SnapshotStore.at(settings.uri()).manifests()) <= 300

    # serve --detach as a job: the deployment outlives it; drift and promote as jobs against it.
    champion = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    port = free_port()
    wait_for_job(head_node, submit(head_node, "serve", "--detach", "--http-port", str(port), *common))
    url = f"http://127.0.0.1:{port}"
    wait_for_rollout(url, champion, timeout_s=240)
    sequential(url, 40)
    logs = wait_for_job(head_node, submit(head_node, "drift", "--min-requests", "30", *common))
    assert f"v{champion} vs 40 recent requests" in logs, logs[-3000:]
    target = "3" if champion != "3" else "1"
    logs = wait_for_job(head_node, submit(head_node, "promote", target, *common))
    assert f"every replica (1) at {url} serves v{target}" in logs, logs[-3000:]
    assert {version for version, _ in sequential(url, 20)} == {target}

    assert len(JobSubmissionClient(head_node).list_jobs()) == 8  # the head node still serves
