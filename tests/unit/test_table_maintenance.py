"""The table's upkeep (app.data.maintenance) on a real PyIceberg SQL catalog on SQLite and real
Parquet under tmp_path: compaction, expiry that spares pinned snapshots, bounded metadata, orphan
removal, and one user's erasure from the table and its history, checked through PyIceberg alone
and by reading every Parquet file left on disk."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.catalog.sql import SqlCatalog

from app.data.catalog import METADATA_VERSIONS_KEPT
from app.data.maintenance import compact, expire, remove_orphans
from app.data.records import dead_letter_folder
from app.data.table import ImageTable
from app.errors import ConfigError

from tables import TOPIC, batch, coordinates, long_history, pyiceberg_alone


def parquet_on_disk(storage: Path) -> set[str]:
    return {str(p) for p in (storage / "warehouse").rglob("*.parquet")}


def needed_by_snapshots(storage: Path) -> set[str]:
    """The data files some snapshot of the table still reads, as local paths."""
    table = pyiceberg_alone(storage)
    return {
        uri.removeprefix("file://")
        for snapshot in table.snapshots()
        for uri in (t.file.file_path for t in table.scan(snapshot_id=snapshot.snapshot_id).plan_files())
    }


def commit_in_small_parts(table: ImageTable, parts: int, per_part: int = 2) -> list[int]:
    """`parts` commits of `per_part` offsets of partition 0 each: one file per event date each."""
    return [
        table.commit(
            batch(0, range(i * per_part, (i + 1) * per_part)),
            {0: (i * per_part, (i + 1) * per_part)},
            0,
            TOPIC,
        )
        for i in range(parts)
    ]


def test_compaction_rewrites_each_event_dates_small_files_into_one_keeping_every_row_once(tmp_path):
    table = ImageTable.at(str(tmp_path))
    snapshots = commit_in_small_parts(table, 6)
    before = table.data_file_uris(snapshots[-1])
    assert len(before) == 12  # two event dates per commit

    report = compact(table, target_file_bytes=1 << 20)
    assert (report.files_before, report.files_after, report.rows) == (12, 2, 12), report
    current = table.current_snapshot_id()
    assert current == report.snapshot_id
    after = table.data_file_uris(current)
    assert len(after) == 2 and not set(after) & set(before)
    assert {u.split("/")[-2] for u in after} == {"event_date=2026-01-01", "event_date=2026-01-02"}
    rows = table.scan(current)
    assert coordinates(rows) == [(0, o) for o in range(12)]
    # Rows in each new file are in Kafka order.
    for uri in after:
        offsets = pq.read_table(uri.removeprefix("file://"), columns=["kafka_offset"]).column(0).to_pylist()
        assert offsets == sorted(offsets)
    # The offsets are carried forward: the next ingest plans from the compaction's snapshot.
    assert table.committed() == {0: 12}
    summary = pyiceberg_alone(tmp_path).current_snapshot().summary.additional_properties
    assert summary["argus.kafka.committed"] == '{"0":12}' and summary["argus.compacted.files"] == "12"
    # A reader pinned before it still reads its own files.
    assert coordinates(table.scan(snapshots[2])) == [(0, o) for o in range(6)]
    assert compact(table, target_file_bytes=1 << 20).snapshot_id is None  # one file per date: done


def test_a_compaction_that_loses_the_swap_to_a_writer_plans_again_and_keeps_the_writers_rows(tmp_path):
    table = ImageTable.at(str(tmp_path))
    commit_in_small_parts(table, 3)
    writer = ImageTable.at(str(tmp_path))
    rewrite = table.write_files
    raced = []

    def a_writer_commits_first(rows: pa.Table):
        if not raced:  # while the compaction writes its first files, an ingest commits
            raced.append(writer.commit(batch(1, range(3)), {1: (0, 3)}, 0, TOPIC))
        return rewrite(rows)

    table.write_files = a_writer_commits_first
    report = compact(table, target_file_bytes=1 << 20)

    assert raced and report.snapshot_id == table.current_snapshot_id()
    assert coordinates(table.scan(report.snapshot_id)) == [(0, o) for o in range(6)] + [
        (1, o) for o in range(3)
    ]
    assert table.committed() == {0: 6, 1: 3}
    # The first plan's rewrite was never committed and is gone; nothing on disk is unaccounted for.
    assert parquet_on_disk(tmp_path) == needed_by_snapshots(tmp_path)


def test_expiry_keeps_pinned_and_current_snapshots_and_deletes_only_files_nobody_reads(tmp_path):
    table = ImageTable.at(str(tmp_path))
    c1, c2, c3, c4 = commit_in_small_parts(table, 4)
    pinned = table.scan(c2)
    compacted = compact(table, target_file_bytes=1 << 20).snapshot_id

    assert expire(table, older_than_s=3600).snapshots == []  # all younger than an hour
    report = expire(table, older_than_s=0, keep={c2})
    assert sorted(report.snapshots) == sorted([c1, c3, c4]) and report.files_deleted > 0
    assert {s.snapshot_id for s in pyiceberg_alone(tmp_path).snapshots()} == {c2, compacted}
    assert table.scan(c2).equals(pinned)  # the pinned reader's rows, files and all
    assert coordinates(table.scan(compacted)) == [(0, o) for o in range(8)]
    assert table.committed() == {0: 8}
    assert parquet_on_disk(tmp_path) == needed_by_snapshots(tmp_path)  # c3's and c4's parts are gone
    # Manifest lists of expired snapshots are gone too.
    lists = {str(p) for p in (tmp_path / "warehouse").rglob("snap-*.avro")}
    kept = {s.manifest_list.removeprefix("file://") for s in pyiceberg_alone(tmp_path).snapshots()}
    assert lists == kept


def test_a_snapshot_cap_bounds_history_but_spares_a_running_readers_snapshot_until_it_lets_go(tmp_path):
    """A busy `watch` commits about once a second and every commit rewrites metadata that lists
    every kept snapshot: the cap keeps that list short. A `train` or `federate` in flight holds its
    snapshot with a tag (`ImageTable.pin`), so its files survive compaction and expiry both."""
    table = ImageTable.at(str(tmp_path))
    ids = commit_in_small_parts(table, 12)
    with table.pin(ids[2]) as held:
        assert held == ids[2]
        rows = table.scan(ids[2])
        compacted = compact(table, target_file_bytes=1 << 20).snapshot_id
        report = expire(table, older_than_s=3600, max_snapshots=3)  # none is an hour old: the cap decides
        kept = {s.snapshot_id for s in pyiceberg_alone(tmp_path).snapshots()}
        assert kept == {ids[10], ids[11], compacted, ids[2]} and sorted(report.snapshots) == sorted(
            set(ids) - kept
        )
        assert table.scan(ids[2]).equals(rows)  # the reader's files, compacted away since, are there
        assert parquet_on_disk(tmp_path) == needed_by_snapshots(tmp_path)
    assert set(pyiceberg_alone(tmp_path).refs()) == {"main"}  # the reader let go
    expire(table, older_than_s=3600, max_snapshots=3)
    assert ids[2] not in {s.snapshot_id for s in pyiceberg_alone(tmp_path).snapshots()}
    assert coordinates(table.scan(table.current_snapshot_id())) == [(0, o) for o in range(24)]


def test_a_reader_tag_left_by_a_run_that_died_ages_out_and_a_snapshot_that_is_gone_cannot_be_pinned(
    tmp_path, monkeypatch
):
    import app.data.maintenance

    table = ImageTable.at(str(tmp_path))
    ids = commit_in_small_parts(table, 4)
    died = table.pin(ids[0])
    died.__enter__()  # never left: the run died
    expire(table, older_than_s=3600, max_snapshots=1)
    assert ids[0] in {s.snapshot_id for s in pyiceberg_alone(tmp_path).snapshots()}
    monkeypatch.setattr(app.data.maintenance, "READER_PIN_TTL_S", 0.0)
    expire(table, older_than_s=3600, max_snapshots=1)
    assert {s.snapshot_id for s in pyiceberg_alone(tmp_path).snapshots()} == {ids[3]}
    assert set(pyiceberg_alone(tmp_path).refs()) == {"main"}
    with pytest.raises(ConfigError, match=f"has no snapshot {ids[0]}"), table.pin(ids[0]):
        pass


def test_metadata_files_stay_bounded_however_many_commits(tmp_path):
    table = ImageTable.at(str(tmp_path))
    commit_in_small_parts(table, METADATA_VERSIONS_KEPT + 10, per_part=1)
    metadata = list((tmp_path / "warehouse").rglob("*.metadata.json"))
    assert len(metadata) <= METADATA_VERSIONS_KEPT + 1, len(metadata)
    assert table.committed() == {0: METADATA_VERSIONS_KEPT + 10}


def test_orphan_removal_deletes_old_unreferenced_files_but_spares_young_and_referenced_ones(tmp_path):
    table = ImageTable.at(str(tmp_path))
    commit_in_small_parts(table, 2)
    # A writer that died after writing its files and before its commit.
    stray = [f.file_path.removeprefix("file://") for f in table.write_files(batch(0, range(4, 6)))]
    assert remove_orphans(table, older_than_s=3600) == []  # young: maybe a live writer's
    hour_ago = time.time() - 7200
    for path in [*stray, *parquet_on_disk(tmp_path)]:
        os.utime(path, (hour_ago, hour_ago))

    removed = remove_orphans(table, older_than_s=3600)
    assert sorted(r.removeprefix("file://") for r in removed) == sorted(stray)
    assert parquet_on_disk(tmp_path) == needed_by_snapshots(tmp_path)
    assert coordinates(table.scan(table.current_snapshot_id())) == [(0, o) for o in range(4)]


def with_users(rows: pa.Table, users: list[str]) -> pa.Table:
    return rows.set_column(rows.column_names.index("user_id"), "user_id", pa.array(users))


def test_erasing_a_user_removes_their_rows_from_the_table_its_history_and_the_disk(tmp_path, cli):
    table = ImageTable.at(str(tmp_path))
    first = table.commit(
        with_users(batch(0, range(6)), ["alice", "bob", "alice", "carol", "bob", "carol"]),
        {0: (0, 6)},
        0,
        TOPIC,
    )
    table.commit(with_users(batch(0, range(6, 8)), ["dave", "alice"]), {0: (6, 8)}, 0, TOPIC)
    compact(table, target_file_bytes=1 << 20)
    table.commit(with_users(batch(1, range(2)), ["erin", "bob"]), {1: (0, 2)}, 0, TOPIC)

    # Dead letters too large for their topic, stored as the sink stores them (two topics' worth).
    owners = [("t", "alice"), ("t", "alice"), ("t2", "alice"), ("t", "bob")]
    payloads = [
        tmp_path / "dlq" / t / dead_letter_folder(u) / f"0-{i}.bin" for i, (t, u) in enumerate(owners)
    ]
    for path in payloads:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(path.name.encode())

    erased = cli("erase", "--user", "alice", "--storage", str(tmp_path))
    assert erased.returncode == 0, erased.stderr
    assert "3 rows of user 'alice' deleted (2 files rewritten)" in erased.stdout, erased.stdout
    assert "3 dead-letter payloads deleted from storage" in erased.stdout, erased.stdout
    assert "served traffic logs hold no user ids" in erased.stdout
    assert sorted((tmp_path / "dlq").rglob("*.bin")) == [payloads[3]]  # bob's stays

    rows = table.scan(table.current_snapshot_id())
    assert "alice" not in rows.column("user_id").to_pylist()
    assert coordinates(rows) == [(0, o) for o in (1, 3, 4, 5, 6)] + [(1, 0), (1, 1)]
    assert table.committed() == {0: 8, 1: 2}  # the offsets stay committed: nothing is re-read
    # No snapshot a reader (even a pinned one) could open holds her rows, and no file on disk does.
    plain = pyiceberg_alone(tmp_path)
    assert first not in {s.snapshot_id for s in plain.snapshots()}
    for snapshot in plain.snapshots():
        assert (
            "alice"
            not in plain.scan(snapshot_id=snapshot.snapshot_id).to_arrow().column("user_id").to_pylist()
        )
    for path in parquet_on_disk(tmp_path):
        assert "alice" not in pq.read_table(path, columns=["user_id"]).column(0).to_pylist(), path

    again = cli("erase", "--user", "alice", "--storage", str(tmp_path))
    assert again.returncode == 0 and "no rows of user 'alice'" in again.stdout, again.stdout
    refused = cli("erase", "--storage", str(tmp_path))
    assert refused.returncode == 2 and "erase needs --user ID" in refused.stderr


def test_erase_where_there_is_no_table_refuses_and_creates_nothing(tmp_path, cli):
    empty = tmp_path / "empty"
    refused = cli("erase", "--user", "alice", "--storage", str(empty))
    assert refused.returncode == 2 and "there is no catalog at" in refused.stderr, refused.stderr
    assert not empty.exists()

    ImageTable.at(str(tmp_path))  # a catalog holding argus.behavior_images, not the table asked for
    refused = cli("erase", "--user", "alice", "--storage", str(tmp_path), "--table", "argus.other")
    assert refused.returncode == 2 and "no table argus.other" in refused.stderr, refused.stderr
    plain = SqlCatalog("argus", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=f"file://{tmp_path}")
    assert not plain.table_exists("argus.other")


def test_an_erasure_is_recorded_so_that_redrive_leaves_the_users_earlier_dead_letters_dead(tmp_path):
    """Kafka keeps the DLQ topic's records, so `erase` records each user it erased in the table's
    properties (by digest, as the payload folders name them: no user id in the metadata) with the
    topic's log ends, and redrive leaves their dead letters below those ends dead (all of them when
    no ends were recorded), whether the user had rows or only dead letters, and also when the
    erasure lands between a redrive's plan and its commit. A later record of the user is new data."""
    import datetime

    import pytest

    from app.data.dead_letters import DeadLetter
    from app.data.erasure import erase_user
    from app.data.metadata import Erasures
    from app.data.records import record_headers, user_digest
    from app.data.redrive import RedriveReport, _triage, commit_redrive
    from app.data.table import OffsetConflict

    table = ImageTable.at(str(tmp_path))
    table.commit(with_users(batch(0, range(4)), ["alice", "bob", "alice", "bob"]), {0: (0, 7)}, 3, TOPIC)
    erase_user(table, "alice")  # no broker was asked: every record of alice's
    erase_user(table, "carol", ends={0: 6, 1: 0})  # no rows, only dead letters: recorded all the same
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    properties = pyiceberg_alone(tmp_path).properties
    assert {k: json.loads(v) for k, v in properties.items() if k.startswith("argus.erased.")} == {
        f"argus.erased.{user_digest('alice')}": {"date": today},
        f"argus.erased.{user_digest('carol')}": {"date": today, "ends": {"0": 6, "1": 0}},
    }
    assert not any("alice" in k or "alice" in v for k, v in properties.items())
    assert table.committed() == {0: 7}

    def dead_letter(user: str, offset: int, label: str | None = "tap") -> DeadLetter:
        headers = record_headers(label, 1_767_225_600_000, None) + [
            ("error_reason", b"unknown_label"),
            ("source_topic", TOPIC.encode()),
            ("source_partition", b"0"),
            ("source_offset", str(offset).encode()),
        ]
        return DeadLetter(user.encode(), b"image bytes", dict(headers), 0)

    letters = [
        dead_letter("alice", 4),
        dead_letter("bob", 5, label=None),
        dead_letter("carol", 2),
        dead_letter("carol", 6),  # at the end recorded with carol's erasure: sent after it
    ]
    report = RedriveReport("dlq", read=4)
    candidates = _triage(letters, TOPIC, table.committed(), {}, Erasures.of(table.load()), report)
    assert [(c.letter.user, c.coordinates) for c in candidates] == [("bob", (0, 5)), ("carol", (0, 6))]
    assert report.stayed_dead == {"erased": 2}, report

    # Planned before dave's erasure, committed after it: refused (the redrive plans again).
    planned, erasures = table.current_snapshot_id(), Erasures.of(table.load())
    files = table.write_files(with_users(batch(0, [5]), ["dave"]))
    erase_user(table, "dave")  # no rows: only the property changes, no snapshot
    assert table.current_snapshot_id() == planned
    with pytest.raises(OffsetConflict, match="erased"):
        commit_redrive(table, files, TOPIC, planned, {0: {5}}, {user_digest("dave")}, erasures, {})
    assert table.current_snapshot_id() == planned
    # Planned after it, carol's later record commits: her erasure is not news to this redrive.
    files = table.write_files(with_users(batch(0, [6]), ["carol"]))
    erasures = Erasures.of(table.load())
    committed = commit_redrive(table, files, TOPIC, planned, {0: {6}}, {user_digest("carol")}, erasures, {})
    assert sorted(r["user_id"] for r in table.scan(committed).to_pylist()) == ["bob", "bob", "carol"]


