"""`python -m app drift`: compare recent served traffic with the data the served model learnt from.

    python -m app drift --window-s 3600                 # report
    python -m app drift --retrain --ray-address http://127.0.0.1:8265   # and submit a retraining job

Serve replicas log, per request, the predicted class, the probability of every class and
per-channel statistics of the transformed image, as immutable JSON-lines objects under
`<storage>/traffic/` (local, S3 or HDFS alike; `app.serve.TrafficLog`). Two detectors:

- inputs: the same statistics over the table snapshot the alias's version was trained on (the one
  its model card names, read as it was then whatever was committed since), and its label
  distribution. Each feature's population stability index (PSI, reference quantile bins)
  above `--threshold` counts as drift.
- outputs: the version's own softmax vectors on a seeded sample of that snapshot's held-out slices
  (what the model did not fit, so it is as confident there as on new in-distribution traffic)
  against the served ones, by a kernel MMD two-sample test; p below `--output-p-value` is drift.
  It sees shifts that move the model's answers even when no image statistic moves much.

`--retrain` submits `ingest → train --promote-if-better` as a Ray job (`app.ops.retrain`), so the
alias moves only when the new version beats the champion on the test slice (`app.selection`).
The statistics themselves are `app.ops.two_sample`'s.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from app import metrics, registry
from app.config import Settings
from app.data.selection import TableRead, UnsafeDataFile, chw_images, select
from app.data.table import ImageTable
from app.errors import ConfigError
from app.ops.two_sample import categorical_psi, mmd_test, psi
from app.storage import Store

log = logging.getLogger(__name__)

STATISTICS = ("mean_r", "mean_g", "mean_b", "std_r", "std_g", "std_b")
OUTPUT_SAMPLE = 512
"""Most reference records the model is run on, and most served vectors tested (MMD is O(n²))."""
SEED = 0
"""Seeds the reference sample, the served subsample and the permutations: a rerun over the same
logs gives the same verdict."""

# The traffic logs sit in shared storage that more than Argus may write: read them as untrusted.
MAX_LINE_BYTES = 64 * 1024
"""A row is ~300 bytes plus ~8 per class (at most registry.MAX_CLASSES); longer lines are skipped."""
MAX_LOG_BYTES = 64 * 1024 * 1024
"""A replica's object holds at most a few thousand rows; a larger one is not its, and not read."""
MAX_ROWS = 200_000
"""Most recent rows read; the newest objects are read first."""
CLOCK_SKEW_S = 300.0
"""Margin for the store's clock against the replicas' when objects are skipped by modification time."""


@dataclass(kw_only=True)
class DriftConfig:
    window_s: float = 3600.0
    """Served traffic of the last this many seconds is compared."""
    threshold: float = 0.2
    """Image-statistic PSI above this is drift (0.1–0.2 is read as moderate, above 0.2 as significant)."""
    label_threshold: float = 0.5
    """Predicted-class PSI above this is drift: class mixes move with the user population, so only
    a large shift counts."""
    output_p_value: float = 0.01
    """The output MMD test's p-value below this is drift (the rate of false alarms on traffic the
    model knows)."""
    min_requests: int = 30
    """Fewer recent requests than this: no verdict."""
    retrain: bool = False
    alias: str = "champion"

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.threshold <= 0 or self.label_threshold <= 0 or self.min_requests < 1:
            raise ConfigError(
                "--window-s, --threshold and --label-threshold must be > 0, --min-requests >= 1"
            )
        if not 0 < self.output_p_value < 1:
            raise ConfigError("--output-p-value must lie in (0, 1)")


@dataclass(frozen=True)
class OutputTest:
    """The output detector's result: MMD² of served vs reference probability vectors, its p-value."""

    mmd2: float
    p_value: float
    reference: int
    served: int


