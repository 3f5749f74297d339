"""Which partitions a `watch` reads, and from where.

The consumer group decides which partitions each watch reads (`--group`); nothing else does. On
assignment a watch seeks each partition to the table's committed offset (`ImageTable.committed`),
never to the group's committed offsets, which only mirror the table. Who may commit is the
catalog's to decide: a part commits only if the table is still committed exactly where the part's
ranges start, so a watch that read a partition another writer (a watch the group gave it to while
this one stalled, a bulk `ingest`) committed first gets `OffsetConflict`, commits nothing and
starts its pipeline over from the table (`Restart`).
"""

from __future__ import annotations

import dataclasses
import logging

from app.data import kafka
from app.data.plan import pending_ranges, report_lost
from app.data.table import ImageTable

log = logging.getLogger(__name__)


class Restart(RuntimeError):
    """The pipeline must start over from the table: what it holds in memory is no longer its own."""


class Partitions:
    """The partitions the group assigned this watch: their read positions and watermarks."""

    def __init__(self, table: ImageTable, connection: kafka.KafkaConnection, topic: str, *, strict: bool):
        self.table, self.connection, self.topic, self.strict = table, connection, topic, strict
        self.owned: set[int] = set()
        self.next_offset: dict[int, int] = {}
        self.watermarks: dict[int, int] = {}
        self.lost: dict[int, int] = {}  # recorded in the next part that covers each partition
        self.at_end: dict[int, bool] = {}
        self.committed: dict[int, int] = {}
        """The end of the last part this watch committed, per partition (mirrored to the group)."""

    def position(self, partitions: list[int]) -> None:
        """Where each of `partitions` resumes: the table's committed offset, or the log start where
        retention deleted records no writer read (lost, and recorded by the next part)."""
        pending = pending_ranges(self.table, self.connection, self.topic)
        mine = set(partitions)
        report_lost(
            self.topic,
            dataclasses.replace(
                pending,
                ranges={p: r for p, r in pending.ranges.items() if p in mine},
                lost={p: n for p, n in pending.lost.items() if p in mine},
            ),
            strict=self.strict,
        )
        # A partition with nothing to read is not in `pending`: it resumes where the table is. Should
        # another writer commit between these reads, a part from a position the table is no longer
        # at is refused (OffsetConflict) and the watch starts over: never a gap, never a duplicate.
        committed = self.table.committed()
        for p in partitions:
            self.next_offset[p] = pending.ranges[p][0] if p in pending.ranges else committed.get(p, 0)
            self.watermarks[p] = pending.watermarks.get(p, 0)
            self.at_end[p] = False
            self.lost.pop(p, None)
            if pending.lost.get(p):
                self.lost[p] = pending.lost[p]

    def assign(self, consumer, partitions) -> None:
        """The group's assignment: position every partition at the table's committed offset."""
        from confluent_kafka import TopicPartition

        assigned = sorted(tp.partition for tp in partitions)
        self.position(assigned)
        self.owned = set(assigned)
        consumer.assign([TopicPartition(self.topic, p, self.next_offset[p]) for p in assigned])
        log.info(
            "assigned partitions %s of %s: reading from %s",
            assigned,
            self.topic,
            {p: self.next_offset[p] for p in assigned},
        )

    def release(self, revoked: set[int]) -> None:
        """Forget `revoked`: their next owner starts from the table."""
        self.owned -= revoked
        for state in (self.next_offset, self.watermarks, self.lost, self.at_end, self.committed):
            for p in revoked:
                state.pop(p, None)
        log.info("released partitions %s of %s", sorted(revoked), self.topic)
