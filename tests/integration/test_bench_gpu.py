"""bench/gpu.py, the one script a lent GPU runs (issue #28), must work the first time it meets one:
here its every part runs on CPU (`--cpu`), and without a GPU a plain run skips cleanly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import ROOT, child_env


def bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), *args],
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=timeout,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU a plain run is the real benchmark")
def test_without_a_gpu_it_says_so_and_exits_0():
    result = bench(timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipped: no CUDA GPU here" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_its_cpu_path_runs_every_part_and_prints_each_goal():
    result = bench("--cpu", timeout=840)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    out = result.stdout
    for title in ("1. preprocess 32 64 px JPEGs → 32 px", "2. train cnn at 32 px", "3. serve cnn at 32 px"):
        assert title in out, out
    assert "CPU actors (ingest without a GPU)" in out and "libjpeg" in out
    for run in ("cnn bf16", "cnn fp16"):  # both autocast modes trained through the full path
        assert run in out
    goals = [line for line in out.splitlines() if line.startswith("goal: ")]
    assert len(goals) == 3 and all(line.endswith(("(PASS)", "(MISS)")) for line in goals), goals
