"""What a writer reads and whether it may still commit it: the ledger's end against the broker.

Every writer (a bulk `ingest`, a `watch`) resumes each partition where the committed snapshots
end, reads to the *proven* end (the embedded broker under-reports high watermarks, so the end is
probed), records what retention deleted unread as lost, and, just before an ingest commits,
re-reads the ledger for a snapshot committed meanwhile over the same offsets.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app import metrics
from app.data import kafka
from app.data.manifest import Manifest, ledger_offsets
from app.data.snapshot import SnapshotStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """What the next ingest reads: per partition [read start, proven end), where records stop and
    only markers may follow, offsets retention deleted unread, and the event-time watermarks."""

    ranges: dict[int, tuple[int, int]]
    visible_ends: dict[int, int]
    lost: dict[int, int]
    watermarks: dict[int, int]


def pending_ranges(
    snapshots: SnapshotStore, connection: kafka.KafkaConnection, topic: str, manifests: list[Manifest]
) -> Pending:
    """The offsets of `topic` from the ledger's end (`manifests`, listed from `snapshots`) to each
    partition's proven end not yet in a snapshot (partitions with nothing to read or lose are left out)."""
    previous, watermarks = ledger_offsets(manifests, topic)
    partitions = kafka.partitions_of(connection, topic)
    probed = kafka.probe_partitions(connection, topic, partitions)
    starts = {p: previous.get(p, 0) for p in partitions}
    behind = {p: (starts[p], probed[p].end) for p in partitions if probed[p].end < starts[p]}
    if behind:
        raise RuntimeError(
            f"the snapshots under {snapshots.snapshots.uri()} end past the topic's end "
            f"(partition: (ledger start, topic end) {behind}): they belong to another broker "
            "or an older incarnation of the topic; use a fresh --storage"
        )
    return plan(starts, probed, watermarks)


def plan(
    starts: dict[int, int], probed: dict[int, kafka.PartitionEnds], watermarks: dict[int, int]
) -> Pending:
    """From the ledger's starts and the probed partitions: read from the later of the ledger's end and
    the log start; what retention deleted in between is lost."""
    lost = {p: ends.log_start - starts[p] for p, ends in probed.items() if ends.log_start > starts[p]}
    ranges = {p: (starts[p] + lost.get(p, 0), ends.end) for p, ends in probed.items()}
    ranges = {p: r for p, r in ranges.items() if r[1] > r[0] or p in lost}
    return Pending(ranges, {p: probed[p].visible_end for p in ranges}, lost, watermarks)


def report_lost(topic: str, pending: Pending, *, strict: bool) -> None:
    """Say what retention deleted unread, at ERROR and in `ray_argus_records_lost_total`; with
    `strict`, fail the run instead."""
    if not pending.lost:
        return
    spans = ", ".join(
        f"p{p}:[{pending.ranges[p][0] - n},{pending.ranges[p][0]})" for p, n in pending.lost.items()
    )
    message = (
        f"{sum(pending.lost.values())} records of {topic} were deleted by the topic's retention "
        f"before any ingest read them (offsets {spans})"
    )
    if strict:
        raise RuntimeError(f"{message}; --strict: nothing written")
    log.error("%s; recorded as lost in the snapshot's manifest, continuing from the log start", message)
    metrics.inc("argus_records_lost", sum(pending.lost.values()), topic=topic)


def check_no_overlap(snapshots: SnapshotStore, topic: str, ranges: dict[int, tuple[int, int]]) -> None:
    """The ledger re-read just before the commit: a snapshot committed meanwhile that covers any of
    these offsets (a writer that ignored or outlived the lease) aborts this one."""
    for manifest in snapshots.manifests():
        if manifest.topic != topic:
            continue
        for p, entry in manifest.offsets.items():
            start, end = ranges.get(p, (0, 0))
            if entry.start < end and start < entry.end:
                raise RuntimeError(
                    f"snapshot {manifest.snapshot_id} was committed meanwhile with offsets "
                    f"[{entry.start}, {entry.end}) of partition {p}, overlapping this ingest's "
                    f"[{start}, {end}); nothing committed"
                )
