"""Several Ray nodes on one host (tests/ray_nodes.py): what survives the loss of a node."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from app.config import ProduceConfig, Settings
from app.produce import produce
from app.snapshot import data_file_uris, list_manifests

from conftest import TEST_IMAGE_SIZE, settings_args
from ray_nodes import LocalRayCluster, submit, wait_for_job


@pytest.fixture
def cluster(tmp_path):
    nodes = LocalRayCluster(tmp_path)
    yield nodes
    nodes.shutdown()


@pytest.fixture
def snapshot_settings(settings) -> Settings:
    """The test's topic holding 960 synthetic records, none corrupt."""
    produce(
        settings,
        ProduceConfig(synthetic=960, seed=21, source_image_size=TEST_IMAGE_SIZE, corrupt_fraction=0.0),
        settings.kafka_connection(),
    )
    return settings


def _submit_training(cluster, settings: Settings, run: str, epochs: int, *options: str) -> tuple[str, Path]:
    """Ingest, then submit an elastic training job; return its id once Ray Train's controller has
    committed its first checkpoint (what a restarted group resumes from), and the run's folder."""
    common = settings_args(settings)
    wait_for_job(cluster.dashboard, submit(cluster.dashboard, "ingest", *common))
    job = submit(
        cluster.dashboard,
        "train",
        *common,
        *("--epochs", str(epochs), "--batch-size", "16", "--run-name", run, "--augment", "none"),
        *options,
    )
    run_dir = Path(settings.storage, "checkpoints", "train", run)
    deadline = time.monotonic() + 600
    while _committed_checkpoints(run_dir) < 1:
        assert time.monotonic() < deadline, "no checkpoint committed"
        time.sleep(0.5)
    return job, run_dir


def _committed_checkpoints(run_dir: Path) -> int:
    try:
        state = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or mid-write
        return 0
    return len(state.get("checkpoint_results", []))


def _history(settings: Settings, version: str) -> list[dict]:
    import mlflow

    mlflow.set_tracking_uri(settings.tracking_uri)
    client = mlflow.MlflowClient()
    run_id = client.get_model_version(settings.model_name, version).run_id
    return json.loads(Path(client.download_artifacts(run_id, "history.json")).read_text())


