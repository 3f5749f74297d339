"""Serving: a Ray Serve application with a FastAPI ingress over the registry's alias (CONTRACT.md §4).

    python -m app serve --http-port 8000          # foreground until Ctrl-C, like `serve run`
    serve run app.serve:build_app mlflow_uri=...  # the same application through Serve's own CLI

Each replica polls the alias (default `champion`) and *prepares* its version, loaded beside the one
it serves; `app/serve/rollout.py`'s coordinator activates a version on every replica at once, at a wall
time every replica knows beforehand, so a rollout drops no request and no client sees new → old.
A version that does not load is not activated anywhere: replicas keep serving the old one and say
why (/rollout). Every response names its replica (`X-Argus-Replica`). Requests share the
training transform and are batched with `@serve.batch`. Bad input is a JSON 4xx and never reaches
the model, and every client reads it: the rest of a body is drained before the answer (`BodyGuard`).
With tokens (`app/serve/access.py`) everything but /healthz and /openapi.json needs `Authorization: Bearer`.

No `from __future__ import annotations` here: FastAPI must resolve the route annotations
(`Request`) on the methods Serve rewrites into class-based views.
"""

import asyncio
import copy
import io
import json
import logging
import math
import threading
import time

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from PIL import Image
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import metrics, registry
from app.config import DEFAULT_MODEL_NAME
from app.model import local_device
from app.serve import access, rollout
from app.transform import IMAGE_FORMATS, BadImage, decode_image, image_statistics, normalize

log = logging.getLogger(__name__)

DEPLOYMENT = "ArgusModel"
APPLICATION = "argus"
IMAGE_TYPES = {"image/jpeg", "image/png", "image/webp", "application/octet-stream"}
REPLICA_HEADER = "X-Argus-Replica"
RETRY_FAILED_LOAD_S = 30.0
"""A version that failed to load is tried again after this long (an artifact fixed in place)."""

MAX_DECODE_PIXELS = 4096 * 4096
"""Far more than any model's input: larger images are refused (400), or, JPEG, decoded at 1/2..1/8."""
MAX_PENDING = 32
"""/predict requests a replica holds at once (bodies, decodes, batches); more are a 503 at once.
Below the deployment's max_ongoing_requests, so the replica, not Serve's proxy, answers them."""
MAX_QUEUED = 256
"""Requests Serve's proxy queues for the deployment; beyond, the proxy answers 503 itself (text)."""
DECODES = 2
"""Concurrent image decodes per replica: each can hold MAX_DECODE_PIXELS x 4 bytes at its peak."""
BODY_TIMEOUT_S = 30.0
"""A body not received within this long (a slow or stalled upload) is a 408."""
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 10.0
"""An early answer (401, 413, 415, ...) waits for up to this much of the unread body, this long."""

# No automatic /docs or /openapi.json: the replica serves both (`openapi_document`, `docs_page`), so
# the document says whether this deployment needs a token and Swagger UI is up only when asked for.
api = FastAPI(
    title="Argus behaviour-image classifier", version="1", docs_url=None, redoc_url=None, openapi_url=None
)


def replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class ReplicaHeader:
    """Pure ASGI middleware: every response names the replica that answered it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = REPLICA_HEADER.lower().encode()

        async def send_named(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if all(name.lower() != header for name, _ in headers):
                    headers.append((header, replica_id().encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_named)


class BodyGuard:
    """Pure ASGI middleware: an answer goes out only after the client finished sending its body.

    Serve's proxy stops reading a request once its answer is sent and the connection closes with the
    rest unread, which a client that writes the whole body before reading (Python's urllib) sees as
    "connection reset" instead of the 413 or 401. So an early answer first drains what is left of a
    declared body (up to DRAIN_MAX_BYTES, within DRAIN_TIMEOUT_S). A chunked body over the limit, a
    larger one or a stalled one (408) is not drained: that answer says `Connection: close`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        declared = int(length) if length.isdigit() else None
        done = not (declared or b"transfer-encoding" in headers)

        async def tracked():
            nonlocal done
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                done = True
            return message

        async def send_drained(message):
            if message["type"] == "http.response.start" and not done:
                if declared is not None and declared <= DRAIN_MAX_BYTES and message["status"] != 408:
                    try:
                        async with asyncio.timeout(DRAIN_TIMEOUT_S):
                            while not done:
                                await tracked()
                    except TimeoutError:
                        pass
                if not done:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked, send_drained)


