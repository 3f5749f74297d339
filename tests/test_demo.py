"""`python -m app demo` end to end, as `make demo` runs it (small, so CI can afford it)."""
import re

import pytest

from app import synth
from app.broker import free_port
from conftest import run_cli


@pytest.mark.slow
def test_demo_serves_predictions_and_rolls_out_the_federated_version(tmp_path):
    result = run_cli("demo", "--storage", str(tmp_path), "--records", "360", "--epochs", "1", "--rounds", "2",
                     "--http-port", str(free_port()), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"→ 200 label='([a-z_]+)' model_version=(\d+)", result.stdout)
    assert match, result.stdout[-3000:]
    assert match.group(1) in synth.DEFAULT_CLASSES and match.group(2) == "1"
    rollout = re.search(r"(\d+) requests during the rollout, (\d+) failed; versions served in order: (.+)",
                        result.stdout)
    assert rollout, result.stdout[-3000:]
    assert int(rollout.group(1)) > 0 and rollout.group(2) == "0" and rollout.group(3).strip() == "1 → 2"
    assert "== done in" in result.stdout
