"""Ingest: Kafka → Ray Data preprocessing → a snapshot (CONTRACT.md §2), exactly once.

    python -m app ingest                        # Kafka → Ray Data → <storage>/snapshots/<id>/

Ingest holds the topic's lease (one writer at a time), reads every partition from where the last
committed snapshot ended to its true end (the embedded broker under-reports high watermarks, so
the end is probed, never trusted), preprocesses in an actor pool with the one transform training
and serving share, writes Parquet straight into the snapshot's folder, commits the manifest (one
object, never overwritten: no rename, so S3 works as local disk does), and only then commits the
offsets. The manifests are the offset ledger, so a run killed anywhere and rerun yields each
record once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import DataContext
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from app import metrics, storage
from app.config import IngestConfig, Settings
from app.data import kafka
from app.data import snapshot as store
from app.data.lease import Lease, LeaseHeld
from app.data.preprocess import preprocess_batches
from app.data.sink import SinkTarget, SnapshotSink

log = logging.getLogger(__name__)

FAULT_ENV = "ARGUS_FAULT"
"""Fault injection for tests: `after_write` or `before_commit` kills ingest at that point."""

IO_TASK_CPUS = 0.25
"""Logical CPUs of a Kafka read task and of a snapshot write task (see PREPROCESS_ACTOR_CPUS)."""

PROGRESS_INTERVAL_S = 10.0
"""How often a running ingest says how far its write has got."""


# ---------------------------------------------------------------- reading


class KafkaRangeDatasource(Datasource):
    """A Ray Data datasource over exact per-partition offset ranges, split into read tasks.

    `ray.data.read_kafka` takes one start offset for all partitions and clamps its end to the
    reported high watermark; resuming from a ledger and reading to the proven end needs ranges.
    """

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


# ---------------------------------------------------------------- the driver


@dataclass
class IngestReport:
    snapshot_id: str | None
    records: int
    dlq: int
    offsets: dict[int, tuple[int, int]]
    seconds: float
    value_bytes: int
    held_by: str | None = None
    """Set when another ingest held the lease, so this one wrote nothing."""

    def __str__(self) -> str:
        if self.held_by is not None:
            return f"another ingest is writing this topic's snapshots ({self.held_by}); nothing written"
        if self.snapshot_id is None:
            return "nothing new to ingest: every partition is at its end; no snapshot written"
        ranges = ", ".join(f"p{p}:[{s},{e})" for p, (s, e) in sorted(self.offsets.items()))
        total = self.records + self.dlq
        return (
            f"snapshot {self.snapshot_id}: {self.records} records, {self.dlq} to the DLQ, "
            f"{total / max(self.seconds, 1e-9):.0f} records/s, "
            f"{self.value_bytes / max(self.seconds, 1e-9) / 1e6:.2f} MB/s in {self.seconds:.1f}s; "
            f"offsets {ranges}"
        )


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.error("fault injection: exiting at %s", point)
        os._exit(137)


@dataclass(frozen=True)
class Pending:
    """What the next ingest reads: per partition [read start, proven end), where records stop and
    only markers may follow, offsets retention deleted unread, and the event-time watermarks."""

    ranges: dict[int, tuple[int, int]]
    visible_ends: dict[int, int]
    lost: dict[int, int]
    watermarks: dict[int, int]


def pending_ranges(
    settings: Settings, connection: kafka.KafkaConnection, manifests: list[store.Manifest]
) -> Pending:
    """The offsets from the ledger's end to each partition's proven end not yet in a snapshot
    (partitions with nothing to read or lose are left out)."""
    previous, watermarks = store.ledger_offsets(manifests, settings.topic)
    partitions = kafka.partitions_of(connection, settings.topic)
    probed = kafka.probe_partitions(connection, settings.topic, partitions)
    starts = {p: previous.get(p, 0) for p in partitions}
    behind = {p: (starts[p], probed[p].end) for p in partitions if probed[p].end < starts[p]}
    if behind:
        raise RuntimeError(
            f"the snapshots under {settings.uri('snapshots')} end past the topic's end "
            f"(partition: (ledger start, topic end) {behind}): they belong to another broker "
            "or an older incarnation of the topic; use a fresh --storage"
        )
    return plan(starts, probed, watermarks)


def plan(
    starts: dict[int, int], probed: dict[int, kafka.PartitionEnds], watermarks: dict[int, int]
) -> Pending:
    """From the ledger's starts and the probed partitions: read from the later of the ledger's end and
    the log start; what retention deleted in between is lost."""
    lost = {p: ends.log_start - starts[p] for p, ends in probed.items() if ends.log_start > starts[p]}
    ranges = {p: (starts[p] + lost.get(p, 0), ends.end) for p, ends in probed.items()}
    ranges = {p: r for p, r in ranges.items() if r[1] > r[0] or p in lost}
    return Pending(ranges, {p: probed[p].visible_end for p in ranges}, lost, watermarks)


def report_lost(settings: Settings, cfg: IngestConfig, pending: Pending) -> None:
    if not pending.lost:
        return
    spans = ", ".join(
        f"p{p}:[{pending.ranges[p][0] - n},{pending.ranges[p][0]})" for p, n in pending.lost.items()
    )
    message = (
        f"{sum(pending.lost.values())} records of {settings.topic} were deleted by the topic's retention "
        f"before any ingest read them (offsets {spans})"
    )
    if cfg.strict:
        raise RuntimeError(f"{message}; --strict: nothing written")
    log.error("%s; recorded as lost in the snapshot's manifest, continuing from the log start", message)
    metrics.inc("argus_records_lost", sum(pending.lost.values()), topic=settings.topic)


def ingest_lease(settings: Settings, cfg: IngestConfig) -> Lease:
    """The lease every writer of this storage's snapshots of the topic takes (ingest, watch)."""
    return Lease(settings.uri("leases", f"ingest-{settings.topic}"), ttl_s=cfg.lease_ttl_s)


