"""The CLI's contract: every command in --help; bad input exits 2 with one clear line."""

import pytest
import torch

from conftest import run_cli

NEEDS_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
COMMANDS = ["demo", "broker", "produce", "ingest", "train", "federate", "serve", "promote", "watch", "drift"]


def test_help_lists_every_contract_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert f"    {command} " in result.stdout, command


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--model", "vgg"], "unknown model 'vgg'"),
        (["train", "--epochs", "-1"], "--epochs must be >= 1"),
        (["train", "--amp", "fp8"], "invalid choice: 'fp8'"),
        (["train", "--augment", "flip"], "invalid choice: 'flip'"),
        (["train", "--model", "resnet18", "--weights", "/nonexistent.pt"], "not a readable state dict"),
        (["produce", "--synthetic", "5", "--bootstrap-servers", "127.0.0.1:1"], "unreachable"),
        (["produce", "--synthetic", "5", "--bootstrap-servers", "no-port"], "expected host:port"),
        (["produce"], "exactly one of --synthetic N or --from-dir DIR"),
        (["serve", "--http-port", "70000"], "--http-port must be in 1..65535"),
        (["ingest", "--image-size", "2"], "--image-size must be in 8..1024"),
        # Credentials come from the environment: a URI ends up in logs, tags and job entrypoints.
        (["train", "--mlflow-uri", "http://argus:s3cret@mlflow:5000"], "--mlflow-uri carries a password"),
        (["ingest", "--storage", "s3://AKIA:s3cret@argus-data"], "--storage carries a password"),
        # On a machine without a GPU, rather than wait forever for one:
        pytest.param(["ingest", "--use-gpu"], "--use-gpu: this machine has no GPU", marks=NEEDS_NO_GPU),
        pytest.param(["train", "--use-gpu"], "--use-gpu: this machine has no GPU", marks=NEEDS_NO_GPU),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    result = run_cli(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("argus: error:") and message in lines[0]
    assert "s3cret" not in result.stderr + result.stdout


def test_environment_variables_configure_and_are_validated():
    result = run_cli(
        "produce", "--synthetic", "3", env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}, timeout=60
    )
    assert result.returncode == 2 and "127.0.0.1:1" in result.stderr


def test_ray_logs_go_to_files_unless_verbose(monkeypatch):
    from app import cluster
    from app.__main__ import _configure_logging

    monkeypatch.setattr(cluster, "_to_files", False)  # the library default, restored afterwards
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")  # setdefault leaves it alone
    _configure_logging(verbose=False)
    assert cluster._to_files
    _configure_logging(verbose=True)  # -v: Ray's logs, its workers' output and progress on the console
    assert not cluster._to_files
