"""The watch without a broker or Ray: its alert rule, its batch on revocation, a part's commit
against a real table another writer moved, and the table's upkeep (compaction, expiry that spares
what registered versions pin, orphan removal, backoff and a stuck upkeep reported), on a real
PyIceberg SQL catalog on SQLite and a real MLflow registry under tmp_path."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from app import registry
from app.config import IngestConfig, Settings
from app.data import watch as watch_module
from app.data.lag import AlertState
from app.data.metadata import Erasures
from app.data.partitions import Restart
from app.data.parts import WRITER_KEY, Batch, Part, PartPipeline
from app.data.proof import WriteStats
from app.data.selection import select
from app.data.sink import SinkTarget
from app.data.table import ImageTable
from app.data.watch import STUCK_AFTER, Upkeep, WatchConfig
from app.storage import Store

from tables import TOPIC, batch, coordinates, pyiceberg_alone


def test_alert_fires_once_after_for_s_and_clears_when_lag_recovers():
    alert = AlertState(threshold_s=5, for_s=2)
    assert alert.update(6, now=0) is None  # over, but not for long enough yet
    assert alert.update(7, now=1.9) is None
    assert alert.update(7, now=2.0) == "fired" and alert.active
    assert alert.update(9, now=5) is None  # still firing: one alert, not one per check
    assert alert.update(1, now=6) == "cleared" and not alert.active
    assert alert.update(6, now=7) is None and alert.update(4, now=8.5) is None  # a blip under for_s
    assert alert.fired == 1


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


def _settings(root: Path) -> Settings:
    return Settings(topic=TOPIC, storage=str(root), image_size=8, model="cnn")


def _pipeline(settings: Settings, table: ImageTable) -> PartPipeline:
    target = SinkTarget(table, Store.at(settings.uri("dlq")), None, TOPIC, settings.dlq_topic, 1_000_000)
    return PartPipeline(target, settings, IngestConfig(), writer="watch test:1")


def _written(table: ImageTable, partition: int, offsets: range) -> WriteStats:
    """What the pool returns for a part whose rows are `offsets` of `partition`: its data files
    (written, not committed) and the count of every offset."""
    stats = WriteStats(files=table.write_files(batch(partition, offsets, writer="watch")))
    for offset in offsets:
        stats.partition(partition).add(offset, dead_letter=False)
    return stats


def _part(number: int, ranges: dict, lost: dict | None = None) -> Part:
    return Part(number, ranges, {}, lost or {}, Erasures(), [], None, 0, {}, 0.0)


def test_a_part_whose_partition_another_writer_committed_first_is_dropped_files_and_all(root):
    table = ImageTable.at(str(root))
    settings = _settings(root)
    pipeline = _pipeline(settings, table)
    # Both read partition 0 from offset 0; the other writer (a bulk ingest, a watch the group gave
    # the partition to while this one stalled) commits first.
    stats = _written(table, 0, range(0, 4))
    table.commit(batch(0, range(0, 4), writer="other"), {0: (0, 4)}, 0, TOPIC)
    with pytest.raises(Restart, match="moved since this writer planned"):
        pipeline.commit(_part(1, {0: (0, 4)}), stats)
    assert not any(os.path.exists(f.file_path.removeprefix("file://")) for f in stats.files)
    rows = table.scan(table.current_snapshot_id())
    assert coordinates(rows) == [(0, o) for o in range(4)]
    assert set(rows.column("user_id").to_pylist()) == {f"other:0:{o}" for o in range(4)}

    # From where the table is, the next part commits, as this writer, with the offsets that
    # retention deleted unread below it recorded as lost.
    stats = _written(table, 0, range(6, 9))
    snapshot_id = pipeline.commit(_part(2, {0: (6, 9)}, lost={0: 2}), stats)
    assert table.committed() == {0: 9}
    summary = pyiceberg_alone(root).snapshot_by_id(snapshot_id).summary.additional_properties
    assert summary[WRITER_KEY] == "watch test:1"
    assert json.loads(summary["argus.kafka.ranges"]) == {"0": [4, 9]}
    assert json.loads(summary["argus.kafka.lost"]) == {"0": [4, 6]}
    assert coordinates(table.scan(snapshot_id)) == [(0, o) for o in [0, 1, 2, 3, 6, 7, 8]]


def test_a_part_missing_an_offset_it_read_is_not_committed(root):
    table = ImageTable.at(str(root))
    pipeline = _pipeline(_settings(root), table)
    stats = _written(table, 0, range(0, 3))
    with pytest.raises(RuntimeError, match=r"expected offsets \[0, 4\) once each"):
        pipeline.commit(_part(1, {0: (0, 4)}), stats)
    assert table.current_snapshot_id() is None


def _small_commits(table: ImageTable, commits: int, per_commit: int = 2) -> list[int]:
    """`commits` commits of `per_commit` offsets of partition 0, as a watch's parts: small files."""
    return [
        table.commit(
            batch(0, range(i * per_commit, (i + 1) * per_commit)),
            {0: (i * per_commit, (i + 1) * per_commit)},
            0,
            TOPIC,
        )
        for i in range(commits)
    ]


