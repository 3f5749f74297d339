"""Ingest's write side: a Ray Data sink whose write tasks put good rows into the table's Parquet
files (written, not yet committed: `ImageTable.write_files`) and publish dead letters, and return
the accounting the commit's proof is built from (`app.data.proof.WriteStats`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from ray.data import Datasink
from ray.data.block import BlockAccessor

from app.data import kafka
from app.data.proof import WriteStats
from app.data.records import dead_letter_folder, record_headers
from app.data.selection import hwc_bytes
from app.data.table import ImageTable
from app.errors import Reason
from app.storage import Store


class TableSink(Datasink):
    """Ray Data sink: good rows → the table's Parquet files, by event date (invisible until the
    driver commits them); dead letters → `<topic>.dlq` with `error` and `error_reason` headers and
    their source coordinates (too large for the topic: the bytes to `<storage>/dlq/`, a pointer
    record to the topic)."""

    def __init__(self, target: SinkTarget):
        self.target = target
        self.stats = WriteStats()

    def get_name(self):
        return "ImageTable"

    def write(self, blocks, ctx) -> WriteStats:
        return write_blocks(blocks, self.target)

    def on_write_complete(self, write_result):
        # Runs on the driver's instance: the per-task accounting becomes the commit.
        for task_stats in write_result.write_returns:
            self.stats.merge(task_stats)


@dataclass(frozen=True)
class SinkTarget:
    """Where one ingest's write tasks put what they write."""

    table: ImageTable
    dlq: Store
    """`<storage>/dlq/`, for dead letters too large for the DLQ topic."""
    connection: kafka.KafkaConnection
    topic: str
    dlq_topic: str
    dlq_max_bytes: int


RECORD_OVERHEAD_BYTES = 512
"""What a record batch adds to a record's key, value and headers, generously (Kafka's
`max.message.bytes` limits the whole batch)."""


def _dead_letter(row: dict, target: SinkTarget) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """The DLQ record's key, value and headers; a record too large for the topic (key, value and
    headers together) has its value stored under `<storage>/dlq/` and carries a pointer to it
    instead. An erased user's record keeps only its coordinates and reason: nothing of the user."""
    key = (row["key"] or "").encode()
    erased = row["reason"] == Reason.ERASED
    headers = [] if erased else record_headers(row["label"], row["event_time"], row["device_id"])
    headers += [
        ("error", row["error"].encode()),
        ("error_reason", row["reason"].encode()),
        ("source_topic", target.topic.encode()),
        ("source_partition", str(row["partition"]).encode()),
        ("source_offset", str(row["offset"]).encode()),
        ("source_timestamp", str(row["kafka_timestamp"]).encode()),  # for `redrive`'s rebuilt row
    ]
    if erased:
        return b"", b"", headers
    value = row["value"]
    size = len(value) + len(key) + sum(len(k) + len(v) for k, v in headers)
    if size + RECORD_OVERHEAD_BYTES <= target.dlq_max_bytes:
        return key, value, headers
    # Named by its source coordinates (a rerun after a crash overwrites the same object), under its
    # user's folder (one user's are erased together).
    relative = f"{target.topic}/{dead_letter_folder(row['key'])}/{row['partition']}-{row['offset']}.bin"
    digest = target.dlq.write(relative, value)
    headers += [
        ("payload_uri", target.dlq.uri(relative).encode()),
        ("payload_size", str(digest.size).encode()),
        ("payload_sha256", digest.sha256.encode()),
    ]
    return key, b"", headers


def table_rows(good: pa.Table) -> pa.Table:
    """Preprocessed good rows (`app.data.preprocess`) as the table's columns (CONTRACT.md §2)."""
    accessor = BlockAccessor.for_block(good)
    images = accessor.to_numpy("image")
    size = images.shape[-1]
    columns = {
        "kafka_partition": good.column("partition").cast(pa.int32()),
        "kafka_offset": good.column("offset").cast(pa.int64()),
        # "" for a record without a key or device id (a column of only those is Arrow's null type)
        "user_id": pc.fill_null(good.column("key").cast(pa.string()), ""),
        "label": good.column("label").cast(pa.string()),
        # int64 in Kafka; a batch that also held gap rows (no event time) may carry them as double.
        "event_time_ms": good.column("event_time").cast(pa.int64()),
        "device_id": pc.fill_null(good.column("device_id").cast(pa.string()), ""),
        "pixels": pa.array(hwc_bytes(images), pa.binary()),
        "height": pa.array([size] * good.num_rows, pa.int32()),
        "width": pa.array([size] * good.num_rows, pa.int32()),
        "kafka_timestamp_ms": good.column("kafka_timestamp").cast(pa.int64()),
    }
    if "source" in good.column_names:
        columns["source"] = good.column("source")
    if "features" in good.column_names:
        features = np.asarray(accessor.to_numpy("features"), dtype=np.float32)
        columns["features"] = pa.array(list(features), pa.list_(pa.float32()))
    return pa.table(columns)


def write_blocks(blocks, target: SinkTarget) -> WriteStats:
    """One write task: the table's data files (uncommitted), dead letters, and the accounting the
    commit's proof is built from."""
    stats = WriteStats()
    producer = None
    failures: list[BaseException] = []
    try:
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            stats.value_bytes += pc.sum(table.column("value_size")).as_py() or 0
            errors = table.column("error").to_pylist()
            gap_ends = table.column("gap_end").to_pylist()
            coordinates = zip(table.column("partition").to_pylist(), table.column("offset").to_pylist())
            for (p, offset), error, gap_end in zip(coordinates, errors, gap_ends):
                if gap_end >= 0:
                    stats.partition(p).skip(offset, gap_end)
                else:
                    stats.partition(p).add(offset, dead_letter=bool(error))
            bad = [i for i, e in enumerate(errors) if e]
            if bad:
                producer = producer or target.connection.producer()
                columns = [
                    "partition",
                    "offset",
                    "kafka_timestamp",
                    "key",
                    "value",
                    "label",
                    "event_time",
                    "device_id",
                    "error",
                    "reason",
                ]
                for row in table.take(bad).select(columns).to_pylist():
                    key, value, headers = _dead_letter(row, target)
                    future = producer.send(target.dlq_topic, key=key, value=value, headers=headers)
                    future.add_errback(failures.append)
                    stats.dlq_errors[row["reason"]] += 1
            records = pc.and_(pc.is_null(table.column("error")), pc.less(table.column("gap_end"), 0))
            good = table.filter(records)
            if good.num_rows == 0:
                continue
            event_times = good.column("event_time").cast(pa.int64())
            stats.labels.update(label for label in good.column("label").to_pylist() if label is not None)
            stats.late += pc.sum(good.column("late")).as_py() or 0
            stats.add_event_times(pc.min(event_times).as_py(), pc.max(event_times).as_py())
            stats.files.extend(target.table.write_files(table_rows(good)))
        if producer is not None:
            producer.flush()
    finally:
        if producer is not None:
            producer.close()
    if failures:  # an unacknowledged dead letter would be a lost record: fail before anything commits
        raise RuntimeError(
            f"{len(failures)} dead letters were not acknowledged by {target.dlq_topic}: {failures[0]}"
        )
    return stats
