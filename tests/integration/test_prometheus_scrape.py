"""A real Prometheus server scrapes a Ray node while Argus works, and evaluates monitoring/'s rules.

The node is a `ray start --head --metrics-export-port` of its own (tests/ray_nodes.py), so its
endpoint holds only this test's series and answers within the 1 s scrape interval; `watch` runs on
it as a user would start it. Needs the `prometheus` binary (Debian's package; .ci/run installs it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from app.config import ProduceConfig
from app.data.produce import produce
from app.net import free_port

from conftest import ROOT, TEST_IMAGE_SIZE, settings_args
from ray_nodes import LocalRayCluster

RULES = ROOT / "monitoring" / "prometheus" / "argus-rules.yml"
PROMETHEUS = shutil.which("prometheus")


def _wait(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return result


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL what is left after 30 s."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class Prometheus:
    """`prometheus` on 127.0.0.1, scraping and evaluating every second, its TSDB under `directory`."""

    def __init__(self, directory: Path, metrics_port: int):
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "ray", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = directory / "prometheus.log"
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'tsdb'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(self._ready, 60, "Prometheus to be ready")

    def _ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()[-3000:]
        try:
            return requests.get(f"{self.url}/-/ready", timeout=5).ok
        except requests.RequestException:
            return False

    def api(self, path: str, **params) -> dict | list:
        answer = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert answer["status"] == "success", answer
        return answer["data"]

    def alerts(self, name: str, **labels: str) -> list[dict]:
        return [
            a
            for a in self.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and labels.items() <= a["labels"].items()
        ]

    def value(self, query: str) -> float | None:
        result = self.api("query", query=query)["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        _stop_group(self.process)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_prometheus_scrapes_ray_and_the_lag_rule_follows_the_real_lag(settings, tmp_path, monkeypatch):
    if PROMETHEUS is None:  # CI installs it (.ci/run): there a missing server is a failure
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "no prometheus binary (apt-get install prometheus)"
        )
    # Processes report to the node's agent every second rather than every ten (Ray's config env).
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")
    produce(
        settings,
        ProduceConfig(
            synthetic=24, seed=3, source_image_size=TEST_IMAGE_SIZE, late_fraction=0, corrupt_fraction=0
        ),
        settings.kafka_connection(),
    )
    topic = {"topic": settings.topic}
    lag = f'max by (topic) (ray_argus_consumer_lag_seconds{{topic="{settings.topic}"}})'
    pause = tmp_path / "pause"
    pause.touch()  # lag builds up while `watch` measures it but commits nothing
    cluster = LocalRayCluster(tmp_path)
    watcher = prometheus = None
    try:
        # One CPU: the watch's one 0.5-CPU preprocessing actor, and room beside it for the driver.
        cluster.start_head(1)
        prometheus = Prometheus(tmp_path, cluster.metrics_port)
        watcher = subprocess.Popen(
            [sys.executable, "-m", "app", "watch", *settings_args(settings), "--ray-address", cluster.address]
            + ["--pause-file", str(pause), "--lag-alert-s", "1", "--lag-alert-for-s", "0.5"],
            env=cluster.env(),
            cwd=ROOT,
            stdout=open(tmp_path / "watch.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def alert(name: str) -> dict | None:
            assert watcher.poll() is None, (tmp_path / "watch.log").read_text()[-3000:]
            found = prometheus.alerts(name, **topic)
            return found[0] if found else None

        # Lag over 5 s: the rule's expression holds (pending: its `for` of a minute has not passed).
        high = _wait(lambda: alert("ArgusConsumerLagHigh"), 180, "ArgusConsumerLagHigh on the real lag")
        assert high["state"] in {"pending", "firing"}
        measured = prometheus.value(lag)
        # The rule's value is the scraped gauge: over its threshold, and what a query reads a moment later.
        assert 5 < float(high["value"]) <= measured + 1e-6 < float(high["value"]) + 10, (high, measured)
        (target,) = prometheus.api("targets")["activeTargets"]
        assert target["health"] == "up", target
        # The watch's own alert gauge (threshold 1 s here) is on too, and so is its rule.
        _wait(lambda: alert("ArgusWatchLagAlert"), 60, "ArgusWatchLagAlert")

        pause.unlink()  # the watch catches up: lag falls to 0 and both rules let go
        _wait(lambda: prometheus.value(lag) == 0, 180, "the scraped lag back at 0")
        _wait(lambda: not alert("ArgusConsumerLagHigh"), 30, "ArgusConsumerLagHigh to clear")
        _wait(lambda: not alert("ArgusWatchLagAlert"), 30, "ArgusWatchLagAlert to clear")
        ingested = f'sum(ray_argus_records_ingested_total{{topic="{settings.topic}"}})'
        _wait(lambda: prometheus.value(ingested) == 24, 30, "all 24 records counted as ingested")
    finally:
        if watcher is not None:
            _stop_group(watcher)
        if prometheus is not None:
            prometheus.stop()
        cluster.shutdown()