api.add_middleware(ReplicaHeader)
api.add_middleware(BodyGuard)


class ErrorBody(BaseModel):
    """Every error answer: what was wrong, in one line."""

    error: str


class Prediction(BaseModel):
    label: str
    scores: dict[str, float]
    """Probability of every class."""
    model_version: str


class Health(BaseModel):
    status: str
    model_version: str


ERRORS = {
    400: "not a decodable JPEG, PNG or WebP image (or over the pixel limit), or no file field `image`",
    401: "no valid bearer token (only when the service has tokens)",
    408: "the body did not arrive in time",
    413: "body over the size limit",
    415: "another content type",
    429: "over this token's rate limit: retry after `Retry-After` seconds",
    503: "no model loaded yet, or the replica is at its limit of pending requests",
}
ERROR_HEADERS = {
    401: {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}, "required": True}},
    429: {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}, "required": True}},
    503: {"Retry-After": {"description": "seconds, when overloaded", "schema": {"type": "integer"}}},
}
AUTHENTICATED = {("/predict", "post"), ("/model", "get"), ("/rollout", "get")}
"""What a token guards when the service has tokens; /healthz and /openapi.json stay open."""


def _errors(*codes: int) -> dict:
    """OpenAPI `responses` for these error statuses, each with the JSON error body."""
    responses = {code: {"model": ErrorBody, "description": ERRORS[code]} for code in codes}
    for code in set(codes) & set(ERROR_HEADERS):
        responses[code]["headers"] = ERROR_HEADERS[code]
    return responses


def _binary(content_types) -> dict:
    return {t: {"schema": {"type": "string", "format": "binary"}} for t in content_types}


PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "description": "The encoded image itself, or a form with the image in the file field `image`.",
        "content": {
            **_binary(sorted(IMAGE_TYPES)),
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image"],
                    "properties": {"image": {"type": "string", "format": "binary"}},
                },
                "encoding": {"image": {"contentType": ", ".join(sorted(IMAGE_TYPES))}},
            },
        },
    }
}


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    # The header here too: Starlette answers unhandled exceptions outside user middleware.
    return JSONResponse(
        {"error": message}, status_code=status, headers={REPLICA_HEADER: replica_id(), **(headers or {})}
    )


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
    return _error(exc.status_code, str(exc.detail), exc.headers)  # a 405's `Allow` among them


