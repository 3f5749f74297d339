"""The storage contract (app.data.manifest, app.data.snapshot, app.data.integrity) on local disk:
manifests, the proof that every offset landed once, the ledger, and snapshot selection. No broker,
no Ray."""

from __future__ import annotations

import dataclasses
import json

import pytest

from app import storage
from app.data.integrity import CorruptSnapshot
from app.data.manifest import (
    DataFile,
    Manifest,
    WriteSpec,
    WriteStats,
    build_manifest,
    discover_classes,
    ledger_offsets,
)
from app.data.snapshot import MANIFEST, SnapshotStore, UnreadableManifest, read_rows
from app.errors import ConfigError

SPEC = WriteSpec(topic="t", dlq_topic="t.dlq", image_size=32, classes=None, allowed_lateness_s=60.0)


def task_stats(
    partition: int,
    offsets: range,
    dead: set[int] = frozenset(),
    labels=("normal",),
    event_times=(1_000, 2_000),
    files=(),
) -> WriteStats:
    stats = WriteStats()
    for offset in offsets:
        stats.partition(partition).add(offset, dead_letter=offset in dead)
    stats.labels.update(labels)
    stats.add_event_times(*event_times)
    stats.files.extend(files)
    return stats


def commit(
    snapshots: SnapshotStore,
    snapshot_id: str,
    ranges: dict,
    stats: WriteStats,
    watermarks=None,
    keep_source=False,
) -> Manifest:
    spec = dataclasses.replace(SPEC, keep_source=keep_source)
    manifest = build_manifest(spec, snapshot_id, ranges, watermarks or {}, stats)
    assert snapshots.commit(manifest)
    return manifest


def test_write_stats_merge_as_if_one_task_saw_everything():
    merged = WriteStats()
    merged.merge(
        task_stats(
            0, range(0, 5), dead={3}, labels=("a", "b"), event_times=(10, 20), files=[DataFile("x", 1, "aa")]
        )
    )
    merged.merge(
        task_stats(0, range(5, 9), labels=("a",), event_times=(5, 15), files=[DataFile("y", 2, "bb")])
    )
    merged.merge(task_stats(1, range(2, 4), event_times=(30, 40)))
    assert merged.partitions[0].records == 8 and merged.partitions[0].dlq == 1
    assert merged.partitions[0].covers_once(0, 9) and merged.partitions[1].covers_once(2, 4)
    assert merged.labels == {"a": 2, "b": 1, "normal": 1} and [f.path for f in merged.files] == ["x", "y"]
    assert (merged.event_min, merged.event_max) == (5, 40)


def test_manifest_json_is_the_contract_and_round_trips(snapshots, root):
    manifest = commit(
        snapshots,
        "snap-1",
        {0: (0, 4), 2: (10, 12)},
        _merged(task_stats(0, range(0, 4), dead={1}), task_stats(2, range(10, 12))),
        watermarks={0: 5_000},
    )
    stored = json.loads((root / "snapshots" / "snap-1" / MANIFEST).read_text())
    assert stored["offsets"] == {
        "0": {"start": 0, "end": 4, "records": 3, "dlq": 1, "watermark": 5_000, "skipped": 0, "lost": 0},
        "2": {"start": 10, "end": 12, "records": 2, "dlq": 0, "watermark": 2_000, "skipped": 0, "lost": 0},
    }
    assert stored["format"] == "argus.snapshot.v1" and stored["records"] == 5 and stored["dlq"] == 1
    assert stored["normalization"] == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    assert Manifest.from_json(json.dumps(stored)) == manifest
    assert manifest.lineage() == {
        "snapshot_id": "snap-1",
        "offsets": {"0": {"start": 0, "end": 4}, "2": {"start": 10, "end": 12}},
    }


@pytest.mark.parametrize(
    "seen, why",
    [
        (range(0, 3), "a missing offset"),
        (range(1, 5), "a missing first offset"),
        (range(0, 5), "an offset past the end"),
    ],
)
def test_build_manifest_refuses_anything_but_every_offset_once(seen, why):
    with pytest.raises(RuntimeError, match="expected offsets \\[0, 4\\) once each"):
        build_manifest(SPEC, "snap-x", {0: (0, 4)}, {}, task_stats(0, seen))


