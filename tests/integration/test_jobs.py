"""`ray job submit` against a real head node on 127.0.0.1: every stage runs as a job (ingest,
federate, train in the drift command's retraining job of ingest → train → promote-if-better, watch,
serve --detach, drift, promote), registering in and loading from `mlflow server` with basic auth
(tests/mlflow_server.py) with the credentials in the node's environment, as KubeRay's pods get them
from a Secret. `drift --retrain` submits that job only on drift, to run in the project's folder on
the storage and registry drift read."""

from __future__ import annotations

import dataclasses
import re
import shutil
import time
import uuid
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from app import registry
from app.config import ProduceConfig, Settings
from app.data.produce import produce
from app.data.table import ImageTable
from app.net import free_port
from app.serve.promote import wait_for_rollout

from conftest import TEST_IMAGE_SIZE
from ray_nodes import LocalRayCluster, submit, wait_for_job
from served import sequential


@pytest.fixture(scope="module")
def head_node(tmp_path_factory, mlflow_server):
    """A `ray start --head` node of its own (2 CPUs, like CI's machine), shared by this module's
    tests and gone with them (a detached Serve deployment on it would otherwise idle on through
    the rest of the suite), with the MLflow server's credentials in its environment: every job's
    driver and every Serve replica has them. Its dashboard URL."""
    cluster = LocalRayCluster(tmp_path_factory.mktemp("head"), head_env=mlflow_server.credentials)
    try:
        cluster.start_head(num_cpus=2)
        yield cluster.dashboard
    finally:
        cluster.shutdown()


