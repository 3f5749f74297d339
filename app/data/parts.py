"""Continuous ingest's write side: micro-batches cut into *parts*, written by a warm actor pool and
committed to the table in cut order (`app.data.stream` feeds it).

A part is one Iceberg commit, like a bulk ingest: the `PartWriter` actors preprocess its rows and
write the table's data files uncommitted (`app.data.sink.write_blocks`), the driver proves every
offset of its ranges once (`app.data.proof.prove`) and commits files and offsets together
(`ImageTable.commit_files`), which the catalog takes only if each partition is still committed
exactly where the part's range starts. Records are cut by size (`--max-batch-records`) or by the
age of the batch's first record (`--max-batch-delay-s`); at most `--max-in-flight` parts are
written at once.
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
from app.config import IngestConfig, Settings
from app.data import kafka
from app.data.erasure import erase_late
from app.data.faults import fault
from app.data.ingest import commit_details
from app.data.metadata import Erasures
from app.data.partitions import Restart
from app.data.preprocess import PREPROCESS_ACTOR_CPUS, Preprocessor
from app.data.proof import WriteStats, prove
from app.data.sink import SinkTarget, write_blocks
from app.data.table import ImageTable, OffsetConflict

log = logging.getLogger(__name__)

STRING_COLUMNS = ("key", "label", "device_id", "schema")
WRITER_KEY = "argus.writer"
"""Summary key naming the watch that committed a part (`watch <host>:<pid>`): who wrote what."""
DISCARD_WAIT_S = 30.0
"""How long a restart waits for parts still being written, to delete their files (later ones are
left to the watch's orphan removal)."""


class PartWriter:
    """A long-lived actor: preprocess one chunk of raw rows and write it as uncommitted data files
    of the table (and its dead letters to the DLQ topic).

    Keeping the actor (and the torch import and model inside its Preprocessor, and the table's
    catalog) across parts is the point: a Ray Data job per micro-batch paid seconds of start-up
    each time."""

    def __init__(self, target: SinkTarget, **preprocessor_kwargs):
        self.target = target
        self.preprocessor = Preprocessor(**preprocessor_kwargs)

    def ready(self) -> bool:
        return True

    def write(self, raw: pa.Table, erasures: Erasures) -> WriteStats:
        """`raw` preprocessed and written; the records `erasures` (as the part was cut) covers
        become dead letters that hold nothing of them."""
        from ray.data.block import BlockAccessor

        self.preprocessor.erasures = erasures
        out = self.preprocessor(BlockAccessor.for_block(raw).to_batch_format("numpy"))
        block = BlockAccessor.batch_to_block(out)
        # An all-null column (unlabelled traffic) would be typed null; the table's are strings.
        for name in STRING_COLUMNS:
            if name in block.column_names and pa.types.is_null(block.schema.field(name).type):
                i = block.column_names.index(name)
                block = block.set_column(i, name, pa.nulls(block.num_rows, pa.string()))
        return write_blocks([block], self.target)


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

    number: int
    ranges: dict[int, tuple[int, int]]
    """Per partition [first offset read, next to read): what the proof covers."""
    watermarks: dict[int, int]
    lost: dict[int, int]
    """Offsets retention deleted unread just below a range's start, recorded by this commit."""
    erasures: Erasures
    """The table's erasures when the part was cut: those that land later, `erase_late` handles."""
    refs: list
    oldest_ms: int | None
    records: int
    per_partition: dict[int, int]
    cut_at: float

    def commit_ranges(self) -> dict[int, tuple[int, int]]:
        """The ranges the commit records: each from the table's committed offset, the lost span
        at its start included (`app.data.plan.commit_ranges`)."""
        return {p: (start - self.lost.get(p, 0), end) for p, (start, end) in self.ranges.items()}


class PartPipeline:
    """The pool of `PartWriter` actors and the parts in flight, committed oldest first."""

    def __init__(self, target: SinkTarget, settings: Settings, ingest_cfg: IngestConfig, writer: str):
        self.target, self.settings, self.ingest_cfg, self.writer = target, settings, ingest_cfg, writer
        self.table: ImageTable = target.table
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
                self.target,
                image_size=self.settings.image_size,
                classes=self.settings.classes,
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
        """Drop the parts not committed (their files deleted) and the pool."""
        self.discard()
        for actor in self.pool:
            ray.kill(actor)

    def discard(self, wait_s: float = DISCARD_WAIT_S) -> None:
        """Forget every part in flight, deleting the data files of those whose writes finish
        within `wait_s` (a write still running then leaves its files to orphan removal)."""
        refs = [ref for part in self.in_flight for ref in part.refs]
        self.in_flight.clear()
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                stats = ray.get(ref)
            except Exception:  # a failed write: whatever it wrote is an orphan now
                continue
            self.table.discard(stats.files)

    def cut(
        self, batch: Batch, next_offset: dict[int, int], watermarks: dict[int, int], lost: dict[int, int]
    ) -> None:
        """Send `batch` to the pool as the next part: per partition [its first offset, the next to
        read), plus `lost` partitions with nothing new whose retention losses it records."""
        self.last_cut = time.monotonic()
        ranges = {p: (start, next_offset[p]) for p, start in batch.starts.items()}
        for p in lost:
            ranges.setdefault(p, (next_offset[p], next_offset[p]))
        refs = []
        n = len(batch)
        erasures = Erasures.of(self.table.load())
        if n:
            table = pa.Table.from_pydict(batch.rows, schema=kafka.RAW_SCHEMA)
            # Spread over the pool in chunks of at least --batch-size rows, one chunk per actor.
            chunks = max(1, min(len(self.pool), n // self.ingest_cfg.batch_size))
            step = -(-n // chunks)
            for i, lo in enumerate(range(0, n, step)):
                actor = self.pool[(self.cuts + i) % len(self.pool)]
                refs.append(actor.write.remote(table.slice(lo, step), erasures))
        per_partition: dict[int, int] = {}
        for p, gap_end in zip(batch.rows["partition"], batch.rows["gap_end"]):
            if gap_end is None:
                per_partition[p] = per_partition.get(p, 0) + 1
        self.cuts += 1
        self.in_flight.append(
            Part(
                self.cuts,
                ranges,
                {p: watermarks[p] for p in ranges if p in watermarks},
                dict(lost),
                erasures,
                refs,
                batch.oldest_ms,
                batch.records,
                per_partition,
                time.monotonic(),
            )
        )

    def commit_ready(self, on_commit: Callable[[Part], None], wait_s: float = 0.0) -> None:
        """Commit finished parts, oldest first: each starts where the one before it ends, so the
        table takes them only in cut order. `on_commit` follows each commit. A part the table
        refuses (another writer committed one of its partitions first) is dropped with every part
        after it: `Restart`."""
        while self.in_flight:
            head = self.in_flight[0]
            if head.refs:
                ready, _ = ray.wait(head.refs, num_returns=len(head.refs), timeout=wait_s)
                if len(ready) < len(head.refs):
                    return
            stats = WriteStats()
            for task_stats in ray.get(head.refs) if head.refs else []:
                stats.merge(task_stats)
            try:
                snapshot_id = self.commit(head, stats)
            except Restart:
                self.in_flight.popleft()  # refused, its files deleted already
                raise
            self.in_flight.popleft()
            self.committed_parts += 1
            on_commit(head)
            topic = self.target.topic
            metrics.inc("argus_watch_parts", topic=topic)
            metrics.inc("argus_records_ingested", stats.records, topic=topic)
            metrics.inc("argus_dlq_records", stats.dlq, topic=topic)
            if stats.skipped:
                metrics.inc("argus_offsets_skipped", stats.skipped, topic=topic)
            log.debug(
                "part %d: table snapshot %d, %d records, %d dead letters, offsets %s",
                head.number,
                snapshot_id,
                stats.records,
                stats.dlq,
                head.ranges,
            )

    def commit(self, part: Part, stats: WriteStats) -> int:
        """Prove `part` (written as `stats` says) and commit it; its table snapshot id. Restart,
        its files deleted, when another writer committed one of its partitions first."""
        prove(part.ranges, stats)  # every offset read is a row, a dead letter or a skipped offset
        fault("after_write")
        details = {**commit_details(stats, self.target.dlq_topic, self.ingest_cfg), WRITER_KEY: self.writer}
        fault("before_commit")
        try:
            snapshot_id = self.table.commit_files(
                stats.files,
                part.commit_ranges(),
                stats.dlq,
                self.target.topic,
                lost=part.lost,
                watermarks=part.watermarks,
                details=details,
            )
        except OffsetConflict as exc:
            self.table.discard(stats.files)
            raise Restart(f"part {part.number} of {self.target.topic} not committed: {exc}") from exc
        fault("after_commit")
        erase_late(self.table, part.erasures, stats.files)
        return snapshot_id
