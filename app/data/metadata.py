"""What Argus keeps in the Iceberg table's own metadata (CONTRACT.md §2), written and read back:
each commit's snapshot summary (the Kafka offsets, dead letters, watermarks, format), the table
properties (where a table made by `ingest --from` begins, erased users) and reader tags.

The summary keys are carried forward: a reader looks for a key in a snapshot or its nearest
ancestor that has it (`nearest`), so a commit by another engine, which knows nothing of Kafka,
never resets the offsets, and expiry may remove the commit that first wrote them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot, ancestors_of

from app.data.catalog import FORMAT, FORMAT_KEY, dumps
from app.data.records import user_digest

TOPIC_KEY = "argus.kafka.topic"
RANGES_KEY = "argus.kafka.ranges"
"""JSON {partition: [start, end)}: the offsets one ingest or watch commit adds."""
COMMITTED_KEY = "argus.kafka.committed"
"""JSON {partition: next offset} over the whole table, carried forward by every commit."""
LOST_KEY = "argus.kafka.lost"
DLQ_KEY = "argus.dlq.records"
WATERMARKS_KEY = "argus.kafka.watermarks"
"""JSON {partition: largest event time (ms) committed so far}, carried forward like the offsets:
a record this far behind it (less the allowed lateness) is counted late."""
FEATURES_WEIGHTS_KEY = "argus.features.weights"
"""The backbone weights file that computed the `features` column ("" for the seeded random one):
a head trained on the features must sit on the same backbone when it serves images."""
DETAILS_PREFIX = "argus."
"""Keys a writer's `details` may add to its summary as they are."""
COMPACTED_KEY = "argus.compacted.files"
"""A compaction's summary: how many files it rewrote (it adds and removes no record)."""
ORIGIN_KEY = "argus.kafka.origin"
"""A table property, JSON {partition: first offset}, of a table `ingest --from` started above offset 0:
offsets below are outside it (`redrive` leaves them out). Absent: the table starts at 0."""
ERASED_PREFIX = "argus.erased."
"""A table property per erased user, `argus.erased.<user_digest(user)>` = `{"date": ISO date (UTC),
"ends": {partition: the topic's proven log end when the user was erased}}` (`Erasures`). Kafka keeps
the user's records and dead letters until retention deletes them, so ingest, watch and redrive read
these and leave every record of the user below those ends out of the table."""
READER_TAG_PREFIX = "argus-reader-"
"""Tags `ImageTable.pin` sets on the snapshot a run reads: expiry keeps their snapshots."""
READER_PIN_TTL_S = 3 * 86_400
"""A reader tag this old belongs to a run that died without removing it: expiry drops it."""

Ranges = dict[int, tuple[int, int]]


def commit_summary(
    table: Table,
    base: Snapshot | None,
    committed: dict[int, int],
    ranges: Ranges,
    topic: str,
    dlq_records: int,
    lost: dict[int, int],
    watermarks: dict[int, int] | None,
    details: dict[str, str] | None,
) -> dict[str, str]:
    """The summary of a commit onto `base` (committed up to `committed`) that adds the offsets
    `ranges` of `topic`: the table's committed offsets and watermarks moved forward past them."""
    summary = {
        **{k: v for k, v in (details or {}).items() if k.startswith(DETAILS_PREFIX)},
        FORMAT_KEY: str(FORMAT),
        TOPIC_KEY: topic,
        RANGES_KEY: dumps({p: list(r) for p, r in ranges.items()}),
        COMMITTED_KEY: dumps({**committed, **{p: end for p, (_, end) in ranges.items()}}),
        DLQ_KEY: str(dlq_records),
    }
    carried = watermarks_at(table, base)
    for p, mark in (watermarks or {}).items():
        carried[p] = max(carried.get(p, mark), mark)
    if carried:
        summary[WATERMARKS_KEY] = dumps(carried)
    if lost:
        summary[LOST_KEY] = dumps({p: [ranges[p][0], ranges[p][0] + n] for p, n in lost.items() if n})
    return summary


def carried_summary(table: Table, base: Snapshot | None) -> dict[str, str]:
    """The Argus keys a commit that adds no offsets (maintenance, redrive) repeats from its base:
    the committed offsets (an ingest plans from the current snapshot), the event-time watermarks,
    the topic and the format: expiry may remove the commits that first held them."""
    summary = {FORMAT_KEY: str(FORMAT), COMMITTED_KEY: dumps(committed_at(table, base))}
    for key in (TOPIC_KEY, WATERMARKS_KEY):
        value = nearest(table, base, key)
        if value is not None:
            summary[key] = value
    return summary


def nearest(table: Table, snapshot: Snapshot | None, key: str) -> str | None:
    """`key` in the summary of `snapshot` or its nearest ancestor that has it: a commit by another
    engine (which knows nothing of Kafka) must not reset the offsets."""
    for ancestor in ancestors_of(snapshot, table.metadata):
        if ancestor.summary is not None and key in ancestor.summary.additional_properties:
            return ancestor.summary.additional_properties[key]
    return None


def committed_at(table: Table, snapshot: Snapshot | None) -> dict[int, int]:
    """{partition: next offset} as of `snapshot`; {} before any commit."""
    raw = nearest(table, snapshot, COMMITTED_KEY)
    return {int(p): int(end) for p, end in json.loads(raw).items()} if raw else {}


def watermarks_at(table: Table, snapshot: Snapshot | None) -> dict[int, int]:
    """{partition: event-time watermark (ms)} as of `snapshot`."""
    raw = nearest(table, snapshot, WATERMARKS_KEY)
    return {int(p): int(mark) for p, mark in json.loads(raw).items()} if raw else {}


def origin(table: Table) -> dict[int, int]:
    """Where the table begins each partition ({} where it begins at 0): see ORIGIN_KEY."""
    raw = table.properties.get(ORIGIN_KEY)
    return {int(p): int(start) for p, start in json.loads(raw).items()} if raw else {}


@dataclass(frozen=True)
class Erasures:
    """The users `argus erase` erased from a table (ERASED_PREFIX), by `user_digest`: each with the
    topic's log end per partition at the erasure, or None (every record of theirs: erased without a
    broker to ask, or by an Argus before the ends were recorded; its value is a bare date).

    A record of an erased user below its partition's end is one the erasure was about: it never
    enters the table again, from a pending ingest, a replay or a redrive. Records past the ends
    came after the erasure, and are the user's new data."""

    ends: dict[str, dict[int, int] | None] = field(default_factory=dict)

    @classmethod
    def of(cls, table: Table) -> Erasures:
        ends: dict[str, dict[int, int] | None] = {}
        for key, value in table.properties.items():
            if key.startswith(ERASED_PREFIX):
                ends[key.removeprefix(ERASED_PREFIX)] = erasure_ends(value)
        return cls(ends)

    def covers(self, user: str | None, partition: int, offset: int) -> bool:
        digest = user_digest(user)
        if digest not in self.ends:
            return False
        ends = self.ends[digest]
        return ends is None or offset < ends.get(partition, 0)

    def since(self, earlier: Erasures) -> set[str]:
        """The digests erased, or erased again, after `earlier` was read."""
        return {digest for digest, ends in self.ends.items() if earlier.ends.get(digest, ()) != ends}


def erasure_ends(value: str) -> dict[int, int] | None:
    """The log ends an erasure record (ERASED_PREFIX) names; None: every record of the user."""
    try:
        ends = json.loads(value).get("ends")
        return {int(p): int(end) for p, end in ends.items()} if ends is not None else None
    except (ValueError, AttributeError, TypeError):  # a bare date: every record of the user
        return None
