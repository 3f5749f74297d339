"""The embedded broker: starts on 127.0.0.1, is found by other commands, stops cleanly by signal;
a command given no bootstrap servers joins the one `python -m app broker` recorded under the
storage dir, or starts one for its own lifetime (CONTRACT.md §3)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from app.data.broker import EmbeddedBroker, recorded_broker
from app.data.kafka import KafkaConnection
from app.data.probe import partitions_of, probe_end_offsets
from app.net import accepts, free_port

from conftest import ROOT, child_env, run_cli

OWN_BROKER_WARNING = "starting an embedded broker for this command only"


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def _start_broker_command(storage: Path, port: int) -> subprocess.Popen:
    """`python -m app broker` in the foreground; returns once it has recorded itself."""
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "broker", "--port", str(port), "--storage", str(storage)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT)),
    )
    deadline = time.monotonic() + 60
    while recorded_broker(storage) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(process.stdout.read())
        time.sleep(0.2)
    return process


def _records_on(bootstrap: str, topic: str) -> int:
    kafka = KafkaConnection(bootstrap)
    return sum(probe_end_offsets(kafka, topic, partitions_of(kafka, topic)).values())


def test_embedded_broker_starts_and_stops_by_pid(tmp_path):
    broker = EmbeddedBroker.create(tmp_path)
    with broker:
        assert broker.port != 0 and accepts("127.0.0.1", broker.port)
        pid = broker.process.pid
    assert broker.process.poll() is not None
    assert _gone(pid)
    assert broker.log_path.exists()


def test_broker_command_records_itself_and_stops_on_sigterm(tmp_path):
    port = free_port()
    process = _start_broker_command(tmp_path, port)
    try:
        assert recorded_broker(tmp_path) == f"127.0.0.1:{port}"
        state = json.loads((tmp_path / "broker.json").read_text())
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert not (tmp_path / "broker.json").exists()
        assert not accepts("127.0.0.1", port)
        assert _gone(state["pid"])
    finally:
        if process.poll() is None:
            process.kill()


def test_a_command_without_bootstrap_servers_joins_the_recorded_broker(tmp_path):
    port, topic = free_port(), f"t-{uuid.uuid4().hex[:8]}"
    process = _start_broker_command(tmp_path, port)
    try:
        result = run_cli(
            "produce", "--synthetic", "3", "--source-image-size", "16", "--storage", str(tmp_path),
            "--topic", topic, timeout=180,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "produced 3 records" in result.stdout and OWN_BROKER_WARNING not in result.stderr
        assert _records_on(f"127.0.0.1:{port}", topic) == 3  # on the broker that outlives the command
        assert [p.name for p in (tmp_path / "broker").iterdir()] == [f"tansu-{port}.log"]  # no other started
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def test_a_command_without_any_broker_runs_one_for_its_lifetime(tmp_path):
    result = run_cli("produce", "--synthetic", "3", "--source-image-size", "16", "--storage", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "produced 3 records" in result.stdout and OWN_BROKER_WARNING in result.stderr
    (log,) = (tmp_path / "broker").iterdir()
    port = int(re.fullmatch(r"tansu-(\d+)\.log", log.name).group(1))
    pid = int(re.search(rf"embedded broker pid (\d+) on 127\.0\.0\.1:{port}", result.stderr).group(1))
    assert _gone(pid) and not accepts("127.0.0.1", port)  # stopped with the command
    assert recorded_broker(tmp_path) is None  # and never recorded for others to join
