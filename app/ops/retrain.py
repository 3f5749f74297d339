"""The retraining job `drift --retrain` submits: `ingest → train --promote-if-better` on the same
broker, storage, table and registry, as a Ray job whose working dir is this checkout (what `ray job
submit` uploads, so nodes without it still run `python -m app`).
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from app import registry
from app.cluster import project_root
from app.config import DEFAULT_TABLE, Settings
from app.errors import ConfigError

log = logging.getLogger(__name__)


def retraining_entrypoint(settings: Settings, card: registry.ModelCard) -> str:
    storage = str(settings.local_storage_path) if settings.is_local_storage else settings.storage
    common = [
        "--topic",
        settings.topic,
        "--storage",
        storage,
        "--image-size",
        str(card.image_size),
        "--model",
        card.arch,
        "--mlflow-uri",
        settings.tracking_uri,
    ]
    if settings.bootstrap_servers:
        common += ["--bootstrap-servers", settings.bootstrap_servers]
    if settings.kafka_config:  # the job runs in a copy of the working dir: an absolute path
        common += ["--kafka-config", str(Path(settings.kafka_config).resolve())]
    if settings.replication_factor != 1:
        common += ["--replication-factor", str(settings.replication_factor)]
    table = []  # the same table: ingest commits to it, train reads it
    if settings.catalog:
        table += ["--catalog", settings.catalog]
    if settings.table != DEFAULT_TABLE:
        table += ["--table", settings.table]
    ingest = shlex.join(["python", "-m", "app", "ingest", *common, *table])
    train = shlex.join(["python", "-m", "app", "train", *common, *table, "--promote-if-better"])
    return f"{ingest} && {train}"


def submit_retraining(settings: Settings, card: registry.ModelCard) -> str:
    """Submit ingest → train --promote-if-better to the cluster's job server."""
    from ray.job_submission import JobSubmissionClient

    address = settings.ray_address or ""
    if not address.startswith("http"):
        raise ConfigError(
            "--retrain submits a Ray job: pass the dashboard address, e.g. "
            "--ray-address http://127.0.0.1:8265"
        )
    entrypoint = retraining_entrypoint(settings, card)
    job_id = JobSubmissionClient(address).submit_job(
        entrypoint=entrypoint, runtime_env={"working_dir": project_root()}
    )
    log.info("submitted retraining job %s: %s", job_id, entrypoint)
    return job_id
