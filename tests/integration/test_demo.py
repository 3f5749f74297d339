"""`python -m app demo` end to end, as `make demo` runs it (small, so CI can afford it), held at the
end so the test can see the dashboard and the endpoint live, then stopped with Ctrl-C."""

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import requests

from app.data import synth
from app.net import free_port

from conftest import ROOT, child_env


def _wait_for_line(lines: list[str], pattern: str, process: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            if match := re.search(pattern, line):
                return match
        if process.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"no line matching {pattern!r}; output so far:\n" + "".join(lines)[-3000:])


@pytest.mark.slow
def test_demo_serves_predictions_rolls_out_and_shows_the_dashboard(tmp_path):
    http_port = free_port()
    stderr = open(tmp_path / "demo.stderr", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "demo",
            "--storage",
            str(tmp_path),
            "--records",
            "360",
            "--epochs",
            "1",
            "--rounds",
            "2",
            "--http-port",
            str(http_port),
            "--hold",
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=child_env(PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        dashboard = _wait_for_line(lines, r"Ray dashboard: (http://127\.0\.0\.1:\d+)", process, 300).group(1)
        _wait_for_line(lines, r"== holding until Ctrl-C", process, 1200)

        # While held: the dashboard is this Ray's and lists the Serve application; the endpoint answers.
        version = requests.get(f"{dashboard}/api/version", timeout=30).json()
        assert version["ray_version"] == ray.__version__
        applications = requests.get(f"{dashboard}/api/serve/applications/", timeout=30).json()["applications"]
        assert applications["argus"]["status"] == "RUNNING"
        sample = next(synth.generate(1, seed=3, size=64))
        answer = requests.post(
            f"http://127.0.0.1:{http_port}/predict",
            data=sample.value,
            headers={"Content-Type": "image/png"},
            timeout=30,
        )
        # v2 (federated) only if it beat v1 on the test slice; otherwise v1 stays.
        promoted = "promoted v2 to the serving alias" in "".join(lines)
        assert answer.status_code == 200 and answer.json()["model_version"] == ("2" if promoted else "1")

        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 0, (tmp_path / "demo.stderr").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        stderr.close()
    reader.join(30)
    output = "".join(lines)
    match = re.search(r"→ 200 label='([a-z_]+)' model_version=(\d+)", output)
    assert match, output[-3000:]
    assert match.group(1) in synth.DEFAULT_CLASSES and match.group(2) == "1"
    # federate --promote-if-better said what it did and why, with both test-slice accuracies; the
    # demo rolled out under traffic only a better model, and its summary says which one it serves.
    judged = re.search(
        r"^(?:promoted v2 to the serving alias|kept v1 as champion, not v2): "
        r"test slice: v2 ([\d.]+) (>|<=) champion v1 ([\d.]+)$",
        output,
        re.M,
    )
    assert judged, output[-3000:]
    candidate, relation, champion = float(judged.group(1)), judged.group(2), float(judged.group(3))
    assert (relation == ">") == promoted  # the figures are printed to 3 places: ties may show
    assert candidate >= champion if promoted else candidate <= champion
    rollout = re.search(
        r"(\d+) requests during the rollout, (\d+) failed; versions served in order: (.+)", output
    )
    if promoted:
        assert rollout, output[-3000:]
        assert int(rollout.group(1)) > 0 and rollout.group(2) == "0" and rollout.group(3).strip() == "1 → 2"
        assert re.search(r"^serving federated v2: test slice", output, re.M), output[-3000:]
    else:
        assert rollout is None, output[-3000:]
        assert re.search(r"^serving v1, federated v2 not rolled out: test slice", output, re.M)
    assert "stopping Serve, Ray and the broker" in output and "== done in" in output
    curves = re.findall(r"^curves: (.+\.png)$", output, re.M)
    assert len(curves) == 2 and all(Path(c).stat().st_size > 0 for c in curves), (
        curves
    )  # train, then federate
    with pytest.raises(requests.ConnectionError):  # everything it started, it stopped
        requests.get(f"{dashboard}/api/version", timeout=5)

    # What a person reads: Argus's stage lines with their progress, a few screens in all; Ray's own
    # output (progress bars, workers' report dicts, Serve's banners) in the files it names once.
    console = output + (tmp_path / "demo.stderr").read_text()
    assert len(console.splitlines()) <= 120, console  # text mode splits a bar's "\r" redraws too
    assert "\x1b[" not in console, console  # no progress bars off a terminal
    assert "TrainingReport(" not in console and "Reporting training result" not in console, console
    stages = ("ingesting with Ray Data", "training with Ray Train", "serving with Ray Serve", "federated")
    for stage in stages:
        assert f"== {stage}" in console, stage
    assert re.search(r"^table snapshot \d+: \d+ records", console, re.M), console
    assert re.search(r"INFO app\.train\.\w+: epoch 1/1: train loss [\d.]+, validation accuracy", console), (
        console
    )
    assert re.search(r"INFO app\.fl\.\w+: round 2/2: validation accuracy", console), console
    logs = re.findall(r"Ray's logs: (\S+) \(-v shows them here\)", console)
    assert len(logs) == 1, console
    folder = Path(logs[0])
    driver_log = "".join(path.read_text() for path in folder.glob("driver-*.log"))
    assert "ray.data" in driver_log and "ray.serve" in driver_log  # the driver's Ray loggers
    workers = "".join(path.read_text(errors="replace") for path in (folder / "ray").glob("worker-*"))
    assert "Reporting training result" in workers  # every worker's output, in Ray's session logs
