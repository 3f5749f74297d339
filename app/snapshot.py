"""The storage contract (CONTRACT.md §2): snapshots, their manifests, and the offset ledger.

    <storage>/snapshots/<snapshot_id>/event_date=YYYY-MM-DD/*.parquet + _manifest.json
    <storage>/offsets/<group>.json

A snapshot is the Parquet its manifest lists; the manifests together are the offset ledger, so
the next ingest starts where the durable snapshots end. Train, federate and drift meet ingest
here and nowhere else: they read manifests and the rows the manifests list.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow.fs as pafs

from app.config import IMAGENET_MEAN, IMAGENET_STD, Settings

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
FORMAT = "argus.snapshot.v1"
STAGING_PREFIX = ".tmp-"


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a local path or URI (s3://, hdfs://, ...) and the path inside it."""
    return pafs.FileSystem.from_uri(uri)


def atomic_write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write then rename, so a reader never sees half a file."""
    tmp = f"{path}{STAGING_PREFIX}{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as stream:
        stream.write(data)
    fs.move(tmp, path)


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
    spans: list[list[int]] = field(default_factory=list)

    def add(self, offset: int, dead_letter: bool) -> None:
        if dead_letter:
            self.dlq += 1
        else:
            self.records += 1
        if self.spans and self.spans[-1][1] == offset:
            self.spans[-1][1] = offset + 1  # the usual case: offsets arrive in order
        else:
            self.spans.append([offset, offset + 1])

    def merge(self, other: PartitionStats) -> None:
        self.records += other.records
        self.dlq += other.dlq
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
    """One snapshot write task's accounting; the driver merges them into the manifest."""

    partitions: dict[int, PartitionStats] = field(default_factory=dict)
    labels: Counter = field(default_factory=Counter)
    dlq_errors: Counter = field(default_factory=Counter)
    files: list[str] = field(default_factory=list)
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
    """One partition's offsets in a snapshot: [start, end), how they split, the event-time watermark."""

    start: int
    end: int
    records: int
    dlq: int
    watermark: int | None = None


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
    classes: list[str]
    label_counts: dict[str, int]
    image_size: int
    normalization: dict
    features: str | None
    features_weights: str | None
    event_time: dict
    """{min, max, late_records, allowed_lateness_s}."""
    value_bytes: int
    files: list[str]
    """Data files relative to the snapshot's folder."""
    format: str = FORMAT

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        data = json.loads(text)
        offsets = {int(p): PartitionRange(**entry) for p, entry in data.pop("offsets").items()}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(offsets=offsets, **{k: v for k, v in data.items() if k in names})

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


