"""Serve's HTTP edge over real HTTP on 127.0.0.1 (CONTRACT.md §4): bearer tokens, per-token rate
limits, early answers every client can read (urllib, requests, curl), chunked, stalled and queued
uploads, and pixel caps. One deployment with tokens, built the way `serve run` and RayService build it."""

from __future__ import annotations

import io
import json
import select
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import NamedTuple
from urllib.parse import urlsplit

import pytest
import requests
from PIL import Image

from app.data import synth

from conftest import run_cli
from served import start, token_file

LIMIT = 10 * 1024 * 1024
OVER = b"\x00" * (11 * 1024 * 1024)
BODY_TIMEOUT_S = 10
NAMES = [
    "model", "rollout", "predict", "hashed", "urllib", "requests", "curl", "chunked", "burst", "other",
    "slow", "probe", "pixels", "promote",
]  # fmt: skip
"""One token per test: the rate limit is per token, so tests never share one."""
RATE = 1e-6
"""Requests/s a token earns back: one in ~12 days, so within a test only the burst counts."""
BURST = 20


class Endpoint(NamedTuple):
    url: str
    version: str
    tokens: dict[str, str]
    storage: str

    def auth(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[name]}"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, ray_cluster):
    from ray import serve

    directory = tmp_path_factory.mktemp("guarded")
    path, tokens = token_file(directory, NAMES)
    url, version, settings = start(
        directory,
        api_tokens=str(path),
        rate_limit=RATE,
        rate_burst=BURST,
        docs="true",
        max_pending=2,
        body_timeout_s=BODY_TIMEOUT_S,
    )
    yield Endpoint(url, version, tokens, settings.storage)
    serve.shutdown()


def _png(seed: int = 1) -> bytes:
    return next(synth.generate(1, seed=seed, size=48)).value


def _assert_json_error(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]
    return response.json()


def test_healthz_is_open_and_says_only_status_and_version(guarded):
    answer = requests.get(f"{guarded.url}/healthz", timeout=10)
    assert answer.status_code == 200 and answer.json() == {"status": "ok", "model_version": guarded.version}


def test_every_guarded_endpoint_needs_a_valid_bearer_token(guarded):
    calls = {
        "predict": lambda h: requests.post(
            f"{guarded.url}/predict", data=_png(), headers={"Content-Type": "image/png", **h}, timeout=30
        ),
        "model": lambda h: requests.get(f"{guarded.url}/model", headers=h, timeout=10),
        "rollout": lambda h: requests.get(f"{guarded.url}/rollout", headers=h, timeout=10),
    }
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {guarded.tokens['model']}"}]
    for name, call in calls.items():
        for headers in wrong:
            refused = call(headers)
            _assert_json_error(refused, 401)
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        assert call(guarded.auth(name)).status_code == 200, name
    # The second token in the file is stored as sha256:<hex>; lowercase `bearer` is still Bearer.
    hashed = {"Authorization": f"bearer {guarded.tokens['hashed']}"}
    assert calls["model"](hashed).json()["version"] == guarded.version


def test_openapi_and_docs_are_open_and_the_document_declares_the_tokens(guarded):
    document = requests.get(f"{guarded.url}/openapi.json", timeout=10).json()
    assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    for path, method in (("/predict", "post"), ("/model", "get"), ("/rollout", "get")):
        operation = document["paths"][path][method]
        assert operation["security"] == [{"bearer": []}] and {"401", "429"} <= set(operation["responses"])
    assert "security" not in document["paths"]["/healthz"]["get"]
    predict = document["paths"]["/predict"]["post"]
    assert set(predict["requestBody"]["content"]) == {
        "image/jpeg", "image/png", "image/webp", "application/octet-stream", "multipart/form-data"
    }  # fmt: skip
    assert predict["requestBody"]["content"]["multipart/form-data"]["schema"]["required"] == ["image"]
    assert {"200", "400", "401", "413", "415", "429", "503"} <= set(predict["responses"])
    docs = requests.get(f"{guarded.url}/docs", timeout=10)
    assert docs.status_code == 200 and "swagger-ui" in docs.text
    refused = requests.put(f"{guarded.url}/predict", timeout=10)
    _assert_json_error(refused, 405)
    assert refused.headers["Allow"] == "POST"


