"""Argus on an object store: a real S3 API server (moto, on 127.0.0.1) holds the table's warehouse
(its Parquet and metadata files) and MLflow's artifacts, configured the standard way
(AWS_ENDPOINT_URL and keys in the environment); the catalog is a SQLite file, as `--catalog` names
it. No step may rely on renaming a directory, which S3 cannot do."""

from __future__ import annotations

import dataclasses

import pytest
import requests

from app.config import IngestConfig, ProduceConfig, ServeConfig, TrainConfig
from app.data import synth
from app.data.ingest import ingest
from app.data.produce import produce
from app.data.table import ImageTable
from app.errors import ConfigError
from app.net import free_port
from app.storage import s3_client

from conftest import run_cli, settings_args, table_args


@pytest.fixture
def s3(settings, s3_bucket, tmp_path):
    """The test's settings with storage in a fresh bucket, the catalog and MLflow's tracking DB on
    local disk."""
    return dataclasses.replace(
        settings,
        storage=f"s3://{s3_bucket}/argus",
        catalog=f"sqlite:///{tmp_path / 'catalog.db'}",
        mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )


WAREHOUSE = "argus/warehouse/argus/behavior_images"


def keys(bucket: str, prefix: str) -> list[str]:
    """Object keys under `prefix`, without the empty `…/` markers pyarrow leaves for the parent
    of what it deletes (S3 has no directories; they mean nothing)."""
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(
        item["Key"] for page in pages for item in page.get("Contents", []) if not item["Key"].endswith("/")
    )


def table_of(settings) -> ImageTable:
    return ImageTable.at(settings.storage, settings.catalog, settings.table)


def table_coordinates(settings) -> list[tuple[int, int]]:
    """(partition, offset) of every row of the table's current snapshot, read as train reads it:
    the snapshot's data files, straight from S3."""
    from app.data.selection import read_rows

    table = table_of(settings)
    snapshot_id = table.current_snapshot_id()
    if snapshot_id is None:
        return []
    rows = read_rows(table.data_file_uris(snapshot_id), ["kafka_partition", "kafka_offset"])
    return list(zip(rows.column("kafka_partition").to_pylist(), rows.column("kafka_offset").to_pylist()))


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
    stored = keys(s3_bucket, f"{WAREHOUSE}/")
    listed = {
        uri.removeprefix(f"s3://{s3_bucket}/") for uri in table_of(s3).data_file_uris(first.snapshot_id)
    }
    assert listed == {k for k in stored if k.startswith(f"{WAREHOUSE}/data/")}  # every file committed
    assert any(k.startswith(f"{WAREHOUSE}/metadata/") for k in stored)  # the table's metadata on S3 too
    assert len(table_coordinates(s3)) == first.records
    assert not [k for k in keys(s3_bucket, "argus/") if ".tmp" in k]  # nothing staged, nothing renamed

    again = ingest(s3, IngestConfig(), kafka)
    assert again.snapshot_id is None and keys(s3_bucket, f"{WAREHOUSE}/") == stored

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


@pytest.mark.parametrize("fault", ["after_write", "before_commit", "after_commit"])
def test_ingest_killed_at_each_commit_step_reruns_exactly_on_s3(s3, s3_bucket, ray_cluster, fault):
    import ray

    kafka = s3.kafka_connection()
    produce(s3, ProduceConfig(synthetic=30, seed=9, source_image_size=32, corrupt_fraction=0.0), kafka)
    args = [
        "ingest",
        *settings_args(s3),
        *table_args(s3),
        "--ray-address",
        ray.get_runtime_context().gcs_address,
    ]
    killed = run_cli(*args, env={"ARGUS_FAULT": fault})
    assert killed.returncode == 137, killed.stderr[-2000:]
    committed_by_the_killed_run = len(table_coordinates(s3))
    assert committed_by_the_killed_run == (30 if fault == "after_commit" else 0)

    ingest(s3, IngestConfig(), kafka)  # the rerun, on the same Ray
    again = ingest(s3, IngestConfig(), kafka)
    assert str(again).startswith("nothing new"), again
    coordinates = table_coordinates(s3)
    assert len(coordinates) == 30 and len(set(coordinates)) == 30


def test_a_table_of_a_newer_argus_on_s3_stops_ingest_and_is_kept(s3, s3_bucket, ray_cluster):
    kafka = s3.kafka_connection()
    produce(s3, ProduceConfig(synthetic=12, seed=2, source_image_size=32, corrupt_fraction=0.0), kafka)
    ingest(s3, IngestConfig(), kafka)
    produce(s3, ProduceConfig(synthetic=6, seed=3, source_image_size=32, corrupt_fraction=0.0), kafka)
    table = table_of(s3).load()
    with table.transaction() as txn:  # as a newer Argus would mark it during a rolling upgrade
        txn.set_properties({"argus.format": "3"})
    before = keys(s3_bucket, "argus/")
    with pytest.raises(ConfigError, match="newer than this Argus"):
        ingest(s3, IngestConfig(), kafka)
    assert keys(s3_bucket, "argus/") == before  # nothing deleted, moved or written
    # Back to this Argus's format (the upgrade rolled back): the next ingest takes exactly the 6 new.
    with table_of_any_format(s3).transaction() as txn:
        txn.set_properties({"argus.format": "2"})
    assert ingest(s3, IngestConfig(), kafka).records == 6
    assert sorted(table_coordinates(s3)) == sorted(set(table_coordinates(s3)))
    assert len(table_coordinates(s3)) == 18


def table_of_any_format(settings):
    """The table through PyIceberg alone, whatever Argus format it says it is in."""
    from app.data.catalog import open_catalog, warehouse_uri

    return open_catalog(settings.catalog, warehouse_uri(settings.storage)).load_table(settings.table)
