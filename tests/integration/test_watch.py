"""Continuous ingest (`watch`) into the Iceberg table: one long-lived pipeline, a table commit per
part, lag alerts, kills at every commit step, watchers sharing a topic, a bulk ingest beside a
watch, the table's upkeep while parts commit, and lag measured with no watch.

Real embedded broker, real Ray, real SQLite catalog; every offset must be in the table exactly once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.config import IngestConfig
from app.data import synth
from app.data.backlog import existing_table
from app.data.ingest import ingest
from app.data.kafka import ensure_topics
from app.data.metadata import RANGES_KEY
from app.data.parts import WRITER_KEY
from app.data.records import record_headers
from app.data.watch import WatchConfig, measure_lag, watch

from conftest import ROOT, MetricsWatcher, child_env, scrape, settings_args
from tables import coordinates, pyiceberg_alone

NO_UPKEEP = dict(compact_interval_s=0)


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def send(settings, n: int, seed: int) -> list[tuple[int, int]]:
    producer = settings.kafka_connection().producer(linger_ms=5)
    futures = [
        producer.send(
            settings.topic,
            key=r.user_id.encode(),
            value=r.value,
            headers=record_headers(r.label, r.event_time_ms, r.device_id),
        )
        for r in synth.generate(n, seed=seed, size=32, late_fraction=0.0, corrupt_fraction=0.0)
    ]
    producer.flush()
    producer.close()
    return [(f.get().partition, f.get().offset) for f in futures]


def covered(settings) -> int:
    """Offsets the table has committed, over every partition (0 before the table exists)."""
    table = existing_table(settings)
    return sum(table.committed().values()) if table else 0


def table_offsets(settings) -> list[tuple[int, int]]:
    """(partition, offset) of every row of the table's current snapshot, sorted, duplicates kept,
    read through PyIceberg alone."""
    table = pyiceberg_alone(Path(settings.storage))
    if table.current_snapshot() is None:
        return []
    return coordinates(table.scan(selected_fields=("kafka_partition", "kafka_offset")).to_arrow())


def commits(settings) -> list[dict[str, str]]:
    """Every table snapshot's summary, oldest first, each with its `timestamp_ms`."""
    table = existing_table(settings)
    if table is None:
        return []
    snapshots = sorted(table.load().snapshots(), key=lambda s: s.timestamp_ms)
    return [{**s.summary.additional_properties, "timestamp_ms": str(s.timestamp_ms)} for s in snapshots]


def writers(settings, since_ms: int = 0) -> dict[int, set[int]]:
    """Watch pid -> the partitions its parts committed after `since_ms` (epoch ms) carry offsets of."""
    out: dict[int, set[int]] = {}
    for summary in commits(settings):
        writer = summary.get(WRITER_KEY, "")
        if not writer.startswith("watch ") or int(summary["timestamp_ms"]) <= since_ms:
            continue
        ranges = json.loads(summary[RANGES_KEY])
        pid = int(writer.rsplit(":", 1)[1])
        out.setdefault(pid, set()).update(int(p) for p, (s, e) in ranges.items() if e > s)
    return out


class Watcher:
    """`watch()` in a thread of this process (on the tests' Ray)."""

    def __init__(self, settings, cfg: WatchConfig):
        self.stop, self.alerts = threading.Event(), []
        self.thread = threading.Thread(
            target=lambda: self.alerts.append(
                watch(settings, cfg, IngestConfig(), settings.kafka_connection(), self.stop)
            )
        )

    def __enter__(self) -> Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def test_lag_alert_fires_once_after_for_s_clears_when_lag_recovers(settings, ray_cluster, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="app.data.stream")
    pause = tmp_path / "pause"
    pause.touch()
    send(settings, 24, seed=1)
    cfg = WatchConfig(lag_alert_s=1.5, lag_alert_for_s=1.0, pause_file=str(pause), **NO_UPKEEP)
    gauges = (
        "ray_argus_consumer_lag_seconds",
        "ray_argus_consumer_lag_records",
        "ray_argus_lag_alert_active",
    )
    messages = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
    with MetricsWatcher(ray_cluster, *gauges, match=f'topic="{settings.topic}"') as metrics_seen:
        with Watcher(settings, cfg) as watcher:
            _wait(lambda: any("LAG ALERT" in m for m in messages()), 60, "a lag alert")
            alert = next(r for r in caplog.records if "LAG ALERT" in r.getMessage())
            assert alert.levelno == logging.WARNING and "24 records" in alert.getMessage()
            assert covered(settings) == 0  # paused: nothing committed
            time.sleep(2)  # still over the threshold: the alert stays one alert, not one per loop
            assert sum("LAG ALERT" in m for m in messages()) == 1
            _wait(
                lambda: any(
                    "ray_argus_lag_alert_active{" in s and s.endswith(" 1.0")
                    for s in metrics_seen.seen["ray_argus_lag_alert_active"]
                ),
                30,
                "the alert gauge at 1",
            )
            pause.unlink()
            _wait(lambda: covered(settings) == 24, 60, "the catch-up")
            _wait(lambda: any("lag alert cleared" in m for m in messages()), 30, "the alert to clear")
            _wait(
                lambda: metrics_seen.seen["ray_argus_lag_alert_active"][-1].endswith(" 0.0"),
                30,
                "the alert gauge back at 0",
            )
            assert measure_lag(settings, settings.kafka_connection()).total == 0
    assert watcher.alerts == [1]
    lines = scrape(ray_cluster, "ray_argus_lag_alerts_total", "ray_argus_watch_parts_total")
    assert any(f'topic="{settings.topic}"' in line for line in lines["ray_argus_lag_alerts_total"])
    missing = [n for n, samples in metrics_seen.seen.items() if not samples]
    assert not missing, f"gauges not exported while watching: {missing}"