def test_a_token_past_its_burst_gets_a_429_with_retry_after_and_others_do_not(guarded):
    def model(name: str):
        return requests.get(f"{guarded.url}/model", headers=guarded.auth(name), timeout=10)

    assert [model("burst").status_code for _ in range(BURST)] == [200] * BURST  # a full bucket
    limited = model("burst")
    _assert_json_error(limited, 429)
    # Retry-After is when the bucket holds a request again: at RATE, about 1/RATE seconds away.
    assert int(limited.headers["Retry-After"]) > 0.9 / RATE
    assert model("other").status_code == 200


def _urllib_post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_every_common_client_reads_the_413_and_the_401_of_an_oversized_body(guarded):
    predict = f"{guarded.url}/predict"
    # urllib writes the whole body before reading: without draining it saw "connection reset".
    for _ in range(3):
        status, body = _urllib_post(predict, OVER, {"Content-Type": "image/jpeg", **guarded.auth("urllib")})
        assert status == 413 and "byte limit" in body["error"], body
    status, body = _urllib_post(predict, OVER, {"Content-Type": "image/jpeg"})
    assert status == 401 and body["error"]
    answer = requests.post(
        predict, data=OVER, headers={"Content-Type": "image/jpeg", **guarded.auth("requests")}, timeout=60
    )
    _assert_json_error(answer, 413)
    curl = subprocess.run(
        ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--data-binary", "@-", predict,
         "-H", "Content-Type: image/jpeg", "-H", f"Authorization: Bearer {guarded.tokens['curl']}"],
        input=OVER, capture_output=True, timeout=60, check=True,
    )  # fmt: skip
    body, status = curl.stdout.decode().rsplit("\n", 1)
    assert status == "413" and "byte limit" in json.loads(body)["error"]
    assert requests.post(
        predict, data=_png(), headers={"Content-Type": "image/png", **guarded.auth("predict")}, timeout=30
    ).json()["model_version"] == guarded.version  # fmt: skip


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body


def _head(url: str, token: str, extra: str) -> bytes:
    host = urlsplit(url).netloc
    return (
        f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: image/png\r\n"
        f"Authorization: Bearer {token}\r\n{extra}\r\n"
    ).encode()


def test_a_chunked_body_over_the_limit_gets_the_413_and_a_close(guarded):
    sock = _connect(guarded.url)
    sock.sendall(_head(guarded.url, guarded.tokens["chunked"], "Transfer-Encoding: chunked\r\n"))
    piece = b"\x00" * (1024 * 1024)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    sock.settimeout(0.05)
    response = None
    try:
        while sent < 100 * len(piece):  # a client that would send 100 MiB
            try:
                sock.sendall(chunk)
                sent += len(piece)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                break  # the server stopped reading
        sock.settimeout(30)
        response = _read_response(sock)
    finally:
        sock.close()
    status, headers, body = response
    assert status == 413 and "byte limit" in json.loads(body)["error"]
    assert headers.get("connection") == "close"
    # How much the client got to send says nothing of the replica: Serve's proxy buffers a body as
    # fast as it arrives (seen: 76 MiB on an idle machine, far less under load), the replica reads
    # it only up to the limit. What every client can count on is the 413 JSON and the close.
    print(f"\nchunked: the client sent {sent / 2**20:.0f} MiB before the 413")


