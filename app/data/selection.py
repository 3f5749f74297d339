"""What a reader (`train`, `federate`, `drift`) reads: one table snapshot, pinned (CONTRACT.md §2).

    read = select(ImageTable.at(storage), image_size=64)          # the current snapshot
    read = select(table, image_size=64, snapshot_id=read.snapshot_id)  # the same rows, later
    ray.data.read_parquet(list(read.files), columns=[...])

A reader records `read.lineage()` (table, snapshot id, Kafka offsets) with what it produces. Expiry
(`app.data.maintenance`) keeps the files of a snapshot a registered version names, and of one a run
holds with `pinned_read` (a tag on the snapshot while the run reads it):

    with pinned_read(settings, snapshot_id=None) as (table, read):   # train and federate
        ...
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from app.config import Settings
from app.data.metadata import FEATURES_WEIGHTS_KEY
from app.data.table import ImageTable
from app.errors import ConfigError


@dataclass(frozen=True)
class TableRead:
    """One table snapshot as a reader uses it: its data files and what its rows hold."""

    table: str
    """The table's identifier, `namespace.table`."""
    snapshot_id: int
    files: tuple[str, ...]
    """The snapshot's Parquet files (URIs); Argus writes no delete files, so their rows are it."""
    committed: dict[int, int]
    """{partition: next offset}: the snapshot holds every offset below, once (or as a dead letter)."""
    label_counts: dict[str, int] = field(default_factory=dict)
    """Rows per label (unlabelled rows are not counted)."""
    image_size: int = 0
    """The stored pixels' side (0: rows of several sizes, each with its source image)."""
    source: bool = False
    """Whether every row keeps its encoded image, from which any image size can be cut."""
    features: bool = False
    """Whether the table has a `features` column (ResNet-50 features computed at ingest)."""
    features_weights: str | None = None
    """The backbone weights file ingest computed the features with (None: the seeded random one)."""

    def classes(self, configured: Sequence[str] | None) -> list[str]:
        """The configured class list, else the sorted distinct labels of the snapshot."""
        return list(configured) if configured else sorted(self.label_counts)

    def lineage(self) -> dict:
        """What a model version records of its input (CONTRACT.md §5): the table, the snapshot id
        and the Kafka offsets the snapshot holds."""
        return {
            "table": self.table,
            "snapshot_id": str(self.snapshot_id),
            "offsets": {str(p): {"start": 0, "end": end} for p, end in sorted(self.committed.items())},
        }


def select(table: ImageTable, image_size: int, snapshot_id: int | None = None) -> TableRead:
    """The table snapshot `snapshot_id` (default: the current one) as a reader at `image_size`
    uses it. ValueError when it holds no rows, or pixels of another size without their sources."""
    if snapshot_id is None:
        snapshot_id = table.current_snapshot_id()
        if snapshot_id is None:
            raise ValueError(f"table {table.identifier} has no commits yet: run `ingest` first")
    files = tuple(table.data_file_uris(snapshot_id))
    check_files(files)
    columns = table.load().schema().column_names
    wanted = ["label", "height", "width"] + (["source"] if "source" in columns else [])
    rows = read_rows(files, wanted) if files else None
    if rows is None or rows.num_rows == 0:
        raise ValueError(
            f"table {table.identifier} snapshot {snapshot_id} holds no rows (only dead letters?): "
            "ingest records first"
        )
    labels = Counter(label for label in rows.column("label").to_pylist() if label is not None)
    sizes = set(zip(rows.column("height").to_pylist(), rows.column("width").to_pylist()))
    source = "source" in rows.column_names and rows.column("source").null_count == 0
    if sizes != {(image_size, image_size)} and not source:
        raise ValueError(
            f"table {table.identifier} holds images of sizes {sorted(sizes)} but --image-size is "
            f"{image_size} (ingest with --keep-source to train at other sizes)"
        )
    return TableRead(
        table=table.identifier,
        snapshot_id=snapshot_id,
        files=files,
        committed=table.committed(snapshot_id),
        label_counts=dict(sorted(labels.items())),
        image_size=sizes.pop()[0] if len(sizes) == 1 else 0,
        source=source,
        features="features" in columns,
        features_weights=table.summary_value(snapshot_id, FEATURES_WEIGHTS_KEY) or None,
    )


