"""The one-writer lease (app.data.lease) on local disk: exclusive, renewed, expired by time or by the
holder's death, and lost to a takeover. The same code runs on S3 (tests/integration/test_s3.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from app.data.lease import Lease, LeaseHeld, LeaseLost, SharedLease

from conftest import ROOT


def _expired_elsewhere() -> dict:
    """A holder record of a writer on another host whose lease ran out a second ago."""
    return {
        "owner": "gone",
        "host": "another-host",
        "pid": 1,
        "acquired_at": 0.0,
        "expires_at": time.time() - 1,
    }


def test_a_second_writer_is_refused_until_the_first_releases(tmp_path):
    first, second = Lease(str(tmp_path / "lease")), Lease(str(tmp_path / "lease"))
    with first.held():
        with pytest.raises(LeaseHeld, match=f"held by {first.owner}"):
            second.acquire()
        first.check()
    with second.held():
        second.check()
        assert second.generation == first.generation + 1


def test_the_holder_renews_so_it_outlives_its_ttl(tmp_path):
    lease = Lease(str(tmp_path / "lease"), ttl_s=0.6)
    with lease.held():
        time.sleep(1.5)  # more than two TTLs: only the heartbeat keeps it
        lease.check()
        with pytest.raises(LeaseHeld):
            Lease(str(tmp_path / "lease"), ttl_s=0.6).acquire()


def test_an_expired_holder_elsewhere_loses_the_lease_to_the_next_writer(tmp_path):
    root = tmp_path / "lease"
    root.mkdir()
    (root / "000000000007.json").write_text(json.dumps(_expired_elsewhere()))
    lease = Lease(str(root))
    lease.acquire()
    assert lease.generation == 8 and not (root / "000000000007.json").exists()


def test_a_holder_killed_on_this_host_is_expired_at_once(tmp_path):
    code = (
        "import sys, time; from app.data.lease import Lease; "
        f"Lease({str(tmp_path / 'lease')!r}, ttl_s=600).acquire(); print('held', flush=True); time.sleep(600)"
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
            Lease(str(tmp_path / "lease")).acquire()
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
        Lease(str(tmp_path / "lease")).acquire()  # no 600 s wait: its pid is gone
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)


def test_a_writer_whose_lease_was_taken_over_must_not_commit(tmp_path):
    slow = Lease(str(tmp_path / "lease"), ttl_s=0.5)
    slow.acquire()  # no heartbeat: a writer that stalled
    time.sleep(0.6)
    with Lease(str(tmp_path / "lease")).held():
        with pytest.raises(LeaseLost, match="taken over"):
            slow.check()


def test_shared_holders_coexist_and_exclude_the_exclusive_writer_and_it_them(tmp_path):
    root = str(tmp_path / "lease")
    first, second = SharedLease(root), SharedLease(root)
    with first.held(), second.held():  # two watches of one topic
        with pytest.raises(LeaseHeld, match="shared by 2 watcher"):
            Lease(root).acquire()  # a bulk ingest waits for both
        first.check()
        second.check()
    with Lease(root).held():  # both gone: the bulk ingest runs, and a watch waits for it
        with pytest.raises(LeaseHeld, match="held by"):
            SharedLease(root).acquire()
    with SharedLease(root).held() as again:
        again.check()


def test_a_writer_that_starts_at_the_same_moment_as_the_other_kind_backs_off(tmp_path):
    """Each writes its record before looking for the other's: the later look sees the earlier write."""
    root = str(tmp_path / "lease")
    exclusive = Lease(root)
    exclusive.sharers = lambda: []  # it looked before the watch's record was written...
    exclusive.acquire()
    with pytest.raises(LeaseHeld, match=f"held by {exclusive.owner}"):
        SharedLease(root).acquire()  # ...so the watch, looking after, sees its generation
    exclusive.release()

    watch, late = SharedLease(root), Lease(root)
    watch.acquire()
    looks = []  # the other order: its first look missed the watch, its second sees it
    late.sharers = lambda: Lease.sharers(late) if looks.append(1) or len(looks) > 1 else []
    with pytest.raises(LeaseHeld, match="shared by 1"):
        late.acquire()
    assert late._read(late.generation).expires_at == 0.0  # the generation it wrote is released
    watch.check()


def test_a_dead_or_expired_sharer_neither_blocks_the_exclusive_writer_nor_may_commit(tmp_path):
    root = tmp_path / "lease"
    (root / "shared").mkdir(parents=True)
    (root / "shared" / "gone.json").write_text(json.dumps(_expired_elsewhere()))
    paused = SharedLease(str(root), ttl_s=0.5)
    paused.acquire()  # no heartbeat: a watch that stalled past its TTL
    time.sleep(0.6)
    with Lease(str(root)).held():
        with pytest.raises(LeaseLost, match="expired"):
            paused.check()
    assert not (root / "shared" / "gone.json").exists()  # nobody renews it again: deleted
