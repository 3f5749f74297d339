"""The registry as production runs it: `mlflow server` with its basic-auth app, over HTTP on
127.0.0.1, its artifact store behind the same authentication. Argus's clients (train, the serving
replicas, promote) reach it with the credentials of MLflow's own environment variables."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import requests

from app import registry
from app.net import free_port

from conftest import ROOT, child_env, run_cli


class MlflowServer(NamedTuple):
    url: str
    credentials: dict[str, str]  # MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD of a user
    artifacts: Path  # where the server keeps the artifacts clients upload through it


def stop(process: subprocess.Popen, terminate, timeout_s: float) -> None:
    """`terminate()` it; SIGKILL its process group if it has not exited within `timeout_s`."""
    terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mlflow-server")
    admin_password = secrets.token_urlsafe(16)
    (directory / "auth.ini").write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{directory / 'auth.db'}\n"
        "admin_username = admin\n"
        f"admin_password = {admin_password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    port, log = free_port(), (directory / "server.log").open("w")
    server = subprocess.Popen(
        [Path(sys.executable).with_name("mlflow"), "server", "--app-name", "basic-auth",
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
         "--artifacts-destination", (directory / "artifacts").as_uri()],
        env=child_env(
            MLFLOW_AUTH_CONFIG_PATH=str(directory / "auth.ini"),
            MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_urlsafe(16),  # the auth app's CSRF key
        ),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (directory / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (directory / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        password = secrets.token_urlsafe(16)
        created = requests.post(
            f"{url}/api/2.0/mlflow/users/create",
            json={"username": "argus", "password": password},
            auth=("admin", admin_password),
            timeout=30,
        )
        assert created.status_code == 200, created.text
        yield MlflowServer(
            url,
            {"MLFLOW_TRACKING_USERNAME": "argus", "MLFLOW_TRACKING_PASSWORD": password},
            directory / "artifacts",
        )
    finally:
        stop(server, lambda: os.killpg(server.pid, signal.SIGTERM), timeout_s=30)
        log.close()


def test_a_client_without_credentials_gets_a_clear_error(mlflow_server, cli):
    for env in ({}, {"MLFLOW_TRACKING_USERNAME": "argus", "MLFLOW_TRACKING_PASSWORD": "not-its-password"}):
        refused = cli("promote", "1", "--mlflow-uri", mlflow_server.url, env=env)
        assert refused.returncode == 2, refused
        assert f"the MLflow server at {mlflow_server.url} refused" in refused.stderr, refused.stderr
        assert "MLFLOW_TRACKING_USERNAME" in refused.stderr


def served_version(url: str, image: bytes) -> str:
    answer = requests.post(f"{url}/predict", data=image, headers={"Content-Type": "image/png"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["model_version"]


@pytest.mark.slow
def test_train_register_serve_and_promote_through_a_server_with_basic_auth(
    trained, mlflow_server, tmp_path, monkeypatch, cli
):
    """Train on the shared fixture's snapshot, registering in the server; `serve` (its replicas load
    through the server) and `promote` with the credentials from the environment; the versions are
    pyfunc models the server hands out; a client without them changes nothing."""
    import mlflow
    import pandas as pd

    from app.data import synth
    from app.serve import wait_for_version
    from app.train import train

    base, snapshot, train_config, _, _ = trained
    settings = dataclasses.replace(base, storage=str(tmp_path / "data"), mlflow_uri=mlflow_server.url)
    shutil.copytree(Path(base.storage, "snapshots"), Path(settings.storage, "snapshots"))
    for name, value in mlflow_server.credentials.items():
        monkeypatch.setenv(name, value)

    report = train(settings, dataclasses.replace(train_config, epochs=1))
    client = mlflow.MlflowClient(mlflow_server.url)
    (dataset,) = client.get_run(report.run_id).inputs.dataset_inputs
    assert dataset.dataset.name == snapshot.snapshot_id
    # The artifacts went through the server into its store, not beside the snapshots.
    assert list(mlflow_server.artifacts.rglob(registry.WEIGHTS_FILE))
    assert not Path(settings.storage, "mlartifacts").exists()
    mlflow.set_tracking_uri(mlflow_server.url)
    pyfunc = mlflow.pyfunc.load_model(f"models:/{settings.model_name}/{report.version}")
    images = [r.value for r in synth.generate(3, seed=21, size=settings.image_size)]
    assert len(pyfunc.predict(pd.DataFrame({registry.IMAGE_COLUMN: images}))) == 3

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    served_args = ("--storage", settings.storage, "--mlflow-uri", mlflow_server.url)
    log = (tmp_path / "serve.log").open("w")
    serving = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", *served_args, "--http-port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        env=child_env(PYTHONPATH=str(ROOT), **mlflow_server.credentials),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # its own Ray starting on a loaded machine
        while f"serving on {url}" not in (output := (tmp_path / "serve.log").read_text()):
            assert serving.poll() is None and time.monotonic() < deadline, output[-3000:]
            time.sleep(1)
        wait_for_version(url, report.version, timeout_s=120)
        assert served_version(url, images[0]) == report.version

        current = registry.load(settings.tracking_uri, settings.model_name, report.version)
        with registry.start_run(settings.tracking_uri, registry.artifact_root(settings), "candidate") as run:
            candidate = registry.register(
                settings.tracking_uri, settings.model_name, run.info.run_id, current.model, current.card
            )
        promoted = run_cli(
            "promote", candidate, *served_args, "--timeout-s", "180",
            env=mlflow_server.credentials, timeout=300,
        )  # fmt: skip
        assert promoted.returncode == 0, promoted.stderr[-3000:]
        assert f"every replica (1) at {url} serves v{candidate}" in promoted.stdout

        for name in mlflow_server.credentials:  # refused by the registry before any Ray: in process
            monkeypatch.delenv(name)
        refused = cli("promote", report.version, *served_args, "--timeout-s", "30")
        assert refused.returncode == 2 and "refused this client (HTTP 401)" in refused.stderr, refused.stderr
        for name, value in mlflow_server.credentials.items():
            monkeypatch.setenv(name, value)
        assert registry.resolve(settings.tracking_uri, settings.model_name, "champion") == candidate
        assert served_version(url, images[0]) == candidate
    finally:
        stop(serving, lambda: serving.send_signal(signal.SIGTERM), timeout_s=180)  # it stops its own Ray
        log.close()
