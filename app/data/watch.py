"""`python -m app watch`: continuous ingest with end-to-end lag gauges and alerts.

    python -m app watch --max-batch-delay-s 1 --lag-alert-s 5 --lag-alert-for-s 1

One long-lived pipeline (`app.data.stream`, with `partitions`, `parts` and `lag`): a consumer kept
open in the consumer group, a pool of preprocessing actors kept warm, micro-batches cut by size or
time and each committed as a small part (a snapshot with its own manifest) under the leases of its
partitions, so offsets advance only with a durable commit; and, beside it, compaction of closed
windows of parts into one snapshot each (`app.data.compact`, by whichever watch holds the
compaction lease). Several watches in one `--group` share the topic's partitions; a bulk `ingest`
waits while any of them runs, and they for it. While `--pause-file` exists nothing is cut or
committed (lag keeps being measured): an operator's brake, and how the alert is tested.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from app.config import IngestConfig, Settings
from app.data.kafka import KafkaConnection, partitions_of, probe_end_offsets
from app.data.manifest import ledger_offsets
from app.data.snapshot import SnapshotStore
from app.errors import ConfigError
from app.retry import Backoff

log = logging.getLogger(__name__)
RESTART_BACKOFF_CAP_S = 60.0
"""A watch that keeps losing what it holds starts over at most this far apart (doubling from 1 s)."""


@dataclass(kw_only=True)
class WatchConfig:
    interval_s: float = 0.0
    """Least time between two micro-batch cuts (0: cut as soon as size or delay says)."""
    max_batch_delay_s: float = 1.0
    """Cut a micro-batch once its first record has waited this long."""
    max_batch_records: int = 2000
    """Cut a micro-batch once it holds this many offsets."""
    max_in_flight: int = 2
    """Micro-batches being preprocessed and written at once (commits stay in cut order)."""
    lag_alert_s: float = 5.0
    """Alert when the oldest record not yet durable is older than this..."""
    lag_alert_for_s: float = 1.0
    """...for at least this long; the alert clears when lag drops back under the threshold."""
    pause_file: str | None = None
    """While this file exists, measure lag but cut and commit nothing."""
    max_ticks: int | None = None
    """Stop after committing this many micro-batches (None: until interrupted)."""
    compact_window_s: float | None = 3600.0
    """Compact the parts of each closed window of this many seconds (by part creation time) into
    one snapshot; None: never compact."""
    compact_max_records: int | None = None
    """Also compact as soon as a window's parts hold this many records."""
    compact_grace_s: float = 60.0
    """Keep superseded parts this long after their compaction, for readers that listed them."""
    session_timeout_s: float | None = None
    """The consumer group's session timeout: a watch that stops heartbeating loses its partitions
    to the others after this long (None: the Kafka properties' `session.timeout.ms`, else 6 s)."""

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.lag_alert_s <= 0 or self.lag_alert_for_s < 0:
            raise ConfigError("--interval-s and --lag-alert-for-s must be >= 0 and --lag-alert-s > 0")
        if self.max_batch_delay_s < 0 or self.max_batch_records < 1 or self.max_in_flight < 1:
            raise ConfigError(
                "--max-batch-delay-s must be >= 0, --max-batch-records and --max-in-flight >= 1"
            )
        if self.max_ticks is not None and self.max_ticks < 1:
            raise ConfigError("--max-ticks must be >= 1")
        if self.compact_window_s is not None and self.compact_window_s <= 0:
            raise ConfigError("--compact-window-s must be > 0")
        if self.compact_max_records is not None and self.compact_max_records < 1:
            raise ConfigError("--compact-max-records must be >= 1")
        if self.session_timeout_s is not None and self.session_timeout_s < 1:
            raise ConfigError("--session-timeout-s must be >= 1")


@dataclass
class Lag:
    records: dict[int, int]
    oldest_age_s: float

    @property
    def total(self) -> int:
        return sum(self.records.values())


def measure_lag(settings: Settings, kafka: KafkaConnection) -> Lag:
    """From outside any watch: records behind the proven end of each partition (the ledger's end
    to it), and the age of the oldest of them."""
    from confluent_kafka import TopicPartition

    starts, _ = ledger_offsets(SnapshotStore.at(settings.uri()).manifests(), settings.topic)
    partitions = partitions_of(kafka, settings.topic)
    ends = probe_end_offsets(kafka, settings.topic, partitions)
    behind = {p: max(0, ends[p] - starts.get(p, 0)) for p in partitions}
    oldest_ms = None
    pending = [TopicPartition(settings.topic, p, starts.get(p, 0)) for p in partitions if behind[p]]
    if pending:
        consumer = kafka.consumer()
        try:
            consumer.assign(pending)
            seen: set[int] = set()
            deadline = time.monotonic() + 10
            while len(seen) < len(pending) and time.monotonic() < deadline:
                message = consumer.poll(0.5)
                if message is None or message.error() or message.partition() in seen:
                    continue
                seen.add(message.partition())
                _, timestamp = message.timestamp()
                oldest_ms = timestamp if oldest_ms is None else min(oldest_ms, timestamp)
        finally:
            consumer.close()
    age = 0.0 if oldest_ms is None else max(0.0, time.time() - oldest_ms / 1000)
    return Lag(behind, age)


def watch(
    settings: Settings,
    cfg: WatchConfig,
    ingest_cfg: IngestConfig,
    kafka: KafkaConnection,
    stop: threading.Event | None = None,
) -> int:
    """Ingest continuously until `stop` is set or `max_ticks` parts committed; return the number
    of lag alerts fired. Waits while a bulk `ingest` holds the topic's lease; starts its pipeline
    over from the ledger when it lost what it held (`Restart`)."""
    from app.data import kafka as kafka_clients
    from app.data.compact import Compactor
    from app.data.ingest import ingest_lease, write_spec
    from app.data.lease import LeaseHeld, SharedLease
    from app.data.partitions import Restart
    from app.data.stream import Stream

    stop = stop or threading.Event()
    kafka_clients.ensure_topics(
        kafka, settings.topic, settings.dlq_topic, settings.partitions, settings.replication_factor
    )
    snapshots = SnapshotStore.at(settings.uri())
    spec = write_spec(settings, ingest_cfg)
    # Shared: other watches of the topic hold it too; a bulk ingest's exclusive hold excludes them all.
    topic_lease = ingest_lease(snapshots.store, settings.topic)
    lease = SharedLease(topic_lease.store, ttl_s=ingest_cfg.lease_ttl_s)
    waiting = False
    restarts = Backoff(base_s=1.0, cap_s=RESTART_BACKOFF_CAP_S)
    while not stop.is_set():
        started = time.monotonic()
        try:
            with lease.held():
                compactor = Compactor(snapshots, settings.topic, cfg, lease, stop)
                compactor.start()
                try:
                    return Stream(snapshots, spec, cfg, ingest_cfg, kafka, lease, stop).run()
                finally:
                    compactor.close()
        except LeaseHeld as exc:
            if not waiting:
                log.warning("watch of %s waits: %s", settings.topic, exc)
                waiting = True
            stop.wait(1.0)
        except Restart as exc:
            if time.monotonic() - started > RESTART_BACKOFF_CAP_S:
                restarts.succeeded()  # it ran a good while: not the same failure again
            wait_s = restarts.failed()  # not in a tight loop should it keep losing what it takes
            log.warning("watch of %s starts over from the ledger in %.1f s: %s", settings.topic, wait_s, exc)
            stop.wait(wait_s)
    return 0
