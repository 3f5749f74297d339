"""Keeping the table cheap over years (CONTRACT.md §2): compaction, snapshot expiry and orphan
removal, each a catalog commit that carries the Kafka offsets forward (one user's erasure, which
builds on them, is `app.data.erasure`).

    report = compact(table)                         # small files → ~128 MB files per event date
    report = expire(table, older_than_s=7 * 86400, keep={pinned_snapshot_id})
    removed = remove_orphans(table, older_than_s=3 * 86400)

Every change is one Iceberg commit asserting the branch is still where it was planned (retries
are off on Argus tables): one that loses the swap re-plans on the new base, so a compaction never
resurrects a row an erasure deleted, nor drops one a writer added. Files are deleted only once no
retained snapshot names them; what a pinned reader (a registered version's snapshot, or a running
`train` or `federate`, which tags the snapshot it reads) still uses stays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs
from pyiceberg.exceptions import CommitFailedException, CommitStateUnknownException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io import FileIO
from pyiceberg.io.pyarrow import ArrowScan
from pyiceberg.manifest import DataFile
from pyiceberg.table import FileScanTask, Table, Transaction
from pyiceberg.table.refs import MAIN_BRANCH
from pyiceberg.table.snapshots import Snapshot
from pyiceberg.table.update import AssertRefSnapshotId, RemoveSnapshotRefUpdate, RemoveSnapshotsUpdate

from app.data.metadata import COMPACTED_KEY, READER_PIN_TTL_S, READER_TAG_PREFIX, carried_summary
from app.data.table import ImageTable

log = logging.getLogger(__name__)

TARGET_FILE_BYTES = 128 * 1024 * 1024
"""What compaction writes: files of about this size per event date (engines read 100 MB–1 GB
files best; the parts `watch` commits are kilobytes)."""
SMALL_FILE_FRACTION = 0.75
"""A file below this fraction of TARGET_FILE_BYTES is small and is rewritten with its neighbours."""
SWAP_ATTEMPTS = 5
"""Catalog swaps a maintenance commit tries (re-planned each time) before it gives way to writers."""


@dataclass
class CompactionReport:
    files_before: int = 0
    files_after: int = 0
    rows: int = 0
    snapshot_id: int | None = None

    def __str__(self) -> str:
        if self.snapshot_id is None:
            return "compaction: nothing to rewrite"
        return (
            f"compaction: {self.files_before} files → {self.files_after} ({self.rows} rows), "
            f"snapshot {self.snapshot_id}"
        )


@dataclass
class ExpiryReport:
    snapshots: list[int] = field(default_factory=list)
    files_deleted: int = 0

    def __str__(self) -> str:
        return f"expiry: {len(self.snapshots)} table snapshots expired, {self.files_deleted} files deleted"


def swap(
    images: ImageTable, what: str, change: Callable[[Table, Snapshot], Transaction | None]
) -> Table | None:
    """Run `change(table, base)` on the current table and commit the transaction it returns (None:
    nothing to do), planning again on the new base whenever another commit wins the swap. Returns
    the table as committed, or None when there was nothing to do."""
    for attempt in range(1, SWAP_ATTEMPTS + 1):
        table = images.load()
        base = table.current_snapshot()
        if base is None:
            return None
        txn = change(table, base)
        if txn is None:
            return None
        try:
            return txn.commit_transaction()
        except CommitFailedException as exc:
            log.info(
                "%s of %s lost a race (attempt %d), planning again: %s", what, images.identifier, attempt, exc
            )
    raise CommitFailedException(
        f"{what}: {SWAP_ATTEMPTS} swaps in a row lost to other writers; nothing changed"
    )


def read_files(table: Table, files: Iterable[DataFile]) -> pa.Table:
    """Every row of `files`, in the table's schema (Argus writes no delete files)."""
    scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
    return scan.to_table([FileScanTask(f) for f in files])


