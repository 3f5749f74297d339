"""Deploying the serving application: `python -m app serve` (foreground or `--detach`), and the
builder `serve run app.serve:build_app key=value ...` and RayService configs use.

    python -m app serve --http-port 8000          # foreground until Ctrl-C or SIGTERM
    serve run app.serve:build_app mlflow_uri=...  # the same application through Serve's own CLI
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ray import serve

from app.config import DEFAULT_MODEL_NAME, ServeConfig, parse_replicas
from app.serve import access, promote
from app.serve.replica import ArgusModel

log = logging.getLogger(__name__)

APPLICATION = "argus"

UPSCALE_DELAY_S = 10.0
"""How long a `--replicas MIN-MAX` deployment must be over its target before Serve adds replicas:
Serve's default (30 s) leaves a burst queueing for half a minute; scaling down keeps Serve's 10
minutes, so a short lull sheds nothing."""


def traffic_dir(settings) -> str:
    return settings.uri("traffic")


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in {"1", "true", "yes", "on"}


def build_app(args: dict) -> serve.Application:
    """Application builder for `serve run app.serve:build_app key=value ...` and RayService configs.

    `num_gpus`: GPUs per replica. Tokens: `token_digests` (what `deploy` passes), else the file
    `api_tokens` names, else the file $ARGUS_API_TOKENS names where the application is built (a
    RayService mounts it from a Secret)."""
    options = dict(args)
    replicas = parse_replicas(options.pop("num_replicas", 1))
    if replicas is None:
        raise ValueError(f"num_replicas must be N or MIN-MAX, got {args['num_replicas']!r}")
    kwargs = {
        "mlflow_uri": options["mlflow_uri"],
        "model_name": options.get("model_name", DEFAULT_MODEL_NAME),
        "alias": options.get("alias", "champion"),
    }
    for key, cast in (
        ("max_batch_size", int),
        ("batch_wait_timeout_s", float),
        ("max_body_bytes", int),
        ("poll_s", float),
        ("threads", int),
        ("traffic_dir", str),
        ("rate_limit", float),
        ("docs", _flag),
        ("max_pending", int),
        ("body_timeout_s", float),
    ):
        if options.get(key) is not None:  # None (no traffic log) stays unset
            kwargs[key] = cast(options[key])
    digests = tuple(options.get("token_digests") or ())
    tokens_file = options.get("api_tokens") or os.environ.get(access.TOKENS_ENV)
    if not digests and tokens_file:
        digests = access.read_token_file(tokens_file)
    if not digests:
        log.warning("no API tokens: /predict, /model and /rollout are open to anyone who reaches them")
    policy = access.AccessConfig(
        token_digests=digests,
        rate_limit=kwargs.get("rate_limit", access.AccessConfig.rate_limit),
        rate_burst=int(options["rate_burst"]) if options.get("rate_burst") is not None else None,
    )
    kwargs.update(token_digests=digests, rate_limit=policy.rate_limit, rate_burst=policy.burst)
    low, high = replicas
    if low == high:
        deployment = ArgusModel.options(num_replicas=low)
    else:  # a replica's share is a full batch: more ongoing requests than that add a replica
        target = kwargs.get("max_batch_size", ServeConfig.max_batch_size)
        deployment = ArgusModel.options(
            autoscaling_config={
                "min_replicas": low,
                "max_replicas": high,
                "target_ongoing_requests": target,
                "upscale_delay_s": UPSCALE_DELAY_S,
            }
        )
    if gpus := float(options.get("num_gpus") or 0):  # a RayService sets its deployment's options instead
        deployment = deployment.options(ray_actor_options={**ArgusModel.ray_actor_options, "num_gpus": gpus})
    return deployment.bind(**kwargs)


def deploy(settings, cfg, *, blocking: bool, policy: access.AccessConfig | None = None) -> str:
    """`python -m app serve`: start Serve's HTTP proxy on host:port and deploy the application.
    Without tokens in `policy` only a loopback host is allowed (ConfigError otherwise)."""
    policy = policy or access.AccessConfig()
    policy.check_host(cfg.http_host)
    serve.start(
        proxy_location=cfg.proxy_location, http_options={"host": cfg.http_host, "port": cfg.http_port}
    )
    app = build_app(
        {
            "mlflow_uri": settings.tracking_uri,
            "model_name": settings.model_name,
            "alias": cfg.alias,
            "num_replicas": cfg.replicas,
            "max_batch_size": cfg.max_batch_size,
            "batch_wait_timeout_s": cfg.batch_wait_timeout_s,
            "max_body_bytes": cfg.max_body_bytes,
            "poll_s": cfg.poll_s,
            "traffic_dir": traffic_dir(settings),
            "token_digests": policy.token_digests,
            "rate_limit": policy.rate_limit,
            "rate_burst": policy.burst,
            "docs": policy.docs,
        }
    )
    serve.run(app, name=APPLICATION, route_prefix="/", blocking=False)
    url = f"http://{cfg.http_host}:{cfg.http_port}"
    log.info("serving %s@%s on %s", settings.model_name, cfg.alias, url)
    return url


def deploy_detached(settings, cfg, policy: access.AccessConfig | None = None) -> str:
    """`python -m app serve --detach`: deploy onto the running cluster and record where, for `promote`."""
    url = deploy(settings, cfg, blocking=False, policy=policy)
    promote.record_deployment(settings, url, foreground=False)
    return url


def serve_until(settings, cfg, stop: threading.Event, policy: access.AccessConfig | None = None) -> None:
    """`python -m app serve`: deploy, record the deployment (so a plain `promote VERSION` waits for
    its replicas), serve until `stop` is set, then remove the record and shut Serve down."""
    policy = policy or access.AccessConfig()
    url = deploy(settings, cfg, blocking=False, policy=policy)
    promote.record_deployment(settings, url, foreground=True)
    try:
        guarded = f"{len(policy.token_digests)} token(s)" if policy.token_digests else "no tokens"
        print(
            f"serving on {url} (POST /predict, GET /healthz, GET /rollout, GET /model, /openapi.json"
            f"{', /docs' if policy.docs else ''}; {guarded}); Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.2):  # a timed wait lets the signal handler run promptly
            pass
    finally:
        promote.forget_deployment(settings)
        began = time.monotonic()
        log.info("stopping: shutting Serve down")
        serve.shutdown()
        log.info("Serve shut down in %.1f s", time.monotonic() - began)


def wait_for_version(url: str, version: str | None = None, timeout_s: float = 60.0) -> str:
    """Poll /healthz until it answers 200 (and reports `version`, if given); return that version."""
    import requests

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            response = requests.get(f"{url}/healthz", timeout=2)
            last = response.json()
            if response.ok and (version is None or last.get("model_version") == version):
                return last["model_version"]
        except (requests.RequestException, ValueError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(
        f"{url}/healthz did not report {version or 'a model'} within {timeout_s}s (last: {last})"
    )