def read_rows(files: Sequence[str], columns: list[str], row_filter=None) -> pa.Table:
    """Selected columns of a snapshot's data files as one Arrow table (`row_filter`: a pyarrow
    expression). Takes plain URIs: federated clients get them as strings in Flower's run config."""
    if not files:
        raise ValueError("no data files to read")
    filesystem, _ = pafs.FileSystem.from_uri(files[0])  # S3 from the environment, as `Store.at`
    paths = [pafs.FileSystem.from_uri(uri)[1] for uri in files]
    dataset = pads.dataset(paths, format="parquet", filesystem=filesystem)
    return dataset.to_table(columns=columns, filter=row_filter)


class UnsafeDataFile(ValueError):
    """A data file whose Parquet schema declares an Arrow extension type: the table's columns have
    none, and some (Ray's `arrow_pickled_object`) unpickle their values when read."""


def check_files(files: Sequence[str]) -> None:
    """Read each file's Parquet footer and refuse (UnsafeDataFile) one that declares an extension
    type, before anything (Ray Data, which registers such types) reads its values: the catalog
    names the files, but their bytes are storage's, which Argus does not trust blindly."""
    for uri in files:
        filesystem, path = pafs.FileSystem.from_uri(uri)
        schema = pq.read_schema(path, filesystem=filesystem)
        stack = list(schema)
        while stack:
            field = stack.pop()
            declared = (field.metadata or {}).get(b"ARROW:extension:name")
            if declared is not None or isinstance(field.type, pa.BaseExtensionType):
                raise UnsafeDataFile(f"{uri}: column {field.name!r} declares an Arrow extension type")
            kind = field.type
            if pa.types.is_struct(kind):
                stack += list(kind)
            elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
                stack.append(kind.value_field)
            elif pa.types.is_map(kind):
                stack += [kind.key_field, kind.item_field]


def chw_images(pixels: Sequence[bytes] | np.ndarray, height: int, width: int) -> np.ndarray:
    """The `pixels` column (uint8 HWC bytes, one size) as the model's uint8 [n, 3, height, width]."""
    flat = np.frombuffer(b"".join(pixels), dtype=np.uint8)
    return np.ascontiguousarray(flat.reshape(len(pixels), height, width, 3).transpose(0, 3, 1, 2))


def hwc_bytes(images: np.ndarray) -> list[bytes]:
    """uint8 [n, 3, height, width] images as the `pixels` column's HWC bytes, one per row."""
    hwc = np.ascontiguousarray(np.asarray(images, dtype=np.uint8).transpose(0, 2, 3, 1))
    return [row.tobytes() for row in hwc]


def label_filter(classes: Sequence[str]) -> pc.Expression:
    """Rows labelled with one of `classes`."""
    return pc.field("label").isin(list(classes))


@contextlib.contextmanager
def pinned_read(settings: Settings, snapshot_id: int | None) -> Iterator[tuple[ImageTable, TableRead]]:
    """The table of `settings` and its snapshot `snapshot_id` (default: the current one) as a
    reader at `settings.image_size` uses it, held against expiry while the block runs
    (`ImageTable.pin`); ConfigError (exit 2) when there is no such table or snapshot, or no rows
    to learn from."""
    table = ImageTable.at(settings.storage, settings.catalog, settings.table, create=False)
    with table.pin(snapshot_id) as pinned:
        try:
            read = select(table, settings.image_size, pinned)
        except UnsafeDataFile:  # storage's bytes, not the arguments: a failed run
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        yield table, read
