"""The image table's catalog in PostgreSQL (Debian's, a server of this module's own on 127.0.0.1),
as a production deployment keeps it: writers in separate processes share it, the catalog's
compare-and-swap lets exactly one of two commits from the same base land, and the loser re-plans
from the table's own offsets. Read back through PyIceberg alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.data.table import ImageTable

from pg_server import PostgresServer
from tables import ROOT, check_one_winner, coordinates, pyiceberg_alone, race_in_processes


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()


def test_two_processes_racing_from_the_same_base_one_commits_the_other_replans(postgres, tmp_path):
    catalog = postgres.new_database()
    ImageTable.at(str(tmp_path), catalog)  # created once, before the writers
    check_one_winner(tmp_path, race_in_processes(tmp_path, catalog), catalog)


# A writer that keeps committing the next `batches` runs of three offsets of partition 0 from
# wherever the table says it stands, re-planning whenever the other writer got there first.
WRITER = """
import sys
sys.path.insert(0, {tests!r})
from app.data.table import ImageTable, OffsetConflict
from tables import TOPIC, batch
storage, catalog, name, batches = sys.argv[1:]
table, conflicts = ImageTable.at(storage, catalog), 0
for _ in range(int(batches)):
    while True:
        start = table.committed().get(0, 0)
        try:
            table.commit(batch(0, range(start, start + 3), name), {{0: (start, start + 3)}}, 0, TOPIC)
            break
        except OffsetConflict:
            conflicts += 1
print(conflicts, flush=True)
"""


def test_two_writers_committing_side_by_side_leave_every_offset_once(postgres, tmp_path):
    catalog, batches = postgres.new_database(), 8
    ImageTable.at(str(tmp_path), catalog)
    code = WRITER.format(tests=str(Path(__file__).parents[1]))
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), catalog, name, str(batches)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name in ("a", "b")
    ]
    try:
        results = [writer.communicate(timeout=300) for writer in writers]
    finally:
        for writer in writers:
            writer.kill()
            writer.wait()
    assert [writer.returncode for writer in writers] == [0, 0], [err[-3000:] for _, err in results]
    conflicts = sum(int(out) for out, _ in results)
    print(f"\n{2 * batches} commits by two writers, {conflicts} lost swaps re-planned")

    table = pyiceberg_alone(tmp_path, catalog)
    rows = table.scan().to_arrow()
    assert coordinates(rows) == [(0, o) for o in range(2 * batches * 3)]  # every offset, once
    writers_of_runs = {
        o // 3: u.split(":")[0] for o, u in zip(rows["kafka_offset"].to_pylist(), rows["user_id"].to_pylist())
    }
    assert sorted(writers_of_runs.values()).count("a") == batches  # each wrote all of its runs
    assert ImageTable.at(str(tmp_path), catalog).committed() == {0: 2 * batches * 3}
    assert len(list(table.snapshots())) == 2 * batches  # one snapshot a commit, none lost or doubled