def test_duplicated_offset_is_refused_even_when_the_count_matches():
    stats = task_stats(0, [0, 1, 1, 3])  # 2 never landed, 1 landed twice
    with pytest.raises(RuntimeError, match="once each"):
        build_manifest(SPEC, "snap-x", {0: (0, 4)}, {}, stats)


def test_the_ledger_starts_where_the_newest_snapshots_end(snapshots, root):
    commit(
        snapshots,
        "snap-1",
        {0: (0, 4), 1: (0, 2)},
        _merged(task_stats(0, range(0, 4)), task_stats(1, range(0, 2))),
    )
    commit(snapshots, "snap-2", {0: (4, 9)}, task_stats(0, range(4, 9), event_times=(3_000, 9_000)))
    (root / "snapshots" / "snap-3-no-manifest").mkdir()  # never committed: invisible
    manifests = snapshots.manifests()
    assert [m.snapshot_id for m in manifests] == ["snap-1", "snap-2"]
    starts, watermarks = ledger_offsets(manifests, "t")
    assert starts == {0: 9, 1: 2} and watermarks == {0: 9_000, 1: 2_000}
    assert ledger_offsets(manifests, "another-topic") == ({}, {})


def test_select_snapshots_by_id_and_classes_from_their_labels(snapshots):
    commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2), labels=("b", "a")))
    commit(snapshots, "snap-2", {0: (2, 3)}, task_stats(0, range(2, 3), labels=("c",)))
    assert [m.snapshot_id for m in snapshots.select("t", 32, None)] == ["snap-1", "snap-2"]
    chosen = snapshots.select("t", 32, ("snap-2",))
    assert [m.snapshot_id for m in chosen] == ["snap-2"]
    assert discover_classes(snapshots.select("t", 32, None), None) == ["a", "b", "c"]
    assert discover_classes(chosen, ("x", "y")) == ["x", "y"]
    with pytest.raises(ValueError, match="unknown snapshots \\['snap-9'\\]"):
        snapshots.select("t", 32, ("snap-9",))


def test_select_snapshots_refuses_another_image_size_and_an_empty_store(snapshots, tmp_path):
    commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2)))
    with pytest.raises(ValueError, match="image sizes \\[32\\] but --image-size is 64"):
        snapshots.select("t", 64, None)
    with pytest.raises(ValueError, match="run `ingest` first"):
        SnapshotStore.at(str(tmp_path / "empty")).select("t", 32, None)


def test_snapshots_that_keep_sources_serve_any_image_size(snapshots):
    manifest = commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2)), keep_source=True)
    assert manifest.source and manifest.pixels == "uint8"
    assert [m.snapshot_id for m in snapshots.select("t", 64, None)] == ["snap-1"]


def test_float_snapshots_from_before_pixel_snapshots_say_how_to_reingest(snapshots):
    manifest = commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2)))
    stored = json.loads(manifest.to_json())
    del stored["pixels"], stored["source"]  # what a manifest written before them holds
    old = Manifest.from_json(json.dumps(stored))
    assert old.pixels == "float32" and not old.source
    snapshots.commit(dataclasses.replace(old, snapshot_id="snap-0"))
    with pytest.raises(ValueError, match=r"\['snap-0'\] hold normalised float32.*new --storage"):
        snapshots.select("t", 32, None)


def _merged(*parts: WriteStats) -> WriteStats:
    merged = WriteStats()
    for part in parts:
        merged.merge(part)
    return merged


def test_a_manifest_is_written_once_and_never_overwritten(snapshots, root):
    first = commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2)))
    other = build_manifest(SPEC, "snap-1", {0: (0, 3)}, {}, task_stats(0, range(0, 3)))
    assert not snapshots.commit(other)
    assert snapshots.manifests() == [first]
    leftovers = [p.name for p in (root / "snapshots" / "snap-1").iterdir()]
    assert leftovers == [MANIFEST]  # the create-if-absent's temporary file is gone too


