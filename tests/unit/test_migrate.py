"""`argus migrate`: snapshot folders of the old layout, written as ingest writes them (Parquet with
a tensor `image` column, a manifest with every file's digest), imported into a real Iceberg table
on a SQLite catalog, then read back through PyIceberg alone (no Argus code)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app import storage
from app.__main__ import main
from app.data.legacy import MANIFEST, DataFile, LegacySnapshots, Manifest, PartitionRange
from app.data.migrate import migrate
from app.errors import ConfigError

SIZE = 4
TOPIC = "t"
TABLE = "argus.behavior_images"


def image(partition: int, offset: int) -> np.ndarray:
    """A record's pixels, channel-first as snapshots hold them, unique to its coordinates."""
    return (
        np.arange(3 * SIZE * SIZE, dtype=np.int64).reshape(3, SIZE, SIZE) * 7 + partition * 50 + offset
    ) % 256


def write_snapshot(
    snapshots: LegacySnapshots,
    snapshot_id: str,
    ranges: dict[int, tuple[int, int]],
    *,
    dead: frozenset[tuple[int, int]] = frozenset(),
    lost: dict[int, int] | None = None,
    supersedes: tuple[str, ...] = (),
):
    """A committed snapshot of `ranges` ({partition: (start, end)} read after `lost` offsets that
    retention deleted), the coordinates in `dead` sent to the dead letters."""
    from ray.data.extensions import ArrowTensorArray

    lost = lost or {}
    rows = [(p, o) for p, (start, end) in ranges.items() for o in range(start, end) if (p, o) not in dead]
    table = pa.table(
        {
            "partition": pa.array([p for p, _ in rows], pa.int64()),
            "offset": pa.array([o for _, o in rows], pa.int64()),
            "key": [f"user-{o % 3}" if o % 4 else None for _, o in rows],
            "label": ["normal" if o % 2 else "phishing_page" for _, o in rows],
            "event_time": pa.array([1_796_000_000_000 + o for _, o in rows], pa.int64()),
            "device_id": [f"dev-{p}" for p, _ in rows],
            "image": ArrowTensorArray.from_numpy(
                np.stack([image(p, o) for p, o in rows]).astype(np.uint8)
                if rows
                else np.zeros((0, 3, SIZE, SIZE), np.uint8)
            ),
        }
    )
    files = []
    if rows:  # as the old sink did: no file where every offset was a dead letter
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer)
        data = buffer.getvalue().to_pybytes()
        relative = "event_date=2026-12-01/part-0000.parquet"
        snapshots.folder(snapshot_id).write(relative, data)
        files.append(DataFile(relative, len(data), storage.sha256(data)))
    offsets = {}
    for p, (start, end) in ranges.items():
        dlq = sum(1 for q, o in dead if q == p and start <= o < end)
        gone = lost.get(p, 0)
        offsets[p] = PartitionRange(start - gone, end, end - start - dlq, dlq, None, 0, gone)
    manifest = Manifest(
        snapshot_id=snapshot_id,
        topic=TOPIC,
        created_at="2026-12-01T00:00:00+00:00",
        offsets=offsets,
        records=len(rows),
        dlq=len(dead),
        dlq_topic=f"{TOPIC}.dlq",
        dlq_errors={"bad_image": len(dead)} if dead else {},
        classes=["normal", "phishing_page"],
        label_counts={},
        image_size=SIZE,
        normalization={},
        features=None,
        features_weights=None,
        event_time={},
        value_bytes=0,
        files=files,
        pixels="uint8",
        supersedes=list(supersedes),
    )
    snapshots.folder(snapshot_id).write(MANIFEST, manifest.to_json().encode())
    return manifest


def read_table(root):
    """The table as any PyIceberg user reads it: the catalog, the table, a scan; no Argus code."""
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog(
        "argus", uri=f"sqlite:///{root / 'catalog.db'}", warehouse=f"file://{root}/warehouse"
    )
    return catalog.load_table(TABLE)


