"""Continuous ingest's write side: micro-batches cut into *parts*, written by a warm actor pool and
committed in cut order (`app.data.stream` feeds it and fences its commits).

A part is a snapshot like any other: its own folder and `_manifest.json` under `<storage>/snapshots/`,
its offsets proven once each by `build_manifest`, committed by the one create-once manifest write.
Records are cut by size (`--max-batch-records`) or by the age of the batch's first record
(`--max-batch-delay-s`); at most `--max-in-flight` parts are written at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import ray

from app import metrics
from app.config import IngestConfig
from app.data import kafka
from app.data.compact import new_part_id
from app.data.faults import fault
from app.data.manifest import Manifest, WriteSpec, WriteStats, build_manifest
from app.data.preprocess import PREPROCESS_ACTOR_CPUS, Preprocessor
from app.data.sink import SinkTarget, write_snapshot_blocks
from app.data.snapshot import SnapshotStore

log = logging.getLogger(__name__)

STRING_COLUMNS = ("key", "label", "device_id", "schema")


class PartWriter:
    """A long-lived actor: preprocess one chunk of raw rows and write it into a part's folder.

    Keeping the actor (and the torch import and model inside its Preprocessor) across parts is
    the point: a Ray Data job per micro-batch paid seconds of start-up each time."""

    def __init__(self, **preprocessor_kwargs):
        self.preprocessor = Preprocessor(**preprocessor_kwargs)

    def ready(self) -> bool:
        return True

    def write(self, raw: pa.Table, target: SinkTarget, task_name: str) -> WriteStats:
        from ray.data.block import BlockAccessor

        out = self.preprocessor(BlockAccessor.for_block(raw).to_batch_format("numpy"))
        block = BlockAccessor.batch_to_block(out)
        # An all-null column (unlabelled traffic) would be typed null; readers expect strings.
        for name in STRING_COLUMNS:
            if name in block.column_names and pa.types.is_null(block.schema.field(name).type):
                i = block.column_names.index(name)
                block = block.set_column(i, name, pa.nulls(block.num_rows, pa.string()))
        return write_snapshot_blocks([block], target, task_name)


@dataclass
class Batch:
    """Raw rows consumed since the last cut, and where each partition's range starts."""

    starts: dict[int, int] = field(default_factory=dict)
    rows: dict[str, list] = field(default_factory=lambda: {n: [] for n in kafka.RAW_SCHEMA.names})
    records: int = 0
    first_at: float | None = None
    oldest_ms: int | None = None

    def __len__(self) -> int:
        """Offsets held, gaps (offsets the broker never returned) included."""
        return len(self.rows["offset"])

    def add(self, row: dict, start: int) -> None:
        self.starts.setdefault(row["partition"], start)
        for name in kafka.RAW_SCHEMA.names:
            self.rows[name].append(row.get(name))
        if row["gap_end"] is None:
            self.records += 1
            ts = row["kafka_timestamp"]
            self.oldest_ms = ts if self.oldest_ms is None else min(self.oldest_ms, ts)
        if self.first_at is None:
            self.first_at = time.monotonic()

    def without(self, partitions: set[int]) -> Batch:
        """This batch less the rows of `partitions` (revoked: their new owner reads them again)."""
        kept = Batch()
        for i, p in enumerate(self.rows["partition"]):
            if p not in partitions:
                kept.add({name: column[i] for name, column in self.rows.items()}, self.starts[p])
        if kept.first_at is not None:
            kept.first_at = self.first_at  # the cut is due when it was, not later
        return kept


@dataclass
class Part:
    """A cut micro-batch being written by the pool."""

    part_id: str
    ranges: dict[int, tuple[int, int]]
    watermarks: dict[int, int]
    lost: dict[int, int]
    refs: list
    oldest_ms: int | None
    records: int
    per_partition: dict[int, int]
    cut_at: float


