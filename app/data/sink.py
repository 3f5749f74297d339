"""Ingest's write side: a Ray Data sink whose write tasks put good rows into Parquet files under the
snapshot's folder (recording each file's size and SHA-256 for the manifest) and publish dead letters,
and return the accounting the manifest's proof is built from (`app.data.manifest.WriteStats`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from ray.data import Datasink
from ray.data.block import BlockAccessor

from app.data import kafka
from app.data.manifest import DataFile, WriteStats, event_date
from app.data.records import record_headers
from app.storage import Store


class SnapshotSink(Datasink):
    """Ray Data sink: good rows → Parquet files straight under the snapshot's folder, by event date
    (invisible until the manifest commits them); dead letters → `<topic>.dlq` with `error` and
    `error_reason` headers and their source coordinates (too large for the topic: the bytes to
    `<storage>/dlq/`, a pointer record to the topic)."""

    def __init__(self, target: SinkTarget):
        self.target = target
        self.stats = WriteStats()

    def get_name(self):
        return "Snapshot"

    def write(self, blocks, ctx) -> WriteStats:
        return write_snapshot_blocks(blocks, self.target, f"{ctx.task_idx:05d}")

    def on_write_complete(self, write_result):
        # Runs on the driver's instance: the per-task accounting becomes the manifest.
        for task_stats in write_result.write_returns:
            self.stats.merge(task_stats)


@dataclass(frozen=True)
class SinkTarget:
    """Where one ingest's write tasks put what they write."""

    folder: Store
    """The snapshot's folder."""
    dlq: Store
    """`<storage>/dlq/`, for dead letters too large for the DLQ topic."""
    connection: kafka.KafkaConnection
    topic: str
    dlq_topic: str
    dlq_max_bytes: int


RECORD_OVERHEAD_BYTES = 512
"""What a record batch adds to a record's key, value and headers, generously (Kafka's
`max.message.bytes` limits the whole batch)."""


def _dead_letter(row: dict, target: SinkTarget) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The DLQ record's value and headers; a record too large for the topic (key, value and headers
    together) has its value stored under `<storage>/dlq/` and carries a pointer to it instead."""
    headers = record_headers(row["label"], row["event_time"], row["device_id"])
    headers += [
        ("error", row["error"].encode()),
        ("error_reason", row["reason"].encode()),
        ("source_topic", target.topic.encode()),
        ("source_partition", str(row["partition"]).encode()),
        ("source_offset", str(row["offset"]).encode()),
    ]
    value = row["value"]
    size = len(value) + len((row["key"] or "").encode()) + sum(len(k) + len(v) for k, v in headers)
    if size + RECORD_OVERHEAD_BYTES <= target.dlq_max_bytes:
        return value, headers
    # Named by its source coordinates: a rerun after a crash overwrites the same object.
    relative = f"{target.topic}/{row['partition']}-{row['offset']}.bin"
    digest = target.dlq.write(relative, value)
    headers += [
        ("payload_uri", target.dlq.uri(relative).encode()),
        ("payload_size", str(digest.size).encode()),
        ("payload_sha256", digest.sha256.encode()),
    ]
    return b"", headers


def write_snapshot_blocks(blocks, target: SinkTarget, task_name: str) -> WriteStats:
    """One write task: Parquet files (size and SHA-256 recorded for the manifest), dead letters,
    and the accounting the manifest is built from."""
    stats = WriteStats()
    producer = None
    failures: list[BaseException] = []
    part = 0
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
                    "key",
                    "value",
                    "label",
                    "event_time",
                    "device_id",
                    "error",
                    "reason",
                ]
                for row in table.take(bad).select(columns).to_pylist():
                    value, headers = _dead_letter(row, target)
                    future = producer.send(
                        target.dlq_topic, key=(row["key"] or "").encode(), value=value, headers=headers
                    )
                    future.add_errback(failures.append)
                    stats.dlq_errors[row["reason"]] += 1
            records = pc.and_(pc.is_null(table.column("error")), pc.less(table.column("gap_end"), 0))
            good = table.filter(records)
            if good.num_rows == 0:
                continue
            good = good.drop_columns(["error", "reason", "value", "value_size", "gap_end"])
            event_times = good.column("event_time").to_pylist()
            dates = [event_date(t) for t in event_times]
            stats.labels.update(label for label in good.column("label").to_pylist() if label is not None)
            stats.late += sum(good.column("late").to_pylist())
            stats.add_event_times(min(event_times), max(event_times))
            good = good.append_column("event_date", pa.array(dates, pa.string()))
            for date in sorted(set(dates)):
                subset = good.filter(pc.equal(good.column("event_date"), date)).drop_columns(["event_date"])
                relative = f"event_date={date}/part-{task_name}-{part:04d}.parquet"
                buffer = pa.BufferOutputStream()
                pq.write_table(subset, buffer)
                digest = target.folder.write(relative, buffer.getvalue().to_pybytes())
                stats.files.append(DataFile(relative, digest.size, digest.sha256))
                part += 1
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
