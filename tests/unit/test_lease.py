"""The one-writer lease (app.data.lease) on local disk: exclusive, renewed, expired by time or by the
holder's death, and lost to a takeover. The same code runs on S3 (tests/integration/test_s3.py).

Time is the lease's clock, moved by hand: expiry and renewal are checked at exact instants, not
raced against a machine's load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from app.data.lease import Lease, LeaseHeld, LeaseLost, SharedLease
from app.storage import Store

from conftest import ROOT


class Clock:
    """A lease clock that moves only when told."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _expired_elsewhere(now: float) -> dict:
    """A holder record of a writer on another host whose lease ran out a second before `now`."""
    return {"owner": "gone", "host": "another-host", "pid": 1, "acquired_at": 0.0, "expires_at": now - 1}


@pytest.fixture
def store(tmp_path) -> Store:
    return Store.at(str(tmp_path / "lease"))


def test_a_second_writer_is_refused_until_the_first_releases(store):
    first, second = Lease(store), Lease(store)
    with first.held():
        with pytest.raises(LeaseHeld, match=f"held by {first.owner}"):
            second.acquire()
        first.check()
    with second.held():
        second.check()
        assert second.generation == first.generation + 1


def test_a_renewed_holder_outlives_its_first_ttl_and_expires_one_ttl_after_its_last_renewal(store):
    clock = Clock()
    holder = Lease(store, ttl_s=30, clock=clock)
    holder.acquire()
    clock.now += 25
    holder.renew()  # live until 25 + 30
    clock.now += 25  # 50 s after acquiring: past the first expiry, within the renewed one
    holder.check()
    with pytest.raises(LeaseHeld, match=f"held by {holder.owner}"):
        Lease(store, ttl_s=30, clock=clock).acquire()
    clock.now += 6  # 31 s after the renewal
    with pytest.raises(LeaseLost, match="expired"):
        holder.check()
    with pytest.raises(LeaseLost, match="expired"):
        holder.renew()  # too late: an expired holder must not revive its lease
    successor = Lease(store, ttl_s=30, clock=clock)
    successor.acquire()
    assert successor.generation == holder.generation + 1


def test_the_heartbeat_renews_the_record_while_the_lease_is_held(store, tmp_path):
    lease = Lease(store, ttl_s=3)  # a beat every second
    with lease.held():
        record = tmp_path / "lease" / f"{lease.generation:012d}.json"
        first = json.loads(record.read_text())["expires_at"]
        deadline = time.monotonic() + 60
        while json.loads(record.read_text())["expires_at"] == first:
            assert time.monotonic() < deadline, "the heartbeat never renewed the lease"
            time.sleep(0.1)
        lease.check()
    assert json.loads(record.read_text())["expires_at"] == 0.0  # released on the way out


def test_an_expired_holder_elsewhere_loses_the_lease_to_the_next_writer(store, tmp_path):
    clock = Clock()
    root = tmp_path / "lease"
    root.mkdir()
    (root / "000000000007.json").write_text(json.dumps(_expired_elsewhere(clock.now)))
    lease = Lease(store, clock=clock)
    lease.acquire()
    assert lease.generation == 8 and not (root / "000000000007.json").exists()


def test_a_holder_killed_on_this_host_is_expired_at_once(store, tmp_path):
    code = (
        "import sys, time; from app.data.lease import Lease; from app.storage import Store; "
        f"Lease(Store.at({str(tmp_path / 'lease')!r}), ttl_s=600).acquire(); print('held', flush=True); "
        "time.sleep(600)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld):
            Lease(store).acquire()
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
        Lease(store).acquire()  # no 600 s wait: its pid is gone
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)


def test_a_writer_whose_lease_was_taken_over_must_not_commit(store):
    clock = Clock()
    slow = Lease(store, ttl_s=30, clock=clock)
    slow.acquire()  # no heartbeat: a writer that stalled...
    clock.now += 31  # ...past its TTL
    Lease(store, ttl_s=30, clock=clock).acquire()
    with pytest.raises(LeaseLost, match="taken over"):
        slow.check()


def test_shared_holders_coexist_and_exclude_the_exclusive_writer_and_it_them(store):
    first, second = SharedLease(store), SharedLease(store)
    with first.held(), second.held():  # two watches of one topic
        with pytest.raises(LeaseHeld, match="shared by 2 watcher"):
            Lease(store).acquire()  # a bulk ingest waits for both
        first.check()
        second.check()
    with Lease(store).held():  # both gone: the bulk ingest runs, and a watch waits for it
        with pytest.raises(LeaseHeld, match="held by"):
            SharedLease(store).acquire()
    with SharedLease(store).held() as again:
        again.check()


def test_a_writer_that_starts_at_the_same_moment_as_the_other_kind_backs_off(store):
    """Each writes its record before looking for the other's: the later look sees the earlier write."""
    exclusive = Lease(store)
    exclusive.sharers = lambda: []  # it looked before the watch's record was written...
    exclusive.acquire()
    with pytest.raises(LeaseHeld, match=f"held by {exclusive.owner}"):
        SharedLease(store).acquire()  # ...so the watch, looking after, sees its generation
    exclusive.release()

    watch, late = SharedLease(store), Lease(store)
    watch.acquire()
    looks = []  # the other order: its first look missed the watch, its second sees it
    late.sharers = lambda: Lease.sharers(late) if looks.append(1) or len(looks) > 1 else []
    with pytest.raises(LeaseHeld, match="shared by 1"):
        late.acquire()
    assert late._read(late.generation).expires_at == 0.0  # the generation it wrote is released
    watch.check()


def test_a_dead_or_expired_sharer_neither_blocks_the_exclusive_writer_nor_may_commit(store, tmp_path):
    clock = Clock()
    root = tmp_path / "lease"
    (root / "shared").mkdir(parents=True)
    (root / "shared" / "gone.json").write_text(json.dumps(_expired_elsewhere(clock.now)))
    paused = SharedLease(store, ttl_s=30, clock=clock)
    paused.acquire()  # no heartbeat: a watch that stalled past its TTL
    clock.now += 31
    exclusive = Lease(store, ttl_s=30, clock=clock)
    exclusive.acquire()
    with pytest.raises(LeaseLost, match="expired"):
        paused.check()
    assert not (root / "shared" / "gone.json").exists()  # nobody renews it again: deleted
    exclusive.release()