@dataclass
class DriftReport:
    version: str
    requests: int
    psi: dict[str, float]
    thresholds: dict[str, float]
    output: OutputTest | None = None
    """None when too few served rows carry probabilities (logged by an older replica)."""
    output_p_value: float = DriftConfig.output_p_value
    job_id: str | None = None

    @property
    def output_drifted(self) -> bool:
        return self.output is not None and self.output.p_value < self.output_p_value

    @property
    def drifted(self) -> bool:
        return self.output_drifted or any(value > self.thresholds[name] for name, value in self.psi.items())

    def __str__(self) -> str:
        rows = [
            f"  {name:<16} PSI {value:6.3f}{'  DRIFT' if value > self.thresholds[name] else ''}"
            for name, value in self.psi.items()
        ]
        if self.output is None:
            rows.append(f"  {'output':<16} MMD² n/a (fewer than the minimum served rows carry probabilities)")
        else:
            rows.append(
                f"  {'output':<16} MMD² {self.output.mmd2:.4f}  p {self.output.p_value:.3f}"
                f"{'  DRIFT' if self.output_drifted else ''}"
                f"  ({self.output.served} served vs {self.output.reference} reference)"
            )
        verdict = "drift detected" if self.drifted else "no drift"
        job = f"; retraining job {self.job_id} submitted" if self.job_id else ""
        return f"v{self.version} vs {self.requests} recent requests: {verdict}{job}\n" + "\n".join(rows)


def _sample_keys(partition: np.ndarray, offset: np.ndarray, seed: int) -> np.ndarray:
    """A seeded pseudo-random key per record (splitmix64 of its Kafka coordinates): the sample is
    the same whatever order Ray Data yields the rows in."""
    with np.errstate(over="ignore"):
        x = (partition.astype(np.uint64) << np.uint64(40)) ^ offset.astype(np.uint64)
        x = x + np.uint64(seed + 1) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@dataclass
class Reference:
    statistics: dict[str, np.ndarray]
    """Every trained-on record's image statistics, by name."""
    label_shares: dict[str, float]
    probabilities: np.ndarray
    """The version's softmax vectors [n, K] on a seeded sample of the held-out records."""


def reference_read(table: ImageTable, loaded: registry.LoadedModel) -> TableRead:
    """The table snapshot the version's card names, as it was when the version read it. A card from
    before the table, or another table's, is a ConfigError; a snapshot the table no longer has
    (expired) is a RuntimeError that says so."""
    card, name = loaded.card, f"{loaded.name} v{loaded.version}"
    snapshot_id = card.table_snapshot_id
    if snapshot_id is None:
        raise ConfigError(
            f"{name} was trained on snapshot folders from before the Iceberg table: it names no table "
            "snapshot to measure drift against; train a version on the table"
        )
    if card.lineage.get("table") != table.identifier:
        raise ConfigError(
            f"{name} was trained on table {card.lineage.get('table')}, not {table.identifier}: "
            "--table (or --catalog) names another"
        )
    data = f"{name}'s training data, table {table.identifier} snapshot {snapshot_id}"
    if table.load().snapshot_by_id(snapshot_id) is None:
        raise RuntimeError(
            f"{data}, is gone: the table no longer has that snapshot. Expiry keeps every snapshot a "
            "registered version names, so it was expired by other means; train a version on the "
            "table as it is to measure drift again"
        )
    try:
        return select(table, card.image_size, snapshot_id)
    except UnsafeDataFile:
        raise
    except ValueError as exc:  # e.g. every row of it erased
        raise RuntimeError(f"{data}, cannot be read: {exc}") from None


