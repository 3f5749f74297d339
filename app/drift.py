"""`python -m app drift`: compare recent served traffic with the data the served model learnt from.

    python -m app drift --window-s 3600                 # report
    python -m app drift --retrain --ray-address http://127.0.0.1:8265   # and submit a retraining job

Serve replicas log, per request, the predicted class and per-channel statistics of the transformed
image (`<storage>/traffic/*.jsonl`). The reference is the same statistics over the snapshots the
alias's version was trained on, and their label distribution. Each feature's population
stability index (PSI, reference quantile bins) above `--threshold` counts as drift. `--retrain`
submits `ingest → train --promote-if-better` as a Ray job, so the alias moves only when the new
version beats the champion on the test slice (`app.selection`).
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app import metrics, registry
from app.config import ConfigError, Settings

log = logging.getLogger(__name__)

STATISTICS = ("mean_r", "mean_g", "mean_b", "std_r", "std_g", "std_b")
EPSILON = 1e-4


@dataclass(kw_only=True)
class DriftConfig:
    window_s: float = 3600.0
    """Served traffic of the last this many seconds is compared."""
    threshold: float = 0.2
    """Image-statistic PSI above this is drift (0.1–0.2 is read as moderate, above 0.2 as significant)."""
    label_threshold: float = 0.5
    """Predicted-class PSI above this is drift: class mixes move with the user population, so only
    a large shift counts."""
    min_requests: int = 30
    """Fewer recent requests than this: no verdict."""
    retrain: bool = False
    alias: str = "champion"

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.threshold <= 0 or self.label_threshold <= 0 or self.min_requests < 1:
            raise ConfigError(
                "--window-s, --threshold and --label-threshold must be > 0, --min-requests >= 1"
            )


@dataclass
class DriftReport:
    version: str
    requests: int
    psi: dict[str, float]
    thresholds: dict[str, float]
    job_id: str | None = None

    @property
    def drifted(self) -> bool:
        return any(value > self.thresholds[name] for name, value in self.psi.items())

    def __str__(self) -> str:
        rows = "\n".join(
            f"  {name:<16} PSI {value:6.3f}{'  DRIFT' if value > self.thresholds[name] else ''}"
            for name, value in self.psi.items()
        )
        verdict = "drift detected" if self.drifted else "no drift"
        job = f"; retraining job {self.job_id} submitted" if self.job_id else ""
        return f"v{self.version} vs {self.requests} recent requests: {verdict}{job}\n{rows}"


def psi(reference: np.ndarray, current: np.ndarray, bins: int = 10) -> float:
    """Population stability index of `current` against `reference`, on reference quantile bins."""
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]))
    expected = np.bincount(np.searchsorted(edges, reference), minlength=len(edges) + 1) / len(reference)
    actual = np.bincount(np.searchsorted(edges, current), minlength=len(edges) + 1) / len(current)
    expected, actual = np.clip(expected, EPSILON, None), np.clip(actual, EPSILON, None)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def categorical_psi(reference: dict[str, float], current: dict[str, float]) -> float:
    names = sorted(set(reference) | set(current))
    expected = np.clip(np.array([reference.get(n, 0.0) for n in names]), EPSILON, None)
    actual = np.clip(np.array([current.get(n, 0.0) for n in names]), EPSILON, None)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def reference_statistics(
    settings: Settings, card: registry.ModelCard
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Image statistics of every record the version was trained on, and its label shares."""
    import ray.data
    import torch

    from app.snapshot import data_file_uris, read_manifest
    from app.transform import normalize_pixels

    manifests = [read_manifest(settings, s["snapshot_id"]) for s in card.snapshots]
    paths = data_file_uris(settings, manifests)
    columns = {name: [] for name in STATISTICS}
    dataset = ray.data.read_parquet(
        paths, columns=["image"], file_extensions=["parquet"], ray_remote_args={"num_cpus": 0.25}
    )
    for batch in dataset.iter_batches(batch_size=256, batch_format="numpy"):
        # Serving measures the normalised tensor the model sees: measure the snapshots' pixels so too.
        images = normalize_pixels(torch.from_numpy(np.asarray(batch["image"]))).numpy()
        means, stds = images.mean(axis=(2, 3)), images.std(axis=(2, 3), ddof=1)
        for i, channel in enumerate("rgb"):
            columns[f"mean_{channel}"].append(means[:, i])
            columns[f"std_{channel}"].append(stds[:, i])
    labels: dict[str, float] = {}
    for manifest in manifests:
        for label, count in manifest.label_counts.items():
            labels[label] = labels.get(label, 0) + count
    total = sum(labels.values()) or 1
    return {k: np.concatenate(v) for k, v in columns.items()}, {k: v / total for k, v in labels.items()}


def recent_traffic(settings: Settings, version: str, window_s: float) -> list[dict]:
    since = time.time() - window_s
    rows = []
    for path in sorted(Path(settings.uri("traffic")).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a replica that died mid-write
            if row["time"] >= since and row["model_version"] == version:
                rows.append(row)
    return rows


def drift(settings: Settings, cfg: DriftConfig) -> DriftReport:
    if not settings.is_local_storage:
        raise ConfigError("drift reads the replicas' traffic logs from a local --storage")
    version = registry.resolve(settings.tracking_uri, settings.model_name, cfg.alias)
    if version is None:
        raise ConfigError(f"alias {cfg.alias!r} of {settings.model_name} points at no version")
    card = registry.load(settings.tracking_uri, settings.model_name, version).card
    traffic = recent_traffic(settings, version, cfg.window_s)
    if len(traffic) < cfg.min_requests:
        raise RuntimeError(
            f"only {len(traffic)} requests to v{version} in the last {cfg.window_s:.0f}s; "
            f"need {cfg.min_requests} for a verdict"
        )
    reference, label_shares = reference_statistics(settings, card)
    scores = {name: psi(reference[name], np.array([row[name] for row in traffic])) for name in STATISTICS}
    served = {}
    for row in traffic:
        served[row["label"]] = served.get(row["label"], 0) + 1 / len(traffic)
    scores["predicted_label"] = categorical_psi(label_shares, served)
    for name, value in scores.items():
        metrics.set_gauge("argus_drift_psi", value, feature=name)
    thresholds = {name: cfg.threshold for name in STATISTICS} | {"predicted_label": cfg.label_threshold}
    report = DriftReport(version, len(traffic), scores, thresholds)
    if report.drifted and cfg.retrain:
        report.job_id = submit_retraining(settings, card)
    return report


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
    ingest = shlex.join(["python", "-m", "app", "ingest", *common])
    train = shlex.join(["python", "-m", "app", "train", *common, "--promote-if-better"])
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
        entrypoint=entrypoint, runtime_env={"working_dir": str(_project_root())}
    )
    log.info("submitted retraining job %s: %s", job_id, entrypoint)
    return job_id


def _project_root() -> Path:
    return Path(__file__).resolve().parents[1]
