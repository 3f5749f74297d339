"""`python -m app watch`: keep ingesting in micro-batches and alert on end-to-end lag.

    python -m app watch --interval-s 5 --lag-alert-s 5

Each tick measures, per partition, how many records are not yet in a snapshot and how old the
oldest of them is (its Kafka timestamp against now), exports both as metrics, logs an alert at
WARNING when the age exceeds `--lag-alert-s`, then ingests what is there. While `--pause-file`
exists, ticks measure but do not ingest: an operator's brake, and how the alert is tested.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from app import metrics
from app.config import ConfigError, IngestConfig, Settings
from app.ingest import ingest
from app.kafka import KafkaConnection, partitions_of, probe_end_offsets
from app.snapshot import ledger_offsets, list_manifests

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class WatchConfig:
    interval_s: float = 5.0
    """Pause between micro-batches."""
    lag_alert_s: float = 5.0
    """Alert when the oldest record not yet in a snapshot is older than this."""
    pause_file: str | None = None
    """While this file exists, measure but do not ingest."""
    max_ticks: int | None = None
    """Stop after this many ticks (None: until interrupted)."""

    def __post_init__(self) -> None:
        if self.interval_s < 0 or self.lag_alert_s <= 0:
            raise ConfigError("--interval-s must be >= 0 and --lag-alert-s > 0")
        if self.max_ticks is not None and self.max_ticks < 1:
            raise ConfigError("--max-ticks must be >= 1")


@dataclass
class Lag:
    records: dict[int, int]
    oldest_age_s: float

    @property
    def total(self) -> int:
        return sum(self.records.values())


def measure_lag(settings: Settings, kafka: KafkaConnection) -> Lag:
    """Records behind the proven end of each partition, and the age of the oldest of them."""
    from confluent_kafka import TopicPartition

    starts, _ = ledger_offsets(list_manifests(settings), settings.topic)
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
    """Run ticks until `stop` is set or `max_ticks` ran; return the number of alerts raised."""
    stop = stop or threading.Event()
    alerts = ticks = 0
    while not stop.is_set():
        lag = measure_lag(settings, kafka)
        for partition, records in lag.records.items():
            metrics.set_gauge(
                "argus_consumer_lag_records", records, topic=settings.topic, partition=partition
            )
        metrics.set_gauge("argus_consumer_lag_seconds", lag.oldest_age_s, topic=settings.topic)
        if lag.oldest_age_s > cfg.lag_alert_s:
            alerts += 1
            metrics.inc("argus_lag_alerts", topic=settings.topic)
            log.warning(
                "LAG ALERT: %d records of %s wait, the oldest for %.1fs (threshold %.1fs)",
                lag.total,
                settings.topic,
                lag.oldest_age_s,
                cfg.lag_alert_s,
            )
        paused = cfg.pause_file is not None and Path(cfg.pause_file).exists()
        if paused:
            log.info("paused by %s: %d records waiting", cfg.pause_file, lag.total)
        elif lag.total:
            log.info("%s", ingest(settings, ingest_cfg, kafka))
        ticks += 1
        if cfg.max_ticks is not None and ticks >= cfg.max_ticks:
            break
        stop.wait(cfg.interval_s)
    return alerts