def ingest(settings: Settings, cfg: IngestConfig, connection: kafka.KafkaConnection) -> IngestReport:
    """`python -m app ingest`: one bounded, exactly-once read of the topic into a new snapshot.

    Under the topic's lease: clean up what dead writers left, read [ledger end, proven end) into
    Parquet under the new snapshot's folder, re-read the ledger, commit the manifest, then mirror
    the offsets into the consumer group. A second ingest started meanwhile writes nothing."""
    started = time.perf_counter()
    if cfg.features and cfg.weights:
        from app.model import feature_backbone

        feature_backbone(cfg.weights)  # a file that does not fit fails here, in one line, not in an actor
    kafka.ensure_topics(
        connection, settings.topic, settings.dlq_topic, settings.partitions, settings.replication_factor
    )
    lease = ingest_lease(settings, cfg)
    try:
        with lease.held():
            return _ingest_holding(settings, cfg, connection, lease, started)
    except LeaseHeld as exc:
        log.warning("ingest of %s into %s skipped: %s", settings.topic, settings.storage, exc)
        return IngestReport(None, 0, 0, {}, time.perf_counter() - started, 0, held_by=str(exc))


def _ingest_holding(
    settings: Settings, cfg: IngestConfig, connection: kafka.KafkaConnection, lease: Lease, started: float
) -> IngestReport:
    manifests = store.list_manifests(settings, quarantine=True)
    store.remove_uncommitted(settings)  # their writers' leases expired: they are gone
    pending = pending_ranges(settings, connection, manifests)
    if not pending.ranges:
        return IngestReport(None, 0, 0, {}, time.perf_counter() - started, 0)
    report_lost(settings, cfg, pending)
    ranges = pending.ranges

    snapshot_id = store.new_snapshot_id()
    log.info("ingesting %s offsets %s into %s", settings.topic, ranges, snapshot_id)
    target = SinkTarget(
        store.snapshot_uri(settings, snapshot_id),
        settings.uri("dlq"),
        connection,
        settings.topic,
        settings.dlq_topic,
        cfg.dlq_max_bytes,
    )
    sink = SnapshotSink(target)
    if any(end > start for start, end in ranges.values()):  # else only lost offsets to record
        source = KafkaRangeDatasource(
            connection,
            settings.topic,
            ranges,
            cfg.records_per_block,
            pending.watermarks,
            int(cfg.allowed_lateness_s * 1000),
            pending.visible_ends,
        )
        with streaming_blocks():
            dataset = preprocess_batches(read_ranges(source), settings, cfg)
        offsets = sum(end - start for start, end in ranges.values())
        with progress_lines(target.snapshot_uri, offsets):
            dataset.write_datasink(
                sink, ray_remote_args={"num_cpus": IO_TASK_CPUS}, concurrency=io_concurrency()
            )
    manifest = store.build_manifest(
        settings,
        snapshot_id,
        ranges,
        pending.watermarks,
        sink.stats,
        features=cfg.features,
        features_weights=cfg.weights,
        allowed_lateness_s=cfg.allowed_lateness_s,
        lost=pending.lost,
        keep_source=cfg.keep_source,
    )
    skipped = sum(r.skipped for r in manifest.offsets.values())
    if skipped:
        log.info(
            "%d offsets of %s are transaction markers or compacted records: counted as skipped",
            skipped,
            settings.topic,
        )
        metrics.inc("argus_offsets_skipped", skipped, topic=settings.topic)
    _fault("after_write")
    check_no_overlap(settings, ranges)
    lease.check()
    _fault("before_manifest")
    if not store.commit(settings, manifest):
        raise RuntimeError(f"snapshot {snapshot_id} already has a manifest: another writer used this id")
    _fault("before_commit")
    ends = {p: end for p, (_, end) in ranges.items()}
    kafka.commit_offsets(connection, cfg.group, settings.topic, ends)
    store.write_offsets_file(settings, cfg.group, ends)
    report = IngestReport(
        snapshot_id,
        manifest.records,
        manifest.dlq,
        ranges,
        time.perf_counter() - started,
        manifest.value_bytes,
    )
    _export_metrics(settings.topic, report)
    return report


