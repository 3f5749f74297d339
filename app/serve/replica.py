"""The Serve deployment `ArgusModel`: one replica answering /predict, /healthz, /model and /rollout
over the registry's alias (CONTRACT.md §4); `app/serve/deploy.py` deploys it.

A replica fixes a request's model version when it accepts it (`app/serve/versions.py` switches
versions with the rest of the fleet), reads the body through `app/serve/http.py`'s limits, decodes
and classifies it with `app/inference.py` in `@serve.batch` batches, and logs what it saw
(`app/serve/traffic.py`). With tokens (`app/serve/access.py`) everything but /healthz and
/openapi.json needs `Authorization: Bearer`.

No `from __future__ import annotations` here: FastAPI must resolve the route annotations
(`Request`) on the methods Serve rewrites into class-based views.
"""

import asyncio
import time

import numpy as np
import ray
import torch
from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from ray import serve

from app import metrics, registry
from app.config import DEFAULT_MODEL_NAME
from app.inference import infer
from app.model import local_device
from app.serve import access
from app.serve.http import (
    BODY_TIMEOUT_S,
    PREDICT_BODY,
    ROLLOUT_EXAMPLE,
    BadRequest,
    Health,
    Prediction,
    api,
    error,
    error_responses,
    openapi_document,
    read_image_bytes,
)
from app.serve.traffic import TrafficLog
from app.serve.versions import ReplicaVersions
from app.transform import BadImage, decode_pixels

DEPLOYMENT = "ArgusModel"
MAX_PENDING = 32
"""/predict requests a replica holds at once (bodies, decodes, batches); more are a 503 at once.
Below the deployment's max_ongoing_requests, so the replica, not Serve's proxy, answers them."""
MAX_QUEUED = 256
"""Requests Serve's proxy queues for the deployment; beyond, the proxy answers 503 itself (text)."""
DECODES = 2
"""Concurrent image decodes per replica: each can hold `app.transform.MAX_IMAGE_PIXELS` x 4 bytes
at its peak, then keeps a reduced copy."""


