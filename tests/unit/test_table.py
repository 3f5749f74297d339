"""The Iceberg table (app.data.table, app.data.catalog) on a real PyIceberg SQL catalog on SQLite
and real Parquet files under tmp_path: commits that carry the Kafka offsets, exactly one winner
among writers racing from the same base (threads and processes), a newer table refused untouched,
and reads pinned to a snapshot, through Argus and through PyIceberg alone."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from app.data.catalog import catalog_uri, warehouse_uri
from app.data.metadata import origin
from app.data.table import ImageTable, OffsetConflict, conform
from app.errors import ConfigError

from tables import (
    TOPIC,
    batch,
    check_one_winner,
    coordinates,
    pixels,
    pyiceberg_alone,
    race,
    race_in_processes,
)


def data_files_on_disk(storage: Path) -> set[str]:
    return {str(p) for p in (storage / "warehouse").rglob("*.parquet")}


def test_a_commit_reads_back_every_row_once_with_its_pixels_and_summary(tmp_path):
    table = ImageTable.at(str(tmp_path))
    assert table.committed() == {} and table.current_snapshot_id() is None
    rows = pa.concat_tables([batch(0, [0, 1, 2, 4]), batch(1, [0, 1])])
    snapshot_id = table.commit(rows, {0: (0, 5), 1: (0, 2)}, dlq_records=1, topic=TOPIC)

    assert table.current_snapshot_id() == snapshot_id
    back = table.scan(snapshot_id).sort_by([("kafka_partition", "ascending"), ("kafka_offset", "ascending")])
    assert coordinates(back) == coordinates(rows)
    for name in ("user_id", "label", "event_time_ms", "device_id", "pixels"):
        assert back.column(name).to_pylist() == rows.column(name).to_pylist(), name
    assert (pixels(back)[1] == np.arange(192, dtype=np.uint8).reshape(8, 8, 3) + 1).all()
    assert {str(d) for d in back.column("event_date").to_pylist()} == {"2026-01-01", "2026-01-02"}

    summary = pyiceberg_alone(tmp_path).current_snapshot().summary.additional_properties
    assert summary["argus.format"] == "2" and summary["argus.kafka.topic"] == TOPIC
    assert json.loads(summary["argus.kafka.ranges"]) == {"0": [0, 5], "1": [0, 2]}
    assert json.loads(summary["argus.kafka.committed"]) == {"0": 5, "1": 2}
    assert summary["argus.dlq.records"] == "1"
    # Partitioned by event date: one folder per day, and the files Ray Data would read are all there.
    uris = table.data_file_uris(snapshot_id)
    assert {u.split("/")[-2] for u in uris} == {"event_date=2026-01-01", "event_date=2026-01-02"}
    assert {u.removeprefix("file://") for u in uris} == data_files_on_disk(tmp_path)


def test_committed_offsets_are_carried_forward_by_every_commit_including_one_of_dead_letters_only(tmp_path):
    table = ImageTable.at(str(tmp_path))
    table.commit(batch(0, range(3)), {0: (0, 3)}, 0, TOPIC)
    table.commit(batch(1, range(2)), {1: (0, 2)}, 0, TOPIC)
    assert table.committed() == {0: 3, 1: 2}
    only_dead = table.commit(batch(0, []), {0: (3, 5)}, dlq_records=2, topic=TOPIC)
    assert table.committed() == {0: 5, 1: 2} == table.committed(only_dead)
    lost = table.commit(batch(1, [4]), {1: (2, 5)}, 0, TOPIC, lost={1: 2})
    summary = pyiceberg_alone(tmp_path).snapshot_by_id(lost).summary.additional_properties
    assert json.loads(summary["argus.kafka.lost"]) == {"1": [2, 4]}
    assert table.committed() == {0: 5, 1: 5}
    # Reopened from the catalog alone, the next writer starts there.
    assert ImageTable.at(str(tmp_path)).committed() == {0: 5, 1: 5}


def test_reading_a_pinned_snapshot_sees_only_what_it_held_after_later_commits(tmp_path):
    table = ImageTable.at(str(tmp_path))
    first = table.commit(batch(0, range(4)), {0: (0, 4)}, 0, TOPIC)
    pinned_files = table.data_file_uris(first)
    table.commit(batch(0, range(4, 7)), {0: (4, 7)}, 0, TOPIC)
    table.commit(batch(1, range(2)), {1: (0, 2)}, 0, TOPIC)

    assert coordinates(table.scan(first)) == [(0, o) for o in range(4)]
    assert table.committed(first) == {0: 4}
    assert table.data_file_uris(first) == pinned_files
    assert coordinates(table.scan(table.current_snapshot_id())) == [(0, o) for o in range(7)] + [
        (1, 0),
        (1, 1),
    ]
    with pytest.raises(ValueError, match="no snapshot 12345"):
        table.scan(12345)


def test_pyiceberg_alone_reads_every_committed_row_once(tmp_path):
    table = ImageTable.at(str(tmp_path))
    table.commit(batch(0, range(5)), {0: (0, 5)}, 0, TOPIC)
    table.commit(batch(1, range(3)), {1: (0, 3)}, 0, TOPIC)
    table.commit(batch(0, range(5, 6)), {0: (5, 6)}, 0, TOPIC)
    rows = pyiceberg_alone(tmp_path).scan().to_arrow()
    assert coordinates(rows) == [(0, o) for o in range(6)] + [(1, o) for o in range(3)]
    assert len(set(rows.column("user_id").to_pylist())) == rows.num_rows


def test_a_writer_planned_from_an_old_base_gets_the_conflict_and_leaves_no_files(tmp_path):
    first, second = ImageTable.at(str(tmp_path)), ImageTable.at(str(tmp_path))
    assert first.committed() == second.committed() == {}
    first.commit(batch(0, range(4), "first"), {0: (0, 4)}, 0, TOPIC)
    with pytest.raises(OffsetConflict, match="p0: planned from 0, table at 4"):
        second.commit(batch(0, range(4), "second"), {0: (0, 4)}, 0, TOPIC)
    rows = second.scan(second.current_snapshot_id())
    assert set(rows.column("user_id").to_pylist()) == {f"first:0:{o}" for o in range(4)}
    assert {u.removeprefix("file://") for u in second.data_file_uris(second.current_snapshot_id())} == (
        data_files_on_disk(tmp_path)
    )


def test_a_first_commit_may_start_anywhere_but_only_while_the_table_has_none(tmp_path):
    """`ingest --from`: a new table's first commit starts each partition where its writer chose
    (what lies below is outside the table, not missing); once any commit landed, that plan is stale."""
    table = ImageTable.at(str(tmp_path))
    with pytest.raises(OffsetConflict, match="p0: planned from 10, table at 0"):
        table.commit(batch(0, range(10, 14), "unplanned"), {0: (10, 14)}, 0, TOPIC)
    files = table.write_files(batch(0, range(10, 14), "from"))
    table.commit_files(files, {0: (10, 14), 1: (7, 7)}, 0, TOPIC, first=True)
    assert table.committed() == {0: 14, 1: 7}
    # A table property, not only the first snapshot's summary: it outlives that snapshot's expiry.
    assert origin(table.load()) == {0: 10, 1: 7}
    stale = table.write_files(batch(0, range(10, 14), "stale"))
    with pytest.raises(OffsetConflict, match="got its first commit from another writer"):
        table.commit_files(stale, {0: (10, 14)}, 0, TOPIC, first=True)
    assert set(table.scan(table.current_snapshot_id()).column("user_id").to_pylist()) == {
        f"from:0:{o}" for o in range(10, 14)
    }


def _paused_in_the_catalog_swap(table: ImageTable) -> tuple[threading.Event, threading.Event]:
    """Make `table`'s commits stop inside the catalog's commit (past Argus's own offset check)
    until released: the window in which another writer's commit lands. The catalog still decides."""
    swap, inside, release = table.catalog.commit_table, threading.Event(), threading.Event()

    def paused(*args, **kwargs):
        inside.set()
        assert release.wait(60)
        return swap(*args, **kwargs)

    table.catalog.commit_table = paused
    return inside, release


def _commit_in_thread(table: ImageTable, *args) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["snapshot_id"] = table.commit(*args)
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("retries_turned_on_elsewhere", [False, True])
def test_a_writer_that_loses_the_catalog_swap_commits_nothing_though_pyiceberg_would_retry(
    tmp_path, retries_turned_on_elsewhere
):
    """PyIceberg 0.12 would re-apply a lost append on the winner's snapshot with the loser's stale
    offsets; the table keeps that retry off, even after another tool turned it back on."""
    winner, loser = ImageTable.at(str(tmp_path)), ImageTable.at(str(tmp_path))
    if retries_turned_on_elsewhere:
        with pyiceberg_alone(tmp_path).transaction() as txn:
            txn.set_properties({"commit.retry.num-retries": "4"})
    inside, release = _paused_in_the_catalog_swap(loser)
    thread, outcome = _commit_in_thread(loser, batch(0, range(4), "loser"), {0: (0, 4)}, 0, TOPIC)
    assert inside.wait(60)  # the loser's offset check passed: the table was at 0
    winner.commit(batch(0, range(4), "winner"), {0: (0, 4)}, 0, TOPIC)
    release.set()
    thread.join()

    assert isinstance(outcome.get("error"), OffsetConflict), outcome
    assert winner.committed() == {0: 4}
    rows = winner.scan(winner.current_snapshot_id())
    assert sorted(rows.column("user_id").to_pylist()) == sorted(f"winner:0:{o}" for o in range(4))
    assert {u.removeprefix("file://") for u in winner.data_file_uris(winner.current_snapshot_id())} == (
        data_files_on_disk(tmp_path)
    )
    # The loser re-plans from the table and commits what follows.
    start = loser.committed()[0]
    loser.commit(batch(0, range(start, start + 2), "loser"), {0: (start, start + 2)}, 0, TOPIC)
    assert coordinates(loser.scan(loser.current_snapshot_id())) == [(0, o) for o in range(6)]


def test_a_lost_swap_to_another_partitions_commit_is_tried_again_and_lands(tmp_path):
    first, second = ImageTable.at(str(tmp_path)), ImageTable.at(str(tmp_path))
    inside, release = _paused_in_the_catalog_swap(second)
    thread, outcome = _commit_in_thread(second, batch(0, range(3)), {0: (0, 3)}, 0, TOPIC)
    assert inside.wait(60)
    first.commit(batch(1, range(2)), {1: (0, 2)}, 0, TOPIC)
    release.set()
    thread.join()

    assert "snapshot_id" in outcome, outcome
    assert first.committed() == {0: 3, 1: 2}
    assert coordinates(first.scan(outcome["snapshot_id"])) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def test_two_threads_racing_from_the_same_base_one_commits_the_other_replans(tmp_path):
    ImageTable.at(str(tmp_path))  # created once, before the writers
    barrier = threading.Barrier(2, timeout=60)
    outcomes: dict[str, str] = {}

    def writer(name):
        outcomes[name] = race(str(tmp_path), name, barrier.wait, lambda: None)

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    check_one_winner(tmp_path, outcomes)


def test_two_processes_racing_from_the_same_base_one_commits_the_other_replans(tmp_path):
    ImageTable.at(str(tmp_path))
    check_one_winner(tmp_path, race_in_processes(tmp_path))


def test_a_table_of_a_newer_argus_is_refused_and_left_unchanged(tmp_path):
    table = ImageTable.at(str(tmp_path))
    table.commit(batch(0, range(2)), {0: (0, 2)}, 0, TOPIC)
    with pyiceberg_alone(tmp_path).transaction() as txn:  # what a newer Argus would have written
        txn.set_properties({"argus.format": "3"})
    before = pyiceberg_alone(tmp_path)
    files = data_files_on_disk(tmp_path)
    metadata = set((tmp_path / "warehouse").rglob("*.json"))

    with pytest.raises(ConfigError, match="Argus format '3' \\(property\\), newer than this Argus's 2"):
        ImageTable.at(str(tmp_path))
    with pytest.raises(ConfigError, match="newer"):  # a handle opened before the upgrade
        table.commit(batch(0, range(2, 4)), {0: (2, 4)}, 0, TOPIC)
    after = pyiceberg_alone(tmp_path)
    assert after.metadata_location == before.metadata_location
    assert after.current_snapshot().snapshot_id == before.current_snapshot().snapshot_id
    assert data_files_on_disk(tmp_path) == files and set((tmp_path / "warehouse").rglob("*.json")) == metadata


def test_a_newer_commit_in_the_summary_is_refused_too(tmp_path):
    ImageTable.at(str(tmp_path))
    newer = pyiceberg_alone(tmp_path)
    newer.append(
        conform(batch(0, [0]), newer.schema().as_arrow()), snapshot_properties={"argus.format": "10"}
    )
    with pytest.raises(ConfigError, match="Argus format '10' \\(snapshot"):
        ImageTable.at(str(tmp_path))


def test_a_table_argus_did_not_create_is_refused(tmp_path):
    from app.data.catalog import table_schema

    pyiceberg_catalog = SqlCatalog(
        "argus", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=f"file://{tmp_path / 'warehouse'}"
    )
    pyiceberg_catalog.create_namespace("argus")
    pyiceberg_catalog.create_table("argus.behavior_images", table_schema())
    with pytest.raises(ConfigError, match="not an Argus table"):
        ImageTable.at(str(tmp_path))


def test_rows_the_ranges_do_not_account_for_are_refused_before_anything_is_written(tmp_path):
    table = ImageTable.at(str(tmp_path))
    with pytest.raises(ValueError, match="more than once"):
        table.commit(batch(0, [0, 1, 1]), {0: (0, 3)}, 0, TOPIC)
    with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
        table.commit(batch(0, [0, 2]), {0: (0, 2)}, 0, TOPIC)
    with pytest.raises(ValueError, match="partitions \\[1\\] not in the ranges"):
        table.commit(batch(1, [0]), {0: (0, 2)}, 0, TOPIC)
    with pytest.raises(ValueError, match="exceed the 2 offsets"):
        table.commit(batch(0, [0, 1]), {0: (0, 2)}, 1, TOPIC)
    with pytest.raises(ValueError, match=r"outside \[2, 4\)"):  # [0, 2) were deleted by retention
        table.commit(batch(0, [1, 2]), {0: (0, 4)}, 0, TOPIC, lost={0: 2})
    assert table.current_snapshot_id() is None and data_files_on_disk(tmp_path) == set()


def test_another_topic_is_refused_in_a_table_that_holds_one(tmp_path):
    table = ImageTable.at(str(tmp_path))
    table.commit(batch(0, range(2)), {0: (0, 2)}, 0, TOPIC)
    files = data_files_on_disk(tmp_path)
    with pytest.raises(ConfigError, match="holds topic 'behavior-images', not 'other'"):
        table.commit(batch(0, range(2, 4)), {0: (2, 4)}, 0, "other")
    assert data_files_on_disk(tmp_path) == files and table.committed() == {0: 2}


def test_the_catalog_defaults_to_sqlite_under_local_storage_and_is_required_elsewhere(tmp_path):
    assert catalog_uri(str(tmp_path)) == f"sqlite:///{tmp_path / 'catalog.db'}"
    assert warehouse_uri(str(tmp_path)) == f"file://{tmp_path / 'warehouse'}"
    assert catalog_uri("s3://bucket/argus", "https://catalog.example/api") == "https://catalog.example/api"
    assert warehouse_uri("s3://bucket/argus/") == "s3://bucket/argus/warehouse"
    with pytest.raises(ConfigError, match="--catalog .* is required when --storage is not a local path"):
        catalog_uri("s3://bucket/argus")


def test_the_handle_travels_as_its_location(tmp_path):
    import pickle

    table = ImageTable.at(str(tmp_path), table="argus.other_images", source=True, features=True)
    table.commit(
        batch(0, [0]).append_column("features", pa.array([[0.5, 1.5]], pa.list_(pa.float32()))),
        {0: (0, 1)},
        0,
        TOPIC,
    )
    copy = pickle.loads(pickle.dumps(table))
    assert copy.identifier == "argus.other_images" and copy.committed() == {0: 1}
    rows = copy.scan(copy.current_snapshot_id(), ["features", "source"])
    assert rows.column("features").to_pylist() == [[0.5, 1.5]] and rows.column("source").to_pylist() == [None]


OPENER = """
import sys
from app.data.table import ImageTable
uri, warehouse, go = sys.argv[1:]
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
ImageTable(uri, warehouse)
"""


def test_processes_opening_a_new_catalog_together_all_get_the_table(tmp_path):
    """PyIceberg creates a SQL catalog's tables, a namespace and a table check-then-create:
    processes that open a new one at once (two ingests or watches started together) race, and
    every one must still get the one table."""
    for round_ in range(3):
        uri = f"sqlite:///{tmp_path / f'catalog-{round_}.db'}"
        children = [
            subprocess.Popen(
                [sys.executable, "-c", OPENER, uri, f"file://{tmp_path}", "go"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        for child in children:
            child.stdin.write("go\n")
            child.stdin.flush()
        errors = [child.communicate(timeout=120)[1] for child in children]
        assert [child.returncode for child in children] == [0] * 6, errors
