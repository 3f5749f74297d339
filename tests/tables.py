"""Rows, racing writers and a plain PyIceberg reader for the image table's tests (app.data.table),
on whichever catalog a test gives: SQLite under the storage folder by default, or PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
from pyiceberg.catalog.rest import RestCatalog
from pyiceberg.catalog.sql import SqlCatalog

from app.data.catalog import catalog_uri, warehouse_uri
from app.data.table import ImageTable, OffsetConflict

ROOT = Path(__file__).resolve().parents[1]
TOPIC = "behavior-images"
DAY_MS = 86_400_000
T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def batch(partition: int, offsets, writer: str = "w") -> pa.Table:
    """Rows for `offsets` of `partition`: two event dates, some unlabelled, 8x8 pixels that differ
    by offset and by position (so a transposed read shows)."""
    offsets = list(offsets)
    base = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    return pa.table(
        {
            "kafka_partition": pa.array([partition] * len(offsets), pa.int32()),
            "kafka_offset": pa.array(offsets, pa.int64()),
            "user_id": [f"{writer}:{partition}:{o}" for o in offsets],
            "label": [None if o % 3 == 0 else "tap" for o in offsets],
            "event_time_ms": pa.array([T0 + (o % 2) * DAY_MS + o for o in offsets], pa.int64()),
            "device_id": [f"device-{o % 2}" for o in offsets],
            "pixels": [(base + o % 256).tobytes() for o in offsets],
            "height": pa.array([8] * len(offsets), pa.int32()),
            "width": pa.array([8] * len(offsets), pa.int32()),
        }
    )


def coordinates(rows: pa.Table) -> list[tuple[int, int]]:
    return sorted(zip(rows.column("kafka_partition").to_pylist(), rows.column("kafka_offset").to_pylist()))


def pyiceberg_alone(storage: Path, catalog: str | None = None):
    """The table as any PyIceberg user opens it: no Argus code."""
    uri = catalog or f"sqlite:///{storage / 'catalog.db'}"
    if uri.startswith("http"):
        return RestCatalog("argus", uri=uri).load_table("argus.behavior_images")
    return SqlCatalog("argus", uri=uri, warehouse=f"file://{storage / 'warehouse'}").load_table(
        "argus.behavior_images"
    )


def race(storage: str, writer: str, ready, go, catalog: str | None = None) -> str:
    """One of two writers that planned from the same base: commit offsets [0, 4) of partition 0;
    on a conflict, plan again from the table and commit the next four. Returns `won` or `lost`."""
    table = ImageTable(catalog_uri(storage, catalog), warehouse_uri(storage))
    start = table.committed().get(0, 0)
    ready()
    go()
    try:
        table.commit(batch(0, range(start, start + 4), writer), {0: (start, start + 4)}, 0, TOPIC)
        return "won"
    except OffsetConflict:
        start = table.committed()[0]
        table.commit(batch(0, range(start, start + 4), writer), {0: (start, start + 4)}, 0, TOPIC)
        return "lost"


RACER = """
import sys
sys.path.insert(0, {tests!r})
from tables import race
storage, name, catalog = sys.argv[1:]
outcome = race(storage, name, lambda: print("ready", flush=True), sys.stdin.readline, catalog or None)
print(outcome, flush=True)
"""


def race_in_processes(storage: Path, catalog: str | None = None) -> dict[str, str]:
    """`race` in two processes of their own, released together once both have read the same base:
    each one's outcome."""
    code = RACER.format(tests=str(Path(__file__).parent))
    children = {
        name: subprocess.Popen(
            [sys.executable, "-c", code, str(storage), name, catalog or ""],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    }
    try:
        for child in children.values():  # both have read the same base
            assert child.stdout.readline().strip() == "ready"
        for child in children.values():
            child.stdin.write("go\n")
            child.stdin.flush()
        outcomes = {name: child.communicate(timeout=120)[0].strip() for name, child in children.items()}
    finally:
        for child in children.values():
            child.kill()
            child.wait()
    assert all(child.returncode == 0 for child in children.values()), outcomes
    return outcomes


def check_one_winner(storage: Path, outcomes: dict[str, str], catalog: str | None = None) -> None:
    """The winner's four offsets first, the loser's re-planned four after, each offset once."""
    assert sorted(outcomes.values()) == ["lost", "won"], outcomes
    winner = next(w for w, o in outcomes.items() if o == "won")
    rows = pyiceberg_alone(storage, catalog).scan().to_arrow()
    assert coordinates(rows) == [(0, o) for o in range(8)]
    by_offset = dict(zip(rows.column("kafka_offset").to_pylist(), rows.column("user_id").to_pylist()))
    assert all(by_offset[o].startswith(f"{winner}:") for o in range(4))
    assert ImageTable.at(str(storage), catalog).committed() == {0: 8}


def long_history(storage: Path, commits: int) -> ImageTable:
    """A table with `commits` commits in its history, built in seconds: one real commit of offset 0
    as a row, then `commits - 1` commits of one dead letter each ([i, i + 1) of partition 0), as
    Argus records them, written as one metadata file the catalog then registers. Those commits add
    no files, so all share the first one's manifest list, as PyIceberg's own would hold the same
    manifests. What 10,000 real commits would cost (hours here) it skips; what a reader, a planner
    or the upkeep meets is the same history."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.serializers import ToOutputFile
    from pyiceberg.table.refs import MAIN_BRANCH, SnapshotRef, SnapshotRefType
    from pyiceberg.table.snapshots import Operation, Snapshot, Summary

    from app.data.catalog import dumps

    images = ImageTable.at(str(storage))
    images.commit(batch(0, [0]), {0: (0, 1)}, 0, TOPIC)
    table = images.load()
    first = table.current_snapshot()
    snapshots, parent = [first], first
    for offset in range(1, commits):
        summary = Summary(
            Operation.APPEND,
            **{
                "argus.format": "2",
                "argus.kafka.topic": TOPIC,
                "argus.kafka.ranges": dumps({0: [offset, offset + 1]}),
                "argus.kafka.committed": dumps({0: offset + 1}),
                "argus.dlq.records": "1",
            },
        )
        parent = Snapshot(
            snapshot_id=first.snapshot_id + offset,
            parent_snapshot_id=parent.snapshot_id,
            sequence_number=first.sequence_number + offset,
            timestamp_ms=first.timestamp_ms,  # not later: expiry by age must reach them all
            manifest_list=first.manifest_list,
            summary=summary,
            schema_id=first.schema_id,
        )
        snapshots.append(parent)
    metadata = table.metadata.model_copy(
        update={
            "snapshots": snapshots,
            "current_snapshot_id": parent.snapshot_id,
            "last_sequence_number": parent.sequence_number,
            "refs": {
                MAIN_BRANCH: SnapshotRef(
                    snapshot_id=parent.snapshot_id, snapshot_ref_type=SnapshotRefType.BRANCH
                )
            },
            "snapshot_log": [],
        }
    )
    location = f"{table.metadata.location}/metadata/99999-long-history.metadata.json"
    ToOutputFile.table_metadata(metadata, table.io.new_output(location))
    images.catalog.drop_table(images.identifier)  # the catalog's pointer only; files stay
    images.catalog.register_table(images.identifier, location)
    assert Catalog.namespace_from(images.identifier)
    return images


def pixels(rows: pa.Table) -> np.ndarray:
    """The `pixels` column as uint8 images [n, height, width, 3] (all rows of one size)."""
    sizes = set(zip(rows.column("height").to_pylist(), rows.column("width").to_pylist()))
    if len(sizes) > 1:
        raise ValueError(f"rows of several image sizes {sorted(sizes)}: select one first")
    height, width = sizes.pop() if sizes else (0, 0)
    flat = np.frombuffer(b"".join(rows.column("pixels").to_pylist()), dtype=np.uint8)
    return flat.reshape(rows.num_rows, height, width, 3)