def test_migrate_imports_each_live_offset_once_and_continues_the_ledger(snapshots, root):
    # Two parts a compaction replaced, the compacted snapshot, and a later part (with dead letters
    # and 2 offsets retention deleted on partition 1) written before the compaction: live are the
    # compacted one and the later part, whose id sorts first, so commit order must follow offsets.
    write_snapshot(snapshots, "snap-1", {0: (0, 3)})
    write_snapshot(snapshots, "snap-2", {0: (3, 5)})
    write_snapshot(snapshots, "snap-4", {0: (5, 8), 1: (2, 6)}, dead=frozenset({(0, 6)}), lost={1: 2})
    write_snapshot(snapshots, "snap-5", {0: (0, 5)}, supersedes=("snap-1", "snap-2"))

    report = migrate(snapshots, str(root), None, TABLE, "t")
    assert report.imported == ["snap-5", "snap-4"] and report.held == []
    assert report.rows == 5 + 2 + 4 and report.dead_letters == 1
    assert report.committed == {0: 8, 1: 6}

    table = read_table(root)
    rows = table.scan().to_arrow()
    coordinates = list(zip(rows["kafka_partition"].to_pylist(), rows["kafka_offset"].to_pylist()))
    expected = [(0, o) for o in range(8) if o != 6] + [(1, o) for o in range(2, 6)]
    assert sorted(coordinates) == expected  # every live offset once, the dead letter not at all
    for row in rows.to_pylist():
        p, o = row["kafka_partition"], row["kafka_offset"]
        assert (row["height"], row["width"]) == (SIZE, SIZE)
        assert row["pixels"] == image(p, o).transpose(1, 2, 0).astype(np.uint8).tobytes()  # row-major HxWx3
        assert row["user_id"] == (f"user-{o % 3}" if o % 4 else "")
        assert row["event_time_ms"] == 1_796_000_000_000 + o and row["device_id"] == f"dev-{p}"
    summaries = [s.summary.additional_properties for s in table.snapshots()]
    assert [json.loads(s["argus.kafka.ranges"]) for s in summaries] == [
        {"0": [0, 5]},
        {"0": [5, 8], "1": [0, 6]},
    ]
    assert json.loads(summaries[-1]["argus.kafka.committed"]) == {"0": 8, "1": 6}
    assert json.loads(summaries[-1]["argus.kafka.lost"]) == {"1": [0, 2]}
    assert summaries[-1]["argus.dlq.records"] == "1"

    again = migrate(snapshots, str(root), None, TABLE, "t")  # a rerun: the table holds them all
    assert again.imported == [] and sorted(again.held) == ["snap-4", "snap-5"]
    assert len(read_table(root).snapshots()) == 2
    assert (root / "snapshots" / "snap-1" / MANIFEST).exists()  # the old layout is left as it was


def test_a_snapshot_of_dead_letters_only_is_a_commit_without_rows(snapshots, root):
    write_snapshot(snapshots, "snap-1", {0: (0, 2)}, dead=frozenset({(0, 0), (0, 1)}))
    write_snapshot(snapshots, "snap-2", {0: (2, 4)})
    report = migrate(snapshots, str(root), None, TABLE, "t")
    assert report.imported == ["snap-1", "snap-2"] and report.rows == 2 and report.dead_letters == 2
    table = read_table(root)
    assert sorted(table.scan().to_arrow()["kafka_offset"].to_pylist()) == [2, 3]
    first = table.snapshots()[0].summary.additional_properties
    assert json.loads(first["argus.kafka.committed"]) == {"0": 2} and first["argus.dlq.records"] == "2"


def test_a_snapshot_missing_from_the_old_layout_stops_the_migration_at_the_gap(snapshots, root):
    write_snapshot(snapshots, "snap-1", {0: (0, 2)})
    write_snapshot(snapshots, "snap-3", {0: (4, 6)})  # [2, 4) is gone
    with pytest.raises(
        ConfigError, match=r"p0: table at 2, next snapshot from 4.*1 snapshot\(s\) were imported"
    ):
        migrate(snapshots, str(root), None, TABLE, "t")
    [only] = read_table(root).snapshots()
    assert json.loads(only.summary.additional_properties["argus.kafka.committed"]) == {"0": 2}


def test_a_manifest_that_does_not_parse_is_refused_and_kept(snapshots, root, capsys):
    # The reproduction: one extra field in the middle snapshot's partition entry (a newer
    # Argus, or bit rot). The old reader skipped it and resumed past its offsets; migrate stops.
    write_snapshot(snapshots, "snap-1", {0: (0, 2)})
    write_snapshot(snapshots, "snap-2", {0: (2, 4)})
    write_snapshot(snapshots, "snap-3", {0: (4, 6)})
    path = root / "snapshots" / "snap-2" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["offsets"]["0"]["checksum_v2"] = "abc"
    path.write_text(json.dumps(manifest))

    code = main(["migrate", "--storage", str(root), "--topic", "t"])
    assert code == 2
    error = capsys.readouterr().err
    assert "snap-2: its manifest is not one this Argus reads" in error and "checksum_v2" in error, error
    assert path.exists() and json.loads(path.read_text()) == manifest  # nothing moved or deleted
    assert not (root / "catalog.db").exists()  # refused before the table was even created


def test_normalised_float_snapshots_are_refused_with_what_to_do(snapshots, root):
    manifest = write_snapshot(snapshots, "snap-1", {0: (0, 2)})
    path = root / "snapshots" / "snap-1" / MANIFEST
    old = json.loads(manifest.to_json())
    del old["pixels"]  # written before pixel snapshots: normalised float32
    path.write_text(json.dumps(old))
    with pytest.raises(ConfigError, match="normalised float32.*ingest their records again"):
        migrate(snapshots, str(root), None, TABLE, "t")


def test_the_cli_prints_what_it_imported(snapshots, root, capsys):
    write_snapshot(snapshots, "snap-1", {0: (0, 3), 1: (0, 2)})
    assert main(["migrate", "--storage", str(root), "--topic", "t", "--table", "lake.images"]) == 0
    out = capsys.readouterr().out
    assert "migrated 1 snapshot(s) into lake.images: 5 rows, 0 dead letters" in out
    assert "p0: 3, p1: 2" in out