def _drifted_copy(trained, tmp_path):
    """The trained version's registry in a storage of this test's own (so the job registers nothing
    other tests see), its table read where it is (the catalog named, as a shared one is in
    production), with traffic the model never saw: flat grey screens."""
    import torch

    from app.serve import TrafficLog

    local, _, _, report, _ = trained
    storage = tmp_path / "data"
    storage.mkdir()
    shutil.copy(local.local_storage_path / "mlflow.db", tmp_path / "mlflow.db")  # artifacts stay put
    settings = dataclasses.replace(
        local,
        storage=str(storage),
        catalog=f"sqlite:///{local.local_storage_path / 'catalog.db'}",
        mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    log = TrafficLog(settings.uri("traffic"), "grey")
    scores = {c: (1.0 if i == 0 else 0.0) for i, c in enumerate(report.classes)}
    answer = {"label": report.classes[0], "scores": scores, "model_version": report.version}
    for _ in range(40):
        log.record(torch.full((3, TEST_IMAGE_SIZE, TEST_IMAGE_SIZE), 2.5), answer)
    log.close()
    return settings


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_stage_runs_as_a_job(head_node, broker, mlflow_server, tmp_path, monkeypatch, cli):
    settings = Settings(
        bootstrap_servers=broker,
        topic=f"t-{uuid.uuid4().hex[:8]}",
        storage=str(tmp_path / "data"),
        image_size=TEST_IMAGE_SIZE,
        model="cnn",
        partitions=2,
        mlflow_uri=mlflow_server.url,
    )
    for name, value in mlflow_server.credentials.items():  # this process's registry calls
        monkeypatch.setenv(name, value)
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
        "--mlflow-uri",
        mlflow_server.url,
    ]
    job = submit(head_node, "ingest", *common)
    logs = wait_for_job(head_node, job)
    assert "table snapshot " in logs
    # Its driver joined the job's cluster (Ray gives it RAY_ADDRESS) rather than starting a Ray of its
    # own: the head's GCS knows the driver of this submission only then.
    assert JobSubmissionClient(head_node).get_job_info(job).driver_info is not None
    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    snapshot_id = table.current_snapshot_id()
    assert sum(table.committed(snapshot_id).values()) == 240  # every offset: a row or a dead letter

    # Federated training as a job: Flower's clients run on the job's cluster, which outlives it. The
    # first version of the name becomes the champion the retraining job must beat.
    logs = wait_for_job(
        head_node,
        submit(head_node, "federate", *common, "--rounds", "1", "--clients", "2", "--clients-per-round", "2"),
    )
    assert "registered v1" in logs and "after 1 rounds" in logs, logs[-3000:]
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == "1"
    first = registry.load(settings.tracking_uri, settings.model_name, "1")
    assert first.card.training_kind == "federated"
    # The artifacts went through the server into its store (the session shares it: v1's run's own
    # folder there), not beside the table.
    import mlflow

    server = mlflow.MlflowClient(mlflow_server.url)
    first_run = server.get_model_version(settings.model_name, "1").run_id
    assert list(mlflow_server.artifacts.glob(f"*/{first_run}/artifacts/model/**/{registry.WEIGHTS_FILE}"))
    assert not Path(settings.storage, "mlartifacts").exists()

    # The retraining job drift submits: ingest (nothing new) && train --promote-if-better, judged
    # against that champion on the test slice.
    from app.ops.retrain import submit_retraining

    job = submit_retraining(dataclasses.replace(settings, ray_address=head_node), first.card)
    logs = wait_for_job(head_node, job)
    assert "nothing new to ingest" in logs and "registered argus-behavior v2" in logs
    comparison = re.search(r"test slice: v2 ([0-9.]+) (?:>|<=) champion v1 ([0-9.]+)", logs)
    assert comparison, logs[-3000:]
    new, old = map(float, comparison.groups())
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == (
        "2" if new > old else "1"
    )
    # The trained version names its snapshot as its MLflow dataset, and its pyfunc model (what
    # `mlflow.pyfunc.load_model` loads, as test_serve.py does) is in the server's store.
    trained_run = server.get_run(server.get_model_version(settings.model_name, "2").run_id)
    (dataset,) = trained_run.inputs.dataset_inputs
    assert dataset.dataset.name == str(snapshot_id)
    assert list(mlflow_server.artifacts.glob(f"*/{trained_run.info.run_id}/artifacts/model/MLmodel"))

    # The long-lived watch as a job: it ingests what arrived since and stops after one micro-batch.
    produce(
        settings,
        ProduceConfig(synthetic=60, seed=9, source_image_size=TEST_IMAGE_SIZE),
        settings.kafka_connection(),
    )
    logs = wait_for_job(head_node, submit(head_node, "watch", *common, "--max-ticks", "1"))
    assert "watch stopped after" in logs, logs[-3000:]
    assert 240 < sum(table.committed().values()) <= 300

    # serve --detach as a job: the deployment outlives it; drift and promote as jobs against it.
    champion = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    port = free_port()
    wait_for_job(head_node, submit(head_node, "serve", "--detach", "--http-port", str(port), *common))
    url = f"http://127.0.0.1:{port}"
    wait_for_rollout(url, champion, timeout_s=240)
    sequential(url, 40)
    logs = wait_for_job(head_node, submit(head_node, "drift", "--min-requests", "30", *common))
    assert f"v{champion} vs 40 recent requests" in logs, logs[-3000:]
    target = "2" if champion != "2" else "1"
    logs = wait_for_job(head_node, submit(head_node, "promote", target, *common))
    assert f"every replica (1) at {url} serves v{target}" in logs, logs[-3000:]
    assert {version for version, _ in sequential(url, 20)} == {target}
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == target

    # A client without the credentials is refused by the registry (before any Ray: in process) and
    # changes nothing.
    for name in mlflow_server.credentials:
        monkeypatch.delenv(name)
    refused = cli("promote", champion, *common, "--timeout-s", "30")
    assert refused.returncode == 2 and "refused this client (HTTP 401)" in refused.stderr, refused.stderr
    for name, value in mlflow_server.credentials.items():
        monkeypatch.setenv(name, value)
    assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == target
    assert {version for version, _ in sequential(url, 10)} == {target}

    # The head node still serves, and every job of this test (the head is shared) succeeded.
    jobs = [job for job in JobSubmissionClient(head_node).list_jobs() if settings.topic in job.entrypoint]
    assert len(jobs) == 7 and {job.status for job in jobs} == {JobStatus.SUCCEEDED}, jobs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_drift_with_retrain_submits_the_retraining_job_only_on_drift(trained, head_node, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from app.ops.drift import DriftConfig, drift

    settings = _drifted_copy(trained, tmp_path)
    settings = dataclasses.replace(settings, ray_address=head_node)
    client = JobSubmissionClient(head_node)

    def jobs():  # the head is this module's: only this test's jobs name its topic
        return [job for job in client.list_jobs() if settings.topic in job.entrypoint]

    looked = drift(settings, DriftConfig(min_requests=30))  # no --retrain: a report, nothing more
    assert looked.drifted and looked.psi["mean_r"] > 1.0 and looked.job_id is None, looked
    assert jobs() == []

    found = drift(settings, DriftConfig(min_requests=30, retrain=True))
    assert found.drifted and found.job_id, found
    assert f"retraining job {found.job_id} submitted" in str(found)
    [job] = jobs()
    assert job.submission_id == found.job_id
    ingest, train = job.entrypoint.split(" && ")
    assert ingest.startswith("python -m app ingest ") and train.startswith("python -m app train ")
    assert train.endswith("--promote-if-better")
    for command in (ingest, train):
        assert f"--storage {settings.local_storage_path} " in command
        assert f"--topic {settings.topic} " in command and f"--image-size {TEST_IMAGE_SIZE} " in command
        assert f"--mlflow-uri {settings.mlflow_uri}" in command
    # It runs from the shipped project folder: its ingest finds the table complete.
    deadline = time.monotonic() + 300
    while "nothing new to ingest" not in client.get_job_logs(found.job_id):
        status = client.get_job_status(found.job_id)
        assert status in (JobStatus.PENDING, JobStatus.RUNNING), client.get_job_logs(found.job_id)[-3000:]
        assert time.monotonic() < deadline, client.get_job_logs(found.job_id)[-3000:]
        time.sleep(2)
    client.stop_job(found.job_id)  # its training is the next test's to watch
