"""Serve's HTTP edge: the FastAPI ingress, its limits, JSON errors and the OpenAPI document.

Everything here is request plumbing the replica (`app/serve/replica.py`) routes through: bad input is
a JSON 4xx and never reaches the model, every client reads that answer (the rest of a body is
drained first, `BodyGuard`), every response names its replica (`X-Argus-Replica`), and the OpenAPI
document says what each operation refuses, so a fuzzer such as schemathesis finds it truthful.
"""

import asyncio
import copy
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

IMAGE_TYPES = {"image/jpeg", "image/png", "image/webp", "application/octet-stream"}
REPLICA_HEADER = "X-Argus-Replica"
BODY_TIMEOUT_S = 30.0
"""A body not received within this long (a slow or stalled upload) is a 408."""
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_TIMEOUT_S = 10.0
"""An early answer (401, 413, 415, ...) waits for up to this much of the unread body, this long."""

# No automatic /docs or /openapi.json: the replica serves both, so the document says whether this
# deployment needs a token and Swagger UI is up only when asked for.
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
    400: "an empty body, or not a decodable JPEG, PNG or WebP image (or over the pixel limit), or no file "
    "field `image`",
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


def error_responses(*codes: int) -> dict:
    """OpenAPI `responses` for these error statuses, each with the JSON error body."""
    responses = {code: {"model": ErrorBody, "description": ERRORS[code]} for code in codes}
    for code in set(codes) & set(ERROR_HEADERS):
        responses[code]["headers"] = ERROR_HEADERS[code]
    return responses


# An image is never empty: without `minLength` an empty body would be schema-valid and its 400 a
# broken promise. Which bytes decode is beyond what a schema can state (the 400 says so).
IMAGE_BYTES = {"type": "string", "format": "binary", "minLength": 1}

PREDICT_BODY = {
    "requestBody": {
        "required": True,
        "description": "The encoded image itself, or a form with the image in the file field `image`.",
        "content": {
            **{content_type: {"schema": IMAGE_BYTES} for content_type in sorted(IMAGE_TYPES)},
            "multipart/form-data": {
                "schema": {"type": "object", "required": ["image"], "properties": {"image": IMAGE_BYTES}},
                "encoding": {"image": {"contentType": ", ".join(sorted(IMAGE_TYPES))}},
            },
        },
    }
}

ROLLOUT_EXAMPLE = {
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


def openapi_document(app: FastAPI, guarded: bool) -> dict:
    """`app`'s OpenAPI document as this deployment runs it: with tokens (`guarded`), the guarded
    operations declare bearer security; without, they never answer 401 or 429."""
    document = copy.deepcopy(app.openapi())
    for path, method in AUTHENTICATED:
        operation = document["paths"][path][method]
        if guarded:
            operation["security"] = [{"bearer": []}]
        else:
            for code in ("401", "429"):
                operation["responses"].pop(code, None)
    if guarded:
        schemes = {"bearer": {"type": "http", "scheme": "bearer"}}
        document.setdefault("components", {})["securitySchemes"] = schemes
    return document


def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    # The header here too: Starlette answers unhandled exceptions outside user middleware.
    return JSONResponse(
        {"error": message}, status_code=status, headers={REPLICA_HEADER: replica_id(), **(headers or {})}
    )


@api.exception_handler(StarletteHTTPException)
async def _http_error(_request, exc: StarletteHTTPException) -> JSONResponse:
    return error(exc.status_code, str(exc.detail), exc.headers)  # a 405's `Allow` among them


@api.exception_handler(Exception)
async def _internal_error(_request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in a request")
    return error(500, f"internal error: {type(exc).__name__}")


@api.exception_handler(RequestValidationError)
async def _validation_error(_request, exc: RequestValidationError) -> JSONResponse:
    return error(400, str(exc.errors()))


class BadRequest(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


async def read_image_bytes(request: Request, max_body_bytes: int, timeout_s: float) -> bytes:
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
        body = await upload.read()
    if not body:
        raise BadRequest(400, "empty body: send the image bytes")
    return bytes(body)
