"""A snapshot's data file checked against its manifest before anything reads it: present, of the
listed size and SHA-256, and Parquet whose schema cannot make reading it run code."""

from __future__ import annotations

from app import storage
from app.data.manifest import DataFile
from app.storage import Store


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
