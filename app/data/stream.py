"""Continuous ingest: one long-lived pipeline from Kafka to small table commits (`watch`).

    python -m app watch --max-batch-delay-s 1 --lag-alert-s 5

One consumer, a member of the consumer group (`--group`), reads the partitions the group assigns
it from the table's committed offsets (`app.data.partitions`); a fixed pool of actors preprocesses
and writes micro-batches as parts, each committed to the table in cut order (`app.data.parts`);
lag is measured at every turn and alerts when it stays high (`app.data.lag`). Offsets advance
only with a part's commit, so a watch killed anywhere and restarted resumes at the table's
committed offsets: each offset once (CONTRACT.md §2). On revocation it commits every part already
cut and drops the open batch's rows of the revoked partitions (their new owner reads them again).
A part the table refuses (another writer committed one of its partitions first) ends the pipeline
(`Restart`): `app.data.watch` starts it over from the table.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from app.config import IngestConfig, Settings
from app.data import kafka
from app.data.lag import LagMonitor
from app.data.partitions import Partitions, Restart
from app.data.parts import Batch, Part, PartPipeline
from app.data.sink import SinkTarget
from app.data.table import ImageTable
from app.storage import Store

log = logging.getLogger(__name__)

DRAIN_S = 60.0
"""How long a revocation waits for the parts already cut to commit."""


class Stream:
    """The watch's loop: consume into the open batch, cut it when due, commit what is written."""

    def __init__(
        self,
        table: ImageTable,
        settings: Settings,
        cfg,
        ingest_cfg: IngestConfig,
        connection: kafka.KafkaConnection,
        lag: LagMonitor,
        writer: str,
        stop,
    ):
        self.cfg, self.ingest_cfg, self.connection = cfg, ingest_cfg, connection
        self.lag, self.writer, self.stop = lag, writer, stop
        self.topic = settings.topic
        self.partitions = Partitions(table, connection, self.topic, strict=ingest_cfg.strict)
        target = SinkTarget(
            table,
            Store.at(settings.uri("dlq")),
            connection,
            self.topic,
            settings.dlq_topic,
            ingest_cfg.dlq_max_bytes,
        )
        self.pipeline = PartPipeline(target, settings, ingest_cfg, writer)
        self.batch = Batch()
        self.closing = False
        self.consumer = None

    def _start(self) -> None:
        self.pipeline.start()
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
            self.writer,
            len(self.pipeline.pool),
        )

    def _on_assign(self, consumer, partitions) -> None:
        self.partitions.assign(consumer, partitions)

    def _on_revoke(self, consumer, partitions) -> None:
        if self.closing:
            return  # stopping: nothing commits from here on
        revoked = {tp.partition for tp in partitions}
        deadline = time.monotonic() + DRAIN_S
        while self.pipeline.in_flight:  # cut parts commit first, or the new owner's or theirs is refused
            if time.monotonic() > deadline:
                raise Restart(f"parts of {self.topic} did not commit within {DRAIN_S:.0f}s of a rebalance")
            self._commit_ready(wait_s=0.5)
        self.batch = self.batch.without(revoked)
        self.partitions.release(revoked)

    def _consume(self, timeout_s: float) -> None:
        from confluent_kafka import KafkaError

        messages = self.consumer.consume(self.cfg.max_batch_records, timeout=timeout_s)
        allowed_ms = int(self.ingest_cfg.allowed_lateness_s * 1000)
        state = self.partitions
        for message in messages:
            p = message.partition()
            if p not in state.owned:
                continue  # fetched before a revocation
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    state.at_end[p] = True
                    continue
                raise RuntimeError(f"reading {self.topic}[{p}]: {message.error()}")
            state.at_end[p] = False
            offset, expected = message.offset(), state.next_offset[p]
            if offset < expected:
                continue  # a re-delivery after a seek: already in this batch or a part
            if offset > expected:  # markers, aborted or compacted records: offsets never returned
                gap = dict.fromkeys(kafka.RAW_SCHEMA.names)
                gap.update(partition=p, offset=expected, gap_end=offset, value=b"", late=False)
                self.batch.add(gap, expected)
            row, state.watermarks[p] = kafka.raw_row(message, state.watermarks.get(p, 0), allowed_ms)
            self.batch.add(row, expected)
            state.next_offset[p] = offset + 1

    def _due(self, paused: bool) -> bool:
        if paused or len(self.pipeline.in_flight) >= self.cfg.max_in_flight:
            return False
        if self.partitions.lost and not self.pipeline.in_flight:
            return True  # record retention's losses even when nothing new arrives
        if self.batch.first_at is None:
            return False
        if time.monotonic() - self.pipeline.last_cut < self.cfg.interval_s:
            return False
        full = len(self.batch) >= self.cfg.max_batch_records
        return full or time.monotonic() - self.batch.first_at >= self.cfg.max_batch_delay_s

    def _cut(self) -> None:
        batch, self.batch = self.batch, Batch()
        state = self.partitions
        lost, state.lost = state.lost, {}
        self.pipeline.cut(batch, state.next_offset, state.watermarks, lost)

    def _commit_ready(self, wait_s: float = 0.0) -> None:
        self.pipeline.commit_ready(self._committed, wait_s=wait_s)

    def _committed(self, part: Part) -> None:
        self.partitions.committed.update({p: end for p, (_, end) in part.ranges.items()})
        self._mirror(asynchronous=True)

    def _mirror(self, asynchronous: bool) -> None:
        """The table is the commit; the group's offsets only mirror it, for Kafka's own lag tools."""
        from confluent_kafka import KafkaException, TopicPartition

        committed = self.partitions.committed
        if not committed:
            return
        try:
            self.consumer.commit(
                offsets=[TopicPartition(self.topic, p, e) for p, e in committed.items()],
                asynchronous=asynchronous,
            )
        except KafkaException as exc:  # a rebalance under way: the next commit mirrors them
            log.info("group offsets of %s not mirrored: %s", self.topic, exc)

    def run(self) -> None:
        """Until `stop` is set or `max_ticks` parts committed; `Restart` when the table refused a part."""
        try:
            self._start()
            while not self.stop.is_set():
                paused = self.cfg.pause_file is not None and Path(self.cfg.pause_file).exists()
                # Backpressure: a full batch that cannot be cut yet stops fetching (the oldest
                # record, whose age is the lag, is already in hand).
                if len(self.batch) >= self.cfg.max_batch_records:
                    self._commit_ready(wait_s=0.05)
                else:
                    self._consume(0.05)
                if self._due(paused):
                    self._cut()
                self._commit_ready()
                self.lag.observe(self.batch, self.pipeline.in_flight, self.partitions.owned)
                if self.cfg.max_ticks is not None and self.pipeline.committed_parts >= self.cfg.max_ticks:
                    break
            # Stopping: what is cut becomes durable; the open batch is read again next time.
            while self.pipeline.in_flight:
                self._commit_ready(wait_s=1.0)
            self._mirror(asynchronous=False)
        finally:
            self.closing = True
            if self.consumer is not None:
                self.consumer.close()
            self.pipeline.close()  # parts not committed (a restart) go, files and all