def test_folders_without_a_manifest_are_invisible_until_removed(snapshots, root):
    commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2)))
    orphan = root / "snapshots" / "snap-2" / "event_date=2026-01-01"
    orphan.mkdir(parents=True)
    (orphan / "part-0.parquet").write_bytes(b"written by an ingest that died")
    assert [m.snapshot_id for m in snapshots.manifests()] == ["snap-1"]
    assert snapshots.remove_uncommitted() == ["snap-2"]
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == ["snap-1"]


@pytest.mark.parametrize("damage", ["newer_field", "newer_format", "torn"])
def test_a_manifest_this_argus_cannot_read_stops_everything_and_nothing_is_deleted(snapshots, root, damage):
    """#25's reproduction: three snapshots [0,2), [2,4), [4,6) and the middle one unreadable. Were it
    skipped (or quarantined, as before), the ledger would resume at 6 and offsets 2-3 never come back."""
    for i in range(3):
        commit(snapshots, f"snap-{i + 1}", {0: (2 * i, 2 * i + 2)}, task_stats(0, range(2 * i, 2 * i + 2)))
    path = root / "snapshots" / "snap-2" / MANIFEST
    data = json.loads(path.read_text())
    if damage == "newer_field":  # one extra field in its partition entry, as a newer Argus may write
        data["offsets"]["0"]["checksum_v2"] = "abc"
        path.write_text(json.dumps(data))
    elif damage == "newer_format":
        data["format"] = "argus-snapshot/99"
        path.write_text(json.dumps(data))
    else:
        path.write_text(path.read_text()[:40])
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    with pytest.raises(UnreadableManifest, match="snapshot snap-2: its manifest is not one this Argus reads"):
        snapshots.manifests()
    assert isinstance(UnreadableManifest("x"), ConfigError)  # the CLI's one line and exit 2
    assert snapshots.remove_uncommitted() == []  # its folder is still a committed snapshot's
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_readers_check_every_listed_file_against_its_manifest(snapshots, root):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = pa.BufferOutputStream()
    pq.write_table(pa.table({"key": ["u1", "u2"], "label": ["a", "b"]}), buffer)
    data = buffer.getvalue().to_pybytes()
    folder = root / "snapshots" / "snap-1" / "event_date=2026-01-01"
    folder.mkdir(parents=True)
    (folder / "part-0.parquet").write_bytes(data)
    stats = task_stats(0, range(0, 2))
    stats.files.append(DataFile("event_date=2026-01-01/part-0.parquet", len(data), storage.sha256(data)))
    manifest = commit(snapshots, "snap-1", {0: (0, 2)}, stats)
    uri = snapshots.uri("snap-1")
    assert read_rows([uri], ["key"]).column("key").to_pylist() == ["u1", "u2"]
    assert snapshots.data_file_uris([manifest]) == [f"{uri}/event_date=2026-01-01/part-0.parquet"]

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    (folder / "part-0.parquet").write_bytes(bytes(flipped))
    with pytest.raises(CorruptSnapshot, match="SHA-256 differs"):
        read_rows([uri], ["key"])
    (folder / "part-0.parquet").write_bytes(data[:-3])
    with pytest.raises(CorruptSnapshot, match=f"{len(data) - 3} bytes, its manifest says {len(data)}"):
        snapshots.data_file_uris([manifest])
    (folder / "part-0.parquet").unlink()
    with pytest.raises(CorruptSnapshot, match="missing"):
        snapshots.data_file_uris([manifest])


def test_manifests_from_before_file_digests_still_read(snapshots):
    manifest = commit(snapshots, "snap-1", {0: (0, 2)}, task_stats(0, range(0, 2)))
    stored = json.loads(manifest.to_json())
    stored["files"] = ["event_date=2026-01-01/part-0.parquet"]
    assert Manifest.from_json(json.dumps(stored)).files == [
        DataFile("event_date=2026-01-01/part-0.parquet", None, None)
    ]
    with pytest.raises(ValueError, match="format"):
        Manifest.from_json(json.dumps({**stored, "format": "something.else"}))


