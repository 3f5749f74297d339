"""Serving: a Ray Serve application with a FastAPI ingress over the registry's alias (CONTRACT.md §4).

    python -m app serve --http-port 8000          # foreground until Ctrl-C, like `serve run`
    serve run app.serve:build_app mlflow_uri=...  # the same application through Serve's own CLI

Each replica serves the version the alias (default `champion`) points at and polls the alias; a
new version is loaded beside the old one and swapped in with one reference assignment, so a
rollout drops no request. Requests share the training transform and are batched with
`@serve.batch`. Bad input is a JSON 4xx and never reaches the model.

No `from __future__ import annotations` here: FastAPI must resolve the route annotations
(`Request`) on the methods Serve rewrites into class-based views.
"""

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import metrics, registry
from app.config import DEFAULT_MODEL_NAME
from app.model import local_device
from app.transform import BadImage, decode_pixels, image_statistics, normalize

log = logging.getLogger(__name__)

DEPLOYMENT = "ArgusModel"
APPLICATION = "argus"
IMAGE_TYPES = {"image/jpeg", "image/png", "image/webp", "application/octet-stream"}

api = FastAPI(title="Argus behaviour-image classifier", version="1")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail))


@api.exception_handler(Exception)
async def _internal_error(_request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in a request")
    return _error(500, f"internal error: {type(exc).__name__}")


@api.exception_handler(RequestValidationError)
async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    return _error(400, str(exc.errors()))


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def _read_image_bytes(request: Request, max_body_bytes: int) -> bytes:
    """The image bytes of a raw or multipart body; size is checked before anything is decoded."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in IMAGE_TYPES and content_type != "multipart/form-data":
        raise BadRequest(
            415,
            f"unsupported content type {content_type or '(none)'!r}; send "
            f"{', '.join(sorted(IMAGE_TYPES))} or multipart/form-data with a file field 'image'",
        )
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise BadRequest(413, f"body of {declared} bytes exceeds the {max_body_bytes} byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_body_bytes:
            raise BadRequest(413, f"body exceeds the {max_body_bytes} byte limit")
    if content_type == "multipart/form-data":
        request._body = bytes(body)  # let Starlette parse the form from what was already read
        form = await request.form()
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            raise BadRequest(400, "multipart body has no file field 'image'")
        return await upload.read()
    return bytes(body)


def infer(items: list[tuple[np.ndarray, registry.LoadedModel]]) -> list[tuple[dict, torch.Tensor]]:
    """Resize, normalise and classify a batch of decoded images, one forward pass per model version
    present in the batch; returns each request's answer with its transformed image.

    Each request is answered by the version it was accepted under, at that version's image size.
    (Kept at module level, above the class: Serve pickles the class by value when it is decorated,
    with the globals defined by then, and torch's internals inside the method body do not pickle.)
    """
    results: list[tuple[dict, torch.Tensor] | None] = [None] * len(items)
    by_version: dict[str, list[int]] = {}
    for i, (_, loaded) in enumerate(items):
        by_version.setdefault(loaded.version, []).append(i)
    for indices in by_version.values():
        loaded = items[indices[0]][1]
        device = next(loaded.model.parameters()).device
        inputs = normalize([items[i][0] for i in indices], loaded.card.image_size, device)
        with torch.inference_mode():
            probabilities = torch.softmax(loaded.model(inputs), dim=1)
        for i, tensor, row in zip(indices, inputs, probabilities.tolist()):
            best = max(range(len(row)), key=row.__getitem__)
            results[i] = (
                {
                    "label": loaded.card.classes[best],
                    "scores": dict(zip(loaded.card.classes, row)),
                    "model_version": loaded.version,
                },
                tensor,
            )
    return results


class TrafficLog:
    """What each replica saw: time, version, predicted label and per-channel statistics of the
    transformed image, one JSON line per request, for `python -m app drift`."""

    def __init__(self, directory: str):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._file = open(
            path / f"{serve.get_replica_context().replica_id.unique_id}.jsonl", "a", buffering=1
        )
        self._lock = threading.Lock()

    def record(self, tensor: torch.Tensor, answer: dict) -> None:
        row = {
            "time": time.time(),
            "model_version": answer["model_version"],
            "label": answer["label"],
            **image_statistics(tensor),
        }
        with self._lock:
            self._file.write(json.dumps(row) + "\n")


@serve.deployment(
    name=DEPLOYMENT, ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64, health_check_period_s=5
)
@serve.ingress(api)
class ArgusModel:
    def __init__(
        self,
        mlflow_uri: str,
        model_name: str = DEFAULT_MODEL_NAME,
        alias: str = "champion",
        max_batch_size: int = 16,
        batch_wait_timeout_s: float = 0.01,
        max_body_bytes: int = 10 * 1024 * 1024,
        poll_s: float = 2.0,
        threads: int = 1,
        traffic_dir: str | None = None,
    ):
        torch.set_num_threads(threads)
        self.device = local_device()  # a replica given `num_gpus` keeps its models on that GPU
        self.traffic = TrafficLog(traffic_dir) if traffic_dir else None
        self.mlflow_uri, self.model_name, self.alias = mlflow_uri, model_name, alias
        self.max_body_bytes = max_body_bytes
        self.current: registry.LoadedModel | None = None
        self.predict_batch.set_max_batch_size(max_batch_size)
        self.predict_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self._refresh()
        self._stop = threading.Event()
        threading.Thread(target=self._follow_alias, args=(poll_s,), daemon=True, name="alias-poller").start()

    def _refresh(self) -> None:
        version = registry.resolve(self.mlflow_uri, self.model_name, self.alias)
        if version is None or (self.current and self.current.version == version):
            return
        loaded = registry.load(self.mlflow_uri, self.model_name, version)  # load first, then swap
        loaded.model.to(self.device)
        previous, self.current = self.current, loaded
        log.info(
            "now serving %s v%s on %s (was %s)",
            self.model_name,
            version,
            self.device,
            previous and previous.version,
        )

    def _follow_alias(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self._refresh()
            except Exception:  # a registry hiccup must not stop the replica serving what it has
                log.exception("could not refresh the model behind alias %r", self.alias)

    async def check_health(self) -> None:
        if self.current is None:
            self._refresh()

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        if self.current is None:
            return _error(503, f"no model version behind alias {self.alias!r} yet")
        return JSONResponse({"status": "ok", "model_version": self.current.version})

    @api.get("/model")
    async def model_info(self) -> JSONResponse:
        current = self.current
        if current is None:
            return _error(503, f"no model version behind alias {self.alias!r} yet")
        card = current.card
        return JSONResponse(
            {
                "name": current.name,
                "version": current.version,
                "run_id": current.run_id,
                "alias": self.alias,
                "arch": card.arch,
                "training_kind": card.training_kind,
                "classes": card.classes,
                "image_size": card.image_size,
                "snapshots": card.snapshots,
                "metrics": card.metrics,
            }
        )

    @api.post("/predict")
    async def predict(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        current = self.current
        response = await self._predict(request, current)
        version = current.version if current else "none"
        metrics.inc("argus_serve_requests", status=response.status_code, model_version=version)
        metrics.observe("argus_serve_latency_seconds", time.perf_counter() - started, model_version=version)
        return response

    async def _predict(self, request: Request, current: registry.LoadedModel | None) -> JSONResponse:
        if current is None:
            return _error(503, f"no model version behind alias {self.alias!r} yet")
        try:
            value = await _read_image_bytes(request, self.max_body_bytes)
            if not value:
                raise BadRequest(400, "empty body: send the image bytes")
            pixels = await asyncio.to_thread(decode_pixels, value)
        except BadRequest as exc:
            return _error(exc.status, str(exc))
        except BadImage as exc:
            return _error(400, str(exc))
        answer, tensor = await self.predict_batch((pixels, current))
        if self.traffic:
            self.traffic.record(tensor, answer)
        return JSONResponse(answer)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def predict_batch(self, items: list[tuple[np.ndarray, registry.LoadedModel]]) -> list[tuple]:
        # On the event loop, not in a thread: requests queue while the model runs, so the next batch
        # is fuller (measured: a worker thread here made batches smaller and throughput lower).
        return infer(items)


def traffic_dir(settings) -> str | None:
    return settings.uri("traffic") if settings.is_local_storage else None


def build_app(args: dict) -> serve.Application:
    """Application builder for `serve run app.serve:build_app key=value ...` and RayService configs."""
    options = dict(args)
    replicas = int(options.pop("num_replicas", 1))
    kwargs = {
        "mlflow_uri": options["mlflow_uri"],
        "model_name": options.get("model_name", DEFAULT_MODEL_NAME),
        "alias": options.get("alias", "champion"),
    }
    for key, cast in (
        ("max_batch_size", int),
        ("batch_wait_timeout_s", float),
        ("max_body_bytes", int),
        ("poll_s", float),
        ("threads", int),
        ("traffic_dir", str),
    ):
        if options.get(key) is not None:  # None (no traffic log on object storage) stays unset
            kwargs[key] = cast(options[key])
    return ArgusModel.options(num_replicas=replicas).bind(**kwargs)


def deploy(settings, cfg, *, blocking: bool) -> str:
    """`python -m app serve`: start Serve's HTTP proxy on host:port and deploy the application."""
    serve.start(http_options={"host": cfg.http_host, "port": cfg.http_port})
    app = build_app(
        {
            "mlflow_uri": settings.tracking_uri,
            "model_name": settings.model_name,
            "alias": cfg.alias,
            "num_replicas": cfg.replicas,
            "max_batch_size": cfg.max_batch_size,
            "batch_wait_timeout_s": cfg.batch_wait_timeout_s,
            "max_body_bytes": cfg.max_body_bytes,
            "poll_s": cfg.poll_s,
            "traffic_dir": traffic_dir(settings),
        }
    )
    serve.run(app, name=APPLICATION, route_prefix="/", blocking=False)
    url = f"http://{cfg.http_host}:{cfg.http_port}"
    log.info("serving %s@%s on %s", settings.model_name, cfg.alias, url)
    return url


def wait_for_version(url: str, version: str | None = None, timeout_s: float = 60.0) -> str:
    """Poll /healthz until it answers 200 (and reports `version`, if given); return that version."""
    import requests

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            response = requests.get(f"{url}/healthz", timeout=2)
            last = response.json()
            if response.ok and (version is None or last.get("model_version") == version):
                return last["model_version"]
        except (requests.RequestException, ValueError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(
        f"{url}/healthz did not report {version or 'a model'} within {timeout_s}s (last: {last})"
    )
