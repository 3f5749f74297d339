"""The image table behind an Iceberg REST catalog (`--catalog http://...`, CONTRACT.md §2), over
real HTTP on 127.0.0.1: every commit, tag, property and expiry travels as the REST spec's
requirements and updates (`tests/rest_catalog.py` is the server), the catalog's compare-and-swap
lets one of two writers from the same base land and the other re-plan, and PyIceberg alone reads
the result through the same REST API."""

from __future__ import annotations

import pytest
from rest_catalog import RestCatalogServer

from app.data.erasure import erase_user
from app.data.maintenance import compact, expire
from app.data.table import ImageTable, OffsetConflict, append

from tables import TOPIC, batch, check_one_winner, coordinates, pyiceberg_alone, race_in_processes


@pytest.fixture
def rest(tmp_path):
    """A REST catalog whose warehouse is `tmp_path`'s, as Argus names it (`<storage>/warehouse`)."""
    server = RestCatalogServer.start(tmp_path)
    try:
        yield server.uri
    finally:
        server.stop()


def test_two_processes_racing_from_the_same_base_one_commits_the_other_replans(rest, tmp_path):
    ImageTable.at(str(tmp_path), rest)  # created once, before the writers
    check_one_winner(tmp_path, race_in_processes(tmp_path, rest), rest)


def test_a_pinned_reader_keeps_its_rows_through_compaction_and_expiry_and_an_erasure_takes_one_user(
    rest, tmp_path
):
    table = ImageTable.at(str(tmp_path), rest)
    commits = [table.commit(batch(0, range(i, i + 2)), {0: (i, i + 2)}, 0, TOPIC) for i in range(0, 8, 2)]
    assert table.committed() == {0: 8} and table.siblings(TOPIC) == []

    with table.pin(commits[1]) as held:  # a tag, set through the REST catalog
        rows = table.scan(held)
        compacted = compact(table, target_file_bytes=1 << 20).snapshot_id
        expire(table, older_than_s=0)
        assert {s.snapshot_id for s in pyiceberg_alone(tmp_path, rest).snapshots()} == {held, compacted}
        assert table.scan(held).equals(rows)  # its files outlived the compaction that replaced them
    assert expire(table, older_than_s=0).snapshots == [commits[1]]  # let go: now it may expire

    report = erase_user(table, "w:0:5")
    assert report.rows == 1
    alone = pyiceberg_alone(tmp_path, rest)
    assert coordinates(alone.scan().to_arrow()) == [(0, o) for o in range(8) if o != 5]
    assert any(key.startswith("argus.erased.") for key in alone.properties)
    assert table.committed() == {0: 8}  # the erasure moved no offset


def test_a_commit_whose_base_moved_is_refused_by_the_server_and_leaves_nothing(rest, tmp_path):
    """Two handles on one table: the second plans from the base the first then moves. A swap onto
    that base fails the server's requirement check (409); a commit re-checks the offsets and
    refuses. No snapshot or row of the second lands."""
    first, second = ImageTable.at(str(tmp_path), rest), ImageTable.at(str(tmp_path), rest)
    first.commit(batch(0, range(0, 2)), {0: (0, 2)}, 0, TOPIC)
    stale = second.load()  # the base the second writer planned from
    first.commit(batch(0, range(2, 4), "x"), {0: (2, 4)}, 0, TOPIC)

    files = second.write_files(batch(0, range(2, 4), "y"))
    assert append(stale, {"argus.test": "1"}, files) is None  # the server's 409: the swap is lost
    second.discard(files)
    with pytest.raises(OffsetConflict):
        second.commit(batch(0, range(2, 4), "y"), {0: (2, 4)}, 0, TOPIC)
    rows = pyiceberg_alone(tmp_path, rest).scan().to_arrow()
    assert coordinates(rows) == [(0, o) for o in range(4)]
    assert set(rows.column("user_id").to_pylist()) == {"w:0:0", "w:0:1", "x:0:2", "x:0:3"}
    assert len(list(pyiceberg_alone(tmp_path, rest).snapshots())) == 2
