"""Ray's Prometheus endpoint under the load Argus's tests and dashboards put on it."""

from __future__ import annotations

import threading
import time

import requests

PROBE = "argus_probe_registration"


def test_metrics_endpoint_keeps_answering_while_new_metric_names_register(ray_cluster):
    """Ray before 2.57 deadlocked the node's dashboard agent for good when a metric name first
    registered while a scrape collected (ray-project/ray#64946): with Ray 2.55.1 this test wedged
    the endpoint within ~2 s here, as CI's full runs did. It guards the Ray pin."""
    import ray

    @ray.remote(num_cpus=0.25)
    def register(batch: int) -> None:
        from ray.util.metrics import Gauge

        for index in range(100):
            Gauge(f"{PROBE}_{batch}_{index}", description="registration race probe").set(1.0)
        time.sleep(1.0)  # one report interval: the worker exports the new names while scrapes run

    stop, answered, failures = threading.Event(), [0], []

    def hammer() -> None:
        while not stop.is_set():
            try:
                requests.get(f"http://127.0.0.1:{ray_cluster}/metrics", timeout=60).raise_for_status()
                answered[0] += 1
            except requests.RequestException as exc:
                failures.append(repr(exc))
                return

    scrapers = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
    for thread in scrapers:
        thread.start()
    try:
        for first in range(0, 24, 4):
            ray.get([register.remote(batch) for batch in range(first, first + 4)])
    finally:
        stop.set()
        for thread in scrapers:
            thread.join(timeout=90)
    assert not failures, failures
    assert answered[0] > 0
    # The names really reached the agent, so registrations did race the scrapes.
    text = requests.get(f"http://127.0.0.1:{ray_cluster}/metrics", timeout=60).text
    assert f"ray_{PROBE}_23_99" in text
