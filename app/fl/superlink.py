"""Flower's deployment runtime as Argus drives it: a SuperLink with TLS and SuperNode authentication
(`SuperLink`), and the `flwr` CLI that registers devices and submits runs to it (`FlowerControl`).

In Flower 1.42 one TLS port carries the SuperLink's Fleet API (devices), Control API (the CLI) and
health check. Its processes start others by name (`flower-superexec`, `flwr-serverapp`,
`flwr-clientapp`), each in a session of its own, so `flower_env` puts this interpreter's scripts
first on PATH and `stop_tree` stops a process with every descendant it started."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from app.errors import ConfigError

log = logging.getLogger(__name__)

CONNECTION = "argus"
"""The name of the SuperLink connection in a `FlowerControl` home's config.toml."""


def flower_program(name: str) -> str:
    """A Flower console script of this interpreter's environment (`flower-superlink`, `flwr`, ...)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise ConfigError(f"{name} is not installed beside {sys.executable} (flwr 1.42 ships it)")
    return str(path)


def flower_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a Flower process: this interpreter's scripts first on PATH, a FLWR_HOME of
    its own, no telemetry and no update check (neither can reach the internet here)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_HOME"] = str(home)
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env.update(extra)
    return env


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--superlink must be HOST:PORT, got {address!r}")
    return host, int(port)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc: Flower starts some in new sessions, so a
    process group does not hold them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def stop_tree(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM `process` and its descendants, SIGKILL whatever is left after `timeout_s`."""
    pids = [process.pid, *descendants(process.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


class SuperLink:
    """A `flower-superlink` process with TLS and SuperNode authentication, bound to `address`; its
    state (registered devices, runs) in a SQLite file under `state_dir`, which also holds its log."""

    def __init__(self, address: str, certfile: str, keyfile: str, ca: str, state_dir: Path):
        self.address, self.ca, self.state_dir = address, ca, Path(state_dir)
        self.host, self.port = split_address(address)
        for flag, path in (
            ("--superlink-certfile", certfile),
            ("--superlink-keyfile", keyfile),
            ("--root-certificates", ca),
        ):
            if not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        self.certfile, self.keyfile = certfile, keyfile
        self.process: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.state_dir / "superlink.log"

    def start(self, timeout_s: float = 120.0) -> SuperLink:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(
                [
                    flower_program("flower-superlink"),
                    "--ssl-ca-certfile", self.ca,
                    "--ssl-certfile", self.certfile,
                    "--ssl-keyfile", self.keyfile,
                    "--enable-supernode-auth",
                    # Runs use the Argus installed here: a submitted app never installs packages.
                    "--disable-runtime-dependency-installation",
                    "--database", str(self.state_dir / "superlink.db"),
                    "--host", self.host,
                    "--port", str(self.port),
                ],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=flower_env(self.state_dir / "home"), start_new_session=True,
            )  # fmt: skip
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("SuperLink at https://%s (state and log in %s)", self.address, self.state_dir)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"flower-superlink exited with {self.process.returncode}: "
                    + self.log_path.read_text(errors="replace")[-2000:]
                )
            try:
                if requests.get(f"https://{self.address}/health", verify=self.ca, timeout=5).ok:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the SuperLink at {self.address} was not healthy within {timeout_s:.0f} s"
                )
            time.sleep(0.3)

    def stop(self) -> None:
        if self.process is not None:
            stop_tree(self.process)
            self.process = None

    def __enter__(self) -> SuperLink:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class FlowerControl:
    """The `flwr` CLI against one SuperLink, over TLS, from a FLWR_HOME of its own (`home`) whose
    config.toml names that SuperLink `argus`."""

    def __init__(self, address: str, ca: str, home: Path):
        split_address(address)
        if not Path(ca).is_file():
            raise ConfigError(f"--root-certificates {ca}: no such file")
        self.address, self.home = address, Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f"[superlink.{CONNECTION}]\n"
            f"address = {json.dumps(address)}\n"
            f"root-certificates = {json.dumps(str(Path(ca).resolve()))}\n"
        )

    def _flwr(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [flower_program("flwr"), *args],
            capture_output=True, text=True, timeout=timeout_s, cwd=self.home,
            env=flower_env(self.home, COLUMNS="200"), stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def register(self, public_key: Path) -> None:
        """Register a device's public key (OpenSSH ECDSA): only registered devices may connect."""
        done = self._flwr("supernode", "register", str(public_key), CONNECTION)
        if done.returncode != 0:
            raise RuntimeError(
                f"flwr supernode register {public_key} failed: {(done.stdout + done.stderr)[-2000:]}"
            )

    def nodes(self) -> list[dict]:
        """The SuperLink's registered devices, as `flwr supernode list --format json` gives them."""
        done = self._flwr("supernode", "list", CONNECTION, "--format", "json")
        if done.returncode != 0:
            raise RuntimeError(f"flwr supernode list failed: {(done.stdout + done.stderr)[-2000:]}")
        return json.loads(done.stdout).get("nodes", [])

    def run(self, app_dir: Path, run_config: dict[str, str], timeout_s: float) -> str:
        """Submit the Flower app in `app_dir` with `run_config` and follow it to its end; its output."""
        overrides = self.home / "run-config.toml"
        overrides.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in run_config.items()))
        done = self._flwr(
            "run", str(app_dir), CONNECTION, "--run-config", str(overrides), "--stream", timeout_s=timeout_s
        )
        output = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(f"flwr run exited with {done.returncode}: {output[-3000:]}")
        return output
