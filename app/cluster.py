"""Joining Ray: the configured cluster, the job's cluster under `ray job submit`, or a local one
sized from this machine's cores (every stage asks for fractional CPUs so they fit together)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

# Where Ray's own output goes: the console (Ray's default, kept for library callers such as tests
# and notebooks) or files, which the CLI chooses unless `-v` (`ray_logs_to_files`).
_to_files = False


def ray_logs_to_files(to_files: bool) -> None:
    """The CLI's choice: Ray's driver logs, every worker's output and Ray Data's progress go to
    files (their folder printed once per Ray session), or, with `-v`, to the console as usual."""
    global _to_files
    _to_files = to_files


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
    """Whether `ray_session` joins a running cluster rather than starting a local Ray from this
    machine's resources: `--ray-address` or RAY_ADDRESS (which `ray job submit` sets for its driver
    to the job's cluster), or a process Ray started (its workers carry RAY_JOB_ID)."""
    return bool(settings.ray_address or os.environ.get("RAY_JOB_ID"))


def require_local_gpu(settings, use_gpu: bool) -> None:
    """`--use-gpu` on a local Ray of a machine without a GPU would wait forever for one: a clear
    error instead. A cluster may autoscale GPU nodes in, so there the request stands."""
    if not use_gpu or joins_cluster(settings):
        return
    from app.errors import ConfigError
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
    runtime_env = {"env_vars": {"PYTHONPATH": project_root()}}
    if joins_cluster(settings):
        # Under `ray job submit` RAY_ADDRESS is set and the working dir is already shipped.
        context = ray.init(address=settings.ray_address or "auto", log_to_driver=not _to_files)
    else:
        # A loaded 2-core machine's agents are slow to register. (The raylet's wait for their port
        # files is a fixed ~15 s that this does not lengthen, and ray.init cannot pass the ports.)
        os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
        apply_serve_env()
        options = dict(
            # "local": without an address Ray joins the cluster `ray start` last recorded in
            # <RAY_TMPDIR or /tmp>/ray/ray_current_cluster, which outlives a killed cluster.
            address="local",
            num_cpus=num_cpus or max(2, os.cpu_count() or 2),
            dashboard_host="127.0.0.1",
            runtime_env=runtime_env,
            log_to_driver=not _to_files,
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
    logs = contextlib.ExitStack()
    try:
        if _to_files:
            logs.enter_context(_ray_logs_in_files(settings))
        yield f"http://{context.dashboard_url}" if context.dashboard_url else None
    finally:
        began = time.monotonic()
        ray.shutdown()
        log.info("Ray shut down in %.1f s", time.monotonic() - began)
        logs.close()  # after the shutdown: what it logs goes to the files too


@contextlib.contextmanager
def _ray_logs_in_files(settings):
    """Move the driver's Ray loggers off the console into `<storage>/logs/<ray session>/`, next to
    a `ray` link to the session's own logs (every worker's stdout and stderr, raylet, GCS, Serve);
    on remote storage, into the session's logs folder itself. Restored on exit."""
    import ray

    # Both install console handlers when first imported: have them do it now, then move them.
    import ray.data
    import ray.serve  # noqa: F401

    folder = _log_folder(settings)
    handler = logging.FileHandler(folder / f"driver-{os.getpid()}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    # Progress bars only on a terminal; a Dataset carries this context to its workers.
    data_context = ray.data.DataContext.get_current()
    progress_bars = data_context.enable_progress_bars
    data_context.enable_progress_bars = sys.stderr.isatty()

    moved: dict[logging.Logger, tuple[list[logging.Handler], bool]] = {}
    for name in [n for n in logging.root.manager.loggerDict if n == "ray" or n.startswith("ray.")]:
        logger = logging.getLogger(name)
        console = [
            h
            for h in logger.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        ]
        # "ray" itself has no handler here (configure_logging=False): it would reach Argus's console.
        if console or name == "ray":
            moved[logger] = (list(logger.handlers), logger.propagate)
            for h in console:
                logger.removeHandler(h)
            if name == "ray" or not logger.propagate:
                logger.addHandler(handler)
            if name == "ray":
                logger.propagate = False
    log.info("Ray's logs: %s (-v shows them here)", folder)
    try:
        yield folder
    finally:
        for logger, (handlers, propagate) in moved.items():
            logger.handlers[:] = handlers
            logger.propagate = propagate
        data_context.enable_progress_bars = progress_bars
        handler.close()


def _log_folder(settings) -> Path:
    import ray

    node = ray._private.worker._global_node  # no public API names the session's logs; None under Ray Client
    session_logs = Path(node.get_logs_dir_path()) if node else None
    if not settings.is_local_storage:
        return session_logs or Path(tempfile.mkdtemp(prefix="argus-logs-"))
    folder = settings.local_storage_path / "logs" / (node.session_name if node else "ray-client")
    folder.mkdir(parents=True, exist_ok=True)
    if session_logs and not (folder / "ray").exists():
        with contextlib.suppress(OSError):  # a filesystem without links still gets the driver's log
            (folder / "ray").symlink_to(session_logs, target_is_directory=True)
    return folder


def project_root() -> str:
    """The folder holding the `app` package: where `python -m app` runs, and a job's working dir."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
