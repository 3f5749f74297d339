"""The embedded broker: starts on 127.0.0.1, is found by other commands, stops cleanly by signal."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from app.data.broker import EmbeddedBroker, recorded_broker
from app.net import free_port

from conftest import ROOT, child_env


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_embedded_broker_starts_and_stops_by_pid(tmp_path):
    broker = EmbeddedBroker.create(tmp_path)
    with broker:
        assert broker.port != 0 and _accepts(broker.port)
        pid = broker.process.pid
    assert broker.process.poll() is not None
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert broker.log_path.exists()


def test_broker_command_records_itself_and_stops_on_sigterm(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "app", "broker", "--port", str(port), "--storage", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=child_env(PYTHONPATH=str(ROOT)),
    )
    try:
        deadline = time.monotonic() + 60
        while recorded_broker(tmp_path) is None:
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.2)
        assert recorded_broker(tmp_path) == f"127.0.0.1:{port}"
        state = json.loads((tmp_path / "broker.json").read_text())
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert not (tmp_path / "broker.json").exists()
        assert not _accepts(port)
        assert (
            not os.path.exists(f"/proc/{state['pid']}")
            or open(f"/proc/{state['pid']}/stat").read().split()[2] == "Z"
        )
    finally:
        if process.poll() is None:
            process.kill()
