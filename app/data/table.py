"""The behaviour images as one Apache Iceberg table (CONTRACT.md §2): commits that carry the Kafka
offsets, reads pinned to a table snapshot.

    table = ImageTable.at("./argus-data")       # sqlite:///argus-data/catalog.db, argus.behavior_images
    start = table.committed()                   # {partition: next offset}, from the table's own history
    snapshot_id = table.commit(rows, {0: (start.get(0, 0), 64)}, dlq_records=1, topic="behavior-images")
    rows = table.scan(snapshot_id)              # what that commit left in the table, whatever came later

Every commit is one Iceberg snapshot whose summary records the offset ranges it adds
(`argus.kafka.ranges`), every partition's next offset over the whole table
(`argus.kafka.committed`, carried forward), its dead letters and the Argus format. A commit lands
only if each partition it writes is still committed exactly up to where its range starts, checked
on the table it is committed on, which the catalog swaps in only if no other commit came first
(`AssertRefSnapshotId`); a writer that loses gets `OffsetConflict`, commits nothing, and re-plans.
The summary keys, properties and tags it writes are `app.data.metadata`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import _dataframe_to_data_files
from pyiceberg.manifest import DataFile
from pyiceberg.table import Table
from pyiceberg.table.snapshots import Snapshot

from app.config import DEFAULT_TABLE
from app.data.catalog import (
    TABLE_PROPERTIES,
    catalog_uri,
    check_format,
    create_or_load,
    dumps,
    open_catalog,
    warehouse_uri,
)
from app.data.metadata import (
    ORIGIN_KEY,
    READER_TAG_PREFIX,
    TOPIC_KEY,
    Ranges,
    commit_summary,
    committed_at,
    nearest,
    watermarks_at,
)
from app.errors import ConfigError

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 5
"""Catalog swaps one commit tries before giving up: a swap lost to a commit that left this one's
partitions where it planned them (another partition's writer, a compaction) is tried again."""


class OffsetConflict(RuntimeError):
    """The table's committed offsets are not where this writer began: another writer committed
    first. Nothing of this commit is in the table; plan again from `ImageTable.committed()`."""


class ImageTable:
    """One Iceberg table of behaviour images, at one catalog and warehouse: created (or loaded)
    once per command and handed to whatever commits to or reads it. Pickled as its location, so a
    Ray task that receives it opens the catalog in its own process."""

    def __init__(
        self,
        catalog: str,
        warehouse: str,
        identifier: str = DEFAULT_TABLE,
        *,
        source: bool = False,
        features: bool = False,
        create: bool = True,
    ):
        """Open the table `identifier` in the catalog at URI `catalog` (warehouse `warehouse`),
        creating it if absent (unless not `create`: ConfigError), with `source` and `features`
        columns if asked. A table a newer Argus wrote is refused (ConfigError) and left as it is."""
        self.catalog_uri, self.warehouse, self.identifier = catalog, warehouse, identifier
        self.catalog = open_catalog(catalog, warehouse, create=create)
        table = create_or_load(self.catalog, identifier, source=source, features=features, create=create)
        check_format(table)
        self.load()  # an older table gets PyIceberg's retries turned off now, not mid-commit

    @classmethod
    def at(cls, storage: str, catalog: str | None = None, table: str | None = None, **options) -> ImageTable:
        """The table of a storage root: catalog `catalog` (default: SQLite under a local
        `storage`), warehouse `<storage>/warehouse`, table `table` (default argus.behavior_images)."""
        return cls(catalog_uri(storage, catalog), warehouse_uri(storage), table or DEFAULT_TABLE, **options)

    def __reduce__(self):
        return ImageTable, (self.catalog_uri, self.warehouse, self.identifier)

    def __repr__(self) -> str:
        return f"ImageTable({self.identifier!r} at {self.catalog_uri!r})"

    def load(self) -> Table:
        """The table as the catalog has it now, checked to be one this Argus may write."""
        table = self.catalog.load_table(self.identifier)
        check_format(table)
        lost = {k: v for k, v in TABLE_PROPERTIES.items() if table.properties.get(k) != v}
        if lost:
            # PyIceberg reads the retry count from the table it commits (Transaction.commit_transaction):
            # whoever set it back, it is off again before this handle's commits use the table.
            log.warning("table %s: setting %s again (every Argus table has them)", self.identifier, lost)
            with table.transaction() as txn:
                txn.set_properties(lost)
            table = self.catalog.load_table(self.identifier)
        return table

    def siblings(self, topic: str) -> list[ImageTable]:
        """The other tables of this catalog's namespace that hold `topic` (made from it by `ingest
        --table NAME --from`): an erasure is of a user, so it reaches each of them."""
        namespace = self.identifier.rsplit(".", 1)[0]
        found = []
        for identifier in self.catalog.list_tables(namespace):
            name = ".".join(identifier)
            if name == self.identifier:
                continue
            other = self.catalog.load_table(name)  # read only: not every table here need be Argus's
            if nearest(other, other.current_snapshot(), TOPIC_KEY) == topic:
                found.append(ImageTable(self.catalog_uri, self.warehouse, name, create=False))
        return found

    def current_snapshot_id(self) -> int | None:
        """The table's current snapshot: what a reader pins to (None before the first commit)."""
        snapshot = self.load().current_snapshot()
        return snapshot.snapshot_id if snapshot else None

    def committed(self, snapshot_id: int | None = None) -> dict[int, int]:
        """{partition: next offset} as of `snapshot_id` (default: now); {} before any commit."""
        table = self.load()
        snapshot = table.current_snapshot() if snapshot_id is None else table.snapshot_by_id(snapshot_id)
        return committed_at(table, snapshot)

    def summary_value(self, snapshot_id: int, key: str) -> str | None:
        """`key` in the summary of `snapshot_id` or of its nearest ancestor that has it."""
        table = self.load()
        return nearest(table, table.snapshot_by_id(snapshot_id), key)

    def watermarks(self, snapshot_id: int | None = None) -> dict[int, int]:
        """{partition: event-time watermark (ms)} as of `snapshot_id` (default: now)."""
        table = self.load()
        snapshot = table.current_snapshot() if snapshot_id is None else table.snapshot_by_id(snapshot_id)
        return watermarks_at(table, snapshot)

    def scan(self, snapshot_id: int, columns: Iterable[str] | None = None) -> pa.Table:
        """The rows (or only `columns`) of the table as of `snapshot_id`, whatever came after."""
        fields = tuple(columns) if columns else ("*",)
        return self._scan(snapshot_id, fields).to_arrow()

    def data_file_uris(self, snapshot_id: int) -> list[str]:
        """The Parquet files that make up `snapshot_id` (for `ray.data.read_parquet`); Argus writes
        no delete files, so these files' rows are exactly the snapshot's."""
        return [task.file.file_path for task in self._scan(snapshot_id, ("*",)).plan_files()]

    def _scan(self, snapshot_id: int, fields: tuple[str, ...]):
        table = self.load()
        if table.snapshot_by_id(snapshot_id) is None:
            raise ValueError(
                f"table {self.identifier} has no snapshot {snapshot_id} (expired, or another table's)"
            )
        return table.scan(snapshot_id=snapshot_id, selected_fields=fields)

    def write_files(self, rows: pa.Table) -> list[DataFile]:
        """Write `rows` as Parquet data files under the table's location, split by event date:
        invisible until `commit_files` commits them (a Ray write task can call this)."""
        table = self.load()
        conformed = conform(rows, table.schema().as_arrow())
        # The same private writer Ray Data's IcebergDatasink calls in its write tasks (Ray 2.57):
        # PyIceberg has no public call that writes data files without committing them.
        return list(_dataframe_to_data_files(table_metadata=table.metadata, df=conformed, io=table.io))

    def commit(
        self,
        rows: pa.Table,
        ranges: Ranges,
        dlq_records: int,
        topic: str,
        *,
        lost: dict[int, int] | None = None,
        watermarks: dict[int, int] | None = None,
        details: dict[str, str] | None = None,
    ) -> int:
        """Commit `rows` as the offsets `ranges` ({partition: (start, end)}) of `topic`, with
        `dlq_records` of them in the dead letters and `lost[p]` at a range's start deleted by
        retention unread. Returns the new snapshot's id; OffsetConflict (nothing committed, the
        files written for it deleted) when a partition's committed offset is not its range's start."""
        check_rows(rows, ranges, dlq_records, lost or {})
        files = self.write_files(rows) if rows.num_rows else []
        try:
            return self.commit_files(
                files, ranges, dlq_records, topic, lost=lost, watermarks=watermarks, details=details
            )
        except (OffsetConflict, ConfigError):  # refused before any catalog swap could land
            self.discard(files)
            raise

    def discard(self, files: Iterable[DataFile]) -> None:
        """Delete data files written for a commit that never landed: no snapshot names them, so
        nobody can be reading them."""
        io = self.catalog.load_table(self.identifier).io
        for data_file in files:
            try:
                io.delete(data_file.file_path)
            except FileNotFoundError:
                pass

    @contextlib.contextmanager
    def pin(self, snapshot_id: int | None = None) -> Iterator[int | None]:
        """Hold `snapshot_id` (default: the current one, None before any commit) for a reader's
        run: an Iceberg tag `argus-reader-<ms>-<id>` on it, which expiry keeps until the reader
        removes it here or READER_PIN_TTL_S has passed (a reader that died). Yields the id."""
        name = f"{READER_TAG_PREFIX}{int(time.time() * 1000)}-{uuid.uuid4().hex[:8]}"
        pinned = _set_tag(self, name, snapshot_id)
        try:
            yield pinned
        finally:
            if pinned is not None:
                try:
                    _set_tag(self, name, None, remove=True)
                except Exception as exc:  # the run's outcome stands; expiry drops the tag later
                    log.warning(
                        "table %s: reader tag %s stays until it ages out: %s", self.identifier, name, exc
                    )

    def commit_files(
        self,
        files: list[DataFile],
        ranges: Ranges,
        dlq_records: int,
        topic: str,
        *,
        lost: dict[int, int] | None = None,
        watermarks: dict[int, int] | None = None,
        details: dict[str, str] | None = None,
        first: bool = False,
    ) -> int:
        """Commit data files from `write_files` as `commit` commits rows (the caller has proved
        every offset of `ranges` once in them or in the dead letters). `watermarks` raise the
        table's event-time watermarks; `details` (keys `argus.*`) go into the summary as they are.
        `first`: the caller planned from a table with no commit (`--from`), so its ranges may start
        anywhere, and it commits only if the table still has none."""
        lost = lost or {}
        _check_counts(sum(f.record_count for f in files), ranges, dlq_records, lost)
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            table = self.load()
            base = table.current_snapshot()
            committed = committed_at(table, base)
            check_topic(self.identifier, table, base, topic)
            _check_base(self.identifier, committed, ranges, first)
            summary = commit_summary(
                table, base, committed, ranges, topic, dlq_records, lost, watermarks, details
            )
            # In the same swap: the table's start outlives its first snapshot's expiry.
            origin_property = {ORIGIN_KEY: dumps({p: s for p, (s, _) in ranges.items()})} if first else {}
            snapshot_id = append(table, summary, files, origin_property)
            if snapshot_id is not None:
                return snapshot_id
            log.info("commit to %s lost a race (attempt %d)", self.identifier, attempt)
        raise OffsetConflict(
            f"table {self.identifier}: {COMMIT_ATTEMPTS} commits in a row lost to other writers; "
            "nothing committed"
        )


def _set_tag(images: ImageTable, name: str, snapshot_id: int | None, remove: bool = False) -> int | None:
    """Create (or remove) tag `name`, again while other writers' commits win the catalog's
    swap; the tag lands only on a table that still has the snapshot (ConfigError if not)."""
    for _ in range(COMMIT_ATTEMPTS):
        table = images.load()
        target = None
        if remove and name not in table.metadata.refs:
            return None  # dropped by expiry (aged out) or by an erasure
        if not remove:
            current = table.current_snapshot()
            target = snapshot_id if snapshot_id is not None else current and current.snapshot_id
            if target is None:
                return None
            if table.snapshot_by_id(target) is None:
                raise ConfigError(f"table {images.identifier} has no snapshot {target} (expired?)")
        try:
            with table.manage_snapshots() as manage:
                if remove:
                    manage.remove_tag(name)
                else:
                    manage.create_tag(target, name)
            return target
        except CommitFailedException:
            continue
    raise OffsetConflict(f"table {images.identifier}: tag {name} lost {COMMIT_ATTEMPTS} swaps in a row")


def check_topic(identifier: str, table: Table, base: Snapshot | None, topic: str) -> None:
    """ConfigError when the table, as of `base`, holds another topic than `topic`."""
    previous = nearest(table, base, TOPIC_KEY)
    if previous is not None and previous != topic:
        raise ConfigError(
            f"table {identifier} holds topic {previous!r}, not {topic!r}: --table names another"
        )


def _check_base(identifier: str, committed: dict[int, int], ranges: Ranges, first: bool) -> None:
    """OffsetConflict unless every partition of `ranges` is committed exactly up to its start
    (`first`: unless the table still has no commit at all)."""
    if first:
        if committed:
            raise OffsetConflict(
                f"table {identifier} got its first commit from another writer since this one "
                "planned; nothing committed, plan again"
            )
        return
    moved = {
        p: (start, committed.get(p, 0)) for p, (start, _) in ranges.items() if committed.get(p, 0) != start
    }
    if moved:
        where = ", ".join(f"p{p}: planned from {s}, table at {c}" for p, (s, c) in sorted(moved.items()))
        raise OffsetConflict(
            f"table {identifier} moved since this writer planned ({where}); nothing committed, plan again"
        )


def append(
    table: Table, summary: dict[str, str], files: list[DataFile], properties: dict[str, str] | None = None
) -> int | None:
    """One catalog swap: `files` appended as a snapshot with `summary` (and `properties` set with
    it), asserting the branch is still where `table` has it (the append's AssertRefSnapshotId).
    Retries are off on Argus tables, so a lost swap is None here, for the caller to re-check."""
    txn = table.transaction()
    if properties:
        txn.set_properties(properties)
    with txn.update_snapshot(snapshot_properties=summary).fast_append() as adding:
        for data_file in files:
            adding.append_data_file(data_file)
    try:
        txn.commit_transaction()
    except CommitFailedException as exc:
        log.debug("lost swap: %s", exc)
        return None
    return adding.snapshot_id


def conform(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` in the table's column order and types, with `event_date` derived from
    `event_time_ms` (UTC) when absent; a column the table lacks is an error, not dropped."""
    if "event_date" not in rows.column_names:
        millis = pc.cast(rows.column("event_time_ms"), pa.timestamp("ms", tz="UTC"))
        rows = rows.append_column("event_date", pc.cast(millis, pa.date32()))
    extra = sorted(set(rows.column_names) - set(schema.names))
    if extra:
        raise ValueError(f"columns {extra} are not in the table (created without them?)")
    missing = [f for f in schema if f.name not in rows.column_names]
    for column in missing:
        if not column.nullable:
            raise ValueError(f"column {column.name!r} is required")
        rows = rows.append_column(column, pa.nulls(rows.num_rows, column.type))
    return rows.select(schema.names).cast(schema)


def check_rows(rows: pa.Table, ranges: Ranges, dlq_records: int, lost: dict[int, int]) -> None:
    """What a commit can check of the caller's per-offset proof from its rows alone: each row's
    offset is inside its partition's range (past what retention deleted) and no offset is twice."""
    partitions = rows.column("kafka_partition").to_numpy()
    offsets = rows.column("kafka_offset").to_numpy()
    outside = ~np.isin(partitions, list(ranges))
    if outside.any():
        raise ValueError(
            f"rows of partitions {sorted(set(partitions[outside].tolist()))} not in the ranges {ranges}"
        )
    for p, (start, end) in ranges.items():
        mine = offsets[partitions == p]
        low = start + lost.get(p, 0)
        if mine.size and (mine.min() < low or mine.max() >= end):
            raise ValueError(f"partition {p}: rows at offsets outside [{low}, {end})")
        if np.unique(mine).size != mine.size:
            raise ValueError(f"partition {p}: an offset is in the rows more than once; nothing committed")
    _check_counts(rows.num_rows, ranges, dlq_records, lost)


def _check_counts(records: int, ranges: Ranges, dlq_records: int, lost: dict[int, int]) -> None:
    for p, (start, end) in ranges.items():
        if end < start or not 0 <= lost.get(p, 0) <= end - start:
            raise ValueError(f"partition {p}: bad range [{start}, {end}) with {lost.get(p, 0)} lost")
    room = sum(end - start - lost.get(p, 0) for p, (start, end) in ranges.items())
    if records + dlq_records > room:
        raise ValueError(
            f"{records} rows and {dlq_records} dead letters exceed the {room} offsets of {ranges}"
        )
