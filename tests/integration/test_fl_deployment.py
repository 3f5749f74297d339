"""Federated learning on real devices (#27): Flower's deployment runtime on 127.0.0.1. `federate
--engine deployment` starts a SuperLink with TLS and SuperNode authentication (a CA and certificates
made here) and registers three devices' keys; three `argus device` processes train on image folders
of their own; a device with an unregistered key, one without TLS and one that does not trust the
SuperLink's certificate are refused. The server keeps its own central snapshot for the test slice;
no broker or Ray is involved."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from app import registry
from app.config import Settings
from app.data import synth
from app.fl import FederateConfig, federate
from app.fl.superlink import FlowerControl, flower_env, flower_program
from app.fl.task import exchanged_keys
from app.net import free_port
from app.transform import decode_pixels, resize_pixels

from conftest import ROOT, TEST_IMAGE_SIZE, child_env, device_keys, make_tls_files, run_cli
from snapshots import commit_snapshot

DEVICES = 3


def image_folder(directory: Path, classes: list[str], seed: int) -> Path:
    """DIR/<label>/<n>.png of the run's classes, plus one label the run does not know."""
    for i, record in enumerate(synth.generate(36, seed=seed, classes=classes, size=32, corrupt_fraction=0)):
        (directory / record.label).mkdir(parents=True, exist_ok=True)
        (directory / record.label / f"{i:03d}.png").write_bytes(record.value)
    (directory / "not-a-class").mkdir()
    shutil.copy(next(directory.glob("*/*.png")), directory / "not-a-class" / "x.png")
    return directory


