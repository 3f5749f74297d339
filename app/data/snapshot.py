"""The storage contract (CONTRACT.md §2): snapshots, their manifests, and the offset ledger.

    <storage>/snapshots/<snapshot_id>/event_date=YYYY-MM-DD/*.parquet + _manifest.json
    <storage>/offsets/<group>.json

A snapshot is the Parquet its manifest lists. Data files go straight to their final names; the
manifest, with every file's size and SHA-256, is written last as one object that is never
overwritten (`commit`): it *is* the commit, on local disk and object stores alike, with no
directory rename. A folder without a manifest is invisible and is removed by the next writer
that holds the ingest lease. The manifests together are the offset ledger, so the next ingest
starts where the committed snapshots end. Train, federate and drift meet ingest here and nowhere
else: they read manifests and, checked against them, the files the manifests list.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow.fs as pafs

from app import storage
from app.config import IMAGENET_MEAN, IMAGENET_STD, Settings
from app.storage import filesystem

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"
FORMAT = "argus.snapshot.v1"
PIXELS = "uint8"
"""What the `image` column of the snapshots this code writes holds."""


class CorruptSnapshot(RuntimeError):
    """A data file does not match its manifest (missing, another size, another digest)."""


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
    lost: dict[int, int] | None = None,
    keep_source: bool = False,
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
        pixels=PIXELS,
        source=keep_source,
        event_time={
            "min": stats.event_min,
            "max": stats.event_max,
            "late_records": stats.late,
            "allowed_lateness_s": allowed_lateness_s,
        },
        value_bytes=stats.value_bytes,
        files=sorted(stats.files, key=lambda f: f.path),
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


def commit(settings: Settings, manifest: Manifest) -> bool:
    """Publish the snapshot: write its manifest only if none exists. False if one already did."""
    return storage.write_new(
        f"{snapshot_uri(settings, manifest.snapshot_id)}/{MANIFEST}", manifest.to_json().encode()
    )


def list_manifests(settings: Settings, *, quarantine: bool = False) -> list[Manifest]:
    """Committed snapshots' manifests, oldest first (ids sort by creation time).

    A manifest that does not parse is skipped with a warning; with `quarantine` (only the lease
    holder mutates storage) it is moved to `<storage>/quarantine/`, which leaves its folder
    uncommitted: the next cleanup removes the folder and its offsets are ingested again.
    """
    fs, root = filesystem(settings.uri("snapshots"))
    manifests = []
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    for info in sorted(infos, key=lambda i: i.base_name):
        if info.type != pafs.FileType.Directory or info.base_name.startswith("."):
            continue
        try:
            raw = storage.read_file(fs, f"{info.path}/{MANIFEST}")
        except FileNotFoundError:
            continue  # being written, or abandoned by a writer that died: not a snapshot
        try:
            manifests.append(Manifest.from_json(raw))
        except (ValueError, KeyError, TypeError) as exc:
            action = "moved to quarantine/" if quarantine else "skipped"
            log.warning(
                "snapshot %s: corrupt manifest (%s: %s); %s", info.base_name, type(exc).__name__, exc, action
            )
            if quarantine:
                _quarantine(settings, info.base_name, raw)
    return manifests


def _quarantine(settings: Settings, snapshot_id: str, raw: bytes) -> None:
    fs, path = filesystem(settings.uri("quarantine", f"{snapshot_id}-{uuid.uuid4().hex[:6]}{MANIFEST}"))
    storage.write_file(fs, path, raw)
    snapshot_fs, manifest_path = filesystem(f"{snapshot_uri(settings, snapshot_id)}/{MANIFEST}")
    snapshot_fs.delete_file(manifest_path)


def remove_uncommitted(settings: Settings) -> list[str]:
    """Delete snapshot folders without a manifest; call only while holding the ingest lease (any
    other writer's lease has then expired, so such a folder's writer is gone). Returns their names."""
    fs, root = filesystem(settings.uri("snapshots"))
    removed = []
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.type == pafs.FileType.Directory and not storage.exists(fs, f"{info.path}/{MANIFEST}"):
            log.warning("removing %s: written by an ingest that never committed it", info.path)
            fs.delete_dir(info.path)
            removed.append(info.base_name)
    return removed


def data_file_uris(settings: Settings, manifests: Iterable[Manifest], *, verify: bool = True) -> list[str]:
    """Every data file the manifests list, as URIs; with `verify`, each is read and its size and
    SHA-256 checked against the manifest first (CorruptSnapshot otherwise)."""
    uris = [f"{snapshot_uri(settings, m.snapshot_id)}/{f.path}" for m in manifests for f in m.files]
    if verify:
        files = [f for m in manifests for f in m.files]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(verify_file, uris, files))
    return uris


def verify_file(uri: str, expected: DataFile, data: bytes | None = None) -> bytes:
    """The file's bytes, after checking them against the manifest's size and digest."""
    if data is None:
        fs, path = filesystem(uri)
        try:
            data = storage.read_file(fs, path)
        except FileNotFoundError:
            raise CorruptSnapshot(f"{uri}: listed in its manifest but missing") from None
    if expected.size is not None and len(data) != expected.size:
        raise CorruptSnapshot(f"{uri}: {len(data)} bytes, its manifest says {expected.size}")
    if expected.sha256 is not None and storage.sha256(data) != expected.sha256:
        raise CorruptSnapshot(f"{uri}: SHA-256 differs from its manifest's")
    check_schema(uri, data)
    return data


# Ray's tensor types carry only a JSON shape. Any other extension type (Ray's own
# `arrow_pickled_object`, or one some library registers) may run code from the file when its
# values are read, so a file that declares one is refused before anything reads it.
TENSOR_EXTENSIONS = frozenset(
    {"ray.data.arrow_tensor", "ray.data.arrow_tensor_v2", "ray.data.arrow_variable_shaped_tensor"}
)
# The columns readers take, by type; a tensor column by its element type.
PLAIN_COLUMNS = {"label": "string", "event_time": "int64", "source": "binary"}
TENSOR_COLUMNS = {"image": ("uint8", "float"), "features": ("float",)}


def check_schema(uri: str, data: bytes) -> None:
    """Refuse Parquet whose schema could make reading it run code, or that holds the columns
    readers take with other types than the ones ingest writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:
        raise CorruptSnapshot(f"{uri}: not readable Parquet ({exc})") from None
    for name, extension, storage_type in _columns(schema):
        if extension is not None and extension not in TENSOR_EXTENSIONS:
            raise CorruptSnapshot(f"{uri}: column {name!r} has the extension type {extension!r}")
        top = name.split(".")[0]
        if (
            name == top
            and top in PLAIN_COLUMNS
            and str(storage_type).removeprefix("large_") != PLAIN_COLUMNS[top]
        ):
            raise CorruptSnapshot(f"{uri}: column {name!r} is {storage_type}, not {PLAIN_COLUMNS[top]}")
        if top in TENSOR_COLUMNS and name == top:
            element = getattr(storage_type, "value_type", None)
            if extension not in TENSOR_EXTENSIONS or str(element) not in TENSOR_COLUMNS[top]:
                raise CorruptSnapshot(f"{uri}: column {name!r} is not a tensor of {TENSOR_COLUMNS[top]}")


