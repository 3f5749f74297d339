"""Operations: the lag watch and the metrics it exports, against the real broker and Ray."""

from __future__ import annotations

import logging
import threading
import time

from app.config import IngestConfig, ProduceConfig
from app.produce import produce
from app.snapshot import list_manifests
from app.watch import WatchConfig, measure_lag, watch

from conftest import MetricsWatcher, scrape


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_watch_alerts_on_lag_while_paused_then_catches_up(settings, ray_cluster, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="app.watch")
    pause = tmp_path / "pause"
    pause.touch()
    produce(
        settings,
        ProduceConfig(synthetic=24, source_image_size=32, corrupt_fraction=0.0),
        settings.kafka_connection(),
    )
    stop, alerts = threading.Event(), []
    cfg = WatchConfig(interval_s=0.5, lag_alert_s=1.5, pause_file=str(pause))
    thread = threading.Thread(
        target=lambda: alerts.append(watch(settings, cfg, IngestConfig(), settings.kafka_connection(), stop))
    )
    gauges = (
        "ray_argus_consumer_lag_seconds",
        "ray_argus_consumer_lag_records",
        "ray_argus_ingest_records_per_second",
    )
    with MetricsWatcher(ray_cluster, *gauges, match=f'topic="{settings.topic}"') as watcher:
        thread.start()
        try:
            _wait(lambda: any("LAG ALERT" in r.getMessage() for r in caplog.records), 60, "a lag alert")
            alert = next(r for r in caplog.records if "LAG ALERT" in r.getMessage())
            assert alert.levelno == logging.WARNING and "24 records" in alert.getMessage()
            assert not list_manifests(settings)  # paused: nothing ingested
            pause.unlink()
            _wait(lambda: sum(m.records for m in list_manifests(settings)) == 24, 120, "the catch-up ingest")
            assert measure_lag(settings, settings.kafka_connection()).total == 0
        finally:
            stop.set()
            thread.join(60)
    assert alerts and alerts[0] >= 1
    # Counters stay on the endpoint; a gauge only for two report intervals after its last set.
    lines = scrape(ray_cluster, "ray_argus_lag_alerts_total", "ray_argus_records_ingested_total")
    missing = [
        name for name, samples in watcher.seen.items() if not any(settings.topic in s for s in samples)
    ]
    assert not missing, f"gauges not exported while watching: {missing}"
    assert any(f'topic="{settings.topic}"' in line for line in lines["ray_argus_lag_alerts_total"])
