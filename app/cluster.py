"""Joining Ray: the configured cluster, the job's cluster under `ray job submit`, or a local one
sized from this machine's cores (every stage asks for fractional CPUs so they fit together)."""
from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_session(settings, *, num_cpus: int | None = None, dashboard: bool = False):
    """Yield the dashboard URL (or None) with Ray initialised; shut Ray down afterwards only if
    this call started it."""
    import ray

    if ray.is_initialized():
        yield None
        return
    runtime_env = {"env_vars": {"PYTHONPATH": _project_root()}}
    if settings.ray_address or os.environ.get("RAY_JOB_ID"):
        # Under `ray job submit` RAY_ADDRESS is set and the working dir is already shipped.
        context = ray.init(address=settings.ray_address or "auto", log_to_driver=True)
    else:
        context = ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=dashboard,
                           dashboard_host="127.0.0.1", runtime_env=runtime_env, log_to_driver=True,
                           configure_logging=False)
    try:
        yield f"http://{context.dashboard_url}" if context.dashboard_url else None
    finally:
        ray.shutdown()


def _project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
