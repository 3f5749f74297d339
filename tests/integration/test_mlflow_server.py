"""The registry behind `mlflow server` with basic auth (tests/mlflow_server.py): a client without
its credentials gets a clear error and changes nothing. Training, serving and promoting through
such a server, with the credentials in the environment of every node, is test_jobs.py's."""

from __future__ import annotations


def test_a_client_without_credentials_gets_a_clear_error(mlflow_server, cli):
    for env in ({}, {"MLFLOW_TRACKING_USERNAME": "argus", "MLFLOW_TRACKING_PASSWORD": "not-its-password"}):
        refused = cli("promote", "1", "--mlflow-uri", mlflow_server.url, env=env)
        assert refused.returncode == 2, refused
        assert f"the MLflow server at {mlflow_server.url} refused" in refused.stderr, refused.stderr
        assert "MLFLOW_TRACKING_USERNAME" in refused.stderr
