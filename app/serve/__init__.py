"""The serving stage: Ray Serve replicas behind a FastAPI ingress, coordinated rollouts, tokens.

`python -m app serve` runs it; `serve run app.serve:build_app` runs the same application through
Serve's own CLI and RayService configs. A request's path through the modules:

    http.py       the ingress: limits, JSON errors, the body guard, the OpenAPI document
    access.py     bearer tokens and per-token rate limits
    replica.py    the `ArgusModel` deployment: routes, batching, pending-request bound
    versions.py   which version a replica serves and prepares, in step with rollout.py's coordinator
    traffic.py    the traffic log `drift` reads
    deploy.py     build_app, deploy, serve_until, wait_for_version
"""

from app.serve.deploy import (
    APPLICATION,
    build_app,
    deploy,
    deploy_detached,
    serve_until,
    wait_for_version,
)
from app.serve.replica import DEPLOYMENT
from app.serve.traffic import TrafficLog

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