def test_watch_keeps_one_actor_pool_commits_parts_and_compacts_them_each_offset_once(settings, ray_cluster):
    import ray

    def part_writers() -> set[str]:
        # The GCS's actor table (the state API needs the dashboard, which the tests' Ray lacks).
        actors = ray._private.state.actors().items()
        return {i for i, a in actors if a["ActorClassName"] == "PartWriter" and a["State"] == "ALIVE"}

    before = part_writers()
    cfg = WatchConfig(max_batch_delay_s=0.3, compact_interval_s=1.0)
    expected = []
    with Watcher(settings, cfg):
        pools = []
        for wave in range(3):
            expected.extend(send(settings, 25, seed=10 + wave))
            _wait(lambda: covered(settings) == 25 * (wave + 1), 60, f"wave {wave}")  # noqa: B023
            pools.append(part_writers() - before)
        assert pools[0] and pools[0] == pools[1] == pools[2]  # the same actors wrote every part
        parts = [c for c in commits(settings) if c.get(WRITER_KEY, "").startswith("watch ")]
        assert len(parts) >= 3  # a commit per part, at least one per wave
        # The upkeep compacts beside the parts' commits (a race either side may lose and re-plan).
        _wait(
            lambda: "argus.compacted.files" in commits(settings)[-1], 60, "a compaction after the last part"
        )
    table = existing_table(settings)
    current = table.current_snapshot_id()
    dates = set(table.scan(current, ["event_date"]).column("event_date").to_pylist())
    assert len(table.data_file_uris(current)) == len(dates)  # the parts' small files: one per date
    assert table_offsets(settings) == sorted(expected)  # each offset exactly once
    assert sum(table.committed().values()) == len(expected)  # carried through the compaction


def _start_watch_child(settings, *extra: str, env: dict | None = None, log=None) -> subprocess.Popen:
    import ray

    args = [
        sys.executable,
        "-m",
        "app",
        "watch",
        *settings_args(settings),
        "--ray-address",
        ray.get_runtime_context().gcs_address,
        "--max-batch-delay-s",
        "0.3",
        *extra,
    ]
    # Its own session, so a kill takes the whole process group the test started and nothing else.
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT), **(env or {})),
        stdout=log or subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_watch_killed_at_each_step_of_a_commit_resumes_exactly_where_the_table_is(settings, ray_cluster):
    expected = send(settings, 10, seed=21)
    for i, point in enumerate(("after_write", "before_commit", "after_commit")):
        before = covered(settings)
        child = _start_watch_child(settings, env={"ARGUS_FAULT": point})
        try:
            assert child.wait(180) == 137, child.stdout.read()[-3000:]
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
        # Killed before the catalog swap, it committed nothing; after it, its one part.
        assert (covered(settings) > before) == (point == "after_commit"), point
        expected += send(settings, 6, seed=22 + i)
    with Watcher(settings, WatchConfig(max_batch_delay_s=0.3, **NO_UPKEEP)):
        _wait(lambda: covered(settings) >= len(expected), 120, "the restarted watch to catch up")
    # A restart from scratch would duplicate the committed part; one past the table would lose.
    assert table_offsets(settings) == sorted(expected)


