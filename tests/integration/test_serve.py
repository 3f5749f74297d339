"""Serving over real HTTP on 127.0.0.1: Ray Serve, the registry's alias, and input safety."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import requests
import torch
from PIL import Image

from app import registry
from app.config import ServeConfig
from app.data import synth
from app.net import free_port
from app.transform import preprocess


@pytest.fixture(scope="module")
def endpoint(trained):
    from ray import serve

    from app.serve import deploy, wait_for_version

    settings, _, _, report, _ = trained
    url = deploy(settings, ServeConfig(http_port=free_port(), poll_s=0.5, max_batch_size=8), blocking=False)
    wait_for_version(url, report.version)
    yield url
    serve.shutdown()


def _png(value_seed: int) -> tuple[str, bytes]:
    record = next(synth.generate(1, seed=value_seed, size=48))
    return record.label, record.value


def test_predictions_match_the_offline_model(trained, endpoint):
    settings, _, _, report, _ = trained
    offline = registry.load(settings.tracking_uri, settings.model_name, report.version)
    for seed in range(4):
        _, value = _png(seed)
        answer = requests.post(
            f"{endpoint}/predict", data=value, headers={"Content-Type": "image/png"}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        with torch.inference_mode():
            expected = torch.softmax(offline.model(preprocess([value], offline.card.image_size)), 1)[0]
        assert body["model_version"] == report.version
        assert body["label"] == offline.card.classes[int(expected.argmax())]
        assert [body["scores"][c] for c in offline.card.classes] == pytest.approx(expected.tolist(), abs=1e-5)
    multipart = requests.post(
        f"{endpoint}/predict", files={"image": ("x.png", value, "image/png")}, timeout=30
    )
    assert multipart.status_code == 200 and multipart.json()["label"] == body["label"]


def test_bad_input_is_a_json_4xx_and_the_service_keeps_serving(endpoint):
    bomb = io.BytesIO()
    Image.new("1", (9000, 9000)).save(bomb, format="PNG")  # tiny file, 81 Mpx when decoded
    cases = [
        (b"definitely not an image", "image/png", 400),
        (b"\x00" * (11 * 1024 * 1024), "image/jpeg", 413),
        (b"hello", "text/plain", 415),
        (b"", "image/png", 400),
        (bomb.getvalue(), "image/png", 400),
    ]
    for body, content_type, status in cases:
        answer = requests.post(
            f"{endpoint}/predict", data=body, headers={"Content-Type": content_type}, timeout=30
        )
        assert answer.status_code == status, (content_type, answer.text)
        assert answer.headers["content-type"].startswith("application/json")
        assert answer.json()["error"]
    missing_field = requests.post(f"{endpoint}/predict", files={"other": ("x.png", b"x")}, timeout=30)
    assert missing_field.status_code == 400 and "image" in missing_field.json()["error"]
    # Python's urllib writes the whole body before it reads: it too gets the 413, not a reset.
    oversized = urllib.request.Request(
        f"{endpoint}/predict", data=cases[1][0], headers={"Content-Type": "image/jpeg"}, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(oversized, timeout=60)
    assert refused.value.code == 413 and json.loads(refused.value.read())["error"]
    assert requests.get(f"{endpoint}/nope", timeout=10).json() == {"error": "Not Found"}
    _, value = _png(7)
    assert (
        requests.post(f"{endpoint}/predict", data=value, headers={"Content-Type": "image/png"}).status_code
        == 200
    )


def test_healthz_model_and_docs(trained, endpoint):
    settings, snapshot, _, report, _ = trained
    answer = requests.get(f"{endpoint}/healthz", timeout=10)
    # Open to anyone, so status and version only; the rollout's detail is behind /rollout.
    assert answer.json() == {"status": "ok", "model_version": report.version}
    assert answer.headers["X-Argus-Replica"]
    info = requests.get(f"{endpoint}/model", timeout=10).json()
    assert info["name"] == settings.model_name and info["version"] == report.version
    assert info["run_id"] == report.run_id and info["classes"] == report.classes
    assert info["image_size"] == settings.image_size
    assert info["snapshots"][0]["snapshot_id"] == snapshot.snapshot_id
    assert set(info["snapshots"][0]["offsets"]) == {str(p) for p in snapshot.offsets}
    # Swagger UI only when asked for (`serve --docs`); the document itself is always there, and
    # without tokens it promises no 401 or 429.
    assert requests.get(f"{endpoint}/docs", timeout=10).json() == {"error": "Not Found"}
    document = requests.get(f"{endpoint}/openapi.json", timeout=10).json()
    assert "securitySchemes" not in document.get("components", {})
    assert {"200", "400", "413", "415"} <= set(document["paths"]["/predict"]["post"]["responses"])
    assert not {"401", "429"} & set(document["paths"]["/predict"]["post"]["responses"])


def test_drift_is_found_in_shifted_traffic_only(trained, endpoint):
    from app.ops.drift import DriftConfig, drift, recent_traffic

    settings, _, _, report, _ = trained

    def send(records, transform=lambda value: value) -> float:
        """Post the records; returns a drift window that holds them and no earlier request, once the
        replicas' logs hold every one (they write every couple of seconds)."""
        time.sleep(1.5)  # the window reaches 1 s before the first request: earlier tests' stay out
        started, sent = time.time(), 0
        for record in records:
            answer = requests.post(
                f"{endpoint}/predict",
                data=transform(record.value),
                headers={"Content-Type": "image/png"},
                timeout=30,
            )
            assert answer.status_code == 200
            sent += 1
        deadline = time.monotonic() + 30
        while len(recent_traffic(settings, report.version, time.time() - started + 1, report.classes)) < sent:
            assert time.monotonic() < deadline, "the traffic logs never held every request"
            time.sleep(0.2)
        return time.time() - started + 1

    # The users the model was trained on (the `trained` fixture's seed), sending new screens.
    usual = send(itertools.islice(synth.generate(780, seed=5, size=32), 480, None))
    calm = drift(settings, DriftConfig(window_s=usual, min_requests=200))
    print(f"\nin-distribution traffic:\n{calm}")
    assert not calm.drifted and calm.requests == 300, calm
    # Clear of the 0.01 line (measured: p ≈ 0.06 against 95 held-out records): new screens from
    # the same users get answers like the held-out records'.
    assert calm.output.served == 300 and calm.output.p_value > 0.03, calm

    def washed_out(value: bytes) -> bytes:  # a new screen theme: far brighter, lower contrast
        image = Image.open(io.BytesIO(value)).convert("RGB").point(lambda v: 170 + v // 3)
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()

    shifted = send(itertools.islice(synth.generate(930, seed=5, size=32), 780, None), washed_out)
    storm = drift(settings, DriftConfig(window_s=shifted, min_requests=100))
    print(f"shifted traffic:\n{storm}")
    assert storm.drifted and storm.psi["mean_r"] > 1.0, storm
    assert storm.output_drifted and storm.output.p_value < 0.01 and storm.output.served == 150, storm
    assert storm.output.mmd2 > 10 * max(calm.output.mmd2, 1e-4), (storm.output, calm.output)


def test_promote_switches_versions_with_no_failed_request(trained, endpoint):
    settings, _, _, report, _ = trained
    current = registry.load(settings.tracking_uri, settings.model_name, report.version)
    with registry.start_run(settings.tracking_uri, registry.artifact_root(settings), "candidate") as run:
        card = dataclasses.replace(current.card, training_kind="federated")
        candidate = registry.register(
            settings.tracking_uri, settings.model_name, run.info.run_id, current.model, card
        )
    _, value = _png(3)
    answers, stop = [], threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                response = requests.post(
                    f"{endpoint}/predict", data=value, headers={"Content-Type": "image/png"}, timeout=30
                )
                answers.append((response.status_code, response.json().get("model_version")))
            except requests.RequestException as exc:
                answers.append((0, str(exc)))

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        time.sleep(1.0)
        registry.promote(settings.tracking_uri, settings.model_name, candidate)
        from app.serve import wait_for_version

        wait_for_version(endpoint, candidate, timeout_s=60)
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join()
        registry.promote(settings.tracking_uri, settings.model_name, report.version)
    assert answers and all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:5]
    versions = [v for _, v in answers]
    switch = versions.index(candidate)
    assert set(versions[:switch]) == {report.version} and set(versions[switch:]) == {candidate}


def test_requests_are_counted_by_status_and_version(trained, endpoint, ray_cluster):
    from conftest import scrape

    _, _, _, report, _ = trained
    requests.post(f"{endpoint}/predict", data=b"x", headers={"Content-Type": "text/plain"}, timeout=10)
    lines = scrape(ray_cluster, "ray_argus_serve_requests_total", "ray_argus_serve_latency_seconds_bucket")
    counts = lines["ray_argus_serve_requests_total"]
    assert any('status="200"' in line and f'model_version="{report.version}"' in line for line in counts)
    assert any('status="415"' in line for line in counts)
