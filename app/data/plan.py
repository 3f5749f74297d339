"""What a writer reads: the table's committed offsets against the broker.

Every writer (a bulk `ingest`, a `watch`) resumes each partition where the table's current
snapshot says it is committed (`ImageTable.committed`), reads to the *proven* end (the embedded
broker under-reports high watermarks, so the end is probed) and records what retention deleted
unread as lost. Whether it may still commit is the catalog's to decide (`ImageTable.commit_files`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from app import metrics
from app.config import start_time_ms
from app.data import kafka, probe
from app.data.table import ImageTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """What the next ingest reads: per partition [read start, proven end), where records stop and
    only markers may follow, offsets retention deleted unread, and the event-time watermarks."""

    ranges: dict[int, tuple[int, int]]
    visible_ends: dict[int, int]
    lost: dict[int, int]
    watermarks: dict[int, int]
    origin: dict[int, int] = field(default_factory=dict)
    """A new table's `--from` start of every partition: its first commit records them all, those
    with nothing to read included, so that no later writer starts one of them at 0."""


def pending_ranges(
    table: ImageTable, connection: kafka.KafkaConnection, topic: str, start_from: str | None = None
) -> Pending:
    """The offsets of `topic` from the table's committed offsets to each partition's proven end
    (partitions with nothing to read or lose are left out). A table with no commit yet starts
    where `start_from` (`--from`) says, or at 0."""
    snapshot_id = table.current_snapshot_id()
    previous = table.committed(snapshot_id) if snapshot_id else {}
    watermarks = table.watermarks(snapshot_id) if snapshot_id else {}
    partitions = probe.partitions_of(connection, topic)
    probed = probe.probe_partitions(connection, topic, partitions)
    if start_from is not None and previous:
        log.info(
            "%s has commits: it resumes from them, --from %s is for a new table", table.identifier, start_from
        )
    if start_from is not None and not previous:
        origin = new_table_starts(connection, topic, probed, start_from)
        log.info("%s is new: reading %s from %s (offsets %s)", table.identifier, topic, start_from, origin)
        # Offsets before the origin are outside this table by choice, not lost.
        return replace(plan(origin, probed, {}), origin=origin)
    starts = {p: previous.get(p, 0) for p in partitions}
    behind = {p: (starts[p], probed[p].end) for p in partitions if probed[p].end < starts[p]}
    if behind:
        raise RuntimeError(
            f"table {table.identifier} is committed past the topic's end "
            f"(partition: (committed, topic end) {behind}): it belongs to another broker "
            "or an older incarnation of the topic; use another --table or --storage"
        )
    return plan(starts, probed, watermarks)


def new_table_starts(
    connection: kafka.KafkaConnection, topic: str, probed: dict[int, probe.PartitionEnds], start_from: str
) -> dict[int, int]:
    """Each partition's first offset for `--from`: its log start for `earliest`, else its first
    record at or after the time."""
    timestamp_ms = start_time_ms(start_from)
    if timestamp_ms is None:
        return {p: ends.log_start for p, ends in probed.items()}
    return probe.offsets_at_time(connection, topic, probed, timestamp_ms)


def plan(
    starts: dict[int, int], probed: dict[int, probe.PartitionEnds], watermarks: dict[int, int]
) -> Pending:
    """From the committed starts and the probed partitions: read from the later of the committed
    offset and the log start; what retention deleted in between is lost."""
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
    log.error("%s; recorded as lost in the table's commit, continuing from the log start", message)
    metrics.inc("argus_records_lost", sum(pending.lost.values()), topic=topic)


def commit_ranges(pending: Pending) -> dict[int, tuple[int, int]]:
    """The ranges a commit of `pending` records: each from the committed offset, so the lost span
    at its start is in it (and in the commit's `lost`); a new table's `--from` origin of every
    partition, an empty range where there is nothing to read."""
    ranges = {p: (start - pending.lost.get(p, 0), end) for p, (start, end) in pending.ranges.items()}
    return {**{p: (start, start) for p, start in pending.origin.items()}, **ranges}
