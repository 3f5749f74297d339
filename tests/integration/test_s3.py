"""Argus on an object store: a real S3 API server (moto, on 127.0.0.1) holds the snapshots, the
ingest lease and MLflow's artifacts, configured the standard way (AWS_ENDPOINT_URL and keys in the
environment). No step may rely on renaming a directory, which S3 cannot do."""

from __future__ import annotations

import dataclasses
import json

import pytest
import requests

from app.config import IngestConfig, ProduceConfig, ServeConfig, TrainConfig
from app.data import synth
from app.data.ingest import ingest
from app.data.produce import produce
from app.data.snapshot import MANIFEST, SnapshotStore, UnreadableManifest, read_rows
from app.net import free_port
from app.storage import Store, s3_client

from conftest import run_cli, settings_args


@pytest.fixture
def s3(settings, s3_bucket, tmp_path):
    """The test's settings with storage in a fresh bucket and MLflow's tracking DB on local disk."""
    return dataclasses.replace(
        settings, storage=f"s3://{s3_bucket}/argus", mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"
    )


def keys(bucket: str, prefix: str) -> list[str]:
    """Object keys under `prefix`, without the empty `…/` markers pyarrow leaves for the parent
    of what it deletes (S3 has no directories; they mean nothing)."""
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(
        item["Key"] for page in pages for item in page.get("Contents", []) if not item["Key"].endswith("/")
    )


def manifests(settings) -> list:
    return SnapshotStore.at(settings.uri()).manifests()


def snapshot_coordinates(settings) -> list[tuple[int, int]]:
    """(partition, offset) of every row in every committed snapshot, read as train reads them."""
    snapshots = SnapshotStore.at(settings.uri())
    uris = [snapshots.uri(m.snapshot_id) for m in snapshots.manifests()]
    if not uris:
        return []
    table = read_rows(uris, ["partition", "offset"])
    return list(zip(table.column("partition").to_pylist(), table.column("offset").to_pylist(), strict=True))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_produce_ingest_train_register_and_serve_on_s3(s3, s3_bucket, ray_cluster):
    from ray import serve

    from app.serve import deploy, wait_for_version
    from app.train import train

    kafka = s3.kafka_connection()
    produce(s3, ProduceConfig(synthetic=160, seed=5, source_image_size=32, corrupt_fraction=0.05), kafka)
    first = ingest(s3, IngestConfig(), kafka)
    assert first.snapshot_id and first.records + first.dlq == 160 and first.dlq > 0
    stored = keys(s3_bucket, f"argus/snapshots/{first.snapshot_id}/")
    manifest = json.loads(s3_client().get_object(Bucket=s3_bucket, Key=stored[0])["Body"].read())
    assert stored[0].endswith(MANIFEST) and manifest["records"] == first.records
    listed = {f"argus/snapshots/{first.snapshot_id}/{f['path']}" for f in manifest["files"]}
    assert listed == set(stored[1:]) and all(len(f["sha256"]) == 64 for f in manifest["files"])
    assert not [k for k in keys(s3_bucket, "argus/") if ".tmp" in k]  # nothing staged, nothing renamed

    again = ingest(s3, IngestConfig(), kafka)
    assert again.snapshot_id is None and keys(s3_bucket, "argus/snapshots/") == stored

    report = train(s3, TrainConfig(epochs=1, num_workers=1, batch_size=32, max_failures=0, run_name="on-s3"))
    weights = [k for k in keys(s3_bucket, "argus/mlartifacts/") if k.endswith("weights.safetensors")]
    assert len(weights) == 1, keys(s3_bucket, "argus/mlartifacts/")  # MLflow's artifacts on the same endpoint

    url = deploy(s3, ServeConfig(http_port=free_port(), poll_s=0.5), blocking=False)
    try:
        wait_for_version(url, report.version, timeout_s=120)
        image = next(synth.generate(1, seed=3, size=32)).value
        answer = requests.post(
            f"{url}/predict", data=image, headers={"Content-Type": "image/png"}, timeout=30
        )
        assert answer.status_code == 200 and answer.json()["model_version"] == report.version
    finally:
        serve.shutdown()


