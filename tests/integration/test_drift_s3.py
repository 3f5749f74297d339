"""Drift on an object store: Serve replicas write their traffic logs to a real S3 API server (moto,
on 127.0.0.1, through AWS_ENDPOINT_URL), as immutable objects, and `drift` reads them, and the
reference in the table snapshot the served version names, whose warehouse is there too. S3 cannot
append: every flush is a new object. Expiry keeps that snapshot while the version names it; one
expired anyway leaves `drift` a clear error."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pyarrow as pa
import pytest
import requests

from app import registry
from app.config import ServeConfig
from app.data import synth
from app.data.maintenance import expire
from app.data.selection import select
from app.data.table import ImageTable
from app.net import free_port
from app.storage import s3_client


def _objects(bucket: str, prefix: str) -> list[str]:
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _rows(bucket: str, prefix: str) -> list[dict]:
    bodies = (
        s3_client().get_object(Bucket=bucket, Key=key)["Body"].read() for key in _objects(bucket, prefix)
    )
    return [json.loads(line) for body in bodies for line in body.splitlines()]


def _copy_to_s3(local, snapshot_id: int, s3) -> tuple[ImageTable, int]:
    """The rows of a local table snapshot committed, as they are, to the table of `s3` (warehouse
    on S3, a catalog of its own), with the same Kafka offsets; that table and its snapshot id."""
    source = ImageTable.at(local.storage, local.catalog, local.table)
    rows, committed = source.scan(snapshot_id), source.committed(snapshot_id)
    table = ImageTable.at(s3.storage, s3.catalog, s3.table)
    dead_letters = sum(committed.values()) - rows.num_rows
    copied = table.commit(rows, {p: (0, end) for p, end in committed.items()}, dead_letters, local.topic)
    return table, copied


def _commit_one_more(table: ImageTable, topic: str) -> int:
    """A later commit: the table's first row again, at the next offset of its partition."""
    committed = table.committed()
    row = table.scan(table.current_snapshot_id()).slice(0, 1)
    partition = row.column("kafka_partition")[0].as_py()
    offset = row.schema.get_field_index("kafka_offset")
    row = row.set_column(offset, "kafka_offset", pa.array([committed[partition]], pa.int64()))
    return table.commit(row, {partition: (committed[partition], committed[partition] + 1)}, 0, topic)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_drift_reads_the_replicas_traffic_logs_and_its_reference_from_s3(trained, s3_bucket, tmp_path):
    from ray import serve

    from app.ops.drift import DriftConfig, drift
    from app.serve import deploy, wait_for_version

    local, snapshot, _, report, _ = trained
    # The trained version's table snapshot, row for row, in a table on S3, and the version registered
    # again under a name of its own naming that snapshot (the session's registry stays as it is).
    s3 = dataclasses.replace(
        local,
        storage=f"s3://{s3_bucket}/argus",
        catalog=f"sqlite:///{tmp_path / 'catalog.db'}",
        mlflow_uri=local.tracking_uri,
        model_name="argus-drift-s3",
    )
    table, copied = _copy_to_s3(local, snapshot.snapshot_id, s3)
    assert all(uri.startswith(f"s3://{s3_bucket}/argus/warehouse/") for uri in table.data_file_uris(copied))
    model = registry.load(local.tracking_uri, local.model_name, report.version)
    card = dataclasses.replace(model.card, lineage=select(table, s3.image_size, copied).lineage())
    with registry.start_run(s3.tracking_uri, registry.artifact_root(local), "drift-s3") as run:
        version = registry.register(s3.tracking_uri, s3.model_name, run.info.run_id, model.model, card)

    url = deploy(s3, ServeConfig(http_port=free_port(), poll_s=0.5, max_batch_size=8), blocking=False)
    try:
        wait_for_version(url, version, timeout_s=120)
        started = time.time()
        for record in itertools.islice(synth.generate(580, seed=5, size=32), 480, None):
            answer = requests.post(
                f"{url}/predict", data=record.value, headers={"Content-Type": "image/png"}, timeout=30
            )
            assert answer.status_code == 200
        deadline = time.monotonic() + 30
        while len(_rows(s3_bucket, "argus/traffic/")) < 100:
            assert time.monotonic() < deadline, _objects(s3_bucket, "argus/traffic/")
            time.sleep(0.2)
        window = DriftConfig(window_s=time.time() - started + 60, min_requests=50)
        result = drift(s3, window)
        print(f"\nfrom S3:\n{result}")
        for record in itertools.islice(synth.generate(585, seed=5, size=32), 580, None):
            requests.post(
                f"{url}/predict", data=record.value, headers={"Content-Type": "image/png"}, timeout=30
            )
    finally:
        serve.shutdown()  # the replica writes what it still buffers as it stops
    assert result.requests == 100 and result.output is not None and result.output.served == 100
    assert not result.output_drifted, result  # traffic the model knows
    logs = _objects(s3_bucket, "argus/traffic/")
    assert logs and all(key.endswith(".jsonl") for key in logs)
    rows = _rows(s3_bucket, "argus/traffic/")
    assert len(rows) == 105 and all(len(row["probabilities"]) == len(report.classes) for row in rows)

    # A commit since, then expiry as `watch` runs it: the snapshot the version names is kept.
    _commit_one_more(table, local.topic)
    assert registry.pinned_snapshot_ids(s3) == {copied}
    expire(table, older_than_s=0, keep=registry.pinned_snapshot_ids(s3))
    assert drift(s3, window).requests == 105
    # Expired anyway (by hand, say): drift says which snapshot of which version it lost.
    expire(table, older_than_s=0)
    lost = f"v{version}'s training data, table .* snapshot {copied}, is gone"
    with pytest.raises(RuntimeError, match=lost):
        drift(s3, window)
