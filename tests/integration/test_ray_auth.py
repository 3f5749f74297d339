"""The control plane closed: a head started with Ray's token authentication (as the KubeRay
manifests and cluster.yaml start theirs) refuses `ray job submit` and its HTTP API without the
token and runs the job with it."""

from __future__ import annotations

import os
import secrets
import subprocess

import pytest
import requests

from ray_nodes import VENV_BIN, LocalRayCluster, wait_for_job

AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture
def token_cluster(tmp_path):
    cluster = LocalRayCluster(tmp_path, token=secrets.token_hex(32))
    try:
        cluster.start_head(num_cpus=1)
        yield cluster
    finally:
        cluster.shutdown()


def _submit(dashboard: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`ray job submit` of a one-line job from a shell whose Ray settings are exactly `env`."""
    shell = {k: v for k, v in os.environ.items() if k not in AUTH_ENV}
    return subprocess.run(
        [str(VENV_BIN / "ray"), "job", "submit", "--address", dashboard, "--no-wait"]
        + ["--", "python", "-c", "print('ran as a job')"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**shell, **env},
    )


def _job_id(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    return next(line.split("'")[1] for line in output.splitlines() if "submitted successfully" in line)


@pytest.mark.slow
def test_job_submission_needs_the_clusters_token(token_cluster, tmp_path):
    dashboard = token_cluster.dashboard
    wrong = tmp_path / "wrong-token"
    wrong.write_text(secrets.token_hex(32))
    for what, env in (
        ("no token", {}),
        ("a wrong token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}),
    ):
        refused = _submit(dashboard, env)
        assert refused.returncode != 0, f"submitted with {what}: {refused.stdout}"
        assert "authentication" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]

    # The dashboard's HTTP API itself: the jobs list and the state API.
    for path in ("/api/jobs/", "/api/v0/nodes"):
        assert requests.get(dashboard + path, timeout=30).status_code in (401, 403), path
        assert requests.get(dashboard + path, headers=token_cluster.headers(), timeout=30).status_code == 200

    job = _job_id(_submit(dashboard, token_cluster.auth_env()))
    logs = wait_for_job(dashboard, job, timeout_s=300, headers=token_cluster.headers())
    assert "ran as a job" in logs
