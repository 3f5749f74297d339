"""The old storage layout, read-only, for `argus migrate` alone (CONTRACT.md §2, "Before #21").

    <storage>/snapshots/<snapshot_id>/event_date=YYYY-MM-DD/*.parquet + _manifest.json

A snapshot was the Parquet its manifest listed, with every file's size and SHA-256; the manifest,
written last and never overwritten, was the commit; a compacted snapshot listed the parts it
replaced in `supersedes`. Nothing else in Argus reads or writes this layout any more.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app import storage
from app.errors import ConfigError
from app.storage import Store

FORMAT = "argus.snapshot.v1"
PIXELS = "uint8"
"""What the `image` column of a pixel snapshot holds (older ones: normalised float32)."""
MANIFEST = "_manifest.json"


@dataclass(frozen=True)
class DataFile:
    """One Parquet file of a snapshot, as its manifest lists it."""

    path: str
    """Relative to the snapshot's folder."""
    size: int | None
    sha256: str | None
    """None only in manifests written before digests were recorded."""


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


def live_manifests(manifests: Iterable[Manifest]) -> list[Manifest]:
    """The manifests no other supersedes: a compacted snapshot and the parts it replaces may both
    exist until the parts are deleted, and each offset must be read once (CONTRACT.md §2)."""
    manifests = list(manifests)
    superseded = {s for m in manifests for s in m.supersedes}
    return [m for m in manifests if m.snapshot_id not in superseded]


class UnreadableManifest(ConfigError):
    """A committed snapshot's manifest that this Argus cannot read: written by a newer Argus (a
    rolling upgrade), or damaged. Nothing is changed: skipping it would leave its offsets out of the
    ledger, and the next ingest would start past them for good."""


class LegacySnapshots:
    """The snapshot folders under one storage root, as `migrate` reads them."""

    def __init__(self, store: Store):
        self.snapshots = store.child("snapshots")

    @classmethod
    def at(cls, uri: str) -> LegacySnapshots:
        """The snapshots under the storage root at `uri` (a local path or s3://, hdfs://, ...)."""
        return cls(Store.at(uri))

    def folder(self, snapshot_id: str) -> Store:
        return self.snapshots.child(snapshot_id)

    def manifests(self) -> list[Manifest]:
        """Committed snapshots' manifests, oldest first (ids sort by creation time); UnreadableManifest
        (exit 2) at the first one that does not parse, and nothing is moved or deleted."""
        manifests = []
        for info in sorted(self.snapshots.list(), key=lambda i: i.base_name):
            if info.type != pafs.FileType.Directory or info.base_name.startswith("."):
                continue
            try:
                raw = self.snapshots.read(f"{info.base_name}/{MANIFEST}")
            except FileNotFoundError:
                continue  # being written, or abandoned by a writer that died: not a snapshot
            try:
                manifests.append(Manifest.from_json(raw))
            except (ValueError, KeyError, TypeError) as exc:
                where = self.folder(info.base_name).uri(MANIFEST)
                raise UnreadableManifest(
                    f"snapshot {info.base_name}: its manifest is not one this Argus reads "
                    f"({type(exc).__name__}: {exc}): written by a newer Argus, or damaged. Nothing was "
                    f"changed; run the Argus that wrote it, or restore {where}"
                ) from None
        return manifests

    def read_rows(self, manifest: Manifest, columns: list[str]) -> pa.Table:
        """Selected columns of the files `manifest` lists, each checked against it as it is read."""
        folder = self.folder(manifest.snapshot_id)
        tables = []
        for listed in manifest.files:
            data = verify_file(folder, listed)
            tables.append(pq.read_table(pa.BufferReader(data), columns=columns))
        return pa.concat_tables(tables)


class CorruptSnapshot(RuntimeError):
    """A data file does not match its manifest (missing, another size, another digest)."""


def verify_file(folder: Store, listed: DataFile) -> bytes:
    """The bytes of `listed` in the snapshot `folder`, after checking them against the manifest's
    size and digest and their schema."""
    uri = folder.uri(listed.path)
    try:
        data = folder.read(listed.path)
    except FileNotFoundError:
        raise CorruptSnapshot(f"{uri}: listed in its manifest but missing") from None
    if listed.size is not None and len(data) != listed.size:
        raise CorruptSnapshot(f"{uri}: {len(data)} bytes, its manifest says {listed.size}")
    if listed.sha256 is not None and storage.sha256(data) != listed.sha256:
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
