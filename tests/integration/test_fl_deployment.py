"""Federated learning on real devices (#27): Flower's deployment runtime on 127.0.0.1. `federate
--engine deployment` starts a SuperLink with TLS and SuperNode authentication (a CA and certificates
made here) and registers three devices' keys; three `argus device` processes train on image folders
of their own; a device with an unregistered key, one without TLS and one that does not trust the
SuperLink's certificate are refused. The server keeps its own central table snapshot for the test
slice; no broker or Ray is involved."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from app import registry
from app.config import Settings
from app.data import synth
from app.data.table import ImageTable
from app.fl import FederateConfig, federate
from app.fl.superlink import FlowerControl, descendants, flower_env, flower_program
from app.fl.task import exchanged_keys, model_arrays
from app.net import free_port
from app.transform import decode_pixels, resize_pixels

from conftest import TEST_IMAGE_SIZE, device_keys, make_tls_files, run_cli, start_device
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
    """The server's own data, a table commit of synthetic records (its newest slice is the test
    slice); its classes."""
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
            devices.append(
                start_device(tmp_path, f"device{i}", folder, address, tls["ca"], keys[f"device{i}"])
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
    # Lineage: the table snapshot that held the central test slice's data.
    assert card.training_kind == "federated" and card.lineage["table"] == settings.table
    current = ImageTable.at(settings.storage, settings.catalog, settings.table).current_snapshot_id()
    assert card.table_snapshot_id == current
    import mlflow

    run = mlflow.MlflowClient(settings.tracking_uri).get_run(result.run_id)
    assert run.data.tags["fl.engine"] == "deployment"


def weights(settings: Settings, version: str) -> dict[str, np.ndarray]:
    model = registry.load(settings.tracking_uri, settings.model_name, version).model
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_secure_aggregation_shows_the_server_only_the_sum_and_outlives_a_device_lost_after_key_sharing(
    tmp_path,
):
    """On one SuperLink and the same three devices (so the same node ids, seeds and data), one round
    with the server seeing each clipped update (DP clip, no noise) and one under SecAgg+ give the
    same model within SecAgg+'s quantisation; the secure round's replies carry no update; a device
    killed once it has shared its keys leaves the round to the other two."""
    from app.fl.superlink import SuperLink

    settings = Settings(storage=str(tmp_path / "data"), image_size=TEST_IMAGE_SIZE, model="cnn")
    classes = central_snapshot(settings)
    tls = make_tls_files(tmp_path / "tls")
    keys = device_keys(tmp_path / "keys", [f"device{i}" for i in range(DEVICES)])
    address = f"127.0.0.1:{free_port()}"
    superlink = SuperLink(
        address, str(tls["server_cert"]), str(tls["server_key"]), str(tls["ca"]), tmp_path / "link"
    ).start()
    devices = []
    try:
        control = FlowerControl(address, str(tls["ca"]), tmp_path / "cli")
        for name in keys:
            control.register(tmp_path / "keys" / f"{name}.pub")
        for i, (name, key) in enumerate(keys.items()):
            folder = image_folder(tmp_path / name, classes, seed=40 + i)
            devices.append(start_device(tmp_path, name, folder, address, tls["ca"], key))
        base = FederateConfig(
            engine="deployment",
            superlink=address,
            root_certificates=str(tls["ca"]),
            rounds=1,
            clients=DEVICES,
            clients_per_round=DEVICES,
            batch_size=16,
            update_dtype="fp32",
            dp_clip=0.5,  # the server's clip of what it sees, the devices' own under SecAgg+
            init_from=None,
            round_timeout_s=60,
        )
        plain = federate(settings, dataclasses.replace(base, run_name="plain"))
        secure = federate(settings, dataclasses.replace(base, run_name="secure", secure_aggregation=True))

        # Killed right after it sent its share of the keys (its second train reply of the round).
        lost = tmp_path / "device2.log"

        def replies_sent() -> int:
            return lost.read_text().count("Sent successfully")

        before = replies_sent()
        outcome: dict = {}
        lost_run = dataclasses.replace(base, run_name="lost", secure_aggregation=True, round_timeout_s=30)
        survived = threading.Thread(
            target=lambda: outcome.update(report=federate(settings, lost_run)), daemon=True
        )
        survived.start()
        deadline = time.monotonic() + 300
        while replies_sent() < before + 2:  # its public keys, then its shares of its secrets
            assert survived.is_alive() and time.monotonic() < deadline, lost.read_text()[-3000:]
            time.sleep(0.05)
        for pid in [devices[2].pid, *descendants(devices[2].pid)]:  # the SuperNode is in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        survived.join(timeout=600)
        assert "report" in outcome, "the round with a lost device did not finish"
    finally:
        for device in devices:  # `argus device` stops its SuperNode's tree on SIGTERM
            device.send_signal(signal.SIGTERM)
        for device in devices:
            device.wait(timeout=60)
        superlink.stop()

    initial, summed_plainly, summed_securely = (
        {k: v.numpy() for k, v in model_arrays(fresh_model(len(plain.classes))).items()},
        weights(settings, plain.version),
        weights(settings, secure.version),
    )
    moved = max(float(np.abs(summed_plainly[k] - initial[k]).max()) for k in initial)
    gap = max(float(np.abs(summed_plainly[k] - summed_securely[k]).max()) for k in initial)
    assert moved > 1e-3 and gap < 1e-4, (moved, gap)  # 3 × 2⁻²¹ · 8 per coordinate, over 3
    for row in (plain.history[0], secure.history[0]):
        assert row["clients_sampled"] == DEVICES and row["updates_accepted"] == DEVICES, row
    # Under SecAgg+ no reply holds arrays: the masked vector travels as bytes, the update never.
    for schema in map(json.loads, secure.wire):
        assert all(not arrays for arrays in schema["arrays"].values()), schema
    row = outcome["report"].history[0]
    assert row["clients_sampled"] == DEVICES and row["updates_accepted"] == DEVICES - 1, row
    assert outcome["report"].version not in (plain.version, secure.version)


def fresh_model(num_classes: int):
    """The model `federate` starts from without --init-from: the seed's, as it builds it."""
    import torch

    from app.model import build_model

    torch.manual_seed(FederateConfig().seed)
    return build_model("cnn", num_classes)
