"""The watch's alert rule, its batch on revocation, compaction's planning and its cleanup of
abandoned folders, without a broker or Ray."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from app.data.compact import (
    PART_SUFFIX,
    folder_owner,
    merged_offsets,
    new_part_id,
    plan_groups,
    remove_abandoned,
)
from app.data.lag import AlertState
from app.data.lease import SharedLease
from app.data.manifest import Manifest, PartitionRange, live_manifests, new_snapshot_id
from app.data.parts import Batch
from app.data.snapshot import SnapshotStore


def test_alert_fires_once_after_for_s_and_clears_when_lag_recovers():
    alert = AlertState(threshold_s=5, for_s=2)
    assert alert.update(6, now=0) is None  # over, but not for long enough yet
    assert alert.update(7, now=1.9) is None
    assert alert.update(7, now=2.0) == "fired" and alert.active
    assert alert.update(9, now=5) is None  # still firing: one alert, not one per check
    assert alert.update(1, now=6) == "cleared" and not alert.active
    assert alert.update(6, now=7) is None and alert.update(4, now=8.5) is None  # a blip under for_s
    assert alert.fired == 1


def _part(
    name: str, created_s: float, offsets: dict[int, tuple[int, int]], part: bool = True, **kw
) -> Manifest:
    return Manifest(
        snapshot_id=name + (PART_SUFFIX if part else ""),
        topic="t",
        created_at=datetime.fromtimestamp(created_s, UTC).isoformat(),
        offsets={p: PartitionRange(s, e, e - s, 0, 100) for p, (s, e) in offsets.items()},
        records=sum(e - s for s, e in offsets.values()),
        dlq=0,
        dlq_topic="t.dlq",
        dlq_errors={},
        classes=["a"],
        label_counts={"a": sum(e - s for s, e in offsets.values())},
        image_size=32,
        normalization={},
        features=None,
        features_weights=None,
        event_time={"min": 1, "max": 2, "late_records": 0, "allowed_lateness_s": 1.0},
        value_bytes=0,
        files=[],
        pixels="uint8",
        **kw,
    )


def test_closed_windows_of_consecutive_parts_are_planned_open_ones_wait():
    hour = 3600
    parts = [
        _part("a", 10, {0: (0, 5), 1: (0, 3)}),
        _part("b", 20, {0: (5, 9)}),
        _part("c", hour + 5, {0: (9, 12), 1: (3, 4)}),  # the next window, still open at `now`
        _part("d", hour + 6, {1: (4, 8)}),
    ]
    groups = plan_groups(parts, "t", hour, None, now=hour + 100)
    assert [[m.snapshot_id for m in g] for g in groups] == [["a-part", "b-part"]]
    merged = merged_offsets(groups[0])
    assert {p: (r.start, r.end, r.records) for p, r in merged.items()} == {0: (0, 9, 9), 1: (0, 3, 3)}
    assert len(plan_groups(parts, "t", hour, None, now=2 * hour + 100)) == 2


def test_a_bulk_snapshot_between_parts_splits_the_run_and_compacted_parts_are_not_live():
    parts = [
        _part("a", 10, {0: (0, 5)}),
        _part("b", 11, {0: (5, 9)}),
        _part("bulk", 12, {0: (9, 20)}, part=False),
        _part("c", 13, {0: (20, 25)}),
        _part("d", 14, {0: (25, 30)}),
    ]
    groups = plan_groups(parts, "t", 3600, None, now=10_000)
    assert [[m.snapshot_id for m in g] for g in groups] == [["a-part", "b-part"], ["c-part", "d-part"]]
    compacted = _part("z", 20, {0: (0, 9)}, part=False, supersedes=["a-part", "b-part"])
    live = live_manifests([*parts, compacted])
    assert {m.snapshot_id for m in live} == {"bulk", "c-part", "d-part", "z"}
    assert plan_groups([*parts, compacted], "t", None, 9, now=10_000) == [parts[3:]]


def test_a_revocation_drops_the_revoked_partitions_rows_and_keeps_the_rest_as_they_were():
    batch = Batch()
    for p, offset in [(0, 10), (1, 4), (0, 11), (2, 7), (1, 5)]:
        batch.add({"partition": p, "offset": offset, "gap_end": None, "kafka_timestamp": 100 + offset}, 0)
    batch.starts = {0: 10, 1: 4, 2: 7}
    kept = batch.without({1})
    assert list(zip(kept.rows["partition"], kept.rows["offset"])) == [(0, 10), (0, 11), (2, 7)]
    assert kept.starts == {0: 10, 2: 7} and kept.records == 3 and kept.oldest_ms == 107
    assert kept.first_at == batch.first_at  # its first record has waited as long as before
    assert batch.without({0, 1, 2}).first_at is None  # nothing left: no cut is due


def test_a_writers_folders_carry_its_owner():
    assert folder_owner(new_part_id("abc123")) == "abc123"
    assert folder_owner(new_snapshot_id() + "-wabc123") == "abc123"  # a compaction's
    assert folder_owner(new_snapshot_id()) is None  # a bulk ingest's
    assert folder_owner(new_snapshot_id() + PART_SUFFIX) is None  # a part from before owners


def test_only_the_uncommitted_folders_of_writers_that_are_gone_are_removed(tmp_path):
    snapshots = SnapshotStore.at(str(tmp_path / "data"))
    topic_lease = snapshots.store.child("leases", "ingest-t")
    this, other = SharedLease(topic_lease), SharedLease(topic_lease)
    this.acquire()
    other.acquire()  # another watch of the topic, alive
    folders = tmp_path / "data" / "snapshots"

    def folder(name: str, committed: bool = False) -> str:
        (folders / name / "event_date=2026-01-01").mkdir(parents=True)
        (folders / name / "event_date=2026-01-01" / "part-0.parquet").write_bytes(b"rows")
        if committed:
            (folders / name / "_manifest.json").write_text(json.dumps({"format": "argus.snapshot.v1"}))
        return name

    mine = folder(new_part_id(this.owner))  # being written by this watch
    others = folder(new_part_id(other.owner))  # being written by the live one
    gone = folder(new_part_id("deadbeef0000"))  # its writer died before committing
    bulk = folder(new_snapshot_id())  # a bulk ingest's, dead: none runs while watches hold the lease
    compacted = folder(new_snapshot_id() + "-wdeadbeef0000")  # a compactor's that died
    committed = folder(new_part_id("deadbeef0000"), committed=True)  # a gone writer's, but committed
    assert sorted(remove_abandoned(snapshots, this)) == sorted([gone, bulk, compacted])
    assert sorted(p.name for p in folders.iterdir()) == sorted([mine, others, committed])
    other.release()
    assert remove_abandoned(snapshots, this) == [others]  # its writer let go without committing
    assert sorted(p.name for p in folders.iterdir()) == sorted([mine, committed])
    this.release()


def test_a_window_that_keeps_failing_is_retried_ever_less_often_and_reported_stuck(
    snapshots, monkeypatch, caplog
):
    """Compaction once retried a failing window every 2 s forever, re-reading it each time."""
    import logging
    import threading
    import time
    from types import SimpleNamespace

    from app.data import compact

    monkeypatch.setattr(compact, "CHECK_S", 0.02)
    monkeypatch.setattr(compact, "STUCK_AFTER", 3)
    window = [_part("snap-a", 0, {0: (0, 5)}), _part("snap-b", 10, {0: (5, 9)})]
    tries: list[float] = []

    def failing(*args, **kwargs):
        tries.append(time.monotonic())
        raise compact.CompactionFailed(window, OSError("storage refused the write"))

    monkeypatch.setattr(compact, "compact_once", failing)
    hold, stop = SharedLease(snapshots.store.child("lease"), ttl_s=30), threading.Event()
    cfg = SimpleNamespace(compact_window_s=60.0, compact_max_records=None)
    with caplog.at_level(logging.WARNING, logger="app.data.compact"), hold.held():
        compactor = compact.Compactor(snapshots, "t", cfg, hold, stop)
        compactor.start()
        deadline = time.monotonic() + 60
        while len(tries) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        compactor.close()
    assert len(tries) >= 5, tries
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    # Each wait is at least half of 0.02 s x 2^(failures - 1): they can only be longer, never shorter.
    assert all(gap >= 0.01 * 2**i for i, gap in enumerate(gaps[:4])), gaps
    messages = [
        (r.levelno, r.getMessage()) for r in caplog.records if "compaction of t failed" in r.getMessage()
    ]
    window_name = "snap-a-part..snap-b-part (2 parts)"
    assert [level for level, _ in messages[:4]] == [logging.WARNING] * 2 + [logging.ERROR] * 2
    assert all(window_name in text for _, text in messages), messages
    assert "failed 3 times in a row (stuck)" in messages[2][1]
