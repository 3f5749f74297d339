"""Continuous ingest's end-to-end lag, its gauges and its alert.

Lag is now minus the Kafka timestamp of the oldest record consumed but not yet durable (buffered
or in a part being written); at a partition's end with nothing pending it is 0. The alert fires
when lag stays above `--lag-alert-s` for `--lag-alert-for-s`, clears when it drops back, and its
state is the gauge `argus_lag_alert_active`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from app import metrics
from app.data.parts import Batch, Part

log = logging.getLogger(__name__)

GAUGE_EVERY_S = 0.5


@dataclass
class AlertState:
    """Fires after lag stays above the threshold for `for_s`; clears when it drops back."""

    threshold_s: float
    for_s: float
    over_since: float | None = None
    active: bool = False
    fired: int = 0

    def update(self, lag_s: float, now: float) -> str | None:
        """'fired', 'cleared' or None."""
        if lag_s > self.threshold_s:
            self.over_since = now if self.over_since is None else self.over_since
            if not self.active and now - self.over_since >= self.for_s:
                self.active, self.fired = True, self.fired + 1
                return "fired"
            return None
        self.over_since = None
        if self.active:
            self.active = False
            return "cleared"
        return None


def lag_seconds(batch: Batch, in_flight: Iterable[Part], now_s: float) -> float:
    """The age of the oldest record consumed but not yet durable; 0 with nothing pending."""
    pending = [batch.oldest_ms] + [part.oldest_ms for part in in_flight]
    pending = [ms for ms in pending if ms is not None]
    if not pending:
        return 0.0
    return max(0.0, now_s - min(pending) / 1000)


class LagMonitor:
    """Measures the lag at every turn of the watch's loop, fires and clears the alert, and exports
    the gauges (every GAUGE_EVERY_S, and at once when the alert changes)."""

    def __init__(self, topic: str, threshold_s: float, for_s: float):
        self.topic = topic
        self.alert = AlertState(threshold_s, for_s)
        self.lag_s = 0.0
        self._gauges_at = 0.0

    def observe(self, batch: Batch, in_flight: Collection[Part], partitions: Iterable[int]) -> None:
        """`partitions`: the ones this watch reads, each exported (0 when nothing of it waits)."""
        now = time.monotonic()
        self.lag_s = lag_seconds(batch, in_flight, time.time())
        change = self.alert.update(self.lag_s, now)
        if change == "fired":
            waiting = batch.records + sum(part.records for part in in_flight)
            metrics.inc("argus_lag_alerts", topic=self.topic)
            log.warning(
                "LAG ALERT: %d records of %s wait, the oldest for %.1fs (threshold %.1fs for %.1fs)",
                waiting,
                self.topic,
                self.lag_s,
                self.alert.threshold_s,
                self.alert.for_s,
            )
        elif change == "cleared":
            log.warning("lag alert cleared: %s lag %.1fs", self.topic, self.lag_s)
        if now - self._gauges_at >= GAUGE_EVERY_S or change:
            self._gauges_at = now
            by_partition = dict.fromkeys(partitions, 0)
            for p in batch.rows["partition"]:
                by_partition[p] = by_partition.get(p, 0) + 1
            for part in in_flight:
                for p, n in part.per_partition.items():
                    by_partition[p] = by_partition.get(p, 0) + n
            for p, n in by_partition.items():
                metrics.set_gauge("argus_consumer_lag_records", n, topic=self.topic, partition=p)
            metrics.set_gauge("argus_consumer_lag_seconds", self.lag_s, topic=self.topic)
            metrics.set_gauge("argus_lag_alert_active", int(self.alert.active), topic=self.topic)

    def close(self) -> None:
        metrics.set_gauge("argus_lag_alert_active", 0, topic=self.topic)