@api.exception_handler(Exception)
async def _internal_error(_request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in a request")
    return _error(500, f"internal error: {type(exc).__name__}")


@api.exception_handler(RequestValidationError)
async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    return _error(400, str(exc.errors()))


class BadRequest(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


async def _read_image_bytes(request: Request, max_body_bytes: int, timeout_s: float) -> bytes:
    """The image bytes of a raw or multipart body; size is checked before anything is decoded, and
    a body is read no further than the limit (a chunked one too) and no longer than `timeout_s`."""
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
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > max_body_bytes:
                    raise BadRequest(413, f"body exceeds the {max_body_bytes} byte limit")
    except TimeoutError:
        raise BadRequest(408, f"the body did not arrive within {timeout_s:g}s") from None
    if content_type == "multipart/form-data":
        request._body = bytes(body)  # let Starlette parse the form from what was already read
        try:
            form = await request.form(max_files=4, max_fields=16)
        except Exception as exc:  # python-multipart and Starlette raise several kinds
            raise BadRequest(400, f"malformed multipart body: {type(exc).__name__}: {exc}"[:300]) from None
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            raise BadRequest(400, "multipart body has no file field 'image'")
        return await upload.read()
    return bytes(body)


def decode_upload(value: bytes) -> np.ndarray:
    """Encoded bytes → uint8 HWC pixels, as `decode_pixels` but capped at MAX_DECODE_PIXELS: larger
    declared sizes are refused before any pixel is decoded (BadImage), except JPEGs, which decode
    at the smallest DCT scale (1/2, 1/4, 1/8) that fits (PIL's draft mode), never at full size."""
    try:
        image = Image.open(io.BytesIO(value), formats=IMAGE_FORMATS)
        width, height = image.size
    except Exception:
        image = None  # decode_image says why, in its own words
    if image is None or image.format != "JPEG" or width * height <= MAX_DECODE_PIXELS:
        return np.array(decode_image(value, max_pixels=MAX_DECODE_PIXELS))
    for scale in (2, 4, 8):
        if math.ceil(width / scale) * math.ceil(height / scale) <= MAX_DECODE_PIXELS:
            break
    else:
        raise BadImage(f"image of {width}x{height} pixels exceeds the {MAX_DECODE_PIXELS} pixel limit")
    try:
        image.draft("RGB", (width // scale, height // scale))
        image.load()
        return np.array(image.convert("RGB"))
    except Exception as exc:  # malformed data raises anything (see decode_image)
        raise BadImage(f"undecodable image: {type(exc).__name__}: {exc}") from exc


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
    """What each replica saw, for `python -m app drift`: per request the time, version, predicted
    label, the probability of every class (card order) and per-channel statistics of the
    transformed image.

    Written through the storage layer, so one way serves a local dir, S3 and HDFS: object stores
    cannot append, so rows are buffered and each flush writes one new, immutable JSON-lines object
    `<replica>-<start>-<seq>.jsonl` (every FLUSH_S, sooner at FLUSH_ROWS), from a thread: a put to
    S3 must not stall the event loop that answers requests."""

    FLUSH_S = 2.0
    FLUSH_ROWS = 256
    MAX_BUFFERED = 65536
    """Rows held while the store is unreachable; beyond, the oldest are dropped (logged)."""

    def __init__(self, root: str, replica: str):
        from app.storage import filesystem

        self._fs, self._dir = filesystem(root)
        # The start time keeps a restarted replica's objects apart from its predecessor's.
        self._prefix, self._seq = f"{replica}-{int(time.time() * 1000)}", 0
        self._rows: list[str] = []
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="traffic-log")
        self._thread.start()

    def record(self, tensor: torch.Tensor, answer: dict) -> None:
        row = {
            "time": time.time(),
            "model_version": answer["model_version"],
            "label": answer["label"],
            "probabilities": [round(p, 4) for p in answer["scores"].values()],
            **image_statistics(tensor),
        }
        with self._lock:
            self._rows.append(json.dumps(row))
            if len(self._rows) > self.MAX_BUFFERED:
                del self._rows[: len(self._rows) - self.MAX_BUFFERED]
                log.warning("traffic log: storage unreachable, dropping the oldest rows")
            if len(self._rows) >= self.FLUSH_ROWS:
                self._wake.set()

    def flush(self) -> None:
        from app.storage import write_file

        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        path = f"{self._dir}/{self._prefix}-{self._seq:06d}.jsonl"
        try:
            write_file(self._fs, path, ("\n".join(rows) + "\n").encode())
            self._seq += 1
        except Exception as exc:  # the store is down: keep the rows for the next try, keep serving
            log.warning("traffic log: cannot write %s: %s: %s", path, type(exc).__name__, exc)
            with self._lock:
                self._rows[:0] = rows

    def close(self) -> None:
        """Write what is buffered and stop (replica shutdown)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)  # within Serve's graceful shutdown (20 s by default)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.FLUSH_S)
            self._wake.clear()
            self.flush()
        self.flush()


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
        self._pending = 0
        self._decodes = asyncio.Semaphore(DECODES)
        self._document: dict | None = None
        torch.set_num_threads(threads)
        self.device = local_device()  # a replica given `num_gpus` keeps its models on that GPU
        self.traffic = TrafficLog(traffic_dir, replica_id()) if traffic_dir else None
        self.mlflow_uri, self.model_name, self.alias = mlflow_uri, model_name, alias
        self.max_body_bytes, self.poll_s = max_body_bytes, poll_s
        self.predict_batch.set_max_batch_size(max_batch_size)
        self.predict_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        context = serve.get_replica_context()
        self.replica, self.node = replica_id(), ray.get_runtime_context().get_node_id()
        self.serving: registry.LoadedModel | None = None
        """Answers requests accepted now."""
        self.prepared: registry.LoadedModel | None = None
        """Loaded beside `serving`, answering requests once the coordinator's activation time comes."""
        self.plan: rollout.Plan | None = None
        self.error: str | None = None
        self._failed_at: dict[str, float] = {}
        self._swap = threading.Lock()
        self._loading = threading.Lock()  # one load at a time: the alias poller or check_health
        self._coordinator_answered = threading.Event()
        self._coordinator_reachable = True
        self._link = rollout.CoordinatorLink(
            rollout.coordinator_name(context.app_name, mlflow_uri, model_name, alias), context, poll_s
        )
        self._stop = threading.Event()
        self.alias_version = registry.resolve(mlflow_uri, model_name, alias)
        # Report before loading anything: a starting replica counts as live, so no activation is
        # scheduled without it, and the first answer says what is active.
        threading.Thread(target=self._report_loop, daemon=True, name="rollout-reporter").start()
        if not self._coordinator_answered.wait(rollout.stale_after_s(poll_s) + 10):
            log.warning("no answer from the rollout coordinator: serving the alias's version")
        self._load_initial()
        threading.Thread(target=self._follow_alias, daemon=True, name="alias-poller").start()

    def __del__(self):
        stop = getattr(self, "_stop", None)  # None when __init__ failed early
        if stop is not None:
            stop.set()
        if getattr(self, "traffic", None) is not None:  # Serve calls __del__ on graceful shutdown
            self.traffic.close()

    def _load(self, version: str) -> registry.LoadedModel:
        loaded = registry.load(self.mlflow_uri, self.model_name, version)
        loaded.model.to(self.device)
        return loaded

    def _load_initial(self) -> None:
        plan = self.plan
        if plan is None:  # no coordinator state: the alias's version, directly
            if self.alias_version is not None:
                self.serving = self._load(self.alias_version)
        elif time.time() < plan.at and plan.previous:
            # Started while an activation is pending: the old version until its time, then the new.
            self.serving, self.prepared = self._load(plan.previous), self._load(plan.version)
        else:
            self.serving = self._load(plan.version)  # what every other replica serves
        log.info("replica %s serving v%s", self.replica, self.serving and self.serving.version)

    def _model_for(self, accepted_at: float) -> registry.LoadedModel | None:
        """The version a request accepted at `accepted_at` (time.time()) gets: the prepared one
        from the activation's time on, which also makes it the served one."""
        plan, prepared = self.plan, self.prepared
        if plan is not None and prepared is not None and prepared.version == plan.version:
            if accepted_at >= plan.at:
                with self._swap:
                    if self.prepared is prepared:
                        previous, self.serving, self.prepared = self.serving, prepared, None
                        log.info("now serving v%s (was v%s)", prepared.version, previous and previous.version)
        return self.serving

    def _has(self, version: str) -> bool:
        return any(m is not None and m.version == version for m in (self.serving, self.prepared))

    def _report(self) -> rollout.ReplicaReport:
        serving, prepared = self.serving, self.prepared
        return rollout.ReplicaReport(
            replica=self.replica,
            node=self.node,
            serving=serving.version if serving else None,
            prepared=prepared.version if prepared else None,
            alias_version=self.alias_version,
            error=self.error,
            plan=self.plan,
        )

    def _report_now(self) -> bool:
        """Report to the coordinator and follow its answer; False when it is unreachable."""
        self._model_for(time.time())  # activate when due even without traffic, so reports are true
        # Every poll, so the gauge follows each activation and alias move (alert ArgusReplicaBehindAlias).
        serving, alias = self.serving, self.alias_version
        behind = alias is not None and (serving is None or serving.version != alias)
        metrics.set_gauge("argus_serve_replica_behind_alias", int(behind), replica=self.replica)
        try:
            answer = self._link.call("report", self._report().to_dict(), timeout_s=max(5.0, 2 * self.poll_s))
        except Exception as exc:  # fail safe: keep serving what this replica serves
            if self._coordinator_reachable:
                log.warning(
                    "rollout coordinator unreachable (%s): no version activates until it is back", exc
                )
            self._coordinator_reachable = False
            return False
        self._coordinator_reachable = True
        self._follow_plan(rollout.Plan.from_dict(answer["plan"]))
        if answer["ready"]:
            self._coordinator_answered.set()
        return True

    def _report_loop(self) -> None:
        while True:
            self._report_now()
            if self._stop.wait(self.poll_s):
                return

    def _follow_plan(self, plan: rollout.Plan | None) -> None:
        current = self.plan
        if plan is None or plan == current or (current is not None and plan.at < current.at):
            return  # a new coordinator that knows nothing yet, or an older plan: keep ours
        if self.serving is not None and time.time() >= plan.at and not self._has(plan.version):
            log.warning("learned of v%s's activation after its time: catching up", plan.version)
        log.info("v%s activates in %.1fs", plan.version, plan.at - time.time())
        self.plan = plan

    def _follow_alias(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._prepare()
            except Exception:  # a registry hiccup must not stop the replica serving what it has
                log.exception("could not follow alias %r", self.alias)

    def _wanted(self) -> str | None:
        """The version to have loaded next: the activation's (catching up), nothing while one is
        pending (its version holds the prepared slot), else the alias's."""
        plan = self.plan
        if plan is not None and not self._has(plan.version):
            return plan.version
        if plan is not None and time.time() < plan.at:
            return None
        return self.alias_version

    def _prepare(self) -> None:
        """Load the wanted version beside the served one; on failure keep serving and say why."""
        with self._loading:
            self.alias_version = registry.resolve(self.mlflow_uri, self.model_name, self.alias)
            self._model_for(time.time())
            target = self._wanted()
            if target is None:
                return
            if self.prepared is not None and self.prepared.version != target:
                # The alias moved away from the prepared version. Tell the coordinator first (it
                # schedules nothing on a version a replica's alias has left) and learn whether that
                # version was scheduled meanwhile: if so, keep it for its activation.
                if not self._report_now() or self._wanted() != target:
                    return
                with self._swap:
                    self.prepared = None
            if self._has(target):
                self.error = None
                return
            failed_at = self._failed_at.get(target)
            if failed_at is not None and time.monotonic() - failed_at < RETRY_FAILED_LOAD_S:
                return
            try:
                loaded = self._load(target)
            except Exception as exc:
                self._failed_at[target] = time.monotonic()
                reason = (str(exc).strip().splitlines() or [""])[0][:300]
                self.error = f"cannot load v{target}: {type(exc).__name__}: {reason}"
                log.warning("%s; still serving v%s", self.error, self.serving and self.serving.version)
                return
            self._failed_at.pop(target, None)
            self.error = None
            with self._swap:
                if self.serving is None:
                    self.serving = loaded  # nothing served yet: nothing to be consistent with
                else:
                    self.prepared = loaded
            log.info("v%s prepared beside v%s", target, self.serving.version)

    async def check_health(self) -> None:
        if self.serving is None:
            await asyncio.to_thread(self._prepare)
            if self.serving is None and self.error:
                raise RuntimeError(self.error)

    def _no_model(self) -> JSONResponse:
        return _error(503, f"no model version behind alias {self.alias!r} yet")

    def _refused(self, request: Request) -> JSONResponse | None:
        """401 without a valid token, 429 over its rate; None when the request may go on."""
        if self.tokens is None:
            return None
        key = self.tokens.match(request.headers.get("authorization"))
        if key is None:
            message = "a valid token is needed: send Authorization: Bearer <token>"
            return _error(401, message, {"WWW-Authenticate": 'Bearer realm="argus"'})
        wait_s = self.limiter.take(key) if self.limiter else 0.0
        if wait_s:
            message = f"over the rate limit of {self.limiter.rate:g} requests/s for this token"
            return _error(429, message, {"Retry-After": access.retry_after(wait_s)})
        return None

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_document(self) -> JSONResponse:
        """The application's OpenAPI document as this deployment runs it: with tokens, the guarded
        operations declare bearer security; without, they never answer 401 or 429."""
        if self._document is None:
            document = copy.deepcopy(api.openapi())
            for path, method in AUTHENTICATED:
                operation = document["paths"][path][method]
                if self.tokens is not None:
                    operation["security"] = [{"bearer": []}]
                else:
                    for code in ("401", "429"):
                        operation["responses"].pop(code, None)
            if self.tokens is not None:
                schemes = {"bearer": {"type": "http", "scheme": "bearer"}}
                document.setdefault("components", {})["securitySchemes"] = schemes
            self._document = document
        return JSONResponse(self._document)

    @api.get("/docs", include_in_schema=False)
    async def docs_page(self):
        if not self.docs:
            return _error(404, "Not Found")
        return HTMLResponse(get_swagger_ui_html(openapi_url="/openapi.json", title=api.title).body)

    @api.get(
        "/healthz",
        summary="Liveness: whether a model is loaded, and which version (no token needed)",
        responses={200: {"model": Health}, **_errors(503)},
    )
    async def healthz(self) -> JSONResponse:
        # Status and version only: it is open to anyone. Rollout detail is behind /rollout.
        serving = self._model_for(time.time())
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
            200: {
                "content": {
                    "application/json": {
                        "example": {
                            "active_version": "2",
                            "activate_at": 1767225600.0,
                            "previous_version": "1",
                            "pending": False,
                            "now": 1767225612.5,
                            "running_replicas": 1,
                            "replicas": [
                                {
                                    "replica": "k3j2x9ab",
                                    "node": "5f1c0e…",
                                    "serving": "2",
                                    "prepared": None,
                                    "alias_version": "2",
                                    "error": None,
                                    "age_s": 0.4,
                                }
                            ],
                        }
                    }
                }
            },
            **_errors(401, 429, 503),
        },
    )
    async def rollout_state(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        # Twice: a coordinator that died with the replica that created it is created again by the
        # second call (the replicas report to it within a poll).
        for _ in range(2):
            try:
                return JSONResponse(await asyncio.to_thread(self._link.call, "snapshot", timeout_s=5.0))
            except Exception as exc:
                error = exc
        return _error(503, f"rollout coordinator unreachable: {type(error).__name__}: {error}")

    @api.get(
        "/model",
        summary="The served version: name, run, classes, image size, and the snapshots and Kafka "
        "offset ranges it was trained on",
        responses=_errors(401, 429, 503),
    )
    async def model_info(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        current = self._model_for(time.time())
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
                "snapshots": card.snapshots,
                "metrics": card.metrics,
            }
        )

    @api.post(
        "/predict",
        summary="Classify one behaviour image",
        description="The body is the encoded image (JPEG, PNG or WebP; its content type, or "
        "application/octet-stream), or multipart/form-data with the image in the file field `image`.",
        openapi_extra=PREDICT_BODY,
        responses={200: {"model": Prediction}, **_errors(400, 401, 408, 413, 415, 429, 503)},
    )
    async def predict(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        current = self._model_for(time.time())  # the version is fixed when the request is accepted
        if (refused := self._refused(request)) is not None:
            response = refused
        elif self._pending >= self.max_pending:  # answered at once: held bodies bound memory
            message = f"{self._pending} requests pending on this replica: retry shortly"
            response = _error(503, message, {"Retry-After": "1"})
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
            value = await _read_image_bytes(request, self.max_body_bytes, self.body_timeout_s)
            if not value:
                raise BadRequest(400, "empty body: send the image bytes")
            async with self._decodes:  # decoded pixels, not bodies, are what could exhaust memory
                pixels = await asyncio.to_thread(decode_upload, value)
        except BadRequest as exc:
            return _error(exc.status, str(exc), exc.headers)
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


def traffic_dir(settings) -> str:
    return settings.uri("traffic")


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in {"1", "true", "yes", "on"}


def build_app(args: dict) -> serve.Application:
    """Application builder for `serve run app.serve:build_app key=value ...` and RayService configs.

    Tokens: `token_digests` (what `deploy` passes), else the file `api_tokens` names, else the file
    $ARGUS_API_TOKENS names where the application is built (a RayService mounts it from a Secret)."""
    import os

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
        ("rate_limit", float),
        ("docs", _flag),
        ("max_pending", int),
        ("body_timeout_s", float),
    ):
        if options.get(key) is not None:  # None (no traffic log) stays unset
            kwargs[key] = cast(options[key])
    digests = tuple(options.get("token_digests") or ())
    tokens_file = options.get("api_tokens") or os.environ.get(access.TOKENS_ENV)
    if not digests and tokens_file:
        digests = access.read_token_file(tokens_file)
    if not digests:
        log.warning("no API tokens: /predict, /model and /rollout are open to anyone who reaches them")
    policy = access.AccessConfig(
        token_digests=digests,
        rate_limit=kwargs.get("rate_limit", access.AccessConfig.rate_limit),
        rate_burst=int(options["rate_burst"]) if options.get("rate_burst") is not None else None,
    )
    kwargs.update(token_digests=digests, rate_limit=policy.rate_limit, rate_burst=policy.burst)
    return ArgusModel.options(num_replicas=replicas).bind(**kwargs)


def deploy(settings, cfg, *, blocking: bool, policy: access.AccessConfig | None = None) -> str:
    """`python -m app serve`: start Serve's HTTP proxy on host:port and deploy the application.
    Without tokens in `policy` only a loopback host is allowed (ConfigError otherwise)."""
    policy = policy or access.AccessConfig()
    policy.check_host(cfg.http_host)
    serve.start(
        proxy_location=cfg.proxy_location, http_options={"host": cfg.http_host, "port": cfg.http_port}
    )
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
            "token_digests": policy.token_digests,
            "rate_limit": policy.rate_limit,
            "rate_burst": policy.burst,
            "docs": policy.docs,
        }
    )
    serve.run(app, name=APPLICATION, route_prefix="/", blocking=False)
    url = f"http://{cfg.http_host}:{cfg.http_port}"
    log.info("serving %s@%s on %s", settings.model_name, cfg.alias, url)
    return url


def deploy_detached(settings, cfg, policy: access.AccessConfig | None = None) -> str:
    """`python -m app serve --detach`: deploy onto the running cluster and record where, for `promote`."""
    url = deploy(settings, cfg, blocking=False, policy=policy)
    rollout.record_deployment(settings, url, foreground=False)
    return url


def serve_until(settings, cfg, stop: threading.Event, policy: access.AccessConfig | None = None) -> None:
    """`python -m app serve`: deploy, record the deployment (so a plain `promote VERSION` waits for
    its replicas), serve until `stop` is set, then remove the record and shut Serve down."""
    policy = policy or access.AccessConfig()
    url = deploy(settings, cfg, blocking=False, policy=policy)
    rollout.record_deployment(settings, url, foreground=True)
    try:
        guarded = f"{len(policy.token_digests)} token(s)" if policy.token_digests else "no tokens"
        print(
            f"serving on {url} (POST /predict, GET /healthz, GET /rollout, GET /model, /openapi.json"
            f"{', /docs' if policy.docs else ''}; {guarded}); Ctrl-C stops",
            flush=True,
        )
        while not stop.wait(0.2):  # a timed wait lets the signal handler run promptly
            pass
    finally:
        rollout.forget_deployment(settings)
        serve.shutdown()


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
