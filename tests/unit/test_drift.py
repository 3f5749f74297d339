"""Drift detection (app/ops/drift.py) without Ray: the MMD two-sample test, the traffic-log reader's
distrust of what it reads, and the replicas' log writer (app/serve/traffic.py's TrafficLog) on local disk."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from app.ops.drift import MAX_LINE_BYTES, STATISTICS, DriftReport, OutputTest, recent_traffic
from app.ops.two_sample import mmd_test
from app.storage import Store

CLASSES = ["a", "b", "c"]


def _probabilities(rng: np.random.Generator, n: int, concentration) -> np.ndarray:
    return rng.dirichlet(concentration, n)


def test_mmd_gives_a_large_p_value_for_samples_of_one_distribution():
    rng = np.random.default_rng(1)
    mmd2, p = mmd_test(_probabilities(rng, 300, [1, 1, 1]), _probabilities(rng, 200, [1, 1, 1]))
    assert p > 0.2 and abs(mmd2) < 0.01, (mmd2, p)


def test_mmd_gives_a_small_p_value_for_a_shifted_distribution():
    rng = np.random.default_rng(1)
    # One class a little more likely: a shift no argmax count of 100 requests would show for sure.
    mmd2, p = mmd_test(_probabilities(rng, 300, [1, 1, 1]), _probabilities(rng, 100, [2, 1, 1]))
    assert p <= 0.01 and mmd2 > 0.01, (mmd2, p)


def test_mmd_is_deterministic_for_a_seed_and_its_p_values_are_calibrated():
    rng = np.random.default_rng(2)
    x, y = _probabilities(rng, 80, [1, 1, 1]), _probabilities(rng, 60, [1, 1, 1])
    assert mmd_test(x, y, seed=3) == mmd_test(x, y, seed=3)
    assert mmd_test(x, y, seed=3)[1] != mmd_test(x, y, seed=4)[1]  # the permutations differ
    # Under the null a p-value below 0.05 is a 5 % event: in 60 trials, rarely more than 7.
    p_values = [
        mmd_test(*np.random.default_rng(s).dirichlet([1, 1, 1], (2, 40)), permutations=100, seed=s)[1]
        for s in range(60)
    ]
    assert sum(p < 0.05 for p in p_values) <= 7, p_values


def test_mmd_of_one_repeated_point_is_no_evidence():
    assert mmd_test(np.ones((5, 3)) / 3, np.ones((7, 3)) / 3) == (0.0, 1.0)


def test_the_report_counts_output_drift_and_shows_it_beside_the_psi_rows():
    psi = dict.fromkeys(STATISTICS, 0.01)
    thresholds = dict.fromkeys(STATISTICS, 0.2)
    calm = DriftReport("3", 100, psi, thresholds, OutputTest(0.0001, 0.6, 512, 100))
    shifted = DriftReport("3", 100, psi, thresholds, OutputTest(0.0412, 0.005, 512, 100))
    assert not calm.drifted and calm.output_p_value == 0.01
    assert shifted.drifted and "output           MMD² 0.0412  p 0.005  DRIFT" in str(shifted)
    assert "no drift" in str(calm) and "DRIFT" not in str(calm)
    assert not DriftReport("3", 100, psi, thresholds).drifted  # no probabilities logged: PSI alone


def _row(**overrides) -> dict:
    row = {
        "time": time.time(),
        "model_version": "1",
        "label": "b",
        "probabilities": [0.1, 0.7, 0.2],
        **dict.fromkeys(STATISTICS, 0.5),
    }
    return {**row, **overrides}


def test_the_traffic_reader_skips_malformed_rows_and_keeps_the_rest(tmp_path, caplog):
    logs = tmp_path / "traffic"
    logs.mkdir()
    traffic = Store.at(str(logs))
    good = [_row(), _row(label="a"), {k: v for k, v in _row().items() if k != "probabilities"}]
    bad = [
        b'{"time": 1, "model_vers',  # cut short
        b"not json at all",
        b"\xff\xfe garbage bytes",
        b"[1, 2, 3]",  # JSON, not an object
        b"[" * 50_000,  # nested past any parser's depth
        json.dumps(_row(probabilities=[0.5, 0.5])).encode(),  # wrong length
        json.dumps(_row(probabilities=[0.5, 0.5, 0.5])).encode(),  # not a distribution
        json.dumps(_row(probabilities=[1.5, -0.3, -0.2])).encode(),
        json.dumps(_row(probabilities=["0.1", "0.7", "0.2"])).encode(),
        json.dumps(_row(probabilities={"a": 1.0})).encode(),
        json.dumps(_row(mean_r=True)).encode(),  # a bool is not a number
        json.dumps(_row(mean_r="0.5")).encode(),
        json.dumps(_row(std_b=None)).encode(),
        json.dumps(_row(label="not-a-class")).encode(),
        json.dumps(_row(model_version=1)).encode(),
        json.dumps(_row(time="now")).encode(),
        b'{"time": NaN, "model_version": "1"}',
        json.dumps(_row(padding="x" * MAX_LINE_BYTES)).encode(),  # over the line limit
    ]
    elsewhere = [json.dumps(_row(model_version="2")), json.dumps(_row(time=time.time() - 7200))]
    lines = [json.dumps(good[0]).encode(), *bad[:9], json.dumps(good[1]).encode(), *bad[9:]]
    (logs / "replica-1-000000.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (logs / "replica-2-000000.jsonl").write_text(json.dumps(good[2]) + "\n" + "\n".join(elsewhere) + "\n")
    (logs / "notes.txt").write_text(json.dumps(_row()) + "\n")  # not a traffic log
    rows = recent_traffic(traffic, "1", 3600, CLASSES)
    assert sorted(row.label for row in rows) == ["a", "b", "b"]
    assert sorted(row.probabilities is None for row in rows) == [False, False, True]
    assert all(row.model_version == "1" and set(row.statistics) == set(STATISTICS) for row in rows)
    assert f"skipped {len(bad)} malformed traffic-log rows" in caplog.text
    assert len(recent_traffic(traffic, "1", 3600, CLASSES, max_rows=1)) == 1


def test_the_traffic_reader_finds_nothing_where_no_replica_logged(tmp_path):
    assert recent_traffic(Store.at(str(tmp_path / "traffic")), "1", 3600, CLASSES) == []


def test_the_traffic_log_writes_immutable_objects_the_reader_reads(tmp_path, monkeypatch):
    import torch

    from app.serve import TrafficLog

    monkeypatch.setattr(TrafficLog, "FLUSH_ROWS", 3)
    monkeypatch.setattr(TrafficLog, "FLUSH_S", 3600.0)  # no timed flush: only a full buffer flushes
    logs = tmp_path / "traffic"
    log = TrafficLog(str(logs), "r1")
    answer = {"label": "c", "scores": {"a": 0.12346, "b": 0.2, "c": 0.67654}, "model_version": "1"}
    tensor = torch.zeros(3, 4, 4)
    for _ in range(2):
        log.record(tensor, answer)
    log.record(tensor, answer)  # the FLUSH_ROWS-th row wakes the writer, long before FLUSH_S
    deadline = time.monotonic() + 60
    while not list(logs.glob("*.jsonl")):
        assert time.monotonic() < deadline, "a full buffer was never written"
        time.sleep(0.05)
    assert [len(o.read_text().splitlines()) for o in logs.glob("r1-*-000000.jsonl")] == [3]
    log.record(tensor, answer)
    log.close()  # what is buffered is written on shutdown, as a new object
    objects = sorted(logs.glob("r1-*.jsonl"))
    assert [o.name.rsplit("-", 1)[1] for o in objects] == ["000000.jsonl", "000001.jsonl"]
    rows = recent_traffic(Store.at(str(logs)), "1", 60, CLASSES)
    assert len(rows) == 4 and {row.probabilities for row in rows} == {(0.1235, 0.2, 0.6765)}


@pytest.mark.parametrize("p_value", [0.0, 1.0, -0.1])
def test_an_output_p_value_outside_0_1_is_a_configuration_error(p_value):
    from app.errors import ConfigError
    from app.ops.drift import DriftConfig

    with pytest.raises(ConfigError, match="--output-p-value"):
        DriftConfig(output_p_value=p_value)


def test_the_retraining_job_ships_the_folder_python_m_app_runs_from():
    """The job's working dir is what `ray job submit` uploads and the job's cwd: it must hold the
    `app` package, or `python -m app` finds nothing on a cluster whose nodes lack this checkout."""
    from pathlib import Path

    from app.cluster import project_root

    assert (Path(project_root()) / "app" / "__main__.py").is_file()