def compact(
    images: ImageTable, target_file_bytes: int = TARGET_FILE_BYTES, min_files: int = 2
) -> CompactionReport:
    """Rewrite each event date's small files into files of about `target_file_bytes`, rows in Kafka
    order, as one commit that removes exactly those files and adds their rows once."""
    report = CompactionReport()
    written: list[DataFile] = []

    def change(table: Table, base: Snapshot) -> Transaction | None:
        _delete_files(table.io, (f.file_path for f in written))  # a lost swap's rewrite: never committed
        written.clear()
        by_date: dict[object, list[DataFile]] = {}
        for task in table.scan(snapshot_id=base.snapshot_id).plan_files():
            if task.file.file_size_in_bytes < target_file_bytes * SMALL_FILE_FRACTION:
                by_date.setdefault(task.file.partition[0], []).append(task.file)
        bins = [
            b for files in by_date.values() for b in _bins(files, target_file_bytes) if len(b) >= min_files
        ]
        if not bins:
            return None
        old = [f for b in bins for f in b]
        for files in bins:
            rows = read_files(table, files).sort_by(
                [("kafka_partition", "ascending"), ("kafka_offset", "ascending")]
            )
            written.extend(images.write_files(rows))
        report.files_before, report.files_after = len(old), len(written)
        report.rows = sum(f.record_count for f in old)
        if sum(f.record_count for f in written) != report.rows:  # never lose or repeat a row
            raise RuntimeError(
                f"compaction read {report.rows} rows but wrote {sum(f.record_count for f in written)}"
            )
        txn = table.transaction()
        summary = {**carried_summary(table, base), COMPACTED_KEY: str(len(old))}
        with txn.update_snapshot(snapshot_properties=summary).overwrite() as rewrite:
            for data_file in old:
                rewrite.delete_data_file(data_file)
            for data_file in written:
                rewrite.append_data_file(data_file)
        return txn

    try:
        committed = swap(images, "compaction", change)
    except CommitStateUnknownException:
        raise  # the catalog may hold the commit: its files must stay
    except BaseException:
        _delete_files(images.load().io, (f.file_path for f in written))
        raise
    if committed is not None:
        report.snapshot_id = committed.current_snapshot().snapshot_id
        log.info("%s", report)
    return report


def _bins(files: list[DataFile], target_bytes: int) -> list[list[DataFile]]:
    """`files` grouped greedily, smallest first, into bins of at most about `target_bytes`."""
    bins: list[list[DataFile]] = [[]]
    size = 0
    for data_file in sorted(files, key=lambda f: f.file_size_in_bytes):
        if bins[-1] and size + data_file.file_size_in_bytes > target_bytes:
            bins.append([])
            size = 0
        bins[-1].append(data_file)
        size += data_file.file_size_in_bytes
    return bins


def _referenced(table: Table, snapshots: Iterable[Snapshot]) -> set[str]:
    """Every file the `snapshots` need: their manifest lists, manifests and live data files."""
    paths: set[str] = set()
    for snapshot in snapshots:
        # Manifest lists and manifests are immutable and shared along the history: each is read once.
        if snapshot.manifest_list in paths:
            continue
        paths.add(snapshot.manifest_list)
        for manifest in snapshot.manifests(table.io):
            if manifest.manifest_path in paths:
                continue
            paths.add(manifest.manifest_path)
            paths.update(
                e.data_file.file_path for e in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
            )
    return paths


def _delete_files(io: FileIO, paths: Iterable[str]) -> int:
    deleted = 0
    for path in paths:
        try:
            io.delete(path)
            deleted += 1
        except FileNotFoundError:
            pass  # deleted by an earlier pass that died before it finished
    return deleted


