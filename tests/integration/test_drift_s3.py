"""Drift on an object store: Serve replicas write their traffic logs to a real S3 API server (moto,
on 127.0.0.1, through AWS_ENDPOINT_URL), as immutable objects, and `drift` reads them, and the
snapshots' reference, from there. S3 cannot append: every flush is a new object."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pytest
import requests

from app.config import ServeConfig
from app.data import synth
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_drift_reads_the_replicas_traffic_logs_from_s3(trained, s3_bucket):
    from ray import serve

    from app.ops.drift import DriftConfig, drift
    from app.serve import deploy, wait_for_version

    local, snapshot, _, report, _ = trained
    # The trained version's snapshot, byte for byte, on S3; the registry stays where it is.
    s3 = dataclasses.replace(local, storage=f"s3://{s3_bucket}/argus", mlflow_uri=local.tracking_uri)
    folder = local.local_storage_path / "snapshots" / snapshot.snapshot_id
    for path in folder.rglob("*"):
        if path.is_file():
            key = f"argus/snapshots/{snapshot.snapshot_id}/{path.relative_to(folder)}"
            s3_client().put_object(Bucket=s3_bucket, Key=key, Body=path.read_bytes())

    url = deploy(s3, ServeConfig(http_port=free_port(), poll_s=0.5, max_batch_size=8), blocking=False)
    try:
        wait_for_version(url, report.version, timeout_s=120)
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
        result = drift(s3, DriftConfig(window_s=time.time() - started + 1, min_requests=50))
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
