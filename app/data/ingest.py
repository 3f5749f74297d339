"""Ingest: Kafka → Ray Data preprocessing → a snapshot (CONTRACT.md §2), exactly once.

    python -m app ingest                        # Kafka → Ray Data → <storage>/snapshots/<id>/

Ingest holds the topic's lease (one writer at a time), reads every partition from where the last
committed snapshot ended to its true end (`app.data.plan`; the read is `app.data.kafka_range`),
preprocesses in an actor pool with the one transform training and serving share, writes Parquet
straight into the snapshot's folder (`app.data.sink`), commits the manifest (one object, never
overwritten: no rename, so S3 works as local disk does), and only then commits the offsets. The
manifests are the offset ledger, so a run killed anywhere and rerun yields each record once.
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
from app.data.faults import fault
from app.data.kafka_range import (
    IO_TASK_CPUS,
    KafkaRangeDatasource,
    io_concurrency,
    read_ranges,
    streaming_blocks,
)
from app.data.lease import Lease, LeaseHeld
from app.data.manifest import WriteSpec, build_manifest, new_snapshot_id
from app.data.plan import check_no_overlap, pending_ranges, report_lost
from app.data.preprocess import preprocess_batches
from app.data.sink import SinkTarget, SnapshotSink
from app.data.snapshot import SnapshotStore
from app.storage import Store

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0
"""How often a running ingest says how far its write has got."""


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


def write_spec(settings: Settings, cfg: IngestConfig) -> WriteSpec:
    """What every snapshot an ingest or a watch of these settings commits records of itself."""
    return WriteSpec(
        topic=settings.topic,
        dlq_topic=settings.dlq_topic,
        image_size=settings.image_size,
        classes=settings.classes,
        features=cfg.features,
        features_weights=cfg.weights,
        allowed_lateness_s=cfg.allowed_lateness_s,
        keep_source=cfg.keep_source,
    )


def ingest_lease(store: Store, topic: str, ttl_s: float | None = None) -> Lease:
    """The lease every writer of the topic's snapshots under the storage root `store` takes (ingest,
    watch); partitions' and compaction's leases live under its folder."""
    return Lease(store.child("leases", f"ingest-{topic}"), ttl_s=ttl_s)


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
    snapshots = SnapshotStore.at(settings.uri())
    lease = ingest_lease(snapshots.store, settings.topic, cfg.lease_ttl_s)
    try:
        with lease.held():
            return _ingest_holding(settings, cfg, connection, snapshots, lease, started)
    except LeaseHeld as exc:
        log.warning("ingest of %s into %s skipped: %s", settings.topic, settings.storage, exc)
        return IngestReport(None, 0, 0, {}, time.perf_counter() - started, 0, held_by=str(exc))


def _ingest_holding(
    settings: Settings,
    cfg: IngestConfig,
    connection: kafka.KafkaConnection,
    snapshots: SnapshotStore,
    lease: Lease,
    started: float,
) -> IngestReport:
    topic = settings.topic
    manifests = snapshots.manifests()
    snapshots.remove_uncommitted()  # their writers' leases expired: they are gone
    pending = pending_ranges(snapshots, connection, topic, manifests)
    if not pending.ranges:
        return IngestReport(None, 0, 0, {}, time.perf_counter() - started, 0)
    report_lost(topic, pending, strict=cfg.strict)
    ranges = pending.ranges

    snapshot_id = new_snapshot_id()
    log.info("ingesting %s offsets %s into %s", topic, ranges, snapshot_id)
    target = SinkTarget(
        snapshots.folder(snapshot_id),
        snapshots.store.child("dlq"),
        connection,
        topic,
        settings.dlq_topic,
        cfg.dlq_max_bytes,
    )
    sink = SnapshotSink(target)
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
            dataset = preprocess_batches(read_ranges(source), settings, cfg)
        offsets = sum(end - start for start, end in ranges.values())
        with progress_lines(target.folder, offsets):
            dataset.write_datasink(
                sink, ray_remote_args={"num_cpus": IO_TASK_CPUS}, concurrency=io_concurrency()
            )
    manifest = build_manifest(
        write_spec(settings, cfg), snapshot_id, ranges, pending.watermarks, sink.stats, pending.lost
    )
    skipped = sum(r.skipped for r in manifest.offsets.values())
    if skipped:
        log.info(
            "%d offsets of %s are transaction markers or compacted records: counted as skipped",
            skipped,
            topic,
        )
        metrics.inc("argus_offsets_skipped", skipped, topic=topic)
    fault("after_write")
    check_no_overlap(snapshots, topic, ranges)
    lease.check()
    fault("before_manifest")
    if not snapshots.commit(manifest):
        raise RuntimeError(f"snapshot {snapshot_id} already has a manifest: another writer used this id")
    fault("before_commit")
    ends = {p: end for p, (_, end) in ranges.items()}
    snapshots.write_offsets(cfg.group, topic, ends)
    kafka.commit_offsets(connection, cfg.group, topic, ends)
    report = IngestReport(
        snapshot_id,
        manifest.records,
        manifest.dlq,
        ranges,
        time.perf_counter() - started,
        manifest.value_bytes,
    )
    _export_metrics(topic, report)
    return report


@contextlib.contextmanager
def progress_lines(folder: Store, offsets: int, interval_s: float | None = None) -> Iterator[None]:
    """While the block runs, a line every `interval_s` (PROGRESS_INTERVAL_S) with the records the
    Parquet files in the snapshot `folder` hold so far: off a terminal, where Ray Data shows no
    progress bar, the only live sign of a long ingest. Write tasks write each file whole, so every
    footer read is of a complete file; dead letters are not in them, so the count may end below
    `offsets`."""
    interval_s = PROGRESS_INTERVAL_S if interval_s is None else interval_s
    stop = threading.Event()

    def report() -> None:
        rows: dict[str, int] = {}  # each file's footer is read once
        while not stop.wait(interval_s):
            try:
                for info in folder.list(recursive=True):
                    if info.path.endswith(".parquet") and info.path not in rows:
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
