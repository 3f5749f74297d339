"""`python -m app watch`: continuous ingest with end-to-end lag gauges and alerts.

    python -m app watch --max-batch-delay-s 1 --lag-alert-s 5 --lag-alert-for-s 1

One long-lived pipeline (`app.data.stream`, with `partitions`, `parts` and `lag`): a consumer kept
open in the consumer group, a pool of preprocessing actors kept warm, micro-batches cut by size or
time and each committed to the table as one Iceberg commit, so offsets advance only with a
durable commit; and, beside it, the table's upkeep (`Upkeep`: compaction, snapshot expiry, orphan
removal). Several watches in one `--group` share the topic's partitions, and a bulk `ingest` may
run beside them: whoever commits a partition's offsets first wins, the others' commits are refused
by the catalog and they start over from the table. While `--pause-file` exists nothing is cut or
committed (lag keeps being measured): an operator's brake, and how the alert is tested.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app import metrics
from app.config import IngestConfig, Settings
from app.data.kafka import KafkaConnection
from app.data.table import ImageTable
from app.errors import ConfigError
from app.retry import Backoff

log = logging.getLogger(__name__)
RESTART_BACKOFF_CAP_S = 60.0
"""A watch that keeps losing what it holds starts over at most this far apart (doubling from 1 s)."""
DAY_S = 86_400.0
UPKEEP_RETRY_S = 5.0
UPKEEP_RETRY_CAP_S = 300.0
"""An upkeep that failed is retried after UPKEEP_RETRY_S, doubling up to this (or the interval)."""
STUCK_AFTER = 5
"""Failed upkeeps in a row after which the upkeep is reported stuck (an error, not a warning)."""
EXPIRY_CHECK_S = 15.0
"""Between two looks at the table's snapshot count. A busy watch commits about once a second and
every kept snapshot makes each commit dearer, so expiry does not wait for the next full upkeep once
the table holds more than twice `keep_snapshots`."""
UPKEEP_PARTITION = 0
"""The watch that holds this partition of the topic keeps the table up; the others leave it be."""
MIN_ORPHAN_AGE_S = 3600.0
"""Files younger than this are never orphans: a writer (a bulk ingest, a part) may not have
committed them yet."""


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
    compact_interval_s: float = 300.0
    """Between two upkeeps of the table (compaction, snapshot expiry, orphan removal); 0: none in
    this watch (run by another, or not at all)."""
    expire_after_s: float = 7 * DAY_S
    """Table snapshots older than this expire, but those registered model versions name."""
    keep_snapshots: int = 20
    """At most this many of the newest table snapshots stay, besides those registered versions name
    and those a running `train` or `federate` reads: each commit rewrites metadata that lists them
    all, so at a commit a second an uncapped week would make every commit take minutes."""
    orphan_after_s: float = 3 * DAY_S
    """Files under the table no snapshot names are deleted once this old (at least an hour: a
    writer's files are nameless until it commits)."""
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
        if self.compact_interval_s < 0 or self.expire_after_s <= 0 or self.keep_snapshots < 1:
            raise ConfigError(
                "--compact-interval-s must be >= 0, --expire-after-s > 0 and --keep-snapshots >= 1"
            )
        if self.orphan_after_s < MIN_ORPHAN_AGE_S:
            raise ConfigError(
                f"--orphan-after-s must be >= {MIN_ORPHAN_AGE_S:.0f}: younger files may be a "
                "writer's, not committed yet"
            )
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
    """From outside any watch: records behind the table's committed offsets (to each partition's
    proven end), and the age of the oldest of them."""
    from app.data.backlog import existing_table, measure_backlog

    backlog = measure_backlog(kafka, existing_table(settings), settings.topic)
    oldest = max((entry.oldest_age_s for entry in backlog), default=0.0)
    return Lag({entry.partition: entry.records for entry in backlog}, oldest)


class UpkeepFailed(RuntimeError):
    """Steps of one upkeep failed; `steps` names each with its cause."""

    def __init__(self, steps: dict[str, BaseException]):
        self.steps = steps
        super().__init__("; ".join(f"{step}: {type(exc).__name__}: {exc}" for step, exc in steps.items()))


def _registry_pins(settings: Settings) -> Callable[[], set[int]]:
    def pinned() -> set[int]:
        from app.registry import pinned_snapshot_ids

        return pinned_snapshot_ids(settings)

    return pinned


class Upkeep:
    """The table's upkeep every `compact_interval_s` (jittered), in a thread beside the watch's
    pipeline: compaction of small files per event date, expiry of snapshots older than
    `expire_after_s` or beyond the newest `keep_snapshots`, but those registered versions name
    (`pinned`) and those running readers tagged, and removal of orphan files. In between, every
    EXPIRY_CHECK_S, expiry alone once the table holds over twice `keep_snapshots` snapshots.

    Only the watch that `leads` (holds UPKEEP_PARTITION in the group) runs it, so several watches do
    not repeat the work; should two lead at once during a rebalance, each step is one catalog commit
    that re-plans when it loses a race. A failed upkeep is retried with backoff
    (`app.retry.Backoff`) and, after STUCK_AFTER failures in a row, reported stuck;
    `argus_compaction_failures` counts every failure, `argus_compactions` every compaction."""

    def __init__(
        self,
        table: ImageTable,
        settings: Settings,
        cfg: WatchConfig,
        stop: threading.Event,
        pinned: Callable[[], set[int]] | None = None,
        leads: Callable[[], bool] = lambda: True,
    ):
        self.table, self.topic, self.cfg, self.stop = table, settings.topic, cfg, stop
        self.pinned = pinned or _registry_pins(settings)
        self.leads = leads
        self.rng = random.Random()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="upkeep")

    def start(self) -> None:
        if self.cfg.compact_interval_s > 0:
            self._thread.start()

    def tick(self) -> None:
        """Compact, expire, remove orphans: each step even when one before it failed, then
        UpkeepFailed naming those that did. Nothing expires while the registry cannot say which
        snapshots its versions pin."""
        from app.data.maintenance import compact, remove_orphans

        failed: dict[str, BaseException] = {}
        try:
            if compact(self.table).snapshot_id is not None:
                metrics.inc("argus_compactions", topic=self.topic)
        except Exception as exc:
            failed["compaction"] = exc
        try:
            self.expire()
        except Exception as exc:
            failed["expiry"] = exc
        try:
            remove_orphans(self.table, older_than_s=self.cfg.orphan_after_s)
        except Exception as exc:
            failed["orphan removal"] = exc
        if failed:
            raise UpkeepFailed(failed)

    def expire(self) -> None:
        """Expire what the watch's settings say, sparing what registered versions pin."""
        from app.data.maintenance import expire

        try:
            keep = self.pinned()
        except Exception as exc:
            raise RuntimeError(
                f"nothing expired: the registry did not say which snapshots its versions pin ({exc})"
            ) from exc
        expire(
            self.table,
            older_than_s=self.cfg.expire_after_s,
            keep=keep,
            max_snapshots=self.cfg.keep_snapshots,
        )

    def _overgrown(self) -> bool:
        return len(self.table.load().snapshots()) > 2 * self.cfg.keep_snapshots

    def _done(self, wait_s: float) -> bool:
        return self._closed.wait(wait_s) or self.stop.is_set()

    def _lead(self, was_leading: bool) -> bool:
        leading = self.leads()
        if leading != was_leading:
            who = "this watch holds" if leading else "another watch holds"
            log.info("upkeep of %s: %s partition %d and runs it", self.topic, who, UPKEEP_PARTITION)
        return leading

    def _run(self) -> None:
        interval = self.cfg.compact_interval_s
        backoff = Backoff(base_s=min(UPKEEP_RETRY_S, interval), cap_s=max(UPKEEP_RETRY_CAP_S, interval))
        due = time.monotonic() + interval * self.rng.uniform(0.75, 1.0)
        leading = False
        while not self._done(min(max(due - time.monotonic(), 0.0), EXPIRY_CHECK_S)):
            leading = self._lead(leading)
            if not leading:  # keeps its own clock should it lead later
                due = max(due, time.monotonic() + EXPIRY_CHECK_S)
                continue
            if time.monotonic() < due:
                self._trim()
                continue
            try:
                self.tick()
                backoff.succeeded()
                due = time.monotonic() + interval * self.rng.uniform(0.75, 1.0)
            except Exception as exc:  # the next try starts from what the table holds then
                wait_s = backoff.failed()
                due = time.monotonic() + wait_s
                metrics.inc("argus_compaction_failures", topic=self.topic)
                stuck = backoff.failures >= STUCK_AFTER
                log.log(
                    logging.ERROR if stuck else logging.WARNING,
                    "upkeep of %s failed %d times in a row%s, next try in %.0f s: %s",
                    self.topic,
                    backoff.failures,
                    " (stuck)" if stuck else "",
                    wait_s,
                    exc,
                    exc_info=backoff.failures == 1,  # the traceback once, not every retry
                )

    def _trim(self) -> None:
        """Expiry between upkeeps, when commits have piled up snapshots. A failure is left to the
        full upkeep, which retries with backoff and counts and reports it."""
        try:
            if self._overgrown():
                self.expire()
        except Exception as exc:
            log.warning("expiry of %s between upkeeps failed: %s", self.topic, exc)

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)