def build_manifest(
    settings: Settings,
    snapshot_id: str,
    ranges: dict[int, tuple[int, int]],
    previous_watermarks: dict[int, int],
    stats: WriteStats,
    *,
    features: str | None,
    features_weights: str | None,
    allowed_lateness_s: float,
) -> Manifest:
    """The manifest of a finished write, after proving every offset of every range landed once.

    Every offset must be in the Parquet files or the DLQ exactly once; anything else fails the run
    before a snapshot becomes visible or an offset is committed.
    """
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
        offsets[p] = PartitionRange(start, end, seen.records, seen.dlq, watermark)
    return Manifest(
        snapshot_id=snapshot_id,
        topic=settings.topic,
        created_at=datetime.now(UTC).isoformat(),
        offsets=offsets,
        records=sum(r.records for r in offsets.values()),
        dlq=sum(r.dlq for r in offsets.values()),
        dlq_topic=settings.dlq_topic,
        dlq_errors=dict(stats.dlq_errors),
        classes=list(settings.classes) if settings.classes else sorted(stats.labels),
        label_counts=dict(sorted(stats.labels.items())),
        image_size=settings.image_size,
        normalization={"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        features=features,
        features_weights=features_weights if features else None,
        event_time={
            "min": stats.event_min,
            "max": stats.event_max,
            "late_records": stats.late,
            "allowed_lateness_s": allowed_lateness_s,
        },
        value_bytes=stats.value_bytes,
        files=sorted(stats.files),
    )


def snapshot_uri(settings: Settings, snapshot_id: str) -> str:
    return settings.uri("snapshots", snapshot_id)


def read_manifest_at(uri: str) -> Manifest:
    """The manifest of the snapshot folder at `uri`."""
    fs, root = filesystem(uri)
    with fs.open_input_stream(f"{root}/{MANIFEST}") as stream:
        return Manifest.from_json(stream.read())


def read_manifest(settings: Settings, snapshot_id: str) -> Manifest:
    return read_manifest_at(snapshot_uri(settings, snapshot_id))


def list_manifests(settings: Settings) -> list[Manifest]:
    """Durable snapshots' manifests, oldest first (ids sort by creation time)."""
    fs, root = filesystem(settings.uri("snapshots"))
    manifests = []
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    for info in sorted(infos, key=lambda i: i.base_name):
        if info.type != pafs.FileType.Directory or info.base_name.startswith("."):
            continue
        try:
            with fs.open_input_stream(f"{info.path}/{MANIFEST}") as stream:
                manifests.append(Manifest.from_json(stream.read()))
        except FileNotFoundError:
            log.warning("snapshot dir %s has no manifest; ignoring it", info.path)
    return manifests


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


def write_offsets_file(settings: Settings, group: str, ends: dict[int, int]) -> None:
    """`<storage>/offsets/<group>.json`: the ledger's ends, for tools that do not read manifests."""
    fs, path = filesystem(settings.uri("offsets", f"{group}.json"))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    body = {"topic": settings.topic, "offsets": {str(p): e for p, e in ends.items()}}
    atomic_write(fs, path, json.dumps(body, indent=2).encode())


def clean_staging(fs: pafs.FileSystem, snapshots_root: str) -> None:
    for info in fs.get_file_info(pafs.FileSelector(snapshots_root, allow_not_found=True)):
        if info.base_name.startswith(STAGING_PREFIX):
            log.warning(
                "removing %s left by an interrupted ingest (its offsets were never committed)", info.path
            )
            fs.delete_dir(info.path)


def select_snapshots(settings: Settings, wanted: tuple[str, ...] | None) -> list[Manifest]:
    """The topic's snapshots with records (or exactly `wanted`), all at `settings.image_size`."""
    manifests = [m for m in list_manifests(settings) if m.topic == settings.topic and m.records > 0]
    if wanted:
        by_id = {m.snapshot_id: m for m in manifests}
        missing = [s for s in wanted if s not in by_id]
        if missing:
            raise ValueError(f"unknown snapshots {missing}; available: {sorted(by_id)}")
        manifests = [by_id[s] for s in wanted]
    if not manifests:
        raise ValueError(f"no snapshots with records under {settings.uri('snapshots')}: run `ingest` first")
    sizes = {m.image_size for m in manifests}
    if sizes != {settings.image_size}:
        raise ValueError(
            f"snapshots have image sizes {sorted(sizes)} but --image-size is {settings.image_size}"
        )
    return manifests


def discover_classes(manifests: Iterable[Manifest], configured: tuple[str, ...] | None) -> list[str]:
    """The configured class list, else the sorted distinct labels the snapshots hold."""
    if configured:
        return list(configured)
    return sorted({label for m in manifests for label in m.label_counts})


def read_rows(snapshot_uris: Iterable[str], columns: list[str], row_filter=None):
    """Selected columns of the files the snapshots' manifests list, as one Arrow table."""
    import pyarrow as pa
    import pyarrow.dataset as ds
    import ray.data  # noqa: F401  (registers Ray's tensor extension type for the image column)

    tables = []
    for uri in snapshot_uris:
        fs, root = filesystem(uri)
        files = [f"{root}/{name}" for name in read_manifest_at(uri).files]
        tables.append(
            ds.dataset(files, format="parquet", filesystem=fs).to_table(columns=columns, filter=row_filter)
        )
    return pa.concat_tables(tables)