def reference_data(read: TableRead, loaded: registry.LoadedModel, seed: int = SEED) -> Reference:
    """Image statistics of every record of the table snapshot `read` the version was trained on, its
    label shares, and the model's outputs on up to OUTPUT_SAMPLE of the held-out records, in one
    read of the snapshot's files."""
    import ray.data
    import torch

    from app.selection import EventTimeSplit
    from app.transform import decode_pixels, normalize_pixels, resize_pixels

    card = loaded.card
    size = card.image_size
    # Pixels stored at another size come with their sources (`select` checked): cut the model's
    # size from those, as training did.
    stored = "pixels" if read.image_size == size else "source"
    # Records from the validation slice on were not fitted; without a split, every record.
    held_out_from = EventTimeSplit(**card.split).val_from if card.split else -(2**63)
    columns = {name: [] for name in STATISTICS}
    keys, sample = np.zeros(0, np.uint64), None
    dataset = ray.data.read_parquet(
        list(read.files),
        columns=["kafka_partition", "kafka_offset", "event_time_ms", stored],
        file_extensions=["parquet"],
        partitioning=None,  # `event_date` is in the files
        ray_remote_args={"num_cpus": 0.25},
    )
    for batch in dataset.iter_batches(batch_size=256, batch_format="numpy"):
        if stored == "pixels":
            pixels = chw_images(list(batch["pixels"]), size, size)
        else:
            pixels = resize_pixels([decode_pixels(v, size) for v in batch["source"]], size).numpy()
        # Serving measures the normalised tensor the model sees: measure the table's pixels so too.
        images = normalize_pixels(torch.from_numpy(pixels)).numpy()
        means, stds = images.mean(axis=(2, 3)), images.std(axis=(2, 3), ddof=1)
        for i, channel in enumerate("rgb"):
            columns[f"mean_{channel}"].append(means[:, i])
            columns[f"std_{channel}"].append(stds[:, i])
        held = batch["event_time_ms"] >= held_out_from
        partitions, offsets = batch["kafka_partition"][held], batch["kafka_offset"][held]
        keys = np.concatenate([keys, _sample_keys(partitions, offsets, seed)])
        sample = pixels[held] if sample is None else np.concatenate([sample, pixels[held]])
        if len(keys) > OUTPUT_SAMPLE:  # keep the smallest keys: a seeded sample without replacement
            keep = np.argsort(keys, kind="stable")[:OUTPUT_SAMPLE]
            keys, sample = keys[keep], sample[keep]
    sample = sample[np.argsort(keys, kind="stable")] if sample is not None else np.zeros((0, 3, 1, 1))
    model, device = loaded.model.eval(), next(loaded.model.parameters()).device
    outputs = [np.zeros((0, len(card.classes)), np.float32)]
    with torch.inference_mode():
        for start in range(0, len(sample), 64):  # bounded memory for large images and models
            inputs = normalize_pixels(torch.from_numpy(sample[start : start + 64]).to(device))
            outputs.append(torch.softmax(model(inputs), dim=1).cpu().numpy())
    total = sum(read.label_counts.values()) or 1
    return Reference(
        {k: np.concatenate(v) for k, v in columns.items()},
        {k: v / total for k, v in read.label_counts.items()},
        np.concatenate(outputs),
    )


@dataclass(frozen=True)
class TrafficRow:
    time: float
    model_version: str
    label: str
    statistics: dict[str, float]
    probabilities: tuple[float, ...] | None
    """None in rows logged before replicas logged them."""


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_row(line: bytes, classes: list[str]) -> TrafficRow | None:
    """One traffic-log line as a row, or None when it is not a well-formed one: JSON only, bounded
    length, every field's type checked, probabilities one per class, each in [0, 1], summing to 1."""
    if len(line) > MAX_LINE_BYTES:
        return None
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # a cut-short line, or garbage
        return None
    if not isinstance(row, dict) or not all(_finite(row.get(k)) for k in ("time", *STATISTICS)):
        return None
    version, label, probabilities = row.get("model_version"), row.get("label"), row.get("probabilities")
    if not isinstance(version, str) or label not in classes:
        return None
    if probabilities is not None:
        if not (
            isinstance(probabilities, list)
            and len(probabilities) == len(classes)
            and all(_finite(p) and 0 <= p <= 1 for p in probabilities)
            and abs(sum(probabilities) - 1) <= 0.01 + 5e-5 * len(classes)  # each rounded to 4 places
        ):
            return None
        probabilities = tuple(float(p) for p in probabilities)
    statistics = {k: float(row[k]) for k in STATISTICS}
    return TrafficRow(float(row["time"]), version, label, statistics, probabilities)


