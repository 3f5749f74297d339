"""Continuous ingest: one long-lived pipeline from Kafka to small committed parts (`watch`).

    python -m app watch --max-batch-delay-s 1 --lag-alert-s 5

One consumer, a member of the consumer group (`--group`), reads the partitions the group assigns
it; a fixed pool of `PartWriter` actors, each holding one `Preprocessor` for the life of the watch,
preprocesses and writes. Records are cut into micro-batches by size (`--max-batch-records`) or by
the age of the batch's first record (`--max-batch-delay-s`). Each micro-batch becomes a *part*: a
snapshot like any other (its own folder and `_manifest.json` under `<storage>/snapshots/`, offsets proven once
each by `build_manifest`), committed by the one create-once manifest write, in cut order. Offsets
advance only with that commit, so a watch killed anywhere and restarted resumes at the ledger's end:
each offset once (CONTRACT.md §2).

Several watches share a topic: each holds the topic's lease shared (so a bulk `ingest` waits) and
an exclusive lease per partition it reads. On assignment it takes each partition's lease and seeks
to the ledger's end, never to the group's committed offsets, which only mirror the ledger; a
partition whose lease another writer still holds is paused until it can be taken. On revocation it
commits every part already cut, drops the open batch's rows of the revoked partitions (their new
owner reads them again) and only then releases their leases. Before each commit it checks the lease
of every partition the part covers, so a watch that lost one (paused past its TTL) commits nothing
that the new owner also commits; it then starts its pipeline over (`Restart`).

Lag is now minus the Kafka timestamp of the oldest record consumed but not yet durable (buffered
or in a part being written); at a partition's end with nothing pending it is 0. The alert fires
when lag stays above `--lag-alert-s` for `--lag-alert-for-s`, clears when it drops back, and its
state is the gauge `argus_lag_alert_active`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import ray

from app import metrics
from app.config import IngestConfig, Settings
from app.data import kafka
from app.data import snapshot as store
from app.data.compact import new_part_id, remove_abandoned
from app.data.ingest import _fault, pending_ranges, report_lost
from app.data.lease import Lease, LeaseHeld, LeaseLost, SharedLease
from app.data.preprocess import PREPROCESS_ACTOR_CPUS, Preprocessor
from app.data.sink import SinkTarget, write_snapshot_blocks

log = logging.getLogger(__name__)

GAUGE_EVERY_S = 0.5
RETRY_LEASE_S = 1.0
"""How often a paused partition's lease is tried again."""
DRAIN_S = 60.0
"""How long a revocation waits for the parts already cut to commit."""
STRING_COLUMNS = ("key", "label", "device_id", "schema")


class Restart(RuntimeError):
    """The pipeline must start over from the ledger: what it holds in memory is no longer its own."""


class PartWriter:
    """A long-lived actor: preprocess one chunk of raw rows and write it into a part's folder.

    Keeping the actor (and the torch import and model inside its Preprocessor) across parts is
    the point: a Ray Data job per micro-batch paid seconds of start-up each time."""

    def __init__(self, **preprocessor_kwargs):
        self.preprocessor = Preprocessor(**preprocessor_kwargs)

    def ready(self) -> bool:
        return True

    def write(self, raw: pa.Table, target: SinkTarget, task_name: str) -> store.WriteStats:
        from ray.data.block import BlockAccessor

        out = self.preprocessor(BlockAccessor.for_block(raw).to_batch_format("numpy"))
        block = BlockAccessor.batch_to_block(out)
        # An all-null column (unlabelled traffic) would be typed null; readers expect strings.
        for name in STRING_COLUMNS:
            if name in block.column_names and pa.types.is_null(block.schema.field(name).type):
                i = block.column_names.index(name)
                block = block.set_column(i, name, pa.nulls(block.num_rows, pa.string()))
        return write_snapshot_blocks([block], target, task_name)