@pytest.mark.slow
def test_watch_killed_mid_stream_restarts_where_the_table_is(settings, ray_cluster):
    expected = send(settings, 20, seed=31)
    child = _start_watch_child(settings)
    stop_sending = threading.Event()

    def trickle() -> None:  # a producer that keeps sending while the watch is killed
        seed = 100
        while not stop_sending.is_set():
            expected.extend(send(settings, 3, seed=seed))
            seed += 1
            time.sleep(0.2)

    producer = threading.Thread(target=trickle)
    producer.start()
    try:
        _wait(lambda: len(commits(settings)) >= 2, 120, "two committed parts")
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
        time.sleep(1)
    finally:
        stop_sending.set()
        producer.join()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    committed_before = covered(settings)
    assert 0 < committed_before < len(expected)
    with Watcher(settings, WatchConfig(max_batch_delay_s=0.3, **NO_UPKEEP)):
        _wait(lambda: covered(settings) >= len(expected), 120, "the restarted watch to catch up")
    assert table_offsets(settings) == sorted(expected)


def test_a_watch_beside_a_bulk_ingest_starts_over_from_the_table_when_the_ingest_commits_first(
    settings, ray_cluster, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="app.data")
    pause = tmp_path / "pause"
    pause.touch()
    expected = send(settings, 12, seed=41)
    cfg = WatchConfig(max_batch_delay_s=0.3, pause_file=str(pause), **NO_UPKEEP)
    messages = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
    with Watcher(settings, cfg):
        # The watch reads from where the table was when the group assigned it the partitions...
        _wait(lambda: any("assigned partitions" in m for m in messages()), 120, "the assignment")
        time.sleep(1)  # ...and holds the records, paused, in its batch
        report = ingest(settings, IngestConfig(), settings.kafka_connection())  # no lease to wait for
        assert report.records == 12 and covered(settings) == 12
        pause.unlink()  # its part now starts below the table's offsets: refused, and it starts over
        _wait(lambda: any("starts over from the table" in m for m in messages()), 60, "the restart")
        expected += send(settings, 8, seed=42)
        _wait(lambda: covered(settings) == 20, 120, "the watch to commit what came after")
    restart = next(m for m in messages() if "starts over from the table" in m)
    assert "moved since this writer planned" in restart, restart
    assert table_offsets(settings) == sorted(expected)
    assert len([c for c in commits(settings) if c.get(WRITER_KEY, "").startswith("watch ")]) >= 1


def _group_flags(settings, partitions: int, *extra: str) -> list[str]:
    """A topic of `partitions` partitions and `watch` flags for one fresh group of watchers with a
    2 s session, small micro-batches, one preprocessing actor each and no upkeep."""
    ensure_topics(settings.kafka_connection(), settings.topic, settings.dlq_topic, partitions)
    return [
        *("--partitions", str(partitions), "--group", f"g-{uuid.uuid4().hex[:8]}"),
        *("--session-timeout-s", "2", "--max-batch-records", "6", "--concurrency", "1"),
        *("--compact-interval-s", "0", *extra),
    ]


