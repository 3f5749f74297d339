"""Ingest's read side: a Ray Data datasource over exact per-partition Kafka offset ranges.

`ray.data.read_kafka` takes one start offset for all partitions and clamps its end to the reported
high watermark; resuming from the ledger and reading to the proven end (`app.data.plan`) needs
ranges. Each read task reads one chunk of one partition with `read_partition_range`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pyarrow as pa
import ray
import ray.data
from ray.data import DataContext
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from app.data import kafka

MAX_BLOCK_BYTES = 16 * 1024 * 1024
"""Ingest's Ray Data block size: a read task passes its records on every `records_per_block` or this
many bytes, and transforms split larger outputs."""
IO_TASK_CPUS = 0.25
"""Logical CPUs of a Kafka read task and of a snapshot write task (see PREPROCESS_ACTOR_CPUS)."""


class KafkaRangeDatasource(Datasource):
    """A Ray Data datasource over exact per-partition offset ranges, split into read tasks."""

    def __init__(
        self,
        connection: kafka.KafkaConnection,
        topic: str,
        ranges: dict[int, tuple[int, int]],
        records_per_block: int,
        watermarks: dict[int, int],
        allowed_lateness_ms: int,
        visible_ends: dict[int, int] | None = None,
        max_offsets_per_task: int = 20_000,
    ):
        self.connection, self.topic = connection, topic
        self.ranges = ranges
        self.visible_ends = visible_ends or {}
        self.records_per_block = records_per_block
        self.watermarks = watermarks
        self.allowed_lateness_ms = allowed_lateness_ms
        self.max_offsets_per_task = max_offsets_per_task

    def estimate_inmemory_data_size(self):
        return None

    def get_name(self):
        return "KafkaRange"

    def read_task_count(self) -> int:
        """Pass it as `override_num_blocks`: Ray Data otherwise aims at ~200 blocks and splits every
        task's output into slivers, paying per-object overhead on each."""
        return sum(-(-(end - start) // self.max_offsets_per_task) for start, end in self.ranges.values())

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        tasks = []
        for partition, (start, end) in sorted(self.ranges.items()):
            for lo in range(start, end, self.max_offsets_per_task):
                hi = min(end, lo + self.max_offsets_per_task)
                # Each chunk after the first seeds its watermark from the previous snapshot only;
                # tasks run in parallel, so cross-chunk order is not observable.
                args = (
                    self.connection,
                    self.topic,
                    partition,
                    lo,
                    hi,
                    self.records_per_block,
                    self.watermarks.get(partition, 0),
                    self.allowed_lateness_ms,
                    # Only the partition's last chunk may end in markers (see `probe.probe_partitions`).
                    self.visible_ends.get(partition, end) if hi == end else hi,
                )
                metadata = BlockMetadata(
                    num_rows=hi - lo,
                    size_bytes=None,
                    exec_stats=None,
                    input_files=[f"kafka://{self.topic}/{partition}/{lo}-{hi}"],
                )
                tasks.append(
                    ReadTask(
                        lambda a=args: read_partition_range(*a),
                        metadata,
                        schema=kafka.RAW_SCHEMA,
                        per_task_row_limit=per_task_row_limit,
                    )
                )
        return tasks


def io_concurrency() -> int:
    """At most one read and one write task per cluster CPU: more consumers than cores only contend
    (with the broker too, where it shares the machine), and each task is a worker process in memory."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def read_ranges(source: KafkaRangeDatasource) -> ray.data.Dataset:
    """The Ray Data read of a KafkaRangeDatasource, as ingest runs it (inside `streaming_blocks`)."""
    return ray.data.read_datasource(
        source,
        ray_remote_args={"num_cpus": IO_TASK_CPUS},
        concurrency=io_concurrency(),
        override_num_blocks=source.read_task_count(),
    )


@contextlib.contextmanager
def streaming_blocks(max_block_bytes: int = MAX_BLOCK_BYTES) -> Iterator[None]:
    """Datasets created inside use blocks of at most `max_block_bytes`.

    Ray Data merges what a read task yields into blocks of up to 128 MiB before passing any on, so
    a Kafka read task would hold its whole range (and a 128 MiB block per task in memory) before
    its first record reached the preprocessing actors. A Dataset keeps the context it was created in.
    """
    context = DataContext.get_current()
    previous = context.target_max_block_size
    context.target_max_block_size = max_block_bytes
    try:
        yield
    finally:
        context.target_max_block_size = previous


def read_partition_range(
    connection: kafka.KafkaConnection,
    topic: str,
    partition: int,
    start: int,
    end: int,
    records_per_block: int,
    watermark_ms: int,
    allowed_lateness_ms: int,
    visible_end: int | None = None,
    stall_timeout_s: float = 60.0,
) -> Iterator[pa.Table]:
    """Every offset of [start, end) of one partition, as Arrow blocks, or an error: never fewer.

    Each offset is a record or part of a gap row: offsets the broker skips over (a later offset
    arrives first) are transaction markers, aborted or compacted records; offsets from
    `visible_end` on may end in an EOF, which proves them markers too (see `app.data.probe.probe_partitions`).
    An EOF before `visible_end` is an error. Lateness is judged against the partition's running
    event-time watermark (the highest event time seen so far, seeded from the previous snapshot),
    as a stream processor would.
    """
    from confluent_kafka import KafkaError, TopicPartition

    visible_end = end if visible_end is None else visible_end
    consumer = connection.consumer()
    consumer.assign([TopicPartition(topic, partition, start)])
    rows: dict[str, list] = {name: [] for name in kafka.RAW_SCHEMA.names}

    def gap(until: int) -> None:
        gap_row = dict.fromkeys(kafka.RAW_SCHEMA.names)
        gap_row.update(partition=partition, offset=next_offset, gap_end=until, value=b"", late=False)
        for name in kafka.RAW_SCHEMA.names:
            rows[name].append(gap_row[name])

    next_offset, last_progress = start, time.monotonic()
    try:
        while next_offset < end:
            messages = consumer.consume(min(records_per_block, end - next_offset), timeout=1.0)
            if not messages and time.monotonic() - last_progress > stall_timeout_s:
                raise RuntimeError(f"{topic}[{partition}] stalled at offset {next_offset} before {end}")
            for message in messages:
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic}[{partition}]: {message.error()}")
                    if next_offset >= end:
                        continue
                    if next_offset < visible_end:
                        raise RuntimeError(f"{topic}[{partition}] ended at {next_offset}, expected {end}")
                    gap(end)  # only markers follow the last record
                    next_offset = end
                    break
                offset = message.offset()
                if offset > next_offset:
                    gap(min(offset, end))
                    next_offset = min(offset, end)
                if offset >= end:
                    break
                last_progress = time.monotonic()
                next_offset = offset + 1
                fields, watermark_ms = kafka.raw_row(message, watermark_ms, allowed_lateness_ms)
                for name in kafka.RAW_SCHEMA.names:
                    rows[name].append(fields[name])
            if len(rows["offset"]) >= records_per_block or sum(map(len, rows["value"])) >= MAX_BLOCK_BYTES:
                yield pa.Table.from_pydict(rows, schema=kafka.RAW_SCHEMA)
                rows = {name: [] for name in kafka.RAW_SCHEMA.names}
        if rows["offset"]:
            yield pa.Table.from_pydict(rows, schema=kafka.RAW_SCHEMA)
    finally:
        consumer.close()