@serve.deployment(
    name=DEPLOYMENT,
    ray_actor_options={"num_cpus": 0.25},
    max_ongoing_requests=64,
    max_queued_requests=MAX_QUEUED,
    health_check_period_s=5,
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
        token_digests: tuple[str, ...] = (),
        rate_limit: float = 50.0,
        rate_burst: int = 100,
        docs: bool = False,
        max_pending: int = MAX_PENDING,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        import ray

        self.tokens = access.TokenCheck(token_digests) if token_digests else None
        limited = token_digests and rate_limit > 0
        self.limiter = access.RateLimiter(rate_limit, rate_burst) if limited else None
        self.docs, self.max_pending, self.body_timeout_s = docs, max_pending, body_timeout_s
        self.max_body_bytes, self.alias = max_body_bytes, alias
        self._pending = 0
        self._decodes = asyncio.Semaphore(DECODES)
        self._document: dict | None = None
        torch.set_num_threads(threads)
        context = serve.get_replica_context()
        self.traffic = TrafficLog(traffic_dir, context.replica_id.unique_id) if traffic_dir else None
        self.predict_batch.set_max_batch_size(max_batch_size)
        self.predict_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        # A replica given `num_gpus` keeps its models on that GPU (local_device).
        node = ray.get_runtime_context().get_node_id()
        share = self.limiter.share_among if self.limiter else None
        self.versions = ReplicaVersions(
            mlflow_uri, model_name, alias, poll_s, local_device(), context, node, on_replica_count=share
        )
        self.versions.start()

    def __del__(self):
        if getattr(self, "versions", None) is not None:  # None when __init__ failed early
            self.versions.stop()
        if getattr(self, "traffic", None) is not None:  # Serve calls __del__ on graceful shutdown
            self.traffic.close()

    async def check_health(self) -> None:
        versions = self.versions
        if versions.serving is None:
            await asyncio.to_thread(versions.prepare)
            if versions.serving is None and versions.error:
                raise RuntimeError(versions.error)

    def _no_model(self) -> JSONResponse:
        return error(503, f"no model version behind alias {self.alias!r} yet")

    def _refused(self, request: Request) -> JSONResponse | None:
        """401 without a valid token, 429 over its rate; None when the request may go on."""
        if self.tokens is None:
            return None
        key = self.tokens.match(request.headers.get("authorization"))
        if key is None:
            message = "a valid token is needed: send Authorization: Bearer <token>"
            return error(401, message, {"WWW-Authenticate": 'Bearer realm="argus"'})
        wait_s = self.limiter.take(key) if self.limiter else 0.0
        if wait_s:
            message = f"over the rate limit of {self.limiter.total_rate:g} requests/s for this token"
            return error(429, message, {"Retry-After": access.retry_after(wait_s)})
        return None

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_json(self) -> JSONResponse:
        if self._document is None:
            self._document = openapi_document(api, guarded=self.tokens is not None)
        return JSONResponse(self._document)

    @api.get("/docs", include_in_schema=False)
    async def docs_page(self):
        if not self.docs:
            return error(404, "Not Found")
        return HTMLResponse(get_swagger_ui_html(openapi_url="/openapi.json", title=api.title).body)

    @api.get(
        "/healthz",
        summary="Liveness: whether a model is loaded, and which version (no token needed)",
        responses={200: {"model": Health}, **error_responses(503)},
    )
    async def healthz(self) -> JSONResponse:
        # Status and version only: it is open to anyone. Rollout detail is behind /rollout.
        serving = self.versions.model_for(time.time())
        if serving is None:
            return self._no_model()
        return JSONResponse({"status": "ok", "model_version": serving.version})

    @api.get(
        "/rollout",
        summary="Where the rollout stands on every live replica",
        description="Read-only, from the rollout coordinator: the active version and the wall time "
        "(`activate_at`, Unix seconds) from which requests get it, and each live replica's served and "
        "prepared version, the version its alias read, load error, node and the age of its last report.",
        responses={
            200: {"content": {"application/json": {"example": ROLLOUT_EXAMPLE}}},
            **error_responses(401, 429, 503),
        },
    )
    async def rollout_state(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        # Twice: a coordinator that died with the replica that created it is created again by the
        # second call (the replicas report to it within a poll). A slow one is not asked again: the
        # caller gets its 503 within one call's timeout.
        for _ in range(2):
            try:
                return JSONResponse(await asyncio.to_thread(self.versions.coordinator_state))
            except ray.exceptions.GetTimeoutError as exc:
                failure = exc
                break
            except Exception as exc:
                failure = exc
        return error(503, f"rollout coordinator unreachable: {type(failure).__name__}: {failure}")

    @api.get(
        "/model",
        summary="The served version: name, run, classes, image size, and the table snapshot and Kafka "
        "offset ranges it was trained on",
        responses=error_responses(401, 429, 503),
    )
    async def model_info(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        current = self.versions.model_for(time.time())
        if current is None:
            return self._no_model()
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
                # {table, snapshot_id, offsets}; versions from before the table list their folders.
                "lineage": card.lineage,
                **({"snapshots": card.snapshots} if card.snapshots is not None else {}),
                "metrics": card.metrics,
            }
        )

    @api.post(
        "/predict",
        summary="Classify one behaviour image",
        description="The body is the encoded image (JPEG, PNG or WebP; its content type, or "
        "application/octet-stream), or multipart/form-data with the image in the file field `image`.",
        openapi_extra=PREDICT_BODY,
        responses={200: {"model": Prediction}, **error_responses(400, 401, 408, 413, 415, 429, 503)},
    )
    async def predict(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        current = self.versions.model_for(time.time())  # the version is fixed when the request is accepted
        if (refused := self._refused(request)) is not None:
            response = refused
        elif self._pending >= self.max_pending:  # answered at once: held bodies bound memory
            message = f"{self._pending} requests pending on this replica: retry shortly"
            response = error(503, message, {"Retry-After": "1"})
        else:
            self._pending += 1
            try:
                response = await self._predict(request, current)
            finally:
                self._pending -= 1
        version = current.version if current else "none"
        metrics.inc("argus_serve_requests", status=response.status_code, model_version=version)
        metrics.observe("argus_serve_latency_seconds", time.perf_counter() - started, model_version=version)
        return response

    async def _predict(self, request: Request, current: registry.LoadedModel | None) -> JSONResponse:
        if current is None:
            return self._no_model()
        try:
            value = await read_image_bytes(request, self.max_body_bytes, self.body_timeout_s)
            async with self._decodes:  # decoded pixels, not bodies, are what could exhaust memory
                pixels = await asyncio.to_thread(decode_pixels, value, current.card.image_size)
        except BadRequest as exc:
            return error(exc.status, str(exc), exc.headers)
        except BadImage as exc:
            return error(400, str(exc))
        answer, tensor = await self.predict_batch((pixels, current))
        if self.traffic:
            self.traffic.record(tensor, answer)
        return JSONResponse(answer)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def predict_batch(self, items: list[tuple[np.ndarray, registry.LoadedModel]]) -> list[tuple]:
        # On the event loop, not in a thread: requests queue while the model runs, so the next batch
        # is fuller (measured: a worker thread here made batches smaller and throughput lower).
        return infer(items)
