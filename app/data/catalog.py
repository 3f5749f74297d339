"""Where the Iceberg table lives (CONTRACT.md §2): the catalog by URI, the warehouse, the schema.

    sqlite:///<storage>/catalog.db      the embedded default, for a local --storage
    postgresql+psycopg://host/argus      any SQLAlchemy database: a PyIceberg SQL catalog
    https://catalog.example/api/catalog  an Iceberg REST catalog

The catalog is named `argus` whichever it is, and holds `argus.behavior_images` unless told
otherwise; the warehouse (the Parquet and the table's metadata files) is `<storage>/warehouse/`.
Reading and committing the table is `app.data.table`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchTableError
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties
from pyiceberg.transforms import IdentityTransform
from pyiceberg.types import (
    BinaryType,
    DateType,
    FloatType,
    IntegerType,
    ListType,
    LongType,
    NestedField,
    StringType,
)

from app.errors import ConfigError

CATALOG_NAME = "argus"

FORMAT = 2
"""`argus.format` of the tables this code writes: in the table's properties and every commit's
summary. A table that says a larger number was written by a newer Argus and is refused."""
FORMAT_KEY = "argus.format"

RETRIES_KEY = TableProperties.COMMIT_NUM_RETRIES
NO_RETRIES = {RETRIES_KEY: "0"}
"""PyIceberg (0.12) retries a conflicting append on the new base with the summary it built for the
old one, so a retried Argus commit would carry stale offsets: every writer of this table re-checks
the offsets itself and re-plans instead (`app.data.table`)."""
METADATA_VERSIONS_KEPT = 20
TABLE_PROPERTIES = {
    **NO_RETRIES,
    # Each commit writes a new metadata JSON: keep the last few, not one per commit for years.
    TableProperties.METADATA_DELETE_AFTER_COMMIT_ENABLED: "true",
    TableProperties.METADATA_PREVIOUS_VERSIONS_MAX: str(METADATA_VERSIONS_KEPT),
    # Rows hold whole images (3 KB at 32 px, 150 KB at 224): PyIceberg's default of 20,000 rows per
    # write batch makes Parquet hash every image of a file into the dictionary it then abandons for
    # the pixels. 1,024 (pyarrow's own default) writes 20,000 32 px rows 3x faster
    # (bench/history.py); pages still split at the page size.
    TableProperties.PARQUET_PAGE_ROW_LIMIT: "1024",
}
"""Properties every Argus table has; `ImageTable` sets them again on a table that lost them."""


CREATE_ATTEMPTS = 3
SQLITE_BUSY_TIMEOUT_S = 60


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def _local_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://")).resolve()


def catalog_uri(storage: str, catalog: str | None = None) -> str:
    """The catalog's URI: `catalog` when given, else a SQLite file under a local `storage`."""
    if catalog:
        return catalog
    if not _is_local(storage):
        raise ConfigError(
            f"--catalog (ARGUS_CATALOG) is required when --storage is not a local path: {storage}"
        )
    return f"sqlite:///{_local_path(storage) / 'catalog.db'}"


def warehouse_uri(storage: str) -> str:
    """`<storage>/warehouse`, as a URI PyIceberg's file IO resolves (file://, s3://, hdfs://)."""
    if _is_local(storage):
        return f"file://{_local_path(storage) / 'warehouse'}"
    return f"{storage.rstrip('/')}/warehouse"


