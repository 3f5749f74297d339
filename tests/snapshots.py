"""A committed snapshot written straight from arrays (no broker, no Ray Data), for tests of what
reads snapshots: federated learning's central split and its deployment engine."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from app import storage
from app.config import Settings
from app.data.manifest import DataFile, WriteSpec, WriteStats, build_manifest
from app.data.snapshot import SnapshotStore


def commit_snapshot(
    settings: Settings, keys: list[str], labels: list[str], event_times: np.ndarray, images: np.ndarray
) -> str:
    """Snapshot `snap-1` of partition 0, record i at offset i (uint8 `images` [N, 3, S, S]); its URI."""
    from ray.data.extensions import ArrowTensorArray

    records = len(keys)
    table = pa.table(
        {
            "partition": pa.array([0] * records, pa.int32()),
            "offset": pa.array(range(records), pa.int64()),
            "key": keys,
            "label": labels,
            "event_time": pa.array(event_times, pa.int64()),
            "image": ArrowTensorArray.from_numpy(images),
        }
    )
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    data = buffer.getvalue().to_pybytes()
    folder = settings.local_storage_path / "snapshots" / "snap-1" / "event_date=1970-01-01"
    folder.mkdir(parents=True)
    (folder / "part-0.parquet").write_bytes(data)
    stats = WriteStats()
    for offset in range(records):
        stats.partition(0).add(offset, dead_letter=False)
    stats.labels.update(labels)
    stats.add_event_times(int(np.min(event_times)), int(np.max(event_times)))
    stats.files.append(DataFile("event_date=1970-01-01/part-0.parquet", len(data), storage.sha256(data)))
    spec = WriteSpec(
        topic=settings.topic, dlq_topic=f"{settings.topic}.dlq", image_size=images.shape[-1], classes=None,
        allowed_lateness_s=60.0,
    )  # fmt: skip
    manifest = build_manifest(spec, "snap-1", {0: (0, records)}, {}, stats)
    snapshots = SnapshotStore.at(settings.uri())
    assert snapshots.commit(manifest)
    return snapshots.uri("snap-1")