@dataclass
class Batch:
    """Raw rows consumed since the last cut, and where each partition's range starts."""

    starts: dict[int, int] = field(default_factory=dict)
    rows: dict[str, list] = field(default_factory=lambda: {n: [] for n in kafka.RAW_SCHEMA.names})
    records: int = 0
    first_at: float | None = None
    oldest_ms: int | None = None

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

    part_id: str
    ranges: dict[int, tuple[int, int]]
    watermarks: dict[int, int]
    lost: dict[int, int]
    refs: list
    oldest_ms: int | None
    records: int
    per_partition: dict[int, int]
    cut_at: float


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


class Stream:
    """The watch's state: consumer position, the open batch, parts in flight, the alert."""

    def __init__(
        self, settings: Settings, cfg, ingest_cfg: IngestConfig, connection, hold: SharedLease, stop
    ):
        self.settings, self.cfg, self.ingest_cfg = settings, cfg, ingest_cfg
        self.connection, self.hold, self.stop = connection, hold, stop
        self.topic = settings.topic
        self.alert = AlertState(cfg.lag_alert_s, cfg.lag_alert_for_s)
        self.batch = Batch()
        self.in_flight: deque[Part] = deque()
        self.parts = 0
        self.cuts = 0
        self.lag_s = 0.0
        self._gauges_at = 0.0
        self._last_cut = 0.0
        self.committed: dict[int, int] = {}
        self.owned: dict[int, Lease] = {}
        """Partitions this watch reads and commits, each with its lease."""
        self.waiting: set[int] = set()
        """Partitions the group assigned whose lease another writer still holds: paused."""
        self.next_offset: dict[int, int] = {}
        self.watermarks: dict[int, int] = {}
        self.lost: dict[int, int] = {}  # recorded in the next part that covers each partition
        self.at_end: dict[int, bool] = {}
        self.closing = False
        self._tried_at = 0.0

    # ------------------------------------------------------------ start and rebalance

    def _start(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # another watch quarantined it first
            store.list_manifests(self.settings, quarantine=True)
        remove_abandoned(self.settings, self.hold)  # folders of writers that died before committing
        self._start_pool()
        # One consumer for the watch's life. fetch.wait.max.ms bounds how long a record waits at the
        # broker for company; a bounded read's 10 ms would make an idle consumer spin.
        extra = {"group.id": self.ingest_cfg.group, "fetch.wait.max.ms": 100}
        if self.cfg.session_timeout_s is not None:
            ms = int(self.cfg.session_timeout_s * 1000)  # heartbeats must come well within it
            extra.update({"session.timeout.ms": ms, "heartbeat.interval.ms": max(100, ms // 4)})
        self.consumer = self.connection.consumer(**extra)
        self.consumer.subscribe(
            [self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )
        log.info(
            "watching %s in group %s as %s with %d preprocessing actors",
            self.topic,
            self.ingest_cfg.group,
            self.hold.owner,
            len(self.pool),
        )

    def _partition_lease(self, p: int) -> Lease:
        uri = self.settings.uri("leases", f"ingest-{self.topic}", "partitions", str(p))
        return Lease(uri, ttl_s=self.ingest_cfg.lease_ttl_s)

    def _take(self, partitions) -> list[int]:
        """Take the leases of `partitions` that are free; the taken ones."""
        taken = []
        for p in partitions:
            if p in self.owned:  # assigned again without a revocation between: still this watch's
                taken.append(p)
                continue
            lease = self._partition_lease(p)
            try:
                self.owned[p] = lease.hold()
                taken.append(p)
            except LeaseHeld as exc:
                log.info("partition %d of %s waits for its lease: %s", p, self.topic, exc)
        return taken

    def _position(self, partitions: list[int]) -> None:
        """Where each of `partitions` resumes: the ledger's end (past what retention deleted), read
        after its lease is taken, since only then can no other writer move it."""
        manifests = store.list_manifests(self.settings)
        pending = pending_ranges(self.settings, self.connection, manifests)
        mine = set(partitions) & set(self.owned)  # a waiting partition's losses are its owner's
        report_lost(
            self.settings,
            self.ingest_cfg,
            dataclasses.replace(
                pending,
                ranges={p: r for p, r in pending.ranges.items() if p in mine},
                lost={p: n for p, n in pending.lost.items() if p in mine},
            ),
        )
        ledger, watermarks = store.ledger_offsets(manifests, self.topic)
        for p in partitions:
            self.next_offset[p] = pending.ranges[p][0] if p in pending.ranges else ledger.get(p, 0)
            self.watermarks[p] = watermarks.get(p, 0)
            self.at_end[p] = False
            self.lost.pop(p, None)
            if p in mine and pending.lost.get(p):
                self.lost[p] = pending.lost[p]

    def _on_assign(self, consumer, partitions) -> None:
        from confluent_kafka import TopicPartition

        try:  # a watch that stalled past its TTL lost the topic too: it starts over, not reads on
            self.hold.check()
        except LeaseLost as exc:
            raise Restart(str(exc)) from exc
        assigned = sorted(tp.partition for tp in partitions)
        taken = self._take(assigned)
        self.waiting = set(assigned) - set(taken)
        self._position(assigned)  # a waiting partition's is redone once its lease is taken
        consumer.assign([TopicPartition(self.topic, p, self.next_offset[p]) for p in assigned])
        if self.waiting:
            consumer.pause([TopicPartition(self.topic, p) for p in self.waiting])
        log.info(
            "%s assigned partitions %s of %s: reading %s, waiting for %s",
            self.hold.owner,
            assigned,
            self.topic,
            {p: self.next_offset[p] for p in taken},
            sorted(self.waiting),
        )

    def _take_waiting(self) -> None:
        from confluent_kafka import TopicPartition

        if not self.waiting or time.monotonic() - self._tried_at < RETRY_LEASE_S:
            return
        self._tried_at = time.monotonic()
        taken = self._take(sorted(self.waiting))
        if not taken:
            return
        self.waiting -= set(taken)
        self._position(taken)  # the previous owner may have committed up to its release
        positions = [TopicPartition(self.topic, p, self.next_offset[p]) for p in taken]
        for tp in positions:
            self.consumer.seek(tp)  # forward only: anything fetched before is below it and skipped
        self.consumer.resume(positions)
        log.info("%s took partitions %s of %s over", self.hold.owner, taken, self.topic)

    def _on_revoke(self, consumer, partitions) -> None:
        if self.closing:
            return  # stopping: its leases are released without another commit
        revoked = {tp.partition for tp in partitions}
        deadline = time.monotonic() + DRAIN_S
        while self.in_flight:  # cut parts commit first: a new owner must not read them again
            if time.monotonic() > deadline:
                raise Restart(f"parts of {self.topic} did not commit within {DRAIN_S:.0f}s of a rebalance")
            self._commit_ready(wait_s=0.5)
        self.batch = self.batch.without(revoked)
        for p in revoked:
            lease = self.owned.pop(p, None)
            if lease is not None:
                lease.release()
            self.waiting.discard(p)
            for state in (self.next_offset, self.watermarks, self.lost, self.at_end, self.committed):
                state.pop(p, None)
        log.info("%s released partitions %s of %s", self.hold.owner, sorted(revoked), self.topic)

    def _start_pool(self) -> None:
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

    # ------------------------------------------------------------ consume

    def _consume(self, timeout_s: float) -> None:
        from confluent_kafka import KafkaError

        messages = self.consumer.consume(self.cfg.max_batch_records, timeout=timeout_s)
        allowed_ms = int(self.ingest_cfg.allowed_lateness_s * 1000)
        for message in messages:
            p = message.partition()
            if p not in self.owned:
                continue  # fetched before a revocation or while its lease was another's
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    self.at_end[p] = True
                    continue
                raise RuntimeError(f"reading {self.topic}[{p}]: {message.error()}")
            self.at_end[p] = False
            offset, expected = message.offset(), self.next_offset[p]
            if offset < expected:
                continue  # a re-delivery after a seek: already in this batch or a part
            if offset > expected:  # markers, aborted or compacted records: offsets never returned
                gap = dict.fromkeys(kafka.RAW_SCHEMA.names)
                gap.update(partition=p, offset=expected, gap_end=offset, value=b"", late=False)
                self.batch.add(gap, expected)
            row, self.watermarks[p] = kafka.raw_row(message, self.watermarks.get(p, 0), allowed_ms)
            self.batch.add(row, expected)
            self.next_offset[p] = offset + 1

    # ------------------------------------------------------------ cut and commit

    def _due(self, paused: bool) -> bool:
        if paused or len(self.in_flight) >= self.cfg.max_in_flight:
            return False
        if self.lost and not self.in_flight:
            return True  # record retention's losses even when nothing new arrives
        if self.batch.first_at is None:
            return False
        if time.monotonic() - self._last_cut < self.cfg.interval_s:
            return False
        full = len(self.batch.rows["offset"]) >= self.cfg.max_batch_records
        return full or time.monotonic() - self.batch.first_at >= self.cfg.max_batch_delay_s

    def _cut(self) -> None:
        batch, self.batch = self.batch, Batch()
        self._last_cut = time.monotonic()
        ranges = {p: (start, self.next_offset[p]) for p, start in batch.starts.items()}
        lost, self.lost = self.lost, {}
        for p in lost:
            ranges.setdefault(p, (self.next_offset[p], self.next_offset[p]))
        part_id = new_part_id(self.hold.owner)
        target = SinkTarget(
            store.snapshot_uri(self.settings, part_id),
            self.settings.uri("dlq"),
            self.connection,
            self.topic,
            self.settings.dlq_topic,
            self.ingest_cfg.dlq_max_bytes,
        )
        refs = []
        n = len(batch.rows["offset"])
        if n:
            table = pa.Table.from_pydict(batch.rows, schema=kafka.RAW_SCHEMA)
            # Spread over the pool in chunks of at least --batch-size rows, one chunk per actor.
            chunks = max(1, min(len(self.pool), n // self.ingest_cfg.batch_size))
            step = -(-n // chunks)
            for i, lo in enumerate(range(0, n, step)):
                actor = self.pool[(self.cuts + i) % len(self.pool)]
                refs.append(actor.write.remote(table.slice(lo, step), target, f"{i:05d}"))
        per_partition: dict[int, int] = {}
        for p, gap_end in zip(batch.rows["partition"], batch.rows["gap_end"]):
            if gap_end is None:
                per_partition[p] = per_partition.get(p, 0) + 1
        self.cuts += 1
        self.in_flight.append(
            Part(
                part_id,
                ranges,
                dict(self.watermarks),
                lost,
                refs,
                batch.oldest_ms,
                batch.records,
                per_partition,
                time.monotonic(),
            )
        )

    def _commit_ready(self, wait_s: float = 0.0) -> None:
        """Commit finished parts, oldest first: a later part committed before an earlier one would
        move the ledger's end past offsets that are not durable."""
        while self.in_flight:
            head = self.in_flight[0]
            if head.refs:
                ready, _ = ray.wait(head.refs, num_returns=len(head.refs), timeout=wait_s)
                if len(ready) < len(head.refs):
                    return
            stats = store.WriteStats()
            for task_stats in ray.get(head.refs):
                stats.merge(task_stats)
            cfg = self.ingest_cfg
            manifest = store.build_manifest(
                self.settings,
                head.part_id,
                head.ranges,
                head.watermarks,
                stats,
                features=cfg.features,
                features_weights=cfg.weights,
                allowed_lateness_s=cfg.allowed_lateness_s,
                lost=head.lost,
                keep_source=cfg.keep_source,
            )
            _fault("after_write")
            try:  # fencing: a watch that lost a partition's lease must not commit its offsets
                self.hold.check()
                for p in head.ranges:
                    if p not in self.owned:
                        raise LeaseLost(f"partition {p} of {self.topic} is no longer this watch's")
                    self.owned[p].check()
            except LeaseLost as exc:
                raise Restart(str(exc)) from exc
            if not store.commit(self.settings, manifest):
                raise RuntimeError(f"part {head.part_id} already has a manifest: another writer used this id")
            _fault("before_commit")
            self.in_flight.popleft()
            self.parts += 1
            ends = {p: end for p, (_, end) in head.ranges.items()}
            self.committed.update(ends)
            # The manifest is the commit; Kafka's group offsets only mirror it for lag tools.
            from confluent_kafka import TopicPartition

            self.consumer.commit(
                offsets=[TopicPartition(self.topic, p, e) for p, e in self.committed.items()],
                asynchronous=True,
            )
            metrics.inc("argus_watch_parts", topic=self.topic)
            metrics.inc("argus_records_ingested", manifest.records, topic=self.topic)
            metrics.inc("argus_dlq_records", manifest.dlq, topic=self.topic)
            log.debug(
                "part %s: %d records, %d dead letters, offsets %s",
                head.part_id,
                manifest.records,
                manifest.dlq,
                head.ranges,
            )

    # ------------------------------------------------------------ lag

    def _lag(self) -> float:
        pending = [self.batch.oldest_ms] + [part.oldest_ms for part in self.in_flight]
        pending = [ms for ms in pending if ms is not None]
        if not pending:
            return 0.0
        return max(0.0, time.time() - min(pending) / 1000)

    def _observe(self) -> None:
        now = time.monotonic()
        self.lag_s = self._lag()
        change = self.alert.update(self.lag_s, now)
        waiting = self.batch.records + sum(part.records for part in self.in_flight)
        if change == "fired":
            metrics.inc("argus_lag_alerts", topic=self.topic)
            log.warning(
                "LAG ALERT: %d records of %s wait, the oldest for %.1fs (threshold %.1fs for %.1fs)",
                waiting,
                self.topic,
                self.lag_s,
                self.cfg.lag_alert_s,
                self.cfg.lag_alert_for_s,
            )
        elif change == "cleared":
            log.warning("lag alert cleared: %s lag %.1fs", self.topic, self.lag_s)
        if now - self._gauges_at >= GAUGE_EVERY_S or change:
            self._gauges_at = now
            by_partition = dict.fromkeys(self.owned, 0)
            for p in self.batch.rows["partition"]:
                by_partition[p] = by_partition.get(p, 0) + 1
            for part in self.in_flight:
                for p, n in part.per_partition.items():
                    by_partition[p] = by_partition.get(p, 0) + n
            for p, n in by_partition.items():
                metrics.set_gauge("argus_consumer_lag_records", n, topic=self.topic, partition=p)
            metrics.set_gauge("argus_consumer_lag_seconds", self.lag_s, topic=self.topic)
            metrics.set_gauge("argus_lag_alert_active", int(self.alert.active), topic=self.topic)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        self._start()
        try:
            while not self.stop.is_set():
                paused = self.cfg.pause_file is not None and Path(self.cfg.pause_file).exists()
                # Backpressure: a full batch that cannot be cut yet stops fetching (the oldest
                # record, whose age is the lag, is already in hand).
                full = len(self.batch.rows["offset"]) >= self.cfg.max_batch_records
                if full:
                    self._commit_ready(wait_s=0.05)
                else:
                    self._consume(0.05)
                if self._due(paused):
                    self._cut()
                self._commit_ready()
                self._take_waiting()
                self._observe()
                if self.cfg.max_ticks is not None and self.parts >= self.cfg.max_ticks:
                    break
            # Stopping: what is cut becomes durable; the open batch is read again next time.
            while self.in_flight:
                self._commit_ready(wait_s=1.0)
            if self.committed:  # the whole ledger: other watches commit the other partitions
                ends, _ = store.ledger_offsets(store.list_manifests(self.settings), self.topic)
                store.write_offsets_file(self.settings, self.ingest_cfg.group, ends)
        finally:
            # Nothing commits from here on, so the leases go first: the partitions' next owners need
            # not wait for them once the group hands the partitions over, which closing starts.
            self.closing = True
            for lease in self.owned.values():
                lease.release()
            self.consumer.close()
            for actor in self.pool:
                ray.kill(actor)
        metrics.set_gauge("argus_lag_alert_active", 0, topic=self.topic)
        return self.alert.fired