@pytest.mark.parametrize("fault", ["after_write", "before_manifest", "before_commit"])
def test_ingest_killed_at_each_commit_step_reruns_exactly_on_s3(s3, s3_bucket, ray_cluster, fault):
    import ray

    kafka = s3.kafka_connection()
    produce(s3, ProduceConfig(synthetic=30, seed=9, source_image_size=32, corrupt_fraction=0.0), kafka)
    args = ["ingest", *settings_args(s3), "--ray-address", ray.get_runtime_context().gcs_address]
    killed = run_cli(*args, env={"ARGUS_FAULT": fault})
    assert killed.returncode == 137, killed.stderr[-2000:]
    committed_by_the_killed_run = manifests(s3)
    assert len(committed_by_the_killed_run) == (1 if fault == "before_commit" else 0)

    ingest(s3, IngestConfig(), kafka)  # the rerun, on the same Ray
    again = ingest(s3, IngestConfig(), kafka)
    assert str(again).startswith("nothing new"), again
    coordinates = snapshot_coordinates(s3)
    assert len(coordinates) == 30 and len(set(coordinates)) == 30
    snapshots = {k.split("/")[2] for k in keys(s3_bucket, "argus/snapshots/")}
    assert snapshots == {m.snapshot_id for m in manifests(s3)}  # the uncommitted folder is gone


def test_a_manifest_on_s3_that_this_argus_cannot_read_stops_ingest_and_is_kept(s3, s3_bucket, ray_cluster):
    kafka = s3.kafka_connection()
    produce(s3, ProduceConfig(synthetic=12, seed=2, source_image_size=32, corrupt_fraction=0.0), kafka)
    first = ingest(s3, IngestConfig(), kafka)
    produce(s3, ProduceConfig(synthetic=6, seed=3, source_image_size=32, corrupt_fraction=0.0), kafka)
    key = f"argus/snapshots/{first.snapshot_id}/{MANIFEST}"
    good = s3_client().get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    newer = {**json.loads(good), "format": "argus.snapshot.v2"}  # as a newer Argus would write it
    s3_client().put_object(Bucket=s3_bucket, Key=key, Body=json.dumps(newer).encode())
    before = keys(s3_bucket, "argus/snapshots/")
    with pytest.raises(UnreadableManifest, match=f"snapshot {first.snapshot_id}: its manifest is not one"):
        ingest(s3, IngestConfig(), kafka)
    assert keys(s3_bucket, "argus/snapshots/") == before  # nothing deleted, moved or written
    # Restored (the Argus that wrote it is back): the next ingest takes exactly the 6 new records.
    s3_client().put_object(Bucket=s3_bucket, Key=key, Body=good)
    assert ingest(s3, IngestConfig(), kafka).records == 6
    assert sorted(snapshot_coordinates(s3)) == sorted(set(snapshot_coordinates(s3)))
    assert len(snapshot_coordinates(s3)) == 18


def test_the_lease_is_exclusive_on_s3_and_taken_over_only_after_it_expires(s3_bucket):
    from app.data.lease import Lease, LeaseHeld, LeaseLost

    root = Store.at(f"s3://{s3_bucket}/argus/leases/ingest-t")
    first = Lease(root, ttl_s=30)
    first.acquire()  # no heartbeat: a writer on another host that stalled
    with pytest.raises(LeaseHeld):
        Lease(root).acquire()
    stale = json.loads(
        s3_client().get_object(Bucket=s3_bucket, Key=f"argus/leases/ingest-t/{1:012d}.json")["Body"].read()
    )
    stale["host"] = "another-host"  # its pid means nothing here: only the expiry counts
    s3_client().put_object(
        Bucket=s3_bucket, Key=f"argus/leases/ingest-t/{1:012d}.json", Body=json.dumps(stale)
    )
    import time

    def past_its_ttl() -> float:  # the next writer's clock: 31 s on, without waiting for them
        return time.time() + 31

    with Lease(root, clock=past_its_ttl).held() as second:
        assert second.generation == 2
        with pytest.raises(LeaseLost, match="taken over"):
            first.check()
    assert keys(s3_bucket, "argus/leases/") == [f"argus/leases/ingest-t/{2:012d}.json"]