def _columns(schema):
    """(dotted name, extension name or None, storage type) of every field, nested ones too. A
    registered extension type shows as a type; an unregistered one only in the field's metadata."""
    import pyarrow as pa

    stack = [(field.name, field) for field in schema]
    while stack:
        name, field = stack.pop()
        kind = field.type
        extension = (field.metadata or {}).get(b"ARROW:extension:name")
        extension = extension.decode(errors="replace") if extension is not None else None
        if isinstance(kind, pa.BaseExtensionType):
            extension, kind = kind.extension_name, kind.storage_type
        yield name, extension, kind
        if pa.types.is_struct(kind):
            stack += [(f"{name}.{child.name}", child) for child in kind]
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            stack.append((f"{name}.item", kind.value_field))
        elif pa.types.is_map(kind):
            stack += [(f"{name}.key", kind.key_field), (f"{name}.value", kind.item_field)]


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
    body = {"topic": settings.topic, "offsets": {str(p): e for p, e in ends.items()}}
    storage.write_file(fs, path, json.dumps(body, indent=2).encode())


def live_manifests(manifests: Iterable[Manifest]) -> list[Manifest]:
    """The manifests no other supersedes: a compacted snapshot and the parts it replaces may both
    exist until the parts are deleted, and each offset must be read once (CONTRACT.md §2)."""
    manifests = list(manifests)
    superseded = {s for m in manifests for s in m.supersedes}
    return [m for m in manifests if m.snapshot_id not in superseded]


def select_snapshots(settings: Settings, wanted: tuple[str, ...] | None) -> list[Manifest]:
    """The topic's live snapshots with records (or exactly `wanted`), all of uint8 pixels at
    `settings.image_size`, or all keeping their source images (any size is then cut from those)."""
    manifests = [
        m for m in live_manifests(list_manifests(settings)) if m.topic == settings.topic and m.records > 0
    ]
    if wanted:
        by_id = {m.snapshot_id: m for m in manifests}
        missing = [s for s in wanted if s not in by_id]
        if missing:
            raise ValueError(f"unknown snapshots {missing}; available: {sorted(by_id)}")
        manifests = [by_id[s] for s in wanted]
    if not manifests:
        raise ValueError(f"no snapshots with records under {settings.uri('snapshots')}: run `ingest` first")
    old = [m.snapshot_id for m in manifests if m.pixels != PIXELS]
    if old:
        raise ValueError(
            f"snapshots {old} hold normalised float32 images from before pixel snapshots; ingest their "
            "records again into a new --storage (the offset ledger is per storage) while Kafka keeps them"
        )
    sizes = {m.image_size for m in manifests}
    if sizes != {settings.image_size} and not all(m.source for m in manifests):
        raise ValueError(
            f"snapshots have image sizes {sorted(sizes)} but --image-size is {settings.image_size} "
            "(ingest with --keep-source to train at other sizes)"
        )
    return manifests


def discover_classes(manifests: Iterable[Manifest], configured: tuple[str, ...] | None) -> list[str]:
    """The configured class list, else the sorted distinct labels the snapshots hold."""
    if configured:
        return list(configured)
    return sorted({label for m in manifests for label in m.label_counts})


def read_rows(snapshot_uris: Iterable[str], columns: list[str], row_filter=None):
    """Selected columns of the files the snapshots' manifests list, each checked against its
    manifest as it is read, as one Arrow table."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data  # noqa: F401  (registers Ray's tensor extension type for the image column)

    tables = []
    for uri in snapshot_uris:
        for listed in read_manifest_at(uri).files:
            data = verify_file(f"{uri}/{listed.path}", listed)
            tables.append(pq.read_table(pa.BufferReader(data), columns=columns, filters=row_filter))
    return pa.concat_tables(tables)
