"""CONTRACT.md §3: with neither `--ray-address` nor RAY_ADDRESS a command runs on a local Ray of
its own, even where a `ray start` that was killed left its address in Ray's temp dir
(`<RAY_TMPDIR or /tmp>/ray/ray_current_cluster`), which a bare `ray.init()` tries to join.

The check runs in a child process whose RAY_TMPDIR is a fresh directory, so the stale file it
writes is where Ray really looks, and no other Ray on this machine sees it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from app.net import free_port

from conftest import ROOT, child_env

CHILD = """
import sys

import ray

from app.cluster import ray_session
from app.config import Settings

try:  # what Ray itself does with the stale file: join the dead cluster it names
    ray.init(num_cpus=1, include_dashboard=False)
    sys.exit("ray.init() started a Ray: it did not read the stale address")
except ValueError as exc:
    print("bare ray.init:", exc)
with ray_session(Settings(storage=sys.argv[1])):
    print("joined", ray.get_runtime_context().gcs_address, "with", ray.cluster_resources()["CPU"], "CPUs")
"""


def test_a_stale_ray_current_cluster_does_not_stop_a_local_run(tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="argus-stale-", dir="/tmp"))  # short: Ray's socket paths
    try:
        dead = f"127.0.0.1:{free_port()}"
        (ray_tmp / "ray").mkdir()
        (ray_tmp / "ray" / "ray_current_cluster").write_text(dead)
        result = subprocess.run(
            [sys.executable, "-c", CHILD, str(tmp_path / "data")],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=child_env(PYTHONPATH=str(ROOT), RAY_TMPDIR=str(ray_tmp), RAY_USAGE_STATS_ENABLED="0"),
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        assert "num_cpus and num_gpus must not be provided" in result.stdout  # the failure `make demo` hit
        joined = result.stdout.split("joined ", 1)[1].split()[0]
        assert joined != dead
        assert (ray_tmp / "ray" / "session_latest").exists()  # the local Ray's own session, in RAY_TMPDIR
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
