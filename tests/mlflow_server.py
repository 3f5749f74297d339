"""The registry as production runs it: `mlflow server` with its basic-auth app, over HTTP on
127.0.0.1, its artifact store behind the same authentication, and one user for Argus's clients
(who reach it with the credentials of MLflow's own environment variables)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import requests

from app.net import free_port

from conftest import child_env


class MlflowServer(NamedTuple):
    url: str
    credentials: dict[str, str]  # MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD of a user
    artifacts: Path  # where the server keeps the artifacts clients upload through it


@contextlib.contextmanager
def start_mlflow_server(directory: Path) -> Iterator[MlflowServer]:
    """A server of its own in `directory` (its stores, its log), stopped by process group."""
    admin_password = secrets.token_urlsafe(16)
    (directory / "auth.ini").write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{directory / 'auth.db'}\n"
        "admin_username = admin\n"
        f"admin_password = {admin_password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # MLflow's opt-in credential cache: a password's scrypt hash is checked once a minute, not
        # on every request (0.13 s of CPU each here; a registration makes dozens).
        "auth_cache_ttl_seconds = 60\n"
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
            # No job runners: five idle Huey consumers (MLflow's GenAI jobs) the registry never uses.
            MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
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
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