@contextlib.contextmanager
def _watchers(settings, flags: list[str], tmp_path) -> Iterator[list[subprocess.Popen]]:
    """Two `watch` children in their own process groups (logs in tmp_path), killed on the way out."""
    logs = [open(tmp_path / f"watch-{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    watchers = [_start_watch_child(settings, *flags, log=log) for log in logs]
    try:
        yield watchers
    finally:
        for w in watchers:
            if w.poll() is None:
                os.killpg(w.pid, signal.SIGKILL)
                w.wait(30)
        for log in logs:
            log.close()


@contextlib.contextmanager
def _trickling(settings, seed: int) -> Iterator[list[tuple[int, int]]]:
    """Steady traffic while inside (4 records every 0.2 s); yields each sent (partition, offset)."""
    expected: list[tuple[int, int]] = []
    stop = threading.Event()

    def run() -> None:
        for batch_seed in itertools.count(seed):
            if stop.is_set():
                return
            expected.extend(send(settings, 4, seed=batch_seed))
            time.sleep(0.2)

    producer = threading.Thread(target=run)
    producer.start()
    try:
        yield expected
    finally:
        stop.set()
        producer.join()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_watchers_share_partitions_and_a_killed_ones_move_to_the_other_each_offset_once(
    settings, ray_cluster, tmp_path
):
    partitions = 4
    flags = _group_flags(settings, partitions)
    with _watchers(settings, flags, tmp_path) as watchers:
        victim, survivor = watchers
        pids = {w.pid for w in watchers}
        with _trickling(settings, seed=1000) as expected:
            _wait(lambda: set(writers(settings)) == pids, 240, "parts committed by both watchers")
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(30)
            killed_at, killed_ms = time.monotonic(), int(time.time() * 1000)
            _wait(
                lambda: writers(settings, killed_ms).get(survivor.pid, set()) == set(range(partitions)),
                60,
                "the survivor to commit parts of every partition",
            )
            took_over_s = time.monotonic() - killed_at
            time.sleep(2)  # traffic goes on after the takeover
        _wait(lambda: covered(settings) >= len(expected), 120, "the survivor to commit every offset")
        assert survivor.poll() is None, "the survivor died"
        survivor.send_signal(signal.SIGINT)  # Ctrl-C, a clean stop: what is cut commits, nothing more
        assert survivor.wait(60) == 0
    print(f"takeover: the survivor committed every partition {took_over_s:.1f}s after the kill")
    assert table_offsets(settings) == sorted(expected)  # each offset once, none lost


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_watcher_paused_past_its_session_loses_its_partitions_and_commits_no_duplicate(
    settings, ray_cluster, tmp_path
):
    partitions = 4
    flags = _group_flags(settings, partitions)
    with _watchers(settings, flags, tmp_path) as watchers:
        paused, other = watchers
        pids = {w.pid for w in watchers}
        with _trickling(settings, seed=2000) as expected:
            _wait(lambda: set(writers(settings)) == pids, 240, "parts committed by both watchers")
            os.killpg(paused.pid, signal.SIGSTOP)  # a stall (GC, swap, a stopped VM) past its session
            try:
                stopped_ms = int(time.time() * 1000)
                _wait(
                    lambda: writers(settings, stopped_ms).get(other.pid, set()) == set(range(partitions)),
                    60,
                    "the other to commit every partition",
                )
                time.sleep(1)
            finally:
                os.killpg(paused.pid, signal.SIGCONT)
            # Back, whatever it held of the partitions it lost is refused or dropped: it rejoins.
            resumed_ms = int(time.time() * 1000)
            _wait(lambda: set(writers(settings, resumed_ms)) == pids, 120, "both to commit again")
            time.sleep(2)
        _wait(lambda: covered(settings) >= len(expected), 120, "every offset committed")
        for w in watchers:
            w.send_signal(signal.SIGINT)
        assert [w.wait(60) for w in watchers] == [0, 0]
    assert table_offsets(settings) == sorted(expected)


def test_the_lag_exporter_sees_the_brokers_backlog_and_its_age_with_no_watch_running(
    settings, ray_cluster, cli
):
    """A watch's own lag counts only what it consumed: with none running, nothing else saw the
    backlog. `argus lag` measures it from the broker: log end − the table's committed offset, and
    the Kafka timestamp of the oldest record waiting; before any table exists it creates none."""
    ensure_topics(settings.kafka_connection(), settings.topic, settings.dlq_topic, 2, 1)
    ten_minutes_ago_ms = int(time.time() * 1000) - 600_000
    producer = settings.kafka_connection().producer(linger_ms=5)
    records = list(synth.generate(12, seed=41, size=32, late_fraction=0.0, corrupt_fraction=0.0))
    for i, r in enumerate(records):  # partition by hand: 8 on partition 0, 4 on partition 1
        producer.send(
            settings.topic,
            key=r.user_id.encode(),
            value=r.value,
            headers=record_headers(r.label, r.event_time_ms, r.device_id),
            partition=0 if i < 8 else 1,
            timestamp_ms=ten_minutes_ago_ms + (60_000 if i in (0, 8) else 120_000),  # first: older
        )
    producer.flush()
    producer.close()

    result = cli("lag", "--once", *settings_args(settings))
    assert result.returncode == 0, result.stderr
    assert existing_table(settings) is None  # measured without creating the table
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith(settings.topic))
    ages = [float(age) for age in re.findall(r"oldest waiting ([\d.]+)s", "\n".join(lines))]
    assert [
        re.search(r"(\d+) records behind \(committed 0, end (\d+)\)", line).groups() for line in lines
    ] == [
        ("8", "8"),
        ("4", "4"),
    ], lines
    assert len(ages) == 2 and all(530 <= age < 600 for age in ages), ages  # 9 minutes, plus the run
    exported = scrape(ray_cluster, "ray_argus_backlog_records", "ray_argus_backlog_oldest_age_seconds")
    mine = [line for line in exported["ray_argus_backlog_records"] if f'topic="{settings.topic}"' in line]
    assert sorted(float(line.rsplit(" ", 1)[1]) for line in mine) == [4.0, 8.0], mine

    ingest(settings, IngestConfig(), settings.kafka_connection())  # the table catches up
    result = cli("lag", "--once", *settings_args(settings))
    assert result.stdout.count("0 records behind") == 2 and result.stdout.count("oldest waiting 0.0s") == 2, (
        result.stdout
    )
    assert "(committed 8, end 8)" in result.stdout and "(committed 4, end 4)" in result.stdout