def central_snapshot(settings: Settings) -> list[str]:
    """The server's own data, a snapshot of synthetic records (its newest slice is the test slice);
    its classes."""
    records = list(synth.generate(240, seed=7, users=12, size=TEST_IMAGE_SIZE))
    images = resize_pixels([decode_pixels(r.value, TEST_IMAGE_SIZE) for r in records], TEST_IMAGE_SIZE)
    commit_snapshot(
        settings,
        [r.user_id for r in records],
        [r.label for r in records],
        np.asarray([r.event_time_ms for r in records]),
        images.numpy(),
    )
    return sorted({r.label for r in records})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_devices_train_over_tls_and_the_server_registers_their_model(tmp_path):
    settings = Settings(storage=str(tmp_path / "data"), image_size=TEST_IMAGE_SIZE, model="cnn")
    classes = central_snapshot(settings)
    tls = make_tls_files(tmp_path / "tls")
    keys = device_keys(tmp_path / "keys", [f"device{i}" for i in range(DEVICES)])
    rogue = device_keys(tmp_path / "unregistered", ["rogue"])["rogue"]
    address = f"127.0.0.1:{free_port()}"
    cfg = FederateConfig(
        engine="deployment",
        superlink=address,
        root_certificates=str(tls["ca"]),
        superlink_certfile=str(tls["server_cert"]),
        superlink_keyfile=str(tls["server_key"]),
        device_keys=str(tmp_path / "keys"),
        rounds=2,
        clients=DEVICES,
        clients_per_round=DEVICES,
        batch_size=16,
        round_timeout_s=240,
        run_name="devices",
        promote_if_better=True,
    )
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["report"] = federate(settings, cfg)
        except BaseException as exc:  # the assertion below shows it
            outcome["error"] = exc

    server = threading.Thread(target=run, daemon=True)
    server.start()
    control = FlowerControl(address, str(tls["ca"]), tmp_path / "cli")
    deadline = time.monotonic() + 180
    while True:  # the SuperLink is up and has the three keys before any device connects
        assert server.is_alive(), outcome
        assert time.monotonic() < deadline, "the SuperLink did not register the devices' keys"
        try:
            if len(control.nodes()) == DEVICES:
                break
        except RuntimeError:
            pass
        time.sleep(1)

    devices = []
    try:
        for i in range(DEVICES):
            folder = image_folder(tmp_path / f"device{i}", classes, seed=40 + i)
            log = (tmp_path / f"device{i}.log").open("w")
            devices.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "app",
                        "device",
                        "--data-dir",
                        str(folder),
                        "--superlink",
                        address,
                        "--root-certificates",
                        str(tls["ca"]),
                        "--auth-key",
                        str(keys[f"device{i}"]),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    start_new_session=True,
                    env=child_env(PYTHONPATH=str(ROOT)),
                )  # fmt: skip
            )

        # An unregistered key is refused by the SuperLink; so is a SuperNode that will not speak TLS.
        refused = run_cli(
            "device", "--data-dir", str(tmp_path / "device0"), "--superlink", address,
            "--root-certificates", str(tls["ca"]), "--auth-key", str(rogue), "--max-retries", "2",
            timeout=120,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stderr[-3000:]
        assert "argus: device failed: Flower exit code" in refused.stderr, refused.stderr[-3000:]
        # A device that does not trust the SuperLink's certificate never gets as far as its key.
        untrusting = run_cli(
            "device", "--data-dir", str(tmp_path / "device0"), "--superlink", address,
            "--root-certificates", str(tls["wrong_ca"]), "--auth-key", str(keys["device0"]),
            "--max-retries", "2", timeout=120,
        )  # fmt: skip
        assert untrusting.returncode == 1, untrusting.stderr[-3000:]
        assert "argus: device failed:" in untrusting.stderr, untrusting.stderr[-3000:]
        # flower-supernode's own SuperExec child outlives it: wait for the SuperNode, end its group.
        plain_log = tmp_path / "plain.log"
        with plain_log.open("w") as out:
            plain = subprocess.Popen(
                [flower_program("flower-supernode"), "--superlink", address, "--insecure",
                 "--max-retries", "2", "--host", "127.0.0.1", "--port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT, env=flower_env(tmp_path / "plain"),
                start_new_session=True,
            )  # fmt: skip
            try:
                plain.wait(timeout=120)
            finally:
                os.killpg(plain.pid, signal.SIGKILL)
        assert plain.returncode not in (0, None), plain_log.read_text()[-3000:]

        server.join(timeout=600)
        assert not server.is_alive(), "the federated run did not end"
        assert "error" not in outcome, outcome.get("error")
    finally:
        for device in devices:
            device.send_signal(signal.SIGTERM)
        for device in devices:
            try:
                device.wait(timeout=60)
            except subprocess.TimeoutExpired:
                device.kill()
    logs = "".join((tmp_path / f"device{i}.log").read_text() for i in range(DEVICES))
    assert "not among the run's classes" in logs, logs[-3000:]  # the unknown label was left out
    assert all(device.returncode == 0 for device in devices), logs[-3000:]

    result = outcome["report"]
    assert result.rounds_run == 2, result.history
    for row in result.history:  # every device took part, and every update passed the guard
        assert row["clients_sampled"] == DEVICES and row["updates_accepted"] == DEVICES, row
        assert row["clients_failed"] == row["clients_timed_out"] == 0, row
    assert 0 <= result.metrics["test_accuracy"] <= 1
    assert result.verdict.promoted  # --promote-if-better honoured: the first version has no champion
    # No reply from a device carried pixels: train replies hold exactly the model's exchanged arrays
    # (fp16 updates) and the metrics the guard knows; evaluate replies only metrics.
    from app.model import build_model

    model_keys = set(exchanged_keys(build_model(settings.model, len(result.classes))))
    assert sum(result.wire.values()) == 2 * DEVICES * 2, result.wire
    for schema in map(json.loads, result.wire):
        assert set(schema["arrays"]) <= {"arrays"} and not schema["configs"], schema
        for arrays in schema["arrays"].values():
            assert set(arrays) == model_keys and {dtype for dtype, _ in arrays.values()} == {"float16"}
        assert set(schema["metrics"]) == {"metrics"}
    card = registry.load(settings.tracking_uri, settings.model_name, result.version).card
    assert card.training_kind == "federated" and card.snapshots  # lineage: the central test slice's data
    import mlflow

    run = mlflow.MlflowClient(settings.tracking_uri).get_run(result.run_id)
    assert run.data.tags["fl.engine"] == "deployment"