def recent_traffic(
    traffic: Store, version: str, window_s: float, classes: list[str], max_rows: int = MAX_ROWS
) -> list[TrafficRow]:
    """The well-formed rows served by `version` in the last `window_s` in the `traffic` logs,
    newest objects first, at most `max_rows`; read through the store, as the replicas wrote them."""
    since = time.time() - window_s
    # An object is written after its rows: one last modified before the window holds none of them.
    modified_since = (since - CLOCK_SKEW_S) * 1e9
    objects = [
        info
        for info in traffic.list()
        if info.is_file and info.base_name.endswith(".jsonl") and (info.size or 0) <= MAX_LOG_BYTES
        if info.mtime_ns is None or info.mtime_ns >= modified_since
    ]
    objects.sort(key=lambda info: (info.mtime_ns or 0, info.path), reverse=True)
    rows, skipped = [], 0
    for info in objects:
        if len(rows) >= max_rows:
            break
        for line in traffic.read(info.base_name).splitlines():
            row = parse_row(line, classes)
            if row is None:
                skipped += line.strip() != b""
            elif row.time >= since and row.model_version == version:
                rows.append(row)
    if skipped:
        log.warning("skipped %d malformed traffic-log rows under %s", skipped, traffic.uri())
    return rows[:max_rows]


def output_test(reference: np.ndarray, traffic: list[TrafficRow], min_rows: int) -> OutputTest | None:
    served = np.array([row.probabilities for row in traffic if row.probabilities is not None])
    if len(served) < max(min_rows, 2) or len(reference) < 2:
        return None
    if len(served) > OUTPUT_SAMPLE:
        served = served[np.random.default_rng(SEED).choice(len(served), OUTPUT_SAMPLE, replace=False)]
    mmd2, p_value = mmd_test(reference, served)
    return OutputTest(mmd2, p_value, len(reference), len(served))


def drift(settings: Settings, cfg: DriftConfig) -> DriftReport:
    version = registry.resolve(settings.tracking_uri, settings.model_name, cfg.alias)
    if version is None:
        raise ConfigError(f"alias {cfg.alias!r} of {settings.model_name} points at no version")
    loaded = registry.load(settings.tracking_uri, settings.model_name, version)
    store = Store.at(settings.uri())
    traffic = recent_traffic(store.child("traffic"), version, cfg.window_s, loaded.card.classes)
    if len(traffic) < cfg.min_requests:
        raise RuntimeError(
            f"only {len(traffic)} requests to v{version} in the last {cfg.window_s:.0f}s; "
            f"need {cfg.min_requests} for a verdict"
        )
    table = ImageTable.at(settings.storage, settings.catalog, settings.table, create=False)
    reference = reference_data(reference_read(table, loaded), loaded)
    scores = {
        name: psi(reference.statistics[name], np.array([row.statistics[name] for row in traffic]))
        for name in STATISTICS
    }
    served = {}
    for row in traffic:
        served[row.label] = served.get(row.label, 0) + 1 / len(traffic)
    scores["predicted_label"] = categorical_psi(reference.label_shares, served)
    for name, value in scores.items():
        metrics.set_gauge("argus_drift_psi", value, feature=name)
    output = output_test(reference.probabilities, traffic, cfg.min_requests)
    if output is not None:
        metrics.set_gauge("argus_drift_output", output.mmd2, statistic="mmd2")
        metrics.set_gauge("argus_drift_output", output.p_value, statistic="p_value")
    thresholds = {name: cfg.threshold for name in STATISTICS} | {"predicted_label": cfg.label_threshold}
    report = DriftReport(version, len(traffic), scores, thresholds, output, cfg.output_p_value)
    if report.drifted and cfg.retrain:
        from app.ops.retrain import submit_retraining  # Ray's job client, only when asked

        report.job_id = submit_retraining(settings, loaded.card)
    return report
