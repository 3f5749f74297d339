"""`python -m app promote`: move the alias, then wait until every live replica serves the version.

    python -m app promote 2 --wait-url http://127.0.0.1:8000   # returns once every replica serves v2
    ARGUS_API_TOKEN=... python -m app promote 2                # a deployment with tokens: /rollout needs one

The switch itself is the replicas' and their coordinator's (`app.serve.rollout`); this side only
reads GET /rollout. A plain `promote VERSION` waits on the deployment `serve` recorded under the
storage dir.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from app.errors import ConfigError
from app.serve.access import CLIENT_TOKEN_ENV
from app.serve.rollout import unfinished

log = logging.getLogger(__name__)

DEPLOYMENT_RECORD = ("serve", "deployment.json")


class RolloutIncomplete(RuntimeError):
    """Not every live replica serves the promoted version within the timeout."""


@dataclass(frozen=True)
class PromoteConfig:
    version: str
    alias: str = "champion"
    wait_url: str | None = None
    """Wait on this endpoint (default: the deployment `serve` recorded under the storage dir)."""
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be > 0, got {self.timeout_s}")


def promote(settings, cfg: PromoteConfig) -> str:
    """`python -m app promote`: point the alias at the version; with a deployment to wait on, return
    only once every live replica serves it (RolloutIncomplete otherwise). Returns what to print."""
    from app import registry

    registry.promote(settings.tracking_uri, settings.model_name, cfg.version, cfg.alias)
    moved = f"{settings.model_name}@{cfg.alias} → v{cfg.version}"
    url = cfg.wait_url or recorded_deployment(settings)
    if url is None:
        return f"{moved} (no running `serve` recorded under the storage dir: not waiting for replicas)"
    log.info("%s; waiting for every replica at %s", moved, url)
    replicas = wait_for_rollout(url, cfg.version, cfg.timeout_s, token=os.environ.get(CLIENT_TOKEN_ENV))
    return f"{moved}\nevery replica ({replicas}) at {url} serves v{cfg.version}"


def wait_for_rollout(
    url: str, version: str, timeout_s: float, interval_s: float = 0.25, token: str | None = None
) -> int:
    """Poll GET {url}/rollout until every live replica serves `version`; return how many replicas.
    `token` goes as `Authorization: Bearer`, which a deployment with tokens needs there."""
    import requests

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + timeout_s
    problems = ["no answer yet"]
    while True:
        try:
            response = requests.get(f"{url}/rollout", headers=headers, timeout=5)
            if response.ok:
                snapshot = response.json()
                problems = unfinished(snapshot, version)
                if not problems:
                    return len(snapshot["replicas"])
            else:
                problems = [f"GET /rollout answered {response.status_code}: {response.text[:200]}"]
                if response.status_code == 401:  # waiting longer cannot help
                    problems.append(f"set {CLIENT_TOKEN_ENV} to one of the deployment's API tokens")
                    break
        except (requests.RequestException, ValueError) as exc:
            problems = [f"GET /rollout failed: {exc}"]
        if time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
    raise RolloutIncomplete(
        f"v{version} is not served by every replica at {url} after {timeout_s:g}s: "
        + "; ".join(problems)
        + f" (the alias points at v{version}; replicas keep serving what they serve)"
    )


# ---------------------------------------------------------------- the deployment `serve` records for promote


def _record_path(settings) -> Path | None:
    return settings.local_storage_path.joinpath(*DEPLOYMENT_RECORD) if settings.is_local_storage else None


def record_deployment(settings, url: str, *, foreground: bool) -> None:
    """Written by `serve` once deployed, so that a plain `promote VERSION` knows where to wait. A
    foreground serve records its pid (and removes the file when it stops); a detached deployment
    outlives the command, so only its URL is checked."""
    path = _record_path(settings)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": url, "pid": os.getpid() if foreground else None}))


def forget_deployment(settings) -> None:
    path = _record_path(settings)
    if path is not None:
        path.unlink(missing_ok=True)


def recorded_deployment(settings) -> str | None:
    """The URL of a live deployment `serve` recorded under the storage dir, if any."""
    from urllib.parse import urlsplit

    from app.net import accepts

    path = _record_path(settings)
    try:
        record = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None
    if not record:
        return None
    if record.get("pid") is not None:
        try:
            os.kill(record["pid"], 0)
        except OSError:
            return None
    parts = urlsplit(record["url"])
    return record["url"] if parts.hostname and accepts(parts.hostname, parts.port or 80) else None