def test_harness_starts_two_nodes_and_a_killed_node_leaves_the_cluster(cluster):
    cluster.start_head(num_cpus=1)
    cluster.add_node("worker", num_cpus=1)
    assert len(cluster.alive_node_ids()) == 2
    cluster.kill("worker")
    assert len(cluster.alive_node_ids()) == 1 and list(cluster.nodes) == ["head"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("head_cpus", "worker_cpus", "cpus_per_worker", "workers_after"),
    [
        # One worker per node, so the group spans both; one is left after the loss.
        (1, 1, 1.0, 1),
        # As a user tried it: the group restarts with both workers on the head's only CPU, which
        # once left Ray Data's tasks pending for good.
        (1, 2, 0.5, 2),
    ],
    ids=["spanning", "head-full"],
)
def test_training_loses_a_node_mid_epoch_and_resumes_on_what_is_left(
    cluster, snapshot_settings, head_cpus, worker_cpus, cpus_per_worker, workers_after
):
    """The worker node dies (SIGKILL to its raylet and workers) once a checkpoint is committed. The
    elastic group restarts on the head from that checkpoint: the epochs before the loss keep their
    rows, each epoch is trained once, and the run finishes and registers."""
    settings = snapshot_settings
    cluster.start_head(num_cpus=head_cpus)
    cluster.add_node("worker", num_cpus=worker_cpus)
    epochs = 6
    job, _ = _submit_training(
        cluster,
        settings,
        "node-loss",
        epochs,
        *("--num-workers", "1-2", "--cpus-per-worker", str(cpus_per_worker), "--max-failures", "3"),
    )
    killed_at = time.time()
    cluster.kill("worker")
    logs = wait_for_job(cluster.dashboard, job, timeout_s=900)
    assert "registered" in logs, logs[-3000:]

    history = _history(settings, "1")
    assert [row["epoch"] for row in history] == list(range(epochs))
    before = [row for row in history if row["finished_at"] < killed_at]
    after = [row for row in history if row["finished_at"] > killed_at]
    # Not a restart from scratch: what finished before the loss is kept, not retrained.
    assert before and len(before) + len(after) == epochs
    assert all(row["workers"] == 2 for row in before)
    assert all(row["workers"] == workers_after for row in after)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_elastic_run_grows_when_a_node_joins(cluster, snapshot_settings):
    """A `1-2` group of one-CPU workers starts alone on a one-CPU head; a second node joins after
    the first checkpoint, and the group grows onto it (restarting from its last checkpoint)."""
    settings = snapshot_settings
    cluster.start_head(num_cpus=1)
    epochs = 12
    job, _ = _submit_training(
        cluster,
        settings,
        "grows",
        epochs,
        *("--num-workers", "1-2", "--cpus-per-worker", "1", "--resize-check-s", "2", "--verbose"),
    )
    cluster.add_node("worker", num_cpus=1)
    joined_at = time.time()
    logs = wait_for_job(cluster.dashboard, job, timeout_s=900)
    assert "registered" in logs, logs[-3000:]

    history = _history(settings, "1")
    assert [row["epoch"] for row in history] == list(range(epochs))
    workers = [row["workers"] for row in history]
    assert workers[0] == 1 and workers[-1] == 2, workers
    grown = workers.index(2)
    assert workers == [1] * grown + [2] * (epochs - grown), workers  # grew once, never shrank
    assert history[grown]["finished_at"] > joined_at


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_workers_holding_every_cpu_still_get_their_streamed_input(cluster, settings):
    """Input too big to hold in the object store streams from storage every epoch while two
    half-CPU workers hold the node's only CPU: its reads must not wait for a CPU."""
    cluster.start_head(1, "--object-store-memory=80000000")  # 25% of it: 20 MB
    settings = dataclasses.replace(settings, image_size=64)  # 12 KB of pixels a record: 1,800 are 22 MB
    produce(
        settings,
        ProduceConfig(synthetic=1800, seed=4, source_image_size=64, corrupt_fraction=0.0),
        settings.kafka_connection(),
    )
    common = settings_args(settings)
    wait_for_job(cluster.dashboard, submit(cluster.dashboard, "ingest", *common))
    job = submit(
        cluster.dashboard,
        "train",
        *common,
        *("--epochs", "2", "--batch-size", "32", "--num-workers", "2", "--cpus-per-worker", "0.5"),
    )
    logs = wait_for_job(cluster.dashboard, job, timeout_s=600)
    assert "streaming the input" in logs and "registered" in logs, logs[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ingest_losing_a_node_commits_exactly_or_nothing_and_the_rerun_is_exact(cluster, snapshot_settings):
    """The worker node dies once the first snapshot file is written: Ray retries the lost tasks to
    an exact snapshot, or ingest fails with nothing committed; either way, after a rerun every
    offset is in the snapshots exactly once."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    settings = snapshot_settings
    cluster.start_head(num_cpus=1)
    cluster.add_node("worker", num_cpus=2)
    common = settings_args(settings)
    job = submit(cluster.dashboard, "ingest", *common)
    snapshots = Path(settings.storage, "snapshots")
    deadline = time.monotonic() + 300
    while not any(snapshots.glob("**/*.parquet")):
        assert time.monotonic() < deadline, "ingest wrote nothing"
        time.sleep(0.2)
    committed_before = len(list_manifests(settings))
    cluster.kill("worker")
    client = JobSubmissionClient(cluster.dashboard)
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED}:
        assert time.monotonic() < deadline + 300, f"ingest {status} after the node loss"
        time.sleep(2)
    if status == JobStatus.FAILED:
        assert len(list_manifests(settings)) == committed_before == 0  # nothing half-committed
    wait_for_job(cluster.dashboard, submit(cluster.dashboard, "ingest", *common))  # the rerun
    import pyarrow.parquet as pq

    manifests = list_manifests(settings)
    tables = [
        pq.read_table(uri, columns=["partition", "offset"]) for uri in data_file_uris(settings, manifests)
    ]
    coordinates = [pair for t in tables for pair in zip(t["partition"].to_pylist(), t["offset"].to_pylist())]
    assert len(coordinates) == len(set(coordinates)) == 960 - sum(m.dlq for m in manifests)
    print(
        f"ingest after the node loss: {status.value}; {len(manifests)} snapshot(s), {len(coordinates)} rows"
    )