def expire_ids(
    images: ImageTable, choose: Callable[[Table], set[int]], overrule_readers: bool = False
) -> tuple[list[int], int]:
    """Expire the snapshots `choose(table)` names (never the current one), in one commit asserting
    the branch did not move, then delete the files only they needed. Returns (ids, files deleted).
    A tag's snapshot stays, but reader tags (`ImageTable.pin`) older than READER_PIN_TTL_S are
    dropped (their run died), and with `overrule_readers` those on a chosen snapshot too."""
    chosen: dict[str, object] = {}

    def change(table: Table, base: Snapshot) -> Transaction | None:
        ids = choose(table)
        readers = {n: ref.snapshot_id for n, ref in table.metadata.refs.items() if _reader_tag_age_s(n) >= 0}
        dropped = {
            name
            for name, snapshot_id in readers.items()
            if _reader_tag_age_s(name) > READER_PIN_TTL_S or (overrule_readers and snapshot_id in ids)
        }
        # Never another ref's head (another engine may have tagged one): its ref would dangle.
        held = {ref.snapshot_id for name, ref in table.metadata.refs.items() if name not in dropped}
        ids = ids - held - {base.snapshot_id}
        if not ids and not dropped:
            return None
        kept = [s for s in table.snapshots() if s.snapshot_id not in ids]
        expired = [s for s in table.snapshots() if s.snapshot_id in ids]
        chosen["ids"] = sorted(ids)
        chosen["files"] = _referenced(table, expired) - _referenced(table, kept)
        txn = table.transaction()
        # PyIceberg's ExpireSnapshots asserts nothing; this removal must not race a compaction that
        # makes a file of an expired snapshot live again.
        updates = [RemoveSnapshotRefUpdate(ref_name=name) for name in sorted(dropped)]
        if ids:
            updates.append(RemoveSnapshotsUpdate(snapshot_ids=sorted(ids)))
        txn._apply(tuple(updates), (AssertRefSnapshotId(snapshot_id=base.snapshot_id, ref=MAIN_BRANCH),))
        return txn

    committed = swap(images, "expiry", change)
    if committed is None:
        return [], 0
    return chosen["ids"], _delete_files(committed.io, chosen["files"])


def _reader_tag_age_s(name: str) -> float:
    """How long ago `ImageTable.pin` set tag `name`; -1 for a ref that is not a reader tag."""
    stamp = name.removeprefix(READER_TAG_PREFIX).split("-")[0]
    if not name.startswith(READER_TAG_PREFIX) or not stamp.isdigit():
        return -1
    return time.time() - int(stamp) / 1000


def expire(
    images: ImageTable, older_than_s: float, keep: Iterable[int] = (), max_snapshots: int | None = None
) -> ExpiryReport:
    """Expire table snapshots older than `older_than_s`, or beyond the newest `max_snapshots`, but
    those in `keep` (the ones registered versions name), those a running reader pinned
    (`ImageTable.pin`) and the current one; delete the files no kept snapshot needs.

    The cap is what keeps commits cheap under a busy `watch` (a commit a second): every commit
    rewrites the table's metadata, which lists every snapshot kept (~0.7 ms a snapshot here)."""
    keep = set(keep)
    cutoff_ms = (time.time() - older_than_s) * 1000

    def choose(table: Table) -> set[int]:
        newest_first = sorted(table.snapshots(), key=lambda s: s.timestamp_ms, reverse=True)
        beyond_cap = newest_first[max_snapshots:] if max_snapshots else []
        old = {s.snapshot_id for s in newest_first if s.timestamp_ms < cutoff_ms}
        return (old | {s.snapshot_id for s in beyond_cap}) - keep

    ids, deleted = expire_ids(images, choose)
    report = ExpiryReport(ids, deleted)
    if ids:
        log.info("%s", report)
    return report


def remove_orphans(images: ImageTable, older_than_s: float) -> list[str]:
    """Delete files under the table's location that neither a snapshot nor the metadata names and
    that are older than `older_than_s` (younger ones may be a writer's, not yet committed)."""

    table = images.load()
    needed = _referenced(table, table.snapshots())
    needed.add(table.metadata_location)
    needed.update(entry.metadata_file for entry in table.metadata.metadata_log)
    filesystem, root = pafs.FileSystem.from_uri(table.location())
    scheme = table.location()[: -len(root)] if table.location().endswith(root) else ""
    cutoff = time.time() - older_than_s
    removed = []
    for info in filesystem.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File or info.mtime is None or info.mtime.timestamp() >= cutoff:
            continue
        uri = scheme + info.path
        if uri not in needed and info.path not in needed:
            filesystem.delete_file(info.path)
            removed.append(uri)
    if removed:
        log.info("removed %d orphan files under %s", len(removed), table.location())
    return removed