@contextlib.contextmanager
def progress_lines(snapshot_uri: str, offsets: int, interval_s: float | None = None) -> Iterator[None]:
    """While the block runs, a line every `interval_s` (PROGRESS_INTERVAL_S) with the records the
    snapshot's Parquet files hold so far: off a terminal, where Ray Data shows no progress bar,
    the only live sign of a long ingest. Write tasks write each file whole, so every footer read
    is of a complete file; dead letters are not in them, so the count may end below `offsets`."""
    interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
    stop = threading.Event()
    fs, root = storage.filesystem(snapshot_uri)

    def report() -> None:
        rows: dict[str, int] = {}  # each file's footer is read once
        while not stop.wait(interval_s):
            try:
                for info in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)):
                    if info.path.endswith(".parquet") and info.path not in rows:
                        rows[info.path] = pq.read_metadata(info.path, filesystem=fs).num_rows
            except Exception as exc:  # storage busy or gone: lose a progress line, not the ingest
                log.debug("ingest progress: %s", exc)
                continue
            log.info("ingest: %d of %d offsets written as records so far", sum(rows.values()), offsets)

    thread = threading.Thread(target=report, name="ingest-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def check_no_overlap(settings: Settings, ranges: dict[int, tuple[int, int]]) -> None:
    """The ledger re-read just before the commit: a snapshot committed meanwhile that covers any of
    these offsets (a writer that ignored or outlived the lease) aborts this one."""
    for manifest in store.list_manifests(settings):
        if manifest.topic != settings.topic:
            continue
        for p, entry in manifest.offsets.items():
            start, end = ranges.get(p, (0, 0))
            if entry.start < end and start < entry.end:
                raise RuntimeError(
                    f"snapshot {manifest.snapshot_id} was committed meanwhile with offsets "
                    f"[{entry.start}, {entry.end}) of partition {p}, overlapping this ingest's "
                    f"[{start}, {end}); nothing committed"
                )


def _export_metrics(topic: str, report: IngestReport) -> None:
    metrics.inc("argus_records_ingested", report.records, topic=topic)
    metrics.inc("argus_dlq_records", report.dlq, topic=topic)
    seconds = max(report.seconds, 1e-9)
    metrics.set_gauge("argus_ingest_records_per_second", (report.records + report.dlq) / seconds, topic=topic)
    metrics.set_gauge("argus_ingest_megabytes_per_second", report.value_bytes / seconds / 1e6, topic=topic)
