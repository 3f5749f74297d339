"""Joining Ray: the configured cluster, the job's cluster under `ray job submit`, or a local one
sized from this machine's cores (every stage asks for fractional CPUs so they fit together)."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)

# Ray Serve's throughput mode (Ray >= 2.55) without its direct ingress, which expects HAProxy in front
# of per-replica ports; the HTTP proxy reaches replicas over gRPC instead of actor calls. Serve reads
# these when its processes start, so every Ray node needs them in its environment: local clusters
# get them here, the image sets them (Dockerfile), cluster.yaml exports them before `ray start`.
# bench/serve.py, 2 cores: the cnn behind Serve 124 → 135 requests/s, resnet18 79 → 87 (= the plain
# FastAPI process).
SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}


def apply_serve_env() -> None:
    """Put SERVE_ENV into this process's environment (a local Ray started afterwards inherits it);
    values already set win."""
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)


def joins_cluster(settings) -> bool:
    """Whether `ray_session` joins a running cluster (`--ray-address`, or inside `ray job submit`)
    rather than starting a local Ray from this machine's resources."""
    return bool(settings.ray_address or os.environ.get("RAY_JOB_ID"))


def require_local_gpu(settings, use_gpu: bool) -> None:
    """`--use-gpu` on a local Ray of a machine without a GPU would wait forever for one: a clear
    error instead. A cluster may autoscale GPU nodes in, so there the request stands."""
    if not use_gpu or joins_cluster(settings):
        return
    from app.config import ConfigError
    from app.model import local_device

    if local_device().type != "cuda":
        raise ConfigError(
            "--use-gpu: this machine has no GPU for its local Ray; drop --use-gpu, or pass "
            "--ray-address of a cluster with GPU nodes"
        )


@contextlib.contextmanager
def ray_session(settings, *, num_cpus: int | None = None, dashboard: bool = False):
    """Yield the dashboard URL (or None) with Ray initialised; shut Ray down afterwards only if
    this call started it."""
    import ray

    if ray.is_initialized():
        yield None
        return
    runtime_env = {"env_vars": {"PYTHONPATH": _project_root()}}
    if joins_cluster(settings):
        # Under `ray job submit` RAY_ADDRESS is set and the working dir is already shipped.
        context = ray.init(address=settings.ray_address or "auto", log_to_driver=True)
    else:
        # A loaded 2-core machine can take longer than the raylet's default wait for the dashboard
        # agent's ports, and the node then dies during start-up.
        os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
        apply_serve_env()
        options = dict(
            num_cpus=num_cpus or max(2, os.cpu_count() or 2),
            dashboard_host="127.0.0.1",
            runtime_env=runtime_env,
            log_to_driver=True,
            configure_logging=False,
        )
        try:
            context = ray.init(include_dashboard=dashboard, **options)
        except Exception as exc:  # on a loaded small machine the dashboard's start can time out
            if not dashboard:
                raise
            log.warning("Ray did not start with its dashboard (%s); starting without it", exc)
            ray.shutdown()
            context = ray.init(include_dashboard=False, **options)
    try:
        yield f"http://{context.dashboard_url}" if context.dashboard_url else None
    finally:
        ray.shutdown()


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
