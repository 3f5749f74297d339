"""Ingest: Kafka → Ray Data preprocessing → one commit of the Iceberg table (CONTRACT.md §2),
exactly once.

    python -m app ingest                        # Kafka → Ray Data → argus.behavior_images

Ingest reads every partition from the table's committed offsets to its true end (`app.data.plan`;
the read is `app.data.kafka_range`), preprocesses in an actor pool with the one transform training
and serving share, writes the table's Parquet files from Ray Data's write tasks (`app.data.sink`),
proves every offset landed once, and commits the files and the offsets together as one Iceberg
snapshot, which the catalog takes only if the table is still where this ingest planned from. A
writer that loses that race commits nothing and plans again; a run killed anywhere and rerun
yields each record once. The consumer group's offsets only mirror the table's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.parquet as pq

from app import metrics
from app.config import IngestConfig, Settings
from app.data import kafka
from app.data.catalog import dumps
from app.data.erasure import erase_late, inherit_erasures
from app.data.faults import fault
from app.data.kafka_range import (
    IO_TASK_CPUS,
    KafkaRangeDatasource,
    io_concurrency,
    read_ranges,
    streaming_blocks,
)
from app.data.metadata import FEATURES_WEIGHTS_KEY, Erasures
from app.data.plan import Pending, commit_ranges, pending_ranges, report_lost
from app.data.preprocess import preprocess_batches
from app.data.proof import WriteStats, prove
from app.data.sink import SinkTarget, TableSink
from app.data.table import ImageTable, OffsetConflict
from app.storage import Store

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0
"""How often a running ingest says how far its write has got."""


PLAN_ATTEMPTS = 5
"""Times an ingest plans again after another writer committed first, before it gives up."""


@dataclass
class IngestReport:
    snapshot_id: int | None
    """The table snapshot this ingest committed; None when there was nothing new."""
    records: int
    dlq: int
    offsets: dict[int, tuple[int, int]]
    seconds: float
    value_bytes: int

    def __str__(self) -> str:
        if self.snapshot_id is None:
            return "nothing new to ingest: every partition is at its end; nothing committed"
        ranges = ", ".join(f"p{p}:[{s},{e})" for p, (s, e) in sorted(self.offsets.items()))
        total = self.records + self.dlq
        return (
            f"table snapshot {self.snapshot_id}: {self.records} records, {self.dlq} to the DLQ, "
            f"{total / max(self.seconds, 1e-9):.0f} records/s, "
            f"{self.value_bytes / max(self.seconds, 1e-9) / 1e6:.2f} MB/s in {self.seconds:.1f}s; "
            f"offsets {ranges}"
        )


def open_table(settings: Settings, cfg: IngestConfig) -> ImageTable:
    """The table every writer of these settings commits to, created on first use with the columns
    `cfg` asks for (`source` with --keep-source, `features` with --features). A table with no
    commit yet takes the erasures of the other tables of its topic (`inherit_erasures`)."""
    table = ImageTable.at(
        settings.storage,
        settings.catalog,
        settings.table,
        source=cfg.keep_source,
        features=bool(cfg.features),
    )
    if table.current_snapshot_id() is None:
        inherit_erasures(table, settings.topic)
    return table


def commit_details(
    stats: WriteStats, dlq_topic: str, cfg: IngestConfig, pending: Pending | None = None
) -> dict[str, str]:
    """What a commit's summary records beside the offsets: dead letters by reason, late and skipped
    records, with --features the backbone that computed them, and a new table's --from (CONTRACT.md
    §2 names the required keys; these are Argus's own)."""
    details = {
        "argus.dlq.topic": dlq_topic,
        "argus.dlq.errors": dumps(dict(stats.dlq_errors)),
        "argus.records.late": str(stats.late),
        "argus.kafka.skipped": str(stats.skipped),
    }
    if cfg.features:
        details[FEATURES_WEIGHTS_KEY] = cfg.weights or ""
    if pending is not None and pending.origin:
        details["argus.kafka.from"] = cfg.start_from or ""
    return details


def ingest(settings: Settings, cfg: IngestConfig, connection: kafka.KafkaConnection) -> IngestReport:
    """`python -m app ingest`: one bounded, exactly-once read of the topic into one table commit.

    Plan from the table's committed offsets, read [committed, proven end) into uncommitted Parquet
    files, prove every offset once, commit files and offsets as one snapshot (the catalog refuses
    it if another writer committed these partitions first: then plan again), then mirror the
    offsets into the consumer group."""
    started = time.perf_counter()
    if cfg.features and cfg.weights:
        from app.model import feature_backbone

        feature_backbone(cfg.weights)  # a file that does not fit fails here, in one line, not in an actor
    kafka.ensure_topics(
        connection, settings.topic, settings.dlq_topic, settings.partitions, settings.replication_factor
    )
    table = open_table(settings, cfg)
    for attempt in range(1, PLAN_ATTEMPTS + 1):
        try:
            return _ingest_once(settings, cfg, connection, table, started)
        except OffsetConflict as exc:
            log.warning("ingest of %s: %s (attempt %d of %d)", settings.topic, exc, attempt, PLAN_ATTEMPTS)
    raise RuntimeError(f"ingest of {settings.topic}: {PLAN_ATTEMPTS} plans in a row lost to other writers")