def test_a_commit_that_lands_after_its_users_erasure_has_their_rows_erased_again(tmp_path):
    """Erase looks for rows before a commit under way lands; that writer, having read the erasures
    before its plan, finds the new one after its commit and erases the user's rows again."""
    from app.data.erasure import erase_late, erase_user
    from app.data.metadata import Erasures

    table = ImageTable.at(str(tmp_path))
    planned = Erasures.of(table.load())
    files = table.write_files(with_users(batch(0, range(3)), ["alice", "bob", "alice"]))
    erase_user(table, "alice", ends={0: 3})  # finds no rows: they are not committed yet
    table.commit_files(files, {0: (0, 3)}, 0, TOPIC)
    assert erase_late(table, planned, files) == ["alice"]
    assert [r["user_id"] for r in table.scan(table.current_snapshot_id()).to_pylist()] == ["bob"]
    assert all(
        "alice" not in table.scan(s.snapshot_id, ["user_id"]).column(0).to_pylist()
        for s in table.load().snapshots()
    )
    assert erase_late(table, Erasures.of(table.load()), files) == []  # nothing new since


def test_a_10000_commit_history_plans_commits_and_shrinks_to_what_is_pinned(tmp_path):
    table = long_history(tmp_path, 10_000)
    first, *_, last = [s.snapshot_id for s in table.load().snapshots()]
    assert table.committed() == {0: 10_000}  # from the current snapshot's summary, not a walk
    assert coordinates(table.scan(last)) == [(0, 0)]
    nth = table.commit(batch(0, range(10_000, 10_002)), {0: (10_000, 10_002)}, 0, TOPIC)
    assert table.committed() == {0: 10_002} and len(table.load().snapshots()) == 10_001

    metadata = max((tmp_path / "warehouse").rglob("*.metadata.json"), key=os.path.getmtime)
    report = expire(table, older_than_s=0, keep={first})
    assert len(report.snapshots) == 9_999
    assert {s.snapshot_id for s in table.load().snapshots()} == {first, nth}
    shrunk = max((tmp_path / "warehouse").rglob("*.metadata.json"), key=os.path.getmtime)
    assert os.path.getsize(shrunk) < os.path.getsize(metadata) / 100
    assert coordinates(table.scan(first)) == [(0, 0)]  # the pinned reader's rows are still there
    assert table.committed() == {0: 10_002}
