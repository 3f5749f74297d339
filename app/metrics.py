"""Ray metrics shared by the stages: they appear on the Ray dashboard and on each node's Prometheus
endpoint (`ray start --metrics-export-port`), named `ray_argus_*` there.

Metrics are created lazily, in whichever process records them (driver, actor, Serve replica), and
only when Ray is initialised, so the core modules stay usable without a cluster.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]

_DEFINITIONS = {
    # name: (kind, description, tag keys)
    "argus_records_ingested": ("counter", "Records written to snapshots", ("topic",)),
    "argus_dlq_records": ("counter", "Records sent to the dead-letter topic", ("topic",)),
    "argus_records_lost": ("counter", "Records retention deleted before any ingest read them", ("topic",)),
    "argus_offsets_skipped": (
        "counter",
        "Offsets never returned: transaction markers, compaction",
        ("topic",),
    ),
    "argus_records_redriven": ("counter", "Dead letters `argus redrive` committed to the table", ("topic",)),
    "argus_redrive_stayed_dead": (
        "counter",
        "Dead letters a redrive read and left dead, by reason (every run counts all it read)",
        ("topic", "reason"),
    ),
    "argus_ingest_records_per_second": ("gauge", "Throughput of the last ingest", ("topic",)),
    "argus_ingest_megabytes_per_second": ("gauge", "Record bytes per second of the last ingest", ("topic",)),
    "argus_consumer_lag_records": (
        "gauge",
        "Records behind the end of each partition",
        ("topic", "partition"),
    ),
    "argus_consumer_lag_seconds": ("gauge", "Age of the oldest record not yet in a snapshot", ("topic",)),
    "argus_backlog_records": (
        "gauge",
        "Records between the ledger's next offset and the log's end (argus lag)",
        ("topic", "partition"),
    ),
    "argus_backlog_oldest_age_seconds": (
        "gauge",
        "Age of the oldest record not yet ingested, by its Kafka timestamp (argus lag)",
        ("topic", "partition"),
    ),
    "argus_lag_alerts": ("counter", "End-to-end lag above the alert threshold", ("topic",)),
    "argus_lag_alert_active": (
        "gauge",
        "1 while the lag alert fires (lag above --lag-alert-s for --lag-alert-for-s), else 0",
        ("topic",),
    ),
    "argus_watch_parts": ("counter", "Micro-batch parts `watch` committed", ("topic",)),
    "argus_compactions": ("counter", "Compactions of the table's small files committed", ("topic",)),
    "argus_compaction_failures": (
        "counter",
        "Upkeep passes of the table (compaction, expiry, orphan removal) that failed, retried with backoff",
        ("topic",),
    ),
    "argus_train_loss": ("gauge", "Training loss of the last epoch", ("run",)),
    "argus_train_val_accuracy": ("gauge", "Validation accuracy of the last epoch", ("run",)),
    "argus_train_images_per_second": ("gauge", "Training images per second (all workers)", ("run",)),
    "argus_train_epoch_seconds": ("gauge", "Wall time of the last epoch", ("run",)),
    "argus_fl_round_seconds": ("gauge", "Wall time of the last federated round", ("run",)),
    "argus_fl_round_bytes": ("gauge", "Update bytes sent by clients in the last round", ("run",)),
    "argus_serve_requests": (
        "counter",
        "HTTP requests by status and model version",
        ("status", "model_version"),
    ),
    "argus_serve_latency_seconds": ("histogram", "Request latency at the replica", ("model_version",)),
    "argus_serve_replica_behind_alias": (
        "gauge",
        "1 while the replica serves another version than its alias names (or none), else 0",
        ("replica",),
    ),
    "argus_drift_psi": ("gauge", "Population stability index of served traffic vs training", ("feature",)),
    "argus_drift_output": (
        "gauge",
        "Output drift: squared MMD of served vs reference softmax vectors (mmd2), its p-value (p_value)",
        ("statistic",),
    ),
}


@functools.cache
def _metric(name: str):
    from ray.util import metrics

    kind, description, tags = _DEFINITIONS[name]
    if kind == "counter":
        return metrics.Counter(name, description=description, tag_keys=tags)
    if kind == "gauge":
        return metrics.Gauge(name, description=description, tag_keys=tags)
    return metrics.Histogram(name, description=description, boundaries=LATENCY_BOUNDARIES_S, tag_keys=tags)


def _enabled() -> bool:
    import ray

    return ray.is_initialized()


def inc(name: str, value: float = 1.0, **tags) -> None:
    if _enabled() and value:
        _metric(name).inc(value, tags={k: str(v) for k, v in tags.items()})


def set_gauge(name: str, value: float, **tags) -> None:
    if _enabled():
        _metric(name).set(value, tags={k: str(v) for k, v in tags.items()})


def observe(name: str, value: float, **tags) -> None:
    if _enabled():
        _metric(name).observe(value, tags={k: str(v) for k, v in tags.items()})