def _ingest_once(
    settings: Settings,
    cfg: IngestConfig,
    connection: kafka.KafkaConnection,
    table: ImageTable,
    started: float,
) -> IngestReport:
    topic = settings.topic
    erasures = Erasures.of(table.load())  # read before the plan: an erasure after it is erase_late's
    pending = pending_ranges(table, connection, topic, cfg.start_from)
    if not pending.ranges and not pending.origin:
        return IngestReport(None, 0, 0, {}, time.perf_counter() - started, 0)
    report_lost(topic, pending, strict=cfg.strict)
    ranges = pending.ranges
    log.info("ingesting %s offsets %s into %s", topic, ranges, table.identifier)
    target = SinkTarget(
        table, Store.at(settings.uri("dlq")), connection, topic, settings.dlq_topic, cfg.dlq_max_bytes
    )
    sink = TableSink(target)
    if any(end > start for start, end in ranges.values()):  # else only lost offsets to record
        source = KafkaRangeDatasource(
            connection,
            topic,
            ranges,
            cfg.records_per_block,
            pending.watermarks,
            int(cfg.allowed_lateness_s * 1000),
            pending.visible_ends,
        )
        with streaming_blocks():
            dataset = preprocess_batches(read_ranges(source), settings, cfg, erasures=erasures)
        offsets = sum(end - start for start, end in ranges.values())
        data = Store.at(f"{table.load().location().rstrip('/')}/data")
        with progress_lines(data, offsets, since_s=time.time() - 1):
            dataset.write_datasink(
                sink, ray_remote_args={"num_cpus": IO_TASK_CPUS}, concurrency=io_concurrency()
            )
    stats = sink.stats
    prove(ranges, stats)
    if stats.skipped:
        log.info(
            "%d offsets of %s are transaction markers or compacted records: counted as skipped",
            stats.skipped,
            topic,
        )
        metrics.inc("argus_offsets_skipped", stats.skipped, topic=topic)
    fault("after_write")
    watermarks = {p: max(pending.watermarks.get(p, 0), stats.event_max or 0) for p in ranges}
    fault("before_commit")
    try:
        snapshot_id = table.commit_files(
            stats.files,
            commit_ranges(pending),
            stats.dlq,
            topic,
            lost=pending.lost,
            watermarks=watermarks,
            details=commit_details(stats, settings.dlq_topic, cfg, pending),
            first=bool(pending.origin),
        )
    except OffsetConflict:
        table.discard(stats.files)
        raise
    fault("after_commit")
    erase_late(table, erasures, stats.files)
    ends = {p: end for p, (_, end) in ranges.items()}
    kafka.commit_offsets(connection, cfg.group, topic, ends)
    report = IngestReport(
        snapshot_id, stats.records, stats.dlq, ranges, time.perf_counter() - started, stats.value_bytes
    )
    _export_metrics(topic, report)
    return report


@contextlib.contextmanager
def progress_lines(
    folder: Store, offsets: int, interval_s: float | None = None, since_s: float | None = None
) -> Iterator[None]:
    """While the block runs, a line every `interval_s` (PROGRESS_INTERVAL_S) with the records the
    Parquet files under `folder` (the table's data folder) hold so far, counting only files written
    at or after `since_s` (epoch seconds; the committed ones are older): off a terminal, where Ray
    Data shows no progress bar, the only live sign of a long ingest. Write tasks write each file
    whole, so every footer read is of a complete file; dead letters are not in them, so the count
    may end below `offsets`."""
    interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
    stop = threading.Event()

    def report() -> None:
        rows: dict[str, int] = {}  # each file's footer is read once
        while not stop.wait(interval_s):
            try:
                for info in folder.list(recursive=True):
                    if not info.path.endswith(".parquet") or info.path in rows:
                        continue
                    if since_s is not None and info.mtime is not None and info.mtime.timestamp() < since_s:
                        continue
                    rows[info.path] = pq.read_metadata(info.path, filesystem=folder.fs).num_rows
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


def _export_metrics(topic: str, report: IngestReport) -> None:
    metrics.inc("argus_records_ingested", report.records, topic=topic)
    metrics.inc("argus_dlq_records", report.dlq, topic=topic)
    seconds = max(report.seconds, 1e-9)
    metrics.set_gauge("argus_ingest_records_per_second", (report.records + report.dlq) / seconds, topic=topic)
    metrics.set_gauge("argus_ingest_megabytes_per_second", report.value_bytes / seconds / 1e6, topic=topic)
