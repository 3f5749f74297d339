"""`drift --retrain`: on drifted traffic, drift submits the retraining job (ingest → train
--promote-if-better) to a real head node's job server, and only then; the job starts in the
project's folder, on the storage and registry drift read. (That the job runs through to a judged
version is tests/integration/test_jobs.py's.)"""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest

from conftest import TEST_IMAGE_SIZE


def _drifted_copy(trained, tmp_path):
    """The trained version's snapshots and registry in a storage of this test's own (so the job
    registers nothing other tests see), with traffic the model never saw: flat grey screens."""
    import torch

    from app.serve import TrafficLog

    local, _, _, report, _ = trained
    storage = tmp_path / "data"
    shutil.copytree(local.local_storage_path / "snapshots", storage / "snapshots")
    shutil.copy(local.local_storage_path / "mlflow.db", tmp_path / "mlflow.db")  # artifacts stay put
    settings = dataclasses.replace(
        local, storage=str(storage), mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"
    )
    log = TrafficLog(settings.uri("traffic"), "grey")
    scores = {c: (1.0 if i == 0 else 0.0) for i, c in enumerate(report.classes)}
    answer = {"label": report.classes[0], "scores": scores, "model_version": report.version}
    for _ in range(40):
        log.record(torch.full((3, TEST_IMAGE_SIZE, TEST_IMAGE_SIZE), 2.5), answer)
    log.close()
    return settings


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_drift_with_retrain_submits_the_retraining_job_only_on_drift(trained, head_node, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    from app.ops.drift import DriftConfig, drift

    settings = _drifted_copy(trained, tmp_path)
    settings = dataclasses.replace(settings, ray_address=head_node)
    client = JobSubmissionClient(head_node)

    looked = drift(settings, DriftConfig(min_requests=30))  # no --retrain: a report, nothing more
    assert looked.drifted and looked.psi["mean_r"] > 1.0 and looked.job_id is None, looked
    assert client.list_jobs() == []

    found = drift(settings, DriftConfig(min_requests=30, retrain=True))
    assert found.drifted and found.job_id, found
    assert f"retraining job {found.job_id} submitted" in str(found)
    [job] = client.list_jobs()
    assert job.submission_id == found.job_id
    ingest, train = job.entrypoint.split(" && ")
    assert ingest.startswith("python -m app ingest ") and train.startswith("python -m app train ")
    assert train.endswith("--promote-if-better")
    for command in (ingest, train):
        assert f"--storage {settings.local_storage_path} " in command
        assert f"--topic {settings.topic} " in command and f"--image-size {TEST_IMAGE_SIZE} " in command
        assert f"--mlflow-uri {settings.mlflow_uri}" in command
    # It runs from the shipped project folder: its ingest finds the copied ledger complete.
    deadline = time.monotonic() + 300
    while "nothing new to ingest" not in client.get_job_logs(found.job_id):
        status = client.get_job_status(found.job_id)
        assert status in (JobStatus.PENDING, JobStatus.RUNNING), client.get_job_logs(found.job_id)[-3000:]
        assert time.monotonic() < deadline, client.get_job_logs(found.job_id)[-3000:]
        time.sleep(2)
    client.stop_job(found.job_id)  # its training is test_jobs.py's to watch