def test_stalled_uploads_end_in_408_and_pending_requests_are_bounded_with_503(guarded):
    def probe():
        return requests.post(
            f"{guarded.url}/predict",
            data=_png(),
            headers={"Content-Type": "image/png", **guarded.auth("probe")},
            timeout=60,
        )

    stalled = []
    try:
        for _ in range(2):  # max_pending=2: two uploads that never finish fill the replica
            sock = _connect(guarded.url)
            sock.sendall(
                _head(guarded.url, guarded.tokens["slow"], "Content-Length: 100000\r\n") + b"\x89PNG"
            )
            stalled.append(sock)
        # Until both uploads reach the replica a probe is answered; then it is refused, not queued.
        # Probes are paced: each costs one of the token's BURST (CI once answered more than BURST
        # back-to-back probes before its loaded proxy handed the uploads over), and the uploads stay
        # pending for BODY_TIMEOUT_S once they arrive, so a pause cannot miss them.
        answered = 0
        while (busy := probe()).status_code == 200:
            readable, _, _ = select.select(stalled, [], [], 0)
            assert not readable, "the uploads were answered before any probe found the replica full"
            answered += 1
            time.sleep(0.5)
        print(f"\n{answered} probe(s) answered before the uploads filled the replica")
        _assert_json_error(busy, 503)
        assert busy.headers["Retry-After"] == "1" and "pending" in busy.json()["error"]
        for sock in stalled:
            status, headers, body = _read_response(sock)
            message = json.loads(body)["error"]
            assert status == 408 and f"did not arrive within {BODY_TIMEOUT_S}s" in message, message
            assert headers.get("connection") == "close"
    finally:
        for sock in stalled:
            sock.close()
    assert probe().status_code == 200


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def test_images_are_capped_in_pixels_and_formats(guarded):
    def post(value: bytes, content_type: str = "image/png"):
        return requests.post(
            f"{guarded.url}/predict",
            data=value,
            headers={"Content-Type": content_type, **guarded.auth("pixels")},
            timeout=60,
        )

    # A PNG that is tiny on the wire and 5000 x 5000 decoded: refused before decoding.
    bomb = post(_encoded(Image.new("1", (5000, 5000)), "PNG"))
    assert "exceeds the 16777216 pixel limit" in _assert_json_error(bomb, 400)["error"]
    # A JPEG over the cap decodes at a reduced DCT scale (draft mode) instead: answered.
    large = post(_encoded(Image.new("RGB", (6000, 5000), (40, 90, 200)), "JPEG", quality=50), "image/jpeg")
    assert large.status_code == 200, large.text
    # Only JPEG, PNG and WebP decode, whatever the content type says.
    gif = post(_encoded(Image.new("RGB", (8, 8)), "GIF"))
    assert "not a JPEG, PNG or WebP" in _assert_json_error(gif, 400)["error"]
    webp = post(_encoded(Image.new("RGB", (40, 40), (1, 2, 3)), "WEBP"), "image/webp")
    assert webp.status_code == 200, webp.text


def test_promote_waits_on_rollout_with_the_token_from_the_environment(guarded):
    from app.serve.promote import RolloutIncomplete, wait_for_rollout

    assert wait_for_rollout(guarded.url, guarded.version, 30, token=guarded.tokens["promote"]) == 1
    # A 401 is final: it gives up at once rather than waiting out the hour (which the suite's
    # per-test timeout would end as a failure).
    with pytest.raises(RolloutIncomplete, match="answered 401.*set ARGUS_API_TOKEN"):
        wait_for_rollout(guarded.url, guarded.version, timeout_s=3600)
    args = ["promote", guarded.version, "--wait-url", guarded.url, "--storage", guarded.storage]
    promoted = run_cli(*args, env={"ARGUS_API_TOKEN": guarded.tokens["promote"]}, timeout=120)
    assert promoted.returncode == 0, promoted.stderr[-2000:]
    assert f"every replica (1) at {guarded.url} serves v{guarded.version}" in promoted.stdout
    refused = run_cli(*args, "--timeout-s", "5", timeout=120)
    assert refused.returncode == 1 and "set ARGUS_API_TOKEN" in refused.stderr.strip().splitlines()[-1]
