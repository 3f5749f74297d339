"""The per-offset proof a writer builds before it commits (CONTRACT.md §2).

A write task counts what it saw (`WriteStats`: every offset as runs, labels, dead letters by
reason, the data files it wrote); the driver merges the tasks' counts and `prove` checks that every
offset of every range landed once, in the rows or the dead letters, or is one the broker declared
skipped, before anything is committed to the table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def _fold(current: int | None, value: int | None, pick) -> int | None:
    """min/max that ignores a missing value."""
    if value is None:
        return current
    return value if current is None else pick(current, value)


@dataclass
class PartitionStats:
    """What one write task (or the whole commit) saw of one partition: counts, and every offset as
    sorted runs [lo, hi), so the proof catches a duplicate that hides a missing offset."""

    records: int = 0
    dlq: int = 0
    skipped: int = 0
    """Offsets the broker never returned (transaction markers, compacted records)."""
    spans: list[list[int]] = field(default_factory=list)

    def add(self, offset: int, dead_letter: bool) -> None:
        if dead_letter:
            self.dlq += 1
        else:
            self.records += 1
        self._cover(offset, offset + 1)

    def skip(self, start: int, end: int) -> None:
        self.skipped += end - start
        self._cover(start, end)

    def _cover(self, start: int, end: int) -> None:
        if self.spans and self.spans[-1][1] == start:
            self.spans[-1][1] = end  # the usual case: offsets arrive in order
        else:
            self.spans.append([start, end])

    def merge(self, other: PartitionStats) -> None:
        self.records += other.records
        self.dlq += other.dlq
        self.skipped += other.skipped
        self.spans.extend(list(span) for span in other.spans)

    def covers_once(self, start: int, end: int) -> bool:
        """Whether the offsets seen are exactly [start, end), each once."""
        position = start
        for lo, hi in sorted(self.spans):
            if lo != position:
                return False
            position = hi
        return position == end


@dataclass
class WriteStats:
    """One write task's accounting; the driver merges them into what it commits."""

    partitions: dict[int, PartitionStats] = field(default_factory=dict)
    labels: Counter = field(default_factory=Counter)
    dlq_errors: Counter = field(default_factory=Counter)
    files: list[Any] = field(default_factory=list)
    """The Iceberg data files written (`pyiceberg.manifest.DataFile`), not yet committed."""
    late: int = 0
    value_bytes: int = 0
    event_min: int | None = None
    event_max: int | None = None

    def partition(self, p: int) -> PartitionStats:
        return self.partitions.setdefault(p, PartitionStats())

    def add_event_times(self, low: int, high: int) -> None:
        self.event_min = _fold(self.event_min, low, min)
        self.event_max = _fold(self.event_max, high, max)

    def merge(self, other: WriteStats) -> None:
        for p, stats in other.partitions.items():
            self.partition(p).merge(stats)
        self.labels.update(other.labels)
        self.dlq_errors.update(other.dlq_errors)
        self.files.extend(other.files)
        self.late += other.late
        self.value_bytes += other.value_bytes
        self.add_event_times(other.event_min, other.event_max)

    @property
    def records(self) -> int:
        return sum(s.records for s in self.partitions.values())

    @property
    def dlq(self) -> int:
        return sum(s.dlq for s in self.partitions.values())

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.partitions.values())


def prove(ranges: dict[int, tuple[int, int]], stats: WriteStats) -> None:
    """Every offset of every range [start, end) seen exactly once, as a row, a dead letter or a
    skipped offset; RuntimeError (nothing committed) otherwise."""
    for p, (start, end) in sorted(ranges.items()):
        seen = stats.partitions.get(p, PartitionStats())
        if not seen.covers_once(start, end):
            spans = sorted(seen.spans)
            raise RuntimeError(
                f"partition {p}: expected offsets [{start}, {end}) once each, got "
                f"{seen.records + seen.dlq} records in runs {spans[:5]}{' ...' if len(spans) > 5 else ''}; "
                "nothing committed"
            )
