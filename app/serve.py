"""Serving: a Ray Serve application with a FastAPI ingress over the registry's alias (CONTRACT.md §4).

    python -m app serve --http-port 8000          # foreground until Ctrl-C, like `serve run`
    serve run app.serve:build_app mlflow_uri=...  # the same application through Serve's own CLI

Each replica polls the alias (default `champion`) and *prepares* its version, loaded beside the one
it serves; `app/rollout.py`'s coordinator activates a version on every replica at once, at a wall
time every replica knows beforehand, so a rollout drops no request and no client sees new → old.
A version that does not load is not activated anywhere: replicas keep serving the old one and say
why (/healthz, /rollout). Every response names its replica (`X-Argus-Replica`). Requests share the
training transform and are batched with `@serve.batch`. Bad input is a JSON 4xx and never reaches
the model.

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

from app import metrics, registry, rollout
from app.config import DEFAULT_MODEL_NAME
from app.model import local_device
from app.transform import BadImage, decode_pixels, image_statistics, normalize

log = logging.getLogger(__name__)

DEPLOYMENT = "ArgusModel"
APPLICATION = "argus"
IMAGE_TYPES = {"image/jpeg", "image/png", "image/webp", "application/octet-stream"}
REPLICA_HEADER = "X-Argus-Replica"
RETRY_FAILED_LOAD_S = 30.0
"""A version that failed to load is tried again after this long (an artifact fixed in place)."""

api = FastAPI(title="Argus behaviour-image classifier", version="1")


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


api.add_middleware(ReplicaHeader)


def _error(status: int, message: str) -> JSONResponse:
    # The header here too: Starlette answers unhandled exceptions outside user middleware.
    return JSONResponse({"error": message}, status_code=status, headers={REPLICA_HEADER: replica_id()})


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
        import ray

        torch.set_num_threads(threads)
        self.device = local_device()  # a replica given `num_gpus` keeps its models on that GPU
        self.traffic = TrafficLog(traffic_dir) if traffic_dir else None
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

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        serving = self._model_for(time.time())
        if serving is None:
            return self._no_model()
        alias = self.alias_version
        return JSONResponse(
            {
                "status": "ok",
                "model_version": serving.version,
                "replica": self.replica,
                "alias_version": alias,
                "behind": alias is not None and alias != serving.version,
                "error": self.error,
            }
        )

    @api.get(
        "/rollout",
        summary="Where the rollout stands on every live replica",
        description="Read-only, from the rollout coordinator: the active version and the wall time "
        "(`activate_at`, Unix seconds) from which requests get it, and each live replica's served and "
        "prepared version, load error, node and the age of its last report.",
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
            503: {
                "description": "the rollout coordinator is unreachable",
                "content": {"application/json": {"example": {"error": "rollout coordinator unreachable: …"}}},
            },
        },
    )
    async def rollout_state(self) -> JSONResponse:
        # Twice: a coordinator that died with the replica that created it is created again by the
        # second call (the replicas report to it within a poll).
        for _ in range(2):
            try:
                return JSONResponse(await asyncio.to_thread(self._link.call, "snapshot", timeout_s=5.0))
            except Exception as exc:
                error = exc
        return _error(503, f"rollout coordinator unreachable: {type(error).__name__}: {error}")

    @api.get("/model")
    async def model_info(self) -> JSONResponse:
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

    @api.post("/predict")
    async def predict(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        current = self._model_for(time.time())  # the version is fixed when the request is accepted
        response = await self._predict(request, current)
        version = current.version if current else "none"
        metrics.inc("argus_serve_requests", status=response.status_code, model_version=version)
        metrics.observe("argus_serve_latency_seconds", time.perf_counter() - started, model_version=version)
        return response

    async def _predict(self, request: Request, current: registry.LoadedModel | None) -> JSONResponse:
        if current is None:
            return self._no_model()
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


def deploy_detached(settings, cfg) -> str:
    """`python -m app serve --detach`: deploy onto the running cluster and record where, for `promote`."""
    url = deploy(settings, cfg, blocking=False)
    rollout.record_deployment(settings, url, foreground=False)
    return url


def serve_until(settings, cfg, stop: threading.Event) -> None:
    """`python -m app serve`: deploy, record the deployment (so a plain `promote VERSION` waits for
    its replicas), serve until `stop` is set, then remove the record and shut Serve down."""
    url = deploy(settings, cfg, blocking=False)
    rollout.record_deployment(settings, url, foreground=True)
    try:
        print(
            f"serving on {url} (POST /predict, GET /healthz, GET /rollout, GET /model, /docs); Ctrl-C stops",
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
