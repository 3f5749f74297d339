"""What a snapshot's manifest records (CONTRACT.md §2), and the proof a writer builds it from.

A write task counts what it saw (`WriteStats`: every offset as runs, labels, files with their
digests); the driver merges the tasks' counts and `build_manifest` proves that every offset of
every range landed once before a manifest exists to commit. The manifests together are the offset
ledger (`ledger_offsets`); a compacted snapshot supersedes its parts (`live_manifests`). Plain data:
reading and writing manifests is `app.data.snapshot`'s.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from app.config import IMAGENET_MEAN, IMAGENET_STD

FORMAT = "argus.snapshot.v1"
PIXELS = "uint8"
"""What the `image` column of the snapshots this code writes holds."""


def event_date(ms: int) -> str:
    """The `event_date=` partition a record's event time (ms since the epoch, UTC) falls in."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d")


def new_snapshot_id() -> str:
    """Ids sort by creation time, so listing order is ledger order."""
    return datetime.now(UTC).strftime("snap-%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"


def _fold(current: int | None, value: int | None, pick) -> int | None:
    """min/max that ignores a missing value."""
    if value is None:
        return current
    return value if current is None else pick(current, value)


@dataclass
class PartitionStats:
    """What one write task (or the whole snapshot) saw of one partition: counts, and every offset
    as sorted runs [lo, hi), so the proof catches a duplicate that hides a missing offset."""

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


@dataclass(frozen=True)
class DataFile:
    """One Parquet file of a snapshot, as its manifest lists it."""

    path: str
    """Relative to the snapshot's folder."""
    size: int | None
    sha256: str | None
    """None only in manifests written before digests were recorded."""


@dataclass
class WriteStats:
    """One snapshot write task's accounting; the driver merges them into the manifest."""

    partitions: dict[int, PartitionStats] = field(default_factory=dict)
    labels: Counter = field(default_factory=Counter)
    dlq_errors: Counter = field(default_factory=Counter)
    files: list[DataFile] = field(default_factory=list)
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


@dataclass(frozen=True)
class PartitionRange:
    """One partition's offsets in a snapshot: [start, end), how they split, the event-time watermark.

    records + dlq + skipped + lost = end - start."""

    start: int
    end: int
    records: int
    dlq: int
    watermark: int | None = None
    skipped: int = 0
    """Offsets the broker never returned: transaction markers, compacted records."""
    lost: int = 0
    """[start, start + lost): deleted by retention before any ingest read them."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """`_manifest.json`: the snapshot's commit record and its entry in the offset ledger."""

    snapshot_id: str
    topic: str
    created_at: str
    offsets: dict[int, PartitionRange]
    records: int
    dlq: int
    dlq_topic: str
    dlq_errors: dict[str, int]
    """Dead letters by reason (`app.errors.Reason`; snapshots before reasons: by the error's words)."""
    classes: list[str]
    label_counts: dict[str, int]
    image_size: int
    normalization: dict
    features: str | None
    features_weights: str | None
    event_time: dict
    """{min, max, late_records, allowed_lateness_s}."""
    value_bytes: int
    files: list[DataFile]
    pixels: str = "float32"
    """The `image` column: `uint8` pixels [3, S, S]; manifests without the field (written before
    pixel snapshots) hold ImageNet-normalised float32."""
    source: bool = False
    """Whether each row keeps its encoded image (`source`), from which any image size can be cut."""
    supersedes: list[str] = field(default_factory=list)
    """Ids of the parts a compacted snapshot replaces (`app.data.compact`); readers skip those."""
    format: str = FORMAT

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and check a stored manifest; ValueError (or KeyError/TypeError) when it is not one."""
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r} is not {FORMAT}")
        offsets = {int(p): PartitionRange(**entry) for p, entry in data.pop("offsets").items()}
        files = [DataFile(f, None, None) if isinstance(f, str) else DataFile(**f) for f in data.pop("files")]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(offsets=offsets, files=files, **{k: v for k, v in data.items() if k in names})

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["offsets"] = {str(p): dataclasses.asdict(r) for p, r in sorted(self.offsets.items())}
        return json.dumps(data, indent=2, sort_keys=True)

    def lineage(self) -> dict:
        """What a model version records of this snapshot (CONTRACT.md §5): its id and offset ranges."""
        return {
            "snapshot_id": self.snapshot_id,
            "offsets": {str(p): {"start": r.start, "end": r.end} for p, r in sorted(self.offsets.items())},
        }


@dataclass(frozen=True, kw_only=True)
class WriteSpec:
    """What every snapshot one writer (an ingest, a watch) commits shares: the topic it reads, and
    how its records were preprocessed."""

    topic: str
    dlq_topic: str
    image_size: int
    classes: tuple[str, ...] | None
    """The configured class list; None: the labels the snapshot holds."""
    features: str | None = None
    features_weights: str | None = None
    allowed_lateness_s: float
    keep_source: bool = False


def build_manifest(
    spec: WriteSpec,
    snapshot_id: str,
    ranges: dict[int, tuple[int, int]],
    previous_watermarks: dict[int, int],
    stats: WriteStats,
    lost: dict[int, int] | None = None,
) -> Manifest:
    """The manifest of a finished write, after proving every offset of every range landed once.

    Every offset read must be in the Parquet files or the DLQ exactly once, or be one the broker
    declared skipped; anything else fails the run before a snapshot becomes visible or an offset is
    committed. `lost[p]` offsets before a range's start were deleted by retention unread: the
    partition's entry starts that much earlier, so the ledger stays contiguous and says so.
    """
    lost = lost or {}
    offsets = {}
    for p, (start, end) in sorted(ranges.items()):
        seen = stats.partitions.get(p, PartitionStats())
        if not seen.covers_once(start, end):
            spans = sorted(seen.spans)
            raise RuntimeError(
                f"partition {p}: expected offsets [{start}, {end}) once each, got "
                f"{seen.records + seen.dlq} records in runs {spans[:5]}{' ...' if len(spans) > 5 else ''}; "
                "nothing committed"
            )
        watermark = max(previous_watermarks.get(p, 0), stats.event_max or 0)
        gone = lost.get(p, 0)
        offsets[p] = PartitionRange(start - gone, end, seen.records, seen.dlq, watermark, seen.skipped, gone)
    return Manifest(
        snapshot_id=snapshot_id,
        topic=spec.topic,
        created_at=datetime.now(UTC).isoformat(),
        offsets=offsets,
        records=sum(r.records for r in offsets.values()),
        dlq=sum(r.dlq for r in offsets.values()),
        dlq_topic=spec.dlq_topic,
        dlq_errors=dict(stats.dlq_errors),
        classes=list(spec.classes) if spec.classes else sorted(stats.labels),
        label_counts=dict(sorted(stats.labels.items())),
        image_size=spec.image_size,
        normalization={"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        features=spec.features,
        features_weights=spec.features_weights if spec.features else None,
        pixels=PIXELS,
        source=spec.keep_source,
        event_time={
            "min": stats.event_min,
            "max": stats.event_max,
            "late_records": stats.late,
            "allowed_lateness_s": spec.allowed_lateness_s,
        },
        value_bytes=stats.value_bytes,
        files=sorted(stats.files, key=lambda f: f.path),
    )


def ledger_offsets(manifests: Iterable[Manifest], topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """Where the next ingest starts per partition, and the event-time watermark per partition."""
    starts: dict[int, int] = {}
    watermarks: dict[int, int] = {}
    for manifest in manifests:
        if manifest.topic != topic:
            continue
        for p, entry in manifest.offsets.items():
            starts[p] = max(starts.get(p, 0), entry.end)
            if entry.watermark is not None:
                watermarks[p] = max(watermarks.get(p, 0), entry.watermark)
    return starts, watermarks


def live_manifests(manifests: Iterable[Manifest]) -> list[Manifest]:
    """The manifests no other supersedes: a compacted snapshot and the parts it replaces may both
    exist until the parts are deleted, and each offset must be read once (CONTRACT.md §2)."""
    manifests = list(manifests)
    superseded = {s for m in manifests for s in m.supersedes}
    return [m for m in manifests if m.snapshot_id not in superseded]


def discover_classes(manifests: Iterable[Manifest], configured: tuple[str, ...] | None) -> list[str]:
    """The configured class list, else the sorted distinct labels the snapshots hold."""
    if configured:
        return list(configured)
    return sorted({label for m in manifests for label in m.label_counts})
