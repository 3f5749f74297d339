"""A device's side of the deployment engine without a SuperLink: the images it trains on, the
arguments it refuses, and the job a `federate --engine deployment` hands to the SuperLink's ServerApp."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.config import Settings
from app.data import synth
from app.fl import FederateConfig
from app.fl.deployment import read_job, write_job
from app.fl.device import load_device_data
from app.transform import decode_pixels, resize_pixels

CLASSES = ("normal", "phishing")


def _folder(tmp_path, per_class: int = 6):
    """DIR/<label>/*.png for both classes, a label the run does not know, and a file that is no image."""
    records = synth.generate(40, seed=3, classes=CLASSES, size=32)
    written = {c: [] for c in CLASSES}
    for i, record in enumerate(records):
        if len(written[record.label]) < per_class:
            (tmp_path / record.label).mkdir(exist_ok=True)
            path = tmp_path / record.label / f"{i:03d}.png"
            path.write_bytes(record.value)
            written[record.label].append(path)
    (tmp_path / "unknown-label").mkdir()
    (tmp_path / "unknown-label" / "a.png").write_bytes(written["normal"][0].read_bytes())
    (tmp_path / "normal" / "broken.png").write_bytes(b"not an image")
    return written


def test_a_device_trains_on_its_labelled_images_as_ingest_prepares_them(tmp_path, caplog):
    written = _folder(tmp_path)
    data = load_device_data(str(tmp_path), CLASSES, 16)
    assert len(data.train_y) + len(data.val_y) == 12  # the unknown label and the broken file left out
    assert len(data.val_y) == 2  # every fifth, in name order
    assert data.train_x.dtype == torch.uint8 and data.train_x.shape[1:] == (3, 16, 16)
    assert "not among the run's classes" in caplog.text and "did not decode" in caplog.text
    # The pixels are ingest's: decoded and resized by the project's one transform.
    ordered = sorted(written["normal"] + written["phishing"])
    expected = resize_pixels([decode_pixels(p.read_bytes(), 16) for p in ordered], 16)
    assert torch.equal(torch.cat([data.train_x, data.val_x]).sort(dim=0).values, expected.sort(dim=0).values)


def test_a_device_without_images_of_the_runs_classes_refuses_to_train(tmp_path):
    _folder(tmp_path)
    with pytest.raises(ValueError, match="no images of the run's classes"):
        load_device_data(str(tmp_path), ("malware",), 16)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data-dir", "/nonexistent"], "--data-dir /nonexistent: no such folder"),
        (["--data-dir", "{empty}"], "no images in DIR/<label>/"),
        (
            ["--data-dir", "{images}", "--auth-key", "/nonexistent.key"],
            "--auth-key /nonexistent.key: no such file",
        ),
        (["--data-dir", "{images}", "--superlink", "no-port"], "--superlink must be HOST:PORT"),
    ],
)
def test_device_arguments_are_checked_before_anything_starts(cli, tmp_path, args, message):
    for folder in ("empty", "images"):
        (tmp_path / folder).mkdir()
    _folder(tmp_path / "images")
    (tmp_path / "ca.pem").write_text("x")
    (tmp_path / "key").write_text("x")
    defaults = {"--superlink": "127.0.0.1:9093", "--root-certificates": str(tmp_path / "ca.pem")}
    defaults["--auth-key"] = str(tmp_path / "key")
    given = [a.format(empty=tmp_path / "empty", images=tmp_path / "images") for a in args]
    for flag, value in defaults.items():
        if flag not in given:
            given += [flag, value]
    result = cli("device", *given)
    assert result.returncode == 2, result
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine", "deployment"], "--engine deployment needs --superlink HOST:PORT and --root-cert"),
        (
            ["--engine", "deployment", "--superlink", "127.0.0.1:1", "--root-certificates", "ca.pem",
             "--superlink-certfile", "cert.pem"],
            "--superlink-certfile and --superlink-keyfile go together",
        ),
        (["--device-keys", "keys"], "--device-keys registers devices with a SuperLink this run starts"),
    ],
)  # fmt: skip
def test_deployment_arguments_are_checked_before_anything_starts(cli, args, message):
    result = cli("federate", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_job_the_serverapp_reads_is_the_run_federate_was_asked_for(tmp_path):
    settings = Settings(storage=str(tmp_path / "data"), image_size=32, model="cnn", classes=("a", "b"))
    cfg = FederateConfig(
        engine="deployment",
        superlink="127.0.0.1:9093",
        root_certificates="ca.pem",
        rounds=3,
        clients=4,
        clients_per_round=2,
        snapshots=4242,
        run_name="r1",
    )
    uri = write_job(settings, cfg)
    assert uri == settings.uri("federated", "r1", "job.json")
    read_settings, read_cfg = read_job(uri)
    assert read_cfg == cfg
    assert dataclasses.asdict(read_settings) == dataclasses.asdict(settings)
