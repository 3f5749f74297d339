"""Continuous ingest (`watch`): long-lived pipeline, parts, compaction, lag alerts, kills.

Real embedded broker, real Ray; every offset must be live exactly once in the snapshots.
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
from datetime import datetime

import pytest

from app.config import IngestConfig
from app.data import synth
from app.data.compact import folder_owner
from app.data.ingest import ingest
from app.data.kafka import ensure_topics
from app.data.manifest import live_manifests
from app.data.records import record_headers
from app.data.snapshot import SnapshotStore, read_rows
from app.data.watch import WatchConfig, measure_lag, watch

from conftest import ROOT, MetricsWatcher, child_env, scrape, settings_args


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


def list_manifests(settings) -> list:
    return SnapshotStore.at(settings.uri()).manifests()


def live_offsets(settings) -> list[tuple[int, int]]:
    """(partition, offset) of every row in the live snapshots, duplicates kept."""
    snapshots = SnapshotStore.at(settings.uri())
    live = [m for m in live_manifests(snapshots.manifests()) if m.files]
    if not live:
        return []
    table = read_rows([snapshots.uri(m.snapshot_id) for m in live], ["partition", "offset"])
    return list(zip(table.column("partition").to_pylist(), table.column("offset").to_pylist()))


def covered(settings) -> int:
    return sum(m.records for m in live_manifests(list_manifests(settings)))


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
    cfg = WatchConfig(lag_alert_s=1.5, lag_alert_for_s=1.0, pause_file=str(pause), compact_window_s=None)
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
            assert not list_manifests(settings)  # paused: nothing committed
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


def test_watch_keeps_one_actor_pool_commits_parts_and_compacts_each_offset_once(settings, ray_cluster):
    import ray

    def writers() -> set[str]:
        # The GCS's actor table (the state API needs the dashboard, which the tests' Ray lacks).
        actors = ray._private.state.actors().items()
        return {i for i, a in actors if a["ActorClassName"] == "PartWriter" and a["State"] == "ALIVE"}

    before = writers()
    cfg = WatchConfig(max_batch_delay_s=0.3, compact_window_s=None, compact_max_records=60, compact_grace_s=0)
    expected = []
    with Watcher(settings, cfg):
        pools = []
        for wave in range(3):
            expected.extend(send(settings, 25, seed=10 + wave))
            _wait(lambda: covered(settings) == 25 * (wave + 1), 60, f"wave {wave}")  # noqa: B023
            pools.append(writers() - before)
        assert pools[0] and pools[0] == pools[1] == pools[2]  # the same actors served every part
        _wait(lambda: any(m.supersedes for m in list_manifests(settings)), 30, "a compaction")
    manifests = list_manifests(settings)
    parts = [m for m in manifests if m.snapshot_id.endswith("-part")]
    compacted = [m for m in manifests if m.supersedes]
    assert len(compacted) == 1 and len(compacted[0].supersedes) >= 2
    assert not set(compacted[0].supersedes) & {m.snapshot_id for m in parts}  # grace 0: deleted
    assert sorted(live_offsets(settings)) == sorted(expected)  # each offset exactly once
    trained_on = SnapshotStore.at(settings.uri()).select(settings.topic, settings.image_size, None)
    assert compacted[0].snapshot_id in {m.snapshot_id for m in trained_on}
    assert not set(compacted[0].supersedes) & {m.snapshot_id for m in trained_on}


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
def test_watch_killed_mid_stream_restarts_where_the_parts_end(settings, ray_cluster):
    expected = send(settings, 20, seed=21)
    child = _start_watch_child(settings, "--compact-window-s", "3600")
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
        _wait(lambda: len(list_manifests(settings)) >= 2, 120, "two committed parts")
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
    with Watcher(settings, WatchConfig(max_batch_delay_s=0.3, compact_window_s=None)):
        _wait(lambda: covered(settings) >= len(expected), 120, "the restarted watch to catch up")
    # A restart from scratch would duplicate the first parts; a restart past the ledger would lose.
    assert sorted(live_offsets(settings)) == sorted(expected)


@pytest.mark.slow
def test_compaction_killed_before_its_manifest_reruns_exactly(settings, ray_cluster):
    first = send(settings, 20, seed=31)
    child = _start_watch_child(
        settings,
        "--compact-max-records",
        "30",
        env={"ARGUS_FAULT": "before_compact_manifest"},
    )
    try:
        _wait(lambda: covered(settings) == len(first), 120, "the first parts")
        expected = first + send(settings, 20, seed=32)
        assert child.wait(120) == 137, child.stdout.read()[-3000:]
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    snapshots = settings.local_storage_path / "snapshots"
    orphans = [d for d in snapshots.iterdir() if not (d / "_manifest.json").exists()]
    assert orphans  # the compacted files were written, their manifest never was
    cfg = WatchConfig(max_batch_delay_s=0.3, compact_window_s=None, compact_max_records=30)
    with Watcher(settings, cfg):
        _wait(lambda: covered(settings) == len(expected), 120, "the rest")
        _wait(lambda: any(m.supersedes for m in list_manifests(settings)), 60, "the compaction rerun")
    assert not any(d.name == o.name for o in orphans for d in snapshots.iterdir())
    assert sorted(live_offsets(settings)) == sorted(expected)


def _lease_records(folder) -> dict[str, dict]:
    """The live records under a lease folder, by file stem."""
    records = {}
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced or deleted as it was read: the next look sees it
            continue
        if record["expires_at"] > time.time():
            records[path.stem] = record
    return records


def partition_holders(settings) -> dict[int, int]:
    """Partition -> pid of the watch holding its lease now."""
    root = settings.local_storage_path / "leases" / f"ingest-{settings.topic}" / "partitions"
    holders = {}
    for folder in root.iterdir() if root.is_dir() else []:
        live = _lease_records(folder)
        if live:
            holders[int(folder.name)] = live[max(live)]["pid"]
    return holders


def _created(manifest) -> float:
    return datetime.fromisoformat(manifest.created_at).timestamp()


def part_owners(settings, since: float = 0.0) -> dict[str, set[int]]:
    """Owner id -> the partitions its parts committed after `since` (epoch seconds) cover."""
    owners: dict[str, set[int]] = {}
    for m in list_manifests(settings):
        if m.snapshot_id.endswith("-part") and m.records and _created(m) > since:
            owners.setdefault(folder_owner(m.snapshot_id), set()).update(m.offsets)
    return owners


def _group_flags(settings, partitions: int, *extra: str) -> list[str]:
    """A topic of `partitions` partitions and `watch` flags for one fresh group of watchers with a
    2 s session, small micro-batches, one preprocessing actor each and compaction every 40 records."""
    ensure_topics(settings.kafka_connection(), settings.topic, settings.dlq_topic, partitions)
    return [
        *("--partitions", str(partitions), "--group", f"g-{uuid.uuid4().hex[:8]}"),
        *("--session-timeout-s", "2", "--max-batch-records", "6", "--concurrency", "1"),
        *("--compact-window-s", "3600", "--compact-max-records", "40", *extra),
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
            _wait(
                lambda: set(partition_holders(settings).values()) == pids,
                240,
                "both watchers to hold partitions",
            )
            shared = settings.local_storage_path / "leases" / f"ingest-{settings.topic}" / "shared"
            owner_pid = {owner: r["pid"] for owner, r in _lease_records(shared).items()}
            assert set(owner_pid.values()) == pids
            _wait(lambda: len(part_owners(settings)) == 2, 120, "parts committed by both watchers")
            # While watchers share the topic a bulk ingest writes nothing.
            report = ingest(settings, IngestConfig(), settings.kafka_connection())
            assert report.held_by and "shared by 2 watcher(s)" in report.held_by
            holders = partition_holders(settings)
            victims = {p for p, pid in holders.items() if pid == victim.pid}
            assert victims and len(victims) < partitions
            before = part_owners(settings)
            assert {owner_pid[o] for o in before} == pids  # each committed parts of its own partitions

            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait(30)  # reaped: its pid is gone, so its leases are expired at once on this host
            killed_at, killed_wall = time.monotonic(), time.time()
            _wait(
                lambda: (
                    set(partition_holders(settings)) == set(range(partitions))
                    and set(partition_holders(settings).values()) == {survivor.pid}
                ),
                60,
                "the survivor to take every partition",
            )
            took_over_s = time.monotonic() - killed_at
            survivor_owner = next(o for o, pid in owner_pid.items() if pid == survivor.pid)
            _wait(
                lambda: victims <= part_owners(settings, killed_wall).get(survivor_owner, set()),
                60,
                "parts of the victim's partitions by the survivor",
            )
            committed_s = time.monotonic() - killed_at
            time.sleep(2)  # traffic goes on after the takeover
        _wait(lambda: covered(settings) >= len(expected), 120, "the survivor to commit every offset")
        assert survivor.poll() is None, "the survivor died"
        survivor.send_signal(signal.SIGINT)  # Ctrl-C, a clean stop: what is cut commits, nothing more
        assert survivor.wait(60) == 0
    print(f"takeover: leases {took_over_s:.1f}s, first part {committed_s:.1f}s after the kill")
    assert sorted(live_offsets(settings)) == sorted(expected)  # each offset once, none lost
    compacted = [m for m in list_manifests(settings) if m.supersedes]
    assert compacted
    # One compactor at a time: the compaction lease's holder (its owner id is in the snapshot's).
    early = {folder_owner(m.snapshot_id) for m in compacted if _created(m) < killed_wall}
    assert len(early) <= 1


def test_a_part_whose_partition_lease_was_taken_over_is_not_committed(settings, ray_cluster):
    from app.data.ingest import ingest_lease, write_spec
    from app.data.lease import Lease, SharedLease
    from app.data.partitions import Partitions, Restart
    from app.data.parts import Part, PartPipeline

    snapshots = SnapshotStore.at(settings.uri())
    hold = SharedLease(ingest_lease(snapshots.store, settings.topic).store)
    kafka = settings.kafka_connection()
    with hold.held():
        partitions = Partitions(snapshots, kafka, settings.topic, hold, strict=False)
        pipeline = PartPipeline(
            snapshots, write_spec(settings, IngestConfig()), IngestConfig(), kafka, hold.owner
        )
        assert partitions.take([0]) == [0]
        lease = partitions.owned[0]
        lease.release()  # as if it had expired while this watch stalled...
        Lease(lease.store).acquire()  # ...and another watch took the partition over
        # A part cut before the stall: retention's losses only, so it needs no preprocessing.
        pipeline.in_flight.append(Part("snap-x-wy-part", {0: (5, 5)}, {}, {0: 5}, [], None, 0, {}, 0.0))
        committed = []
        with pytest.raises(Restart, match="taken over"):
            pipeline.commit_ready(
                lambda part: partitions.fence(part.ranges), lambda *done: committed.append(done)
            )
        assert not committed and len(pipeline.in_flight) == 1
        partitions.release_all()
    assert not list_manifests(settings)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_watcher_paused_past_its_lease_loses_its_partitions_and_commits_no_duplicate(
    settings, ray_cluster, tmp_path
):
    flags = _group_flags(settings, 4, "--lease-ttl-s", "3")
    with _watchers(settings, flags, tmp_path) as watchers:
        paused, other = watchers
        pids = {w.pid for w in watchers}
        with _trickling(settings, seed=2000) as expected:
            _wait(
                lambda: set(partition_holders(settings).values()) == pids,
                240,
                "both watchers to hold partitions",
            )
            _wait(lambda: len(part_owners(settings)) == 2, 120, "parts committed by both watchers")
            os.killpg(paused.pid, signal.SIGSTOP)  # a stall (GC, swap, a stopped VM) past session and TTL
            try:
                _wait(
                    lambda: set(partition_holders(settings).values()) == {other.pid},
                    60,
                    "the other to take over",
                )
                time.sleep(1)
            finally:
                os.killpg(paused.pid, signal.SIGCONT)
            # Back, it finds its leases gone, drops what it held and rejoins: the two share again.
            _wait(lambda: set(partition_holders(settings).values()) == pids, 120, "the paused one to rejoin")
            time.sleep(2)
        _wait(lambda: covered(settings) >= len(expected), 120, "every offset committed")
        for w in watchers:
            w.send_signal(signal.SIGINT)
        assert [w.wait(60) for w in watchers] == [0, 0]
    assert sorted(live_offsets(settings)) == sorted(expected)


def test_the_lag_exporter_sees_the_brokers_backlog_and_its_age_with_no_watch_running(
    settings, ray_cluster, cli
):
    """A watch's own lag counts only what it consumed: with none running, nothing else saw the
    backlog. `argus lag` measures it from the broker: log end − the ledger's next offset, and the
    Kafka timestamp of the oldest record waiting."""
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

    ingest(settings, IngestConfig(), settings.kafka_connection())  # the ledger catches up
    result = cli("lag", "--once", *settings_args(settings))
    assert result.stdout.count("0 records behind") == 2 and result.stdout.count("oldest waiting 0.0s") == 2, (
        result.stdout
    )
