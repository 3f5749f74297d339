"""A table commit written straight from arrays (no broker, no Ray Data), for tests of what reads
the table: federated learning's central split and its deployment engine."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from app.config import Settings
from app.data.selection import hwc_bytes
from app.data.table import ImageTable


def commit_snapshot(
    settings: Settings, keys: list[str], labels: list[str], event_times: np.ndarray, images: np.ndarray
) -> int:
    """One commit of partition 0, record i at offset i (uint8 `images` [N, 3, S, S]) to the table
    of `settings`; its table snapshot id."""
    records, size = len(keys), images.shape[-1]
    rows = pa.table(
        {
            "kafka_partition": pa.array([0] * records, pa.int32()),
            "kafka_offset": pa.array(range(records), pa.int64()),
            "user_id": keys,
            "label": labels,
            "event_time_ms": pa.array(event_times, pa.int64()),
            "device_id": [f"device-{k}" for k in keys],
            "pixels": pa.array(hwc_bytes(images), pa.binary()),
            "height": pa.array([size] * records, pa.int32()),
            "width": pa.array([size] * records, pa.int32()),
        }
    )
    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    return table.commit(rows, {0: (0, records)}, dlq_records=0, topic=settings.topic)
