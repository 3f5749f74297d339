"""`argus migrate`: the snapshot folders of the old layout (`<storage>/snapshots/<id>/`, each
committed by its `_manifest.json`) imported into the Iceberg table (CONTRACT.md §2), one table
commit per live snapshot, in offset order. Each commit carries the snapshot's Kafka ranges, dead
letters and lost spans as an ingest's commit does, so the table's history continues the old ledger
exactly and the next ingest starts where the folders ended.

Nothing is trusted or dropped on the way: a manifest that does not parse, a snapshot of normalised
float32 images, a data file whose digest does not match, or snapshots that do not continue the
offsets the table holds stop the migration with what is wrong (exit 2), and each commit is checked
offset by offset as any other. The folders stay where they are: remove them once the table is
checked. Run again, it imports only what the table does not hold yet (after a crash, the rest).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from app.data.legacy import PIXELS, CorruptSnapshot, LegacySnapshots, Manifest, live_manifests
from app.data.selection import hwc_bytes
from app.data.table import ImageTable
from app.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Migration:
    """What one `migrate` run did."""

    table: str
    imported: list[str] = field(default_factory=list)
    """Snapshot ids committed to the table by this run, in commit order."""
    held: list[str] = field(default_factory=list)
    """Snapshot ids whose offsets the table already held (an earlier run's)."""
    rows: int = 0
    dead_letters: int = 0
    committed: dict[int, int] = field(default_factory=dict)
    """The table's {partition: next offset} afterwards: where the next ingest starts."""
    other_topics: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"migrated {len(self.imported)} snapshot(s) into {self.table}: {self.rows} rows, "
            f"{self.dead_letters} dead letters; {len(self.held)} were in the table already",
            "the table's committed offsets: "
            + (", ".join(f"p{p}: {end}" for p, end in sorted(self.committed.items())) or "none"),
            "the snapshot folders are left as they were: remove <storage>/snapshots once the table is "
            "checked",
        ]
        if self.other_topics:
            lines.append(f"other topics' snapshots left out (migrate each with --topic): {self.other_topics}")
        return "\n".join(lines)


def migrate(
    snapshots: LegacySnapshots, storage: str, catalog: str | None, table: str, topic: str
) -> Migration:
    """Import the live snapshots of `topic` under `snapshots` into `table` (catalog `catalog`,
    warehouse under `storage`), created with `source`/`features` columns when the snapshots have them."""
    try:
        return _migrate(snapshots, storage, catalog, table, topic)
    except CorruptSnapshot as exc:  # refused, as a bad input is: nothing of that snapshot committed
        raise ConfigError(f"{exc}; nothing of it imported, a rerun continues where the table ends") from exc


def _migrate(
    snapshots: LegacySnapshots, storage: str, catalog: str | None, table: str, topic: str
) -> Migration:
    manifests = snapshots.manifests()
    live = [m for m in live_manifests(manifests) if m.topic == topic and m.offsets]
    normalised = [m.snapshot_id for m in live if m.pixels != PIXELS]
    if normalised:
        raise ConfigError(
            f"snapshots {normalised} hold normalised float32 images from before pixel snapshots: "
            "they cannot become table rows; ingest their records again while Kafka keeps them"
        )
    image_table = ImageTable.at(
        storage,
        catalog,
        table,
        source=any(m.source for m in live),
        features=any(m.features for m in live),
    )
    report = Migration(table=table, other_topics=sorted({m.topic for m in manifests} - {topic}))
    position = image_table.committed()
    pending = []
    for manifest in live:
        if all(r.end <= position.get(p, 0) for p, r in manifest.offsets.items()):
            report.held.append(manifest.snapshot_id)
        else:
            pending.append(manifest)
    while pending:
        ready = next((m for m in pending if _continues(m, position)), None)
        if ready is None:
            raise ConfigError(_gap(pending, position, report))
        pending.remove(ready)
        rows = table_rows(snapshots, ready)
        ranges = {p: (r.start, r.end) for p, r in ready.offsets.items()}
        lost = {p: r.lost for p, r in ready.offsets.items() if r.lost}
        image_table.commit(rows, ranges, ready.dlq, topic, lost=lost)
        position.update({p: end for p, (_, end) in ranges.items()})
        report.imported.append(ready.snapshot_id)
        report.rows += rows.num_rows
        report.dead_letters += ready.dlq
        log.info("migrate: %s → %s (%d rows)", ready.snapshot_id, table, rows.num_rows)
    report.committed = image_table.committed()
    return report


def _continues(manifest: Manifest, position: dict[int, int]) -> bool:
    return all(r.start == position.get(p, 0) for p, r in manifest.offsets.items())


def _gap(pending: list[Manifest], position: dict[int, int], report: Migration) -> str:
    """Why no remaining snapshot continues the table: the lowest pending start of each partition
    against where the table is, e.g. a snapshot lost from the old layout."""
    starts: dict[int, int] = {}
    for manifest in pending:
        for p, r in manifest.offsets.items():
            starts[p] = min(starts.get(p, r.start), r.start)
    where = ", ".join(
        f"p{p}: table at {position.get(p, 0)}, next snapshot from {start}"
        for p, start in sorted(starts.items())
        if start != position.get(p, 0)
    )
    return (
        f"snapshots {[m.snapshot_id for m in pending]} do not continue the table's offsets ({where}): "
        f"offsets are missing from the old layout or the table holds others; {len(report.imported)} "
        "snapshot(s) were imported before this, nothing more"
    )


def table_rows(snapshots: LegacySnapshots, manifest: Manifest) -> pa.Table:
    """A snapshot's rows in the table's columns, read through its manifest (every file's digest
    checked): pixels from channel-first [3, S, S] to row-major S x S x 3 bytes."""
    if not manifest.files:  # every offset a dead letter or skipped: the sink wrote no file
        return pa.table(
            {"kafka_partition": pa.array([], pa.int32()), "kafka_offset": pa.array([], pa.int64())}
        )
    columns = ["partition", "offset", "key", "label", "event_time", "device_id", "image"]
    columns += [name for name, kept in (("source", manifest.source), ("features", manifest.features)) if kept]
    raw = snapshots.read_rows(manifest, columns)
    images = raw.column("image").combine_chunks().to_numpy()
    count, _, height, width = images.shape if images.size else (0, 3, 0, 0)
    rows = {
        "kafka_partition": raw.column("partition").cast(pa.int32()),
        "kafka_offset": raw.column("offset").cast(pa.int64()),
        "user_id": _text(raw.column("key")),
        "label": raw.column("label").cast(pa.string()),
        "event_time_ms": raw.column("event_time").cast(pa.int64()),
        "device_id": _text(raw.column("device_id")),
        "pixels": pa.array(hwc_bytes(images), pa.binary()),
        "height": pa.array(np.full(count, height, np.int32)),
        "width": pa.array(np.full(count, width, np.int32)),
    }
    if manifest.source:
        rows["source"] = raw.column("source").cast(pa.binary())
    if manifest.features:
        features = raw.column("features").combine_chunks().to_numpy().astype(np.float32)
        rows["features"] = pa.array(list(features), pa.list_(pa.float32()))
    return pa.table(rows)


def _text(column: pa.ChunkedArray) -> pa.Array:
    """A string column with "" for a missing value (a record without a key or device id)."""
    values = column.to_pylist()
    return pa.array(["" if v is None else v.decode() if isinstance(v, bytes) else str(v) for v in values])
