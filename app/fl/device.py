"""`argus device`: a federated-learning device. Its images stay in its folder; it trains the
rounds' model on them with the project's one transform and sends back only the update.

    python -m app device --data-dir DIR --superlink HOST:PORT --root-certificates ca.pem --auth-key KEY

The device is a Flower SuperNode (`flower-supernode`) that reaches the SuperLink over TLS only,
authenticated by its private key (the SuperLink refuses keys it has not registered). The rounds'
ClientApp is `app.fl.client_app`, the simulation's own, which finds the folder in the node config
(`load_device_data`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from app.data.produce import IMAGE_EXTENSIONS
from app.errors import ConfigError
from app.fl.superlink import flower_env, flower_program, split_address, stop_tree
from app.fl.task import ClientData
from app.net import free_port
from app.transform import BadImage, decode_pixels, resize_pixels

log = logging.getLogger(__name__)

DATA_DIR_KEY = "data-dir"
"""The node-config key of a device's image folder (`flower-supernode --node-config`)."""
MAX_DEVICE_IMAGES = 100_000
"""The most images a device trains on (its newest by name beyond that are left out)."""
DEVICE_VAL_FRACTION = 0.2
"""Share of a device's images it validates on (every fifth, in name order) rather than trains on."""
EXIT_GRACE_S = 10.0
"""How long flower-supernode may linger after naming its exit code before it is stopped."""
FLOWER_EXIT = re.compile(r"Exit Code: (\d+)")
"""How flower-supernode names why it stopped (flower.ai/docs/framework/ref-exit-codes); the lines
after it say it in words."""


@dataclass(kw_only=True)
class DeviceConfig:
    data_dir: str
    superlink: str
    root_certificates: str
    auth_key: str
    max_retries: int | None = None

    def __post_init__(self) -> None:
        split_address(self.superlink)
        if not Path(self.data_dir).is_dir():
            raise ConfigError(f"--data-dir {self.data_dir}: no such folder (expected DIR/<label>/<images>)")
        if not _image_files(Path(self.data_dir)):
            raise ConfigError(
                f"--data-dir {self.data_dir}: no images in DIR/<label>/ "
                f"(extensions {sorted(IMAGE_EXTENSIONS)})"
            )
        for flag, path in (("--root-certificates", self.root_certificates), ("--auth-key", self.auth_key)):
            if not Path(path).is_file():
                raise ConfigError(f"{flag} {path}: no such file")
        if self.max_retries is not None and self.max_retries < 0:
            raise ConfigError("--max-retries must be >= 0")


def _image_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def load_device_data(data_dir: str, classes: tuple[str, ...], image_size: int) -> ClientData:
    """The device's labelled images (`DIR/<label>/*` with a label among `classes`), decoded and
    resized as ingest does, as uint8 pixels; every fifth in name order validates. Images that do not
    decode, and labels the run does not know, are left out and counted in the log."""
    files = [p for p in _image_files(Path(data_dir)) if p.parent.name in classes][:MAX_DEVICE_IMAGES]
    unknown = {p.parent.name for p in _image_files(Path(data_dir))} - set(classes)
    if unknown:
        log.warning(
            "device: labels %s are not among the run's classes: their images are left out", sorted(unknown)
        )
    pixels, labels, bad = [], [], 0
    for path in files:
        try:
            pixels.append(decode_pixels(path.read_bytes(), image_size))
        except BadImage:
            bad += 1
            continue
        labels.append(classes.index(path.parent.name))
    if bad:
        log.warning("device: %d image(s) did not decode and are left out", bad)
    if not labels:
        raise ValueError(f"the device has no images of the run's classes {list(classes)} under {data_dir}")
    x = resize_pixels(pixels, image_size)
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    validate = torch.zeros(len(y), dtype=torch.bool)
    if len(y) >= 1 / DEVICE_VAL_FRACTION:
        validate[4 :: round(1 / DEVICE_VAL_FRACTION)] = True
    return ClientData(x[~validate], y[~validate], x[validate], y[validate])


def run_device(cfg: DeviceConfig) -> int:
    """Run the SuperNode in the foreground until the SuperLink ends it, SIGINT or SIGTERM; 0 when it
    stopped cleanly, else 1 with the reason on stderr."""
    home = Path(cfg.data_dir).resolve() / ".flower"
    command = [
        flower_program("flower-supernode"),
        "--superlink", cfg.superlink,
        "--root-certificates", str(Path(cfg.root_certificates).resolve()),
        "--auth-supernode-private-key", str(Path(cfg.auth_key).resolve()),
        "--node-config", f'{DATA_DIR_KEY}="{Path(cfg.data_dir).resolve()}"',
        # Its ClientAppIo API, for the SuperExec it starts: this host only.
        "--host", "127.0.0.1", "--port", str(free_port()),
    ]  # fmt: skip
    if cfg.max_retries is not None:
        command += ["--max-retries", str(cfg.max_retries)]
    process = subprocess.Popen(
        command,
        env=flower_env(home),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True
        stop_tree(process)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    reason: list[str] = []
    named_exit = threading.Event()

    def relay() -> None:  # passed on as it comes; Flower's exit code and its words kept
        collecting = False
        for line in process.stdout:
            sys.stderr.write(line)
            if match := FLOWER_EXIT.search(line):
                reason[:] = [f"Flower exit code {match.group(1)}"]
                collecting = True
                named_exit.set()
            elif collecting and line.startswith("For more information"):
                collecting = False
            elif collecting and line.strip():
                reason.append(line.strip())

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        while (code := process.poll()) is None:
            # Once Flower has named its exit, its helper threads and the SuperExec it started must
            # not keep the device up (a refused key printed its code and then lingered).
            if named_exit.wait(timeout=0.5) and process.poll() is None:
                time.sleep(EXIT_GRACE_S)
                if process.poll() is None:
                    stop_tree(process)
        # The SuperExec it started may outlive it and hold the pipe open: end its process group.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            reader.join(timeout=10)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping or code == 0:
        return 0
    why = ": ".join(part for part in reason if part) or f"flower-supernode exited with {code}"
    print(f"argus: device failed: {why}", file=sys.stderr)
    return 1
