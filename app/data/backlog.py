"""Lag from the broker's side (`argus lag`): per partition, the records between the table's
committed offset and the log's proven end, and the age of the oldest of them.

    python -m app lag --once

`watch` measures lag over what it has consumed, so it cannot see the broker's backlog, partitions
between two owners during a rebalance, or itself when it is dead (its gauges vanish with it). This
reads only Kafka and the table's committed offsets (`ImageTable.committed`), so it tells the same
story whether a watch runs or not; the alert rules (`monitoring/prometheus/argus-rules.yml`)
compare it with the watch's own gauges.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from app import metrics
from app.config import Settings
from app.data.catalog import catalog_uri, open_catalog, warehouse_uri
from app.data.kafka import KafkaConnection
from app.data.probe import partitions_of, probe_partitions
from app.data.table import ImageTable
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
    """The table's committed (next) offset for the partition (0 when nothing was ever ingested)."""
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


def existing_table(settings: Settings) -> ImageTable | None:
    """The table of `settings`, or None while no writer has created it: measuring creates nothing
    (a table made here would lack the columns the first ingest asks for)."""
    uri, warehouse = catalog_uri(settings.storage, settings.catalog), warehouse_uri(settings.storage)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    if not open_catalog(uri, warehouse).table_exists(settings.table):
        return None
    return ImageTable(uri, warehouse, settings.table, create=False)


def measure_backlog(
    kafka: KafkaConnection, table: ImageTable | None, topic: str, now_s: float | None = None
) -> list[PartitionBacklog]:
    """Each partition's backlog: the table's committed offsets (none without a table) against the
    log's proven ends."""
    partitions = partitions_of(kafka, topic)
    ends = probe_partitions(kafka, topic, partitions)
    committed = table.committed() if table is not None else {}
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
    settings: Settings, cfg: LagConfig, kafka: KafkaConnection, stop: threading.Event
) -> list[PartitionBacklog]:
    """Measure and export every `interval_s` until `stop` (once with `cfg.once`); the last measure."""
    topic, table = settings.topic, None
    while True:
        table = table or existing_table(settings)
        backlog = measure_backlog(kafka, table, topic)
        export(topic, backlog)
        total = sum(entry.records for entry in backlog)
        oldest = max((entry.oldest_age_s for entry in backlog), default=0.0)
        log.info("%s: %d records behind the table, the oldest for %.1fs", topic, total, oldest)
        if cfg.once or stop.wait(cfg.interval_s):
            return backlog
