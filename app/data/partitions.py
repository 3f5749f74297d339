"""Which partitions a `watch` reads, under which leases, and from where.

Several watches share a topic: each holds the topic's lease shared (so a bulk `ingest` waits) and
an exclusive lease per partition it reads (`partitions/<p>/` under the topic's lease). On
assignment a watch takes each partition's lease and seeks to the ledger's end, never to the
group's committed offsets, which only mirror the ledger; a partition whose lease another writer
still holds is paused until it can be taken. On revocation its leases are released (after the
parts already cut commit, which `app.data.stream` sees to). Before each commit the leases of every
partition the part covers are checked (`fence`), so a watch that lost one (paused past its TTL)
commits nothing that the new owner also commits; it then starts its pipeline over (`Restart`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from app.data import kafka
from app.data.lease import Lease, LeaseHeld, LeaseLost, SharedLease
from app.data.manifest import ledger_offsets
from app.data.plan import pending_ranges, report_lost
from app.data.snapshot import SnapshotStore

log = logging.getLogger(__name__)

RETRY_LEASE_S = 1.0
"""How often a paused partition's lease is tried again."""


class Restart(RuntimeError):
    """The pipeline must start over from the ledger: what it holds in memory is no longer its own."""


class Partitions:
    """The partitions the group assigned this watch: their leases, read positions and watermarks."""

    def __init__(
        self,
        snapshots: SnapshotStore,
        connection: kafka.KafkaConnection,
        topic: str,
        hold: SharedLease,
        *,
        strict: bool,
    ):
        self.snapshots, self.connection, self.topic, self.hold = snapshots, connection, topic, hold
        self.strict = strict
        self.owned: dict[int, Lease] = {}
        """Partitions this watch reads and commits, each with its lease."""
        self.waiting: set[int] = set()
        """Partitions the group assigned whose lease another writer still holds: paused."""
        self.next_offset: dict[int, int] = {}
        self.watermarks: dict[int, int] = {}
        self.lost: dict[int, int] = {}  # recorded in the next part that covers each partition
        self.at_end: dict[int, bool] = {}
        self.committed: dict[int, int] = {}
        """The end of the last part this watch committed, per partition."""
        self._tried_at = 0.0

    def _lease(self, p: int) -> Lease:
        return Lease(self.hold.store.child("partitions", str(p)), ttl_s=self.hold.ttl_s)

    def take(self, partitions) -> list[int]:
        """Take the leases of `partitions` that are free; the taken ones."""
        taken = []
        for p in partitions:
            if p in self.owned:  # assigned again without a revocation between: still this watch's
                taken.append(p)
                continue
            try:
                self.owned[p] = self._lease(p).hold()
                taken.append(p)
            except LeaseHeld as exc:
                log.info("partition %d of %s waits for its lease: %s", p, self.topic, exc)
        return taken

    def position(self, partitions: list[int]) -> None:
        """Where each of `partitions` resumes: the ledger's end (past what retention deleted), read
        after its lease is taken, since only then can no other writer move it."""
        manifests = self.snapshots.manifests()
        pending = pending_ranges(self.snapshots, self.connection, self.topic, manifests)
        mine = set(partitions) & set(self.owned)  # a waiting partition's losses are its owner's
        report_lost(
            self.topic,
            dataclasses.replace(
                pending,
                ranges={p: r for p, r in pending.ranges.items() if p in mine},
                lost={p: n for p, n in pending.lost.items() if p in mine},
            ),
            strict=self.strict,
        )
        ledger, watermarks = ledger_offsets(manifests, self.topic)
        for p in partitions:
            self.next_offset[p] = pending.ranges[p][0] if p in pending.ranges else ledger.get(p, 0)
            self.watermarks[p] = watermarks.get(p, 0)
            self.at_end[p] = False
            self.lost.pop(p, None)
            if p in mine and pending.lost.get(p):
                self.lost[p] = pending.lost[p]

    def assign(self, consumer, partitions) -> None:
        """The group's assignment: take what leases are free, position every partition, pause the rest."""
        from confluent_kafka import TopicPartition

        try:  # a watch that stalled past its TTL lost the topic too: it starts over, not reads on
            self.hold.check()
        except LeaseLost as exc:
            raise Restart(str(exc)) from exc
        assigned = sorted(tp.partition for tp in partitions)
        taken = self.take(assigned)
        self.waiting = set(assigned) - set(taken)
        self.position(assigned)  # a waiting partition's is redone once its lease is taken
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

    def take_waiting(self, consumer) -> None:
        """Try the paused partitions' leases again (every RETRY_LEASE_S); read those taken."""
        from confluent_kafka import TopicPartition

        if not self.waiting or time.monotonic() - self._tried_at < RETRY_LEASE_S:
            return
        self._tried_at = time.monotonic()
        taken = self.take(sorted(self.waiting))
        if not taken:
            return
        self.waiting -= set(taken)
        self.position(taken)  # the previous owner may have committed up to its release
        positions = [TopicPartition(self.topic, p, self.next_offset[p]) for p in taken]
        for tp in positions:
            consumer.seek(tp)  # forward only: anything fetched before is below it and skipped
        consumer.resume(positions)
        log.info("%s took partitions %s of %s over", self.hold.owner, taken, self.topic)

    def release(self, revoked: set[int]) -> None:
        """Give `revoked` up: their leases and everything this watch knew of them."""
        for p in revoked:
            lease = self.owned.pop(p, None)
            if lease is not None:
                lease.release()
            self.waiting.discard(p)
            for state in (self.next_offset, self.watermarks, self.lost, self.at_end, self.committed):
                state.pop(p, None)
        log.info("%s released partitions %s of %s", self.hold.owner, sorted(revoked), self.topic)

    def release_all(self) -> None:
        for lease in self.owned.values():
            lease.release()

    def fence(self, partitions) -> None:
        """Restart unless this watch still holds the topic's lease and each of `partitions`'."""
        try:
            self.hold.check()
            for p in partitions:
                if p not in self.owned:
                    raise LeaseLost(f"partition {p} of {self.topic} is no longer this watch's")
                self.owned[p].check()
        except LeaseLost as exc:
            raise Restart(str(exc)) from exc