def watch(
    settings: Settings,
    cfg: WatchConfig,
    ingest_cfg: IngestConfig,
    kafka: KafkaConnection,
    stop: threading.Event | None = None,
) -> int:
    """Ingest continuously until `stop` is set or `max_ticks` parts committed; return the number
    of lag alerts fired. Starts its pipeline over from the table, with backoff, whenever the table
    refused a part (`Restart`: another writer committed one of its partitions first)."""
    from app.data import kafka as kafka_clients
    from app.data.ingest import open_table
    from app.data.lag import LagMonitor
    from app.data.partitions import Restart
    from app.data.stream import Stream

    stop = stop or threading.Event()
    kafka_clients.ensure_topics(
        kafka, settings.topic, settings.dlq_topic, settings.partitions, settings.replication_factor
    )
    table = open_table(settings, ingest_cfg)
    writer = f"watch {socket.gethostname()}:{os.getpid()}"
    lag = LagMonitor(settings.topic, cfg.lag_alert_s, cfg.lag_alert_for_s)
    stream: Stream | None = None
    upkeep = Upkeep(
        table,
        settings,
        cfg,
        stop,
        leads=lambda: stream is not None and UPKEEP_PARTITION in stream.partitions.owned,
    )
    upkeep.start()
    restarts = Backoff(base_s=1.0, cap_s=RESTART_BACKOFF_CAP_S)
    try:
        while not stop.is_set():
            started = time.monotonic()
            try:
                stream = Stream(table, settings, cfg, ingest_cfg, kafka, lag, writer, stop)
                stream.run()
                break
            except Restart as exc:
                if time.monotonic() - started > RESTART_BACKOFF_CAP_S:
                    restarts.succeeded()  # it ran a good while: not the same failure again
                wait_s = restarts.failed()  # not in a tight loop should it keep losing what it takes
                log.warning(
                    "watch of %s starts over from the table in %.1f s: %s", settings.topic, wait_s, exc
                )
                stop.wait(wait_s)
    finally:
        upkeep.close()
        lag.close()
    return lag.alert.fired
