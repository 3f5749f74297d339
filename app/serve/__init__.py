"""The serving stage: Ray Serve replicas behind a FastAPI ingress, coordinated rollouts, tokens.

`python -m app serve` runs it; `serve run app.serve:build_app` runs the same application through
Serve's own CLI and RayService configs."""

from app.serve.replica import (
    APPLICATION,
    DEPLOYMENT,
    TrafficLog,
    build_app,
    deploy,
    deploy_detached,
    serve_until,
    wait_for_version,
)

__all__ = [
    "APPLICATION",
    "DEPLOYMENT",
    "TrafficLog",
    "build_app",
    "deploy",
    "deploy_detached",
    "serve_until",
    "wait_for_version",
]