class PartPipeline:
    """The pool of `PartWriter` actors and the parts in flight, committed oldest first."""

    def __init__(
        self,
        snapshots: SnapshotStore,
        spec: WriteSpec,
        ingest_cfg: IngestConfig,
        connection: kafka.KafkaConnection,
        owner: str,
    ):
        self.snapshots, self.spec, self.ingest_cfg = snapshots, spec, ingest_cfg
        self.connection, self.owner = connection, owner
        self.in_flight: deque[Part] = deque()
        self.pool: list = []
        self.cuts = 0
        self.committed_parts = 0
        self.last_cut = 0.0

    def start(self) -> None:
        cfg, resources = self.ingest_cfg, ray.cluster_resources()
        cpus = max(1, int(resources.get("CPU", 1)))
        if cfg.use_gpu:
            count, options = max(1, int(resources.get("GPU", 1))), dict(num_cpus=0, num_gpus=1)
        else:
            # 0.5 CPU each, one per core: the driver (consumer, commits) keeps room on every core.
            count, options = cpus, dict(num_cpus=PREPROCESS_ACTOR_CPUS)
        count = cfg.concurrency or count
        actor = ray.remote(PartWriter).options(**options)
        self.pool = [
            actor.remote(
                image_size=self.spec.image_size,
                classes=self.spec.classes,
                max_record_bytes=cfg.max_record_bytes,
                features=cfg.features,
                weights=cfg.weights,
                decode_threads=cfg.decode_threads or (max(1, cpus // count) if cfg.use_gpu else 1),
                keep_source=cfg.keep_source,
            )
            for _ in range(count)
        ]
        ray.get([a.ready.remote() for a in self.pool])

    def close(self) -> None:
        for actor in self.pool:
            ray.kill(actor)

    def cut(
        self, batch: Batch, next_offset: dict[int, int], watermarks: dict[int, int], lost: dict[int, int]
    ) -> None:
        """Send `batch` to the pool as the next part: per partition [its first offset, the next to
        read), plus `lost` partitions with nothing new whose retention losses it records."""
        self.last_cut = time.monotonic()
        ranges = {p: (start, next_offset[p]) for p, start in batch.starts.items()}
        for p in lost:
            ranges.setdefault(p, (next_offset[p], next_offset[p]))
        part_id = new_part_id(self.owner)
        target = SinkTarget(
            self.snapshots.folder(part_id),
            self.snapshots.store.child("dlq"),
            self.connection,
            self.spec.topic,
            self.spec.dlq_topic,
            self.ingest_cfg.dlq_max_bytes,
        )
        refs = []
        n = len(batch)
        if n:
            table = pa.Table.from_pydict(batch.rows, schema=kafka.RAW_SCHEMA)
            # Spread over the pool in chunks of at least --batch-size rows, one chunk per actor.
            chunks = max(1, min(len(self.pool), n // self.ingest_cfg.batch_size))
            step = -(-n // chunks)
            for i, lo in enumerate(range(0, n, step)):
                actor = self.pool[(self.cuts + i) % len(self.pool)]
                refs.append(actor.write.remote(table.slice(lo, step), target, f"{i:05d}"))
        per_partition: dict[int, int] = {}
        for p, gap_end in zip(batch.rows["partition"], batch.rows["gap_end"]):
            if gap_end is None:
                per_partition[p] = per_partition.get(p, 0) + 1
        self.cuts += 1
        self.in_flight.append(
            Part(
                part_id,
                ranges,
                dict(watermarks),
                lost,
                refs,
                batch.oldest_ms,
                batch.records,
                per_partition,
                time.monotonic(),
            )
        )

    def commit_ready(
        self,
        fence: Callable[[Part], None],
        on_commit: Callable[[Part, Manifest], None],
        wait_s: float = 0.0,
    ) -> None:
        """Commit finished parts, oldest first: a later part committed before an earlier one would
        move the ledger's end past offsets that are not durable. `fence(part)` raises unless this
        writer may still commit the part's partitions; `on_commit` follows each commit."""
        while self.in_flight:
            head = self.in_flight[0]
            if head.refs:
                ready, _ = ray.wait(head.refs, num_returns=len(head.refs), timeout=wait_s)
                if len(ready) < len(head.refs):
                    return
            stats = WriteStats()
            for task_stats in ray.get(head.refs):
                stats.merge(task_stats)
            manifest = build_manifest(self.spec, head.part_id, head.ranges, head.watermarks, stats, head.lost)
            fault("after_write")
            fence(head)
            if not self.snapshots.commit(manifest):
                raise RuntimeError(f"part {head.part_id} already has a manifest: another writer used this id")
            fault("before_commit")
            self.in_flight.popleft()
            self.committed_parts += 1
            on_commit(head, manifest)
            topic = self.spec.topic
            metrics.inc("argus_watch_parts", topic=topic)
            metrics.inc("argus_records_ingested", manifest.records, topic=topic)
            metrics.inc("argus_dlq_records", manifest.dlq, topic=topic)
            log.debug(
                "part %s: %d records, %d dead letters, offsets %s",
                head.part_id,
                manifest.records,
                manifest.dlq,
                head.ranges,
            )