def _register_reader_of(settings: Settings, table: ImageTable, snapshot_id: int) -> None:
    """A registered model version that learnt from `snapshot_id` (its lineage names it)."""
    from app.model import build_model

    card = registry.ModelCard(
        arch="cnn",
        classes=["tap", "swipe"],
        image_size=8,
        features=False,
        training_kind="ddp",
        lineage=select(table, 8, snapshot_id).lineage(),
        metrics={},
    )
    artifacts = Path(settings.storage, "mlartifacts").as_uri()
    with registry.start_run(settings.tracking_uri, artifacts, "pinned") as run:
        registry.register(
            settings.tracking_uri, settings.model_name, run.info.run_id, build_model("cnn", 2), card
        )


def test_upkeep_compacts_expires_all_but_what_a_registered_version_pins_and_removes_orphans(root):
    settings = _settings(root)
    table = ImageTable.at(str(root))
    snapshots = _small_commits(table, 5)
    pinned = snapshots[1]
    _register_reader_of(settings, table, pinned)
    assert registry.pinned_snapshot_ids(settings) == {pinned}
    pinned_files = table.data_file_uris(pinned)
    orphan = Path(table.load().location().removeprefix("file://"), "data", "left-by-a-dead-writer.parquet")
    orphan.write_bytes(b"never committed")
    four_days_ago = time.time() - 4 * 86400
    os.utime(orphan, (four_days_ago, four_days_ago))

    time.sleep(0.05)
    cfg = WatchConfig(compact_interval_s=60, expire_after_s=0.01)
    Upkeep(table, settings, cfg, threading.Event()).tick()

    current = table.current_snapshot_id()
    assert current not in snapshots  # the compaction's
    assert len(table.data_file_uris(current)) == 2  # one file per event date
    assert coordinates(table.scan(current)) == [(0, o) for o in range(10)]
    kept = {s.snapshot_id for s in pyiceberg_alone(root).snapshots()}
    assert kept == {pinned, current}  # the rest expired
    # The pinned reader still reads its own snapshot, from the files it read before.
    assert coordinates(table.scan(pinned)) == [(0, o) for o in range(4)]
    assert sorted(table.data_file_uris(pinned)) == sorted(pinned_files)
    assert all(os.path.exists(uri.removeprefix("file://")) for uri in pinned_files)
    assert not orphan.exists()
    assert table.committed() == {0: 10}


def test_an_upkeep_without_the_registry_expires_nothing_retries_ever_less_often_and_is_reported_stuck(
    root, caplog
):
    settings = _settings(root)
    table = ImageTable.at(str(root))
    snapshots = _small_commits(table, 3)
    tries: list[float] = []

    def registry_down() -> set[int]:
        tries.append(time.monotonic())
        raise ConnectionError("registry at http://mlflow:5000 refused the connection")

    stop = threading.Event()
    cfg = WatchConfig(compact_interval_s=0.02, expire_after_s=0.01)
    upkeep = Upkeep(table, settings, cfg, stop, pinned=registry_down)
    with caplog.at_level(logging.WARNING, logger="app.data.watch"):
        upkeep.start()
        deadline = time.monotonic() + 60
        while len(tries) < STUCK_AFTER + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        upkeep.close()
    assert len(tries) >= STUCK_AFTER + 1, tries
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    # Each wait is at least half of 0.02 s x 2^(failures - 1): they can only be longer, never shorter.
    assert all(gap >= 0.01 * 2**i for i, gap in enumerate(gaps[:STUCK_AFTER])), gaps
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if "upkeep of" in r.getMessage()]
    levels = [level for level, _ in messages[:STUCK_AFTER]]
    assert levels == [logging.WARNING] * (STUCK_AFTER - 1) + [logging.ERROR], messages
    assert f"failed {STUCK_AFTER} times in a row (stuck)" in messages[STUCK_AFTER - 1][1]
    assert all("nothing expired" in text and "refused the connection" in text for _, text in messages)
    # The compaction ran; nothing expired blindly: every snapshot is still there.
    ids = {s.snapshot_id for s in pyiceberg_alone(root).snapshots()}
    assert set(snapshots) < ids and table.current_snapshot_id() not in snapshots


def test_only_the_watch_holding_partition_0_keeps_the_table_up_and_trims_snapshots_between_upkeeps(
    root, monkeypatch
):
    monkeypatch.setattr(watch_module, "EXPIRY_CHECK_S", 0.05)
    settings = _settings(root)
    table = ImageTable.at(str(root))
    snapshots = _small_commits(table, 7)
    holds_partition_0 = threading.Event()
    # The full upkeep (compaction) is an hour away: only the trim between upkeeps can expire.
    cfg = WatchConfig(compact_interval_s=3600, keep_snapshots=3)
    upkeep = Upkeep(table, settings, cfg, threading.Event(), pinned=set, leads=holds_partition_0.is_set)

    def kept() -> list[int]:
        return [s.snapshot_id for s in pyiceberg_alone(root).snapshots()]

    upkeep.start()
    try:
        time.sleep(0.5)  # ten looks at the table while another watch holds partition 0
        assert kept() == snapshots
        holds_partition_0.set()
        deadline = time.monotonic() + 30
        while len(kept()) > 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        upkeep.close()
    assert sorted(kept()) == sorted(snapshots[-3:])  # the newest 3, and no compaction commit
    assert table.current_snapshot_id() == snapshots[-1] and table.committed() == {0: 14}