def file_io_properties() -> dict[str, str]:
    """S3 settings for PyIceberg's file IO, from the environment as AWS tools (and pyarrow, and
    MLflow) read it: PyIceberg itself reads neither `AWS_ENDPOINT_URL` nor the region there, and
    without a region it asks AWS where the bucket is."""
    properties = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        properties["s3.endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region or endpoint:
        properties["s3.region"] = region or "us-east-1"
    return properties


def open_catalog(uri: str, warehouse: str, create: bool = True) -> Catalog:
    """The `argus` catalog at `uri`: REST for http(s), else a SQL catalog on that SQLAlchemy URI.
    Without `create`, a SQLite file that is not there is a ConfigError, not a new empty catalog."""
    if uri.startswith(("http://", "https://")):
        from pyiceberg.catalog.rest import RestCatalog

        return RestCatalog(CATALOG_NAME, uri=uri, warehouse=warehouse, **file_io_properties())
    from pyiceberg.catalog.sql import SqlCatalog

    engine_uri = uri
    if uri.startswith("sqlite:///"):  # SQLite creates the file, not the folder it goes in
        path = Path(uri.removeprefix("sqlite:///").split("?")[0])
        if not create and not path.exists():
            raise ConfigError(
                f"there is no catalog at {uri} (--storage or --catalog names another); nothing created"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        if "timeout=" not in uri:
            # Writers in several processes (watches, an ingest, their upkeep) take SQLite's one
            # write lock in turn: wait for it as long as a slow commit may hold it, not 5 s.
            engine_uri = f"{uri}{'&' if '?' in uri else '?'}timeout={SQLITE_BUSY_TIMEOUT_S}"
    for attempt in range(CREATE_ATTEMPTS):
        try:
            return SqlCatalog(CATALOG_NAME, uri=engine_uri, warehouse=warehouse, **file_io_properties())
        except Exception as exc:  # a URI SQLAlchemy cannot parse or whose driver is absent
            # PyIceberg creates its two tables check-then-create: two processes opening a new
            # catalog at once (two watches starting) race, and the loser's tables now exist.
            if "already exists" in str(exc) and attempt + 1 < CREATE_ATTEMPTS:
                continue
            raise ConfigError(f"--catalog {uri}: {type(exc).__name__}: {exc}") from exc
    raise AssertionError("unreachable")


def table_schema(*, source: bool = False, features: bool = False) -> Schema:
    """The table's columns (CONTRACT.md §2); `source` and `features` only when asked."""
    fields = [
        NestedField(1, "kafka_partition", IntegerType(), required=True),
        NestedField(2, "kafka_offset", LongType(), required=True),
        NestedField(3, "user_id", StringType(), required=True),
        NestedField(4, "label", StringType(), required=False, doc="null when unlabelled"),
        NestedField(5, "event_time_ms", LongType(), required=True, doc="ms since the epoch, UTC"),
        NestedField(6, "device_id", StringType(), required=True),
        NestedField(7, "pixels", BinaryType(), required=True, doc="uint8, height x width x 3, row-major"),
        NestedField(8, "height", IntegerType(), required=True),
        NestedField(9, "width", IntegerType(), required=True),
        NestedField(10, "event_date", DateType(), required=True, doc="UTC date of event_time_ms"),
        NestedField(14, "kafka_timestamp_ms", LongType(), required=False, doc="the record's Kafka timestamp"),
    ]
    if source:
        fields.append(NestedField(11, "source", BinaryType(), required=False, doc="the encoded image"))
    if features:
        element = ListType(element_id=13, element_type=FloatType(), element_required=True)
        fields.append(NestedField(12, "features", element, required=False))
    return Schema(*fields)


def partition_spec() -> PartitionSpec:
    """By event date: identity on `event_date`. PyIceberg 0.12 writes a day() transform only with
    the optional `pyiceberg-core` (Rust) package; identity it computes in pyarrow, and engines prune
    on `event_date` either way."""
    return PartitionSpec(
        PartitionField(source_id=10, field_id=1000, transform=IdentityTransform(), name="event_date")
    )


def create_or_load(
    catalog: Catalog, identifier: str, *, source: bool, features: bool, create: bool = True
) -> Table:
    """The table, created (with its namespace) if it does not exist yet; without `create`, a
    missing table is a ConfigError and nothing is written."""
    namespace = Catalog.namespace_from(identifier)
    if not namespace:
        raise ConfigError(f"--table {identifier}: expected namespace.table")
    try:  # load first: creating writes a metadata file even when the table turns out to exist
        return catalog.load_table(identifier)
    except NoSuchTableError:
        if not create:
            raise ConfigError(
                f"there is no table {identifier} in the catalog (--table names another); nothing created"
            ) from None
    properties = {FORMAT_KEY: str(FORMAT), **TABLE_PROPERTIES}
    for attempt in range(CREATE_ATTEMPTS):
        try:
            catalog.create_namespace_if_not_exists(namespace)
            return catalog.create_table_if_not_exists(
                identifier,
                table_schema(source=source, features=features),
                partition_spec=partition_spec(),
                properties=properties,
            )
        except Exception as exc:
            # Two writers creating the table at once (two ingests, a watch and an ingest): the SQL
            # catalog's check-then-insert of the namespace fails for one. Take what the other made.
            try:
                return catalog.load_table(identifier)
            except NoSuchTableError:
                if attempt + 1 == CREATE_ATTEMPTS:
                    raise exc from None
    raise AssertionError("unreachable")


def check_format(table: Table) -> None:
    """Refuse (ConfigError: exit 2) a table Argus did not create or a newer Argus wrote: its
    `argus.format` property, and that of its latest Argus commit, must be at most FORMAT."""
    name = ".".join(table.name())
    stated = table.properties.get(FORMAT_KEY)
    if stated is None:
        raise ConfigError(
            f"table {name} has no {FORMAT_KEY} property: not an Argus table; --table names another"
        )
    snapshot = table.current_snapshot()
    found = [("property", stated)]
    if (
        snapshot is not None
        and snapshot.summary is not None
        and FORMAT_KEY in snapshot.summary.additional_properties
    ):
        found.append((f"snapshot {snapshot.snapshot_id}", snapshot.summary.additional_properties[FORMAT_KEY]))
    for where, value in found:
        if not value.isdigit() or int(value) > FORMAT:
            raise ConfigError(
                f"table {name} is in Argus format {value!r} ({where}), newer than this Argus's {FORMAT}: "
                "upgrade Argus to read or write it; nothing was changed"
            )


def dumps(mapping: dict) -> str:
    """JSON for a summary value: partitions as string keys, sorted, compact."""
    return json.dumps({str(k): v for k, v in sorted(mapping.items())}, separators=(",", ":"))
