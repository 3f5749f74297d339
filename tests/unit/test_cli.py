"""The CLI's contract: every command in --help; bad input exits 2 with one clear line. In this
process through `app.__main__.main`, except the one test of the installed `argus` entry point."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, child_env

NEEDS_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
COMMANDS = ["demo", "broker", "produce", "ingest", "train", "federate", "serve", "promote", "watch", "drift"]


def test_help_lists_every_contract_command(cli):
    result = cli("--help")
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
        (["ingest", "--from", "yesterday"], "--from must be earliest, an ISO 8601 time or epoch ms"),
        # Credentials come from the environment: a URI ends up in logs, tags and job entrypoints.
        (["train", "--mlflow-uri", "http://argus:s3cret@mlflow:5000"], "--mlflow-uri carries a password"),
        (["ingest", "--storage", "s3://AKIA:s3cret@argus-data"], "--storage carries a password"),
        # On a machine without a GPU, rather than wait forever for one:
        pytest.param(["ingest", "--use-gpu"], "--use-gpu: this machine has no GPU", marks=NEEDS_NO_GPU),
        pytest.param(["train", "--use-gpu"], "--use-gpu: this machine has no GPU", marks=NEEDS_NO_GPU),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_line(cli, args, message):
    result = cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("argus: error:") and message in lines[0]
    assert "s3cret" not in result.stderr + result.stdout


def test_the_installed_argus_script_runs_the_cli():
    """The `argus` console script (pyproject's [project.scripts]) in a process of its own, as a
    user runs it: help, and a bad argument's one line with exit 2."""
    argus = Path(sys.executable).parent / "argus"
    assert argus.exists(), f"{argus} missing: `pip install -e .` installs it"
    env = child_env()
    shown = subprocess.run([argus, "--help"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: argus ") and all(f"    {c} " in shown.stdout for c in COMMANDS)
    refused = subprocess.run(
        [argus, "train", "--epochs", "0"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == ["argus: error: --epochs must be >= 1, got 0"]


def test_ray_logs_go_to_files_unless_verbose(monkeypatch):
    from app import cluster
    from app.__main__ import _configure_logging

    monkeypatch.setattr(cluster, "_to_files", False)  # the library default, restored afterwards
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")  # setdefault leaves it alone
    _configure_logging(verbose=False)
    assert cluster._to_files
    _configure_logging(verbose=True)  # -v: Ray's logs, its workers' output and progress on the console
    assert not cluster._to_files


# A foreground command whose cleanup never returns (where `serve` once hung in CI after SIGTERM).
HANGING_STOP = """
import sys, threading, time
from app.commands import _stop_event
stop = _stop_event(float(sys.argv[1]) or None)
print("ready", flush=True)
stop.wait()
print("stopping", flush=True)
threading.Event().wait()  # a shutdown that hangs
"""


@pytest.mark.parametrize("grace_s", [1.0, None])
def test_a_hung_stop_ends_after_its_grace_with_every_stack(grace_s):
    """SIGTERM sets the stop; a cleanup that then hangs is ended `grace_s` later with exit 1 and
    each thread's stack on stderr. Without a grace (commands that must finish their write) it waits."""
    hanging = subprocess.Popen(
        [sys.executable, "-c", HANGING_STOP, str(grace_s or 0)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )  # fmt: skip
    try:
        assert hanging.stdout.readline() == "ready\n"
        hanging.send_signal(signal.SIGTERM)
        assert hanging.stdout.readline() == "stopping\n"
        if grace_s is None:
            with pytest.raises(subprocess.TimeoutExpired):
                hanging.wait(timeout=5)
            return
        assert hanging.wait(timeout=60) == 1
        stderr = hanging.stderr.read()
        assert stderr.startswith("Timeout (0:00:01)!"), stderr
        assert 'File "<string>", line 8 in <module>' in stderr, stderr  # where the main thread hung
    finally:
        if hanging.poll() is None:
            hanging.kill()
            hanging.wait()
