"""Lag from the broker's side (`argus lag`): per partition, the records between the ledger's next
offset and the log's proven end, and the age of the oldest of them.

`watch` measures lag over what it has consumed, so it cannot see the broker's backlog, partitions
paused during a lease handover, or itself when it is dead (its gauges vanish with it). This reads
only Kafka and the ledger, so it tells the same story whether a watch runs or not; the alert rules
(`monitoring/prometheus/argus-rules.yml`) compare it with the watch's own gauges.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from app import metrics
from app.data.kafka import KafkaConnection, partitions_of, probe_partitions
from app.data.manifest import ledger_offsets, live_manifests
from app.data.snapshot import SnapshotStore
from app.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LagConfig:
    interval_s: float = 15.0
    """Between two measurements (a Prometheus scrape interval is the natural choice)."""
    once: bool = False
    """Measure, print and export once, then exit."""

    def __post_init__(self):
        if not self.interval_s > 0:
            raise ConfigError("--interval-s must be > 0")


@dataclass(frozen=True)
class PartitionBacklog:
    partition: int
    committed: int
    """The ledger's next offset for the partition (0 when nothing was ever ingested)."""
    end: int
    """The log's proven end (last offset + 1)."""
    records: int
    """Offsets from max(committed, log start) to the end: waiting to be ingested."""
    oldest_age_s: float
    """Now minus the Kafka timestamp of the oldest record waiting; 0 when none waits."""

    def __str__(self) -> str:
        return (
            f"partition {self.partition}: {self.records} records behind (committed {self.committed}, "
            f"end {self.end}), oldest waiting {self.oldest_age_s:.1f}s"
        )


def _oldest_timestamps_ms(kafka: KafkaConnection, topic: str, starts: dict[int, int]) -> dict[int, int]:
    """The Kafka timestamp of the first record at or after each partition's offset in `starts`
    (absent where only transaction markers follow it)."""
    from confluent_kafka import KafkaError, TopicPartition

    if not starts:
        return {}
    consumer = kafka.consumer()
    try:
        consumer.assign([TopicPartition(topic, p, offset) for p, offset in starts.items()])
        pending, found = set(starts), {}
        deadline = time.monotonic() + 30
        while pending and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.partition() not in pending:
                continue
            if message.error():
                if message.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading {topic}[{message.partition()}]: {message.error()}")
            else:
                found[message.partition()] = message.timestamp()[1]
            pending.discard(message.partition())
        return found
    finally:
        consumer.close()


def measure_backlog(
    kafka: KafkaConnection, snapshots: SnapshotStore, topic: str, now_s: float | None = None
) -> list[PartitionBacklog]:
    """Each partition's backlog: the ledger's next offsets against the log's proven ends."""
    partitions = partitions_of(kafka, topic)
    ends = probe_partitions(kafka, topic, partitions)
    committed, _ = ledger_offsets(live_manifests(snapshots.manifests()), topic)
    # Below the log start is retention's (lost, and counted as such by the next ingest), not backlog.
    starts = {p: max(committed.get(p, 0), ends[p].log_start) for p in partitions}
    waiting = {p: start for p, start in starts.items() if start < ends[p].end}
    oldest = _oldest_timestamps_ms(kafka, topic, waiting)
    now_s = time.time() if now_s is None else now_s
    return [
        PartitionBacklog(
            partition=p,
            committed=committed.get(p, 0),
            end=ends[p].end,
            records=ends[p].end - starts[p],
            oldest_age_s=max(0.0, now_s - oldest[p] / 1000) if p in oldest else 0.0,
        )
        for p in partitions
    ]


def export(topic: str, backlog: list[PartitionBacklog]) -> None:
    for entry in backlog:
        metrics.set_gauge("argus_backlog_records", entry.records, topic=topic, partition=entry.partition)
        metrics.set_gauge(
            "argus_backlog_oldest_age_seconds", entry.oldest_age_s, topic=topic, partition=entry.partition
        )


def run_lag(
    snapshots: SnapshotStore, topic: str, cfg: LagConfig, kafka: KafkaConnection, stop: threading.Event
) -> list[PartitionBacklog]:
    """Measure and export every `interval_s` until `stop` (once with `cfg.once`); the last measure."""
    while True:
        backlog = measure_backlog(kafka, snapshots, topic)
        export(topic, backlog)
        total = sum(entry.records for entry in backlog)
        oldest = max((entry.oldest_age_s for entry in backlog), default=0.0)
        log.info("%s: %d records behind the ledger, the oldest for %.1fs", topic, total, oldest)
        if cfg.once or stop.wait(cfg.interval_s):
            return backlog
