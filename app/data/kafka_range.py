"""Ingest's read side: a Ray Data datasource over exact per-partition Kafka offset ranges.

`ray.data.read_kafka` takes one start offset for all partitions and clamps its end to the reported
high watermark; resuming from the ledger and reading to the proven end (`app.data.plan`) needs
ranges. Each read task reads one chunk of one partition with `app.data.kafka.read_partition_range`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ray
import ray.data
from ray.data import DataContext
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from app.data import kafka

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
                    # Only the partition's last chunk may end in markers (see probe_partitions).
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
                        lambda a=args: kafka.read_partition_range(*a),
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
def streaming_blocks(max_block_bytes: int = kafka.MAX_BLOCK_BYTES) -> Iterator[None]:
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
