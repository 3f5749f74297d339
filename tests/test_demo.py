"""`python -m app demo` end to end, as `make demo` runs it (small, so CI can afford it)."""
import re

import pytest

from app import synth
from app.broker import free_port
from conftest import run_cli


@pytest.mark.slow
def test_demo_serves_a_prediction(tmp_path):
    result = run_cli("demo", "--storage", str(tmp_path), "--records", "360", "--epochs", "1",
                     "--http-port", str(free_port()), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"→ 200 label='([a-z_]+)' model_version=(\d+)", result.stdout)
    assert match, result.stdout[-3000:]
    assert match.group(1) in synth.DEFAULT_CLASSES and match.group(2) == "1"
    assert "== done in" in result.stdout
