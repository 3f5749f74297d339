"""The storage contract (CONTRACT.md §2): where snapshots live, how they are committed and read.

    <storage>/snapshots/<snapshot_id>/event_date=YYYY-MM-DD/*.parquet + _manifest.json
    <storage>/offsets/<group>.json

A snapshot is the Parquet its manifest lists (`app.data.manifest`). Data files go straight to their
final names; the manifest, with every file's size and SHA-256, is written last as one object that
is never overwritten (`SnapshotStore.commit`): it *is* the commit, on local disk and object stores
alike, with no directory rename. A folder without a manifest is invisible and is removed by the
next writer that holds the ingest lease. The manifests together are the offset ledger, so the next
ingest starts where the committed snapshots end. Train, federate and drift meet ingest here and
nowhere else: they read manifests and, checked against them (`app.data.integrity`), the files the
manifests list. A manifest this Argus cannot read (a newer Argus's, or damaged) stops every command
that lists the manifests (`UnreadableManifest`): skipped, its offsets would fall out of the ledger.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs

from app.data.integrity import verify_file
from app.data.manifest import PIXELS, Manifest, live_manifests
from app.errors import ConfigError
from app.storage import Store

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"


class UnreadableManifest(ConfigError):
    """A committed snapshot's manifest that this Argus cannot read: written by a newer Argus (a
    rolling upgrade), or damaged. Nothing is changed: skipping it would leave its offsets out of the
    ledger, and the next ingest would start past them for good."""


class SnapshotStore:
    """The snapshots (and the ledger's mirror files) under one storage root; created once per
    command and handed to whatever reads or writes them."""

    def __init__(self, store: Store):
        self.store = store
        self.snapshots = store.child("snapshots")

    @classmethod
    def at(cls, uri: str) -> SnapshotStore:
        """The snapshots under the storage root at `uri` (a local path or s3://, hdfs://, ...)."""
        return cls(Store.at(uri))

    def folder(self, snapshot_id: str) -> Store:
        """Where the snapshot's files go, named relative to it as its manifest lists them."""
        return self.snapshots.child(snapshot_id)

    def uri(self, snapshot_id: str) -> str:
        return self.snapshots.uri(snapshot_id)

    def read_manifest(self, snapshot_id: str) -> Manifest:
        return Manifest.from_json(self.snapshots.read(f"{snapshot_id}/{MANIFEST}"))

    def commit(self, manifest: Manifest) -> bool:
        """Publish the snapshot: write its manifest only if none exists. False if one already did."""
        return self.snapshots.write_new(f"{manifest.snapshot_id}/{MANIFEST}", manifest.to_json().encode())

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

    def remove_uncommitted(self, spare: Callable[[str], bool] = lambda snapshot_id: False) -> list[str]:
        """Delete snapshot folders without a manifest, but those `spare` names (writers still at
        work); call only while holding the ingest lease, so that no other such writer is live.
        Returns the folders' names."""
        removed = []
        for info in self.snapshots.list():
            if info.type != pafs.FileType.Directory or spare(info.base_name):
                continue
            if not self.snapshots.exists(f"{info.base_name}/{MANIFEST}"):
                log.warning("removing %s: written by a writer that is gone and never committed it", info.path)
                self.snapshots.delete_dir(info.base_name)
                removed.append(info.base_name)
        return removed

    def delete(self, snapshot_id: str) -> None:
        """Remove a committed snapshot: its manifest first (the folder is then uncommitted, which
        any later writer may remove), then the folder."""
        try:
            self.snapshots.delete(f"{snapshot_id}/{MANIFEST}")
        except FileNotFoundError:
            pass
        if self.snapshots.exists(snapshot_id):
            self.snapshots.delete_dir(snapshot_id)

    def data_file_uris(self, manifests: Iterable[Manifest], *, verify: bool = True) -> list[str]:
        """Every data file the manifests list, as URIs; with `verify`, each is read and its size and
        SHA-256 checked against the manifest first (CorruptSnapshot otherwise)."""
        listed = [(self.folder(m.snapshot_id), f) for m in manifests for f in m.files]
        if verify:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda entry: verify_file(*entry), listed))
        return [folder.uri(f.path) for folder, f in listed]

    def write_offsets(self, group: str, topic: str, ends: dict[int, int]) -> None:
        """`<storage>/offsets/<group>.json`: the ledger's ends, for tools that do not read manifests."""
        body = {"topic": topic, "offsets": {str(p): e for p, e in ends.items()}}
        self.store.write(f"offsets/{group}.json", json.dumps(body, indent=2).encode())

    def select(self, topic: str, image_size: int, wanted: tuple[str, ...] | None) -> list[Manifest]:
        """The topic's live snapshots with records (or exactly `wanted`), all of uint8 pixels at
        `image_size`, or all keeping their source images (any size is then cut from those)."""
        manifests = [m for m in live_manifests(self.manifests()) if m.topic == topic and m.records > 0]
        if wanted:
            by_id = {m.snapshot_id: m for m in manifests}
            missing = [s for s in wanted if s not in by_id]
            if missing:
                raise ValueError(f"unknown snapshots {missing}; available: {sorted(by_id)}")
            manifests = [by_id[s] for s in wanted]
        if not manifests:
            raise ValueError(f"no snapshots with records under {self.snapshots.uri()}: run `ingest` first")
        old = [m.snapshot_id for m in manifests if m.pixels != PIXELS]
        if old:
            raise ValueError(
                f"snapshots {old} hold normalised float32 images from before pixel snapshots; ingest their "
                "records again into a new --storage (the offset ledger is per storage) while Kafka keeps them"
            )
        sizes = {m.image_size for m in manifests}
        if sizes != {image_size} and not all(m.source for m in manifests):
            raise ValueError(
                f"snapshots have image sizes {sorted(sizes)} but --image-size is {image_size} "
                "(ingest with --keep-source to train at other sizes)"
            )
        return manifests


def read_rows(snapshot_uris: Iterable[str], columns: list[str], row_filter=None):
    """Selected columns of the files the manifests of the snapshot folders at `snapshot_uris` list,
    each checked against its manifest as it is read, as one Arrow table. Takes URIs, not a store:
    federated clients get their snapshots' locations as plain strings in Flower's run config."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data  # noqa: F401  (registers Ray's tensor extension type for the image column)

    tables = []
    for uri in snapshot_uris:
        folder = Store.at(uri)
        for listed in Manifest.from_json(folder.read(MANIFEST)).files:
            data = verify_file(folder, listed)
            tables.append(pq.read_table(pa.BufferReader(data), columns=columns, filters=row_filter))
    return pa.concat_tables(tables)