def test_skipped_offsets_count_as_covered_and_lost_ones_keep_the_ledger_contiguous(snapshots):
    stats = task_stats(0, [10, 11, 14])
    stats.partition(0).skip(12, 14)  # a transaction marker and a compacted record
    stats.partition(0).skip(15, 16)  # the commit marker at the end
    manifest = build_manifest(SPEC, "snap-1", {0: (10, 16)}, {}, stats, lost={0: 10})
    entry = manifest.offsets[0]
    assert (entry.start, entry.end, entry.records, entry.skipped, entry.lost) == (0, 16, 3, 3, 10)
    assert snapshots.commit(manifest)
    assert ledger_offsets(snapshots.manifests(), "t")[0] == {0: 16}
    undeclared = task_stats(0, [10, 11, 14, 15])  # 12 and 13 neither seen nor declared skipped
    with pytest.raises(RuntimeError, match="once each"):
        build_manifest(SPEC, "snap-2", {0: (10, 16)}, {}, undeclared)


class _WritesAFile:
    """Unpickling this creates `path`: proof that reading ran code from the file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _listed_file(snapshots, root, snapshot_id: str, table) -> tuple[str, Manifest]:
    """`table` as a snapshot's only file, with a manifest whose digest matches it (as someone who
    can write the store could make one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    data = buffer.getvalue().to_pybytes()
    folder = root / "snapshots" / snapshot_id / "event_date=2026-01-01"
    folder.mkdir(parents=True)
    (folder / "part-0.parquet").write_bytes(data)
    stats = task_stats(0, range(0, table.num_rows))
    stats.files.append(DataFile("event_date=2026-01-01/part-0.parquet", len(data), storage.sha256(data)))
    return snapshots.uri(snapshot_id), commit(snapshots, snapshot_id, {0: (0, table.num_rows)}, stats)


def test_parquet_whose_values_would_unpickle_is_refused_before_it_is_read(snapshots, root, tmp_path):
    import pyarrow as pa
    from ray.data._internal.object_extensions.arrow import ArrowPythonObjectArray

    marker = tmp_path / "ran"
    payload = ArrowPythonObjectArray.from_objects([_WritesAFile(marker), _WritesAFile(marker)])
    table = pa.table({"label": ["a", "b"], "event_time": [1, 2], "image": payload})
    uri, manifest = _listed_file(snapshots, root, "snap-pickle", table)
    with pytest.raises(CorruptSnapshot, match="extension type 'ray.data.arrow_pickled_object'"):
        snapshots.data_file_uris([manifest])
    with pytest.raises(CorruptSnapshot, match="arrow_pickled_object"):
        read_rows([uri], ["image"])
    assert not marker.exists()


def test_parquet_schemas_readers_cannot_trust_are_refused(snapshots, root):
    import numpy as np
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    pixels = ArrowTensorArray.from_numpy(np.zeros((2, 3, 4, 4), dtype=np.uint8))
    good = pa.table({"label": ["a", "b"], "event_time": [1, 2], "image": pixels})
    uri, manifest = _listed_file(snapshots, root, "snap-good", good)
    assert read_rows([uri], ["label"]).column("label").to_pylist() == ["a", "b"]

    unknown = pa.field("image", pa.large_binary(), metadata={"ARROW:extension:name": "somelib.pickled"})
    cases = {
        "snap-unregistered": (
            pa.table({"image": pa.array([b"x", b"y"], pa.large_binary())}).cast(pa.schema([unknown])),
            "somelib.pickled",
        ),
        "snap-label": (
            pa.table({"label": [1, 2], "event_time": [1, 2], "image": pixels}),
            "'label' is int64",
        ),
        "snap-pixels": (
            pa.table({"label": ["a", "b"], "image": pa.array([[1], [2]])}),
            "'image' is not a tensor",
        ),
    }
    for snapshot_id, (table, why) in cases.items():
        _, manifest = _listed_file(snapshots, root, snapshot_id, table)
        with pytest.raises(CorruptSnapshot, match=why):
            snapshots.data_file_uris([manifest])


def test_a_store_travels_to_workers_as_its_location_and_resolves_its_filesystem_there(root):
    import pickle

    from app.storage import Store

    folder = Store.at(str(root)).child("snapshots", "snap-1")
    copy = pickle.loads(pickle.dumps(folder))
    assert copy == folder and copy.uri("a") == str(root / "snapshots" / "snap-1" / "a")
    assert copy.fs is not folder.fs  # resolved anew, from the receiving process's environment
    assert copy.write_new("a", b"first") and not folder.write_new("a", b"second")
    assert folder.read("a") == b"first"
