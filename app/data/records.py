"""The CONTRACT.md §1 record's headers: written by producers, checked by the reader.

Every problem with a record's headers becomes its dead letter's `error`, never an exception: one
bad record must not fail the read task that holds thousands of good ones.
"""

from __future__ import annotations

import hashlib
import operator

from app.errors import Reason

SCHEMA_VERSION = "ubi.v1"


def record_headers(label: str | None, event_time_ms: int, device_id: str | None) -> list[tuple[str, bytes]]:
    headers = [("schema", SCHEMA_VERSION.encode()), ("event_time", str(int(event_time_ms)).encode())]
    if label is not None:
        headers.append(("label", label.encode()))
    if device_id is not None:
        headers.append(("device_id", device_id.encode()))
    return headers


MAX_EVENT_TIME_MS = 253_402_300_799_999
"""9999-12-31T23:59:59.999Z, the last millisecond a `datetime` (so an `event_date=` partition) holds.
Event times are integers in [0, MAX_EVENT_TIME_MS]: anything else would fail a whole read task
(beyond int64) or write task (after year 9999), so the record goes to the DLQ instead."""
TEXT_HEADERS = ("label", "device_id", "schema", "event_time")
"""The CONTRACT.md §1 headers Argus reads; each must be UTF-8 text."""
FIELD_LIMITS = {"key": 256, "label": 128, "device_id": 256, "schema": 64}
"""Bytes a record's key and its text headers may hold (a fleet's user and device ids, class names
and schema tags are far shorter). Longer makes the record a dead letter (`header_too_long`): its
`error` quotes the value shortened and its DLQ record leaves the field out, so no header can make
a dead letter too large for the DLQ topic or copy itself into a commit's counts."""
message_headers = operator.methodcaller("headers")
"""`message.headers()`, called from C so that CPython checks its result. confluent-kafka decodes
header keys as strict UTF-8: for a key that is not, `headers()` returns a list holding a NULL key
and leaves the UnicodeDecodeError set. Called from C, that raises SystemError (from the decode
error); at a Python call site that 3.11 has specialised (any loop) the check is skipped, the list
comes back (touching it segfaults) and the error stays pending. Call it once: the list is cached."""


def _shown(raw: bytes | str, limit: int = 40) -> str:
    """A header's key or value as a dead letter's `error` quotes it: repr, at most `limit` long."""
    return repr(raw[:limit]) + ("…" if len(raw) > limit else "")


def _event_time_ms(text: str) -> int | None:
    """The integer in `text` (optional sign, ASCII digits), or None when it is not one. Out-of-range
    values come back as an int beyond the valid range, never after converting a huge string."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not (digits.isascii() and digits.isdigit()):
        return None
    if len(digits.lstrip("0")) > 19:  # beyond int64 whatever the digits: never convert huge strings
        return -1 if text.startswith("-") else MAX_EVENT_TIME_MS + 1
    return int(text)


def _too_long(name: str, raw: bytes | str) -> str | None:
    limit = FIELD_LIMITS[name]
    if len(raw) <= limit:
        return None
    what = "key" if name == "key" else f"header {name}"
    return f"{what} of {len(raw)} bytes is over its {limit} byte limit: {_shown(raw)}"


def header_fields(
    headers,
    kafka_timestamp: int | None = None,
    unreadable: Exception | None = None,
    record_key: bytes | None = None,
) -> dict:
    """A record's key and CONTRACT.md §1 headers → its raw-row fields (`RAW_SCHEMA`).

    Never raises for what a producer sent: a header that cannot be read, or a key or header over its
    `FIELD_LIMITS`, sets `header_error` and `header_reason`, which make the record a dead letter
    (`Preprocessor._problem`), and the row still fits `RAW_SCHEMA` (without the oversized field).
    `unreadable` is what `message.headers()` raised: confluent-kafka decodes header keys as strict
    UTF-8 and raises SystemError from a UnicodeDecodeError for one that is not. With a
    `kafka_timestamp`, `event_time` is always an int: the header's, else the Kafka timestamp; for a
    record whose event time is invalid, the timestamp if that is valid, else 0 (a dead letter's
    stand-in, which `kafka_range.read_partition_range` keeps out of the watermark).
    """
    errors: list[str] = []
    too_long: list[str] = []
    values: dict[str, bytes | None] = {}
    if unreadable is not None:
        chain = (unreadable, unreadable.__cause__, unreadable.__context__)
        cause = next((e for e in chain if isinstance(e, UnicodeDecodeError)), None)
        if cause is not None:
            errors.append(f"header key {_shown(cause.object)} is not UTF-8")
        else:
            errors.append(f"headers are unreadable: {type(unreadable).__name__}: {unreadable}")
    for key, value in headers or []:
        try:  # bytes from another client, or a str with lone surrogates (a surrogateescape decoding)
            name = key.decode("utf-8") if isinstance(key, bytes) else key
            name.encode("utf-8")
        except UnicodeError:
            errors.append(f"header key {_shown(key)} is not UTF-8")
            continue
        values[name] = value

    text: dict[str, str | None] = {}
    for name in TEXT_HEADERS:
        raw = values.get(name)
        if raw is not None and name in FIELD_LIMITS and (problem := _too_long(name, raw)):
            text[name] = None
            too_long.append(problem)
            continue
        try:
            text[name] = raw.decode("utf-8") if raw is not None else None
        except UnicodeDecodeError:
            text[name] = None
            errors.append(f"header {name} is not UTF-8: {_shown(raw)}")

    if record_key is not None and (problem := _too_long("key", record_key)):
        record_key = None
        too_long.append(problem)
    fields = {
        "key": record_key.decode("utf-8", "replace") if record_key else None,
        "label": text["label"],
        "device_id": text["device_id"],
        "schema": text["schema"],
        "event_time": None,
        "header_error": None,
        "header_reason": None,
    }
    raw_time = text["event_time"]
    if raw_time is not None:
        event_time = _event_time_ms(raw_time)
        if event_time is None:
            errors.append(f"event_time header {_shown(raw_time)} is not an integer")
        elif not 0 <= event_time <= MAX_EVENT_TIME_MS:
            errors.append(f"event_time header {_shown(raw_time)} is out of range (1970..9999)")
        else:
            fields["event_time"] = event_time
    valid_timestamp = kafka_timestamp is not None and 0 <= kafka_timestamp <= MAX_EVENT_TIME_MS
    if fields["event_time"] is None and kafka_timestamp is not None:
        if raw_time is None and not valid_timestamp and not errors:
            errors.append(
                f"Kafka timestamp {kafka_timestamp} is out of range (1970..9999) and there is no "
                "event_time header"
            )
        fields["event_time"] = kafka_timestamp if valid_timestamp else 0
    if too_long or errors:
        fields["header_error"] = "; ".join(too_long + errors)
        fields["header_reason"] = Reason.HEADER_TOO_LONG if too_long else Reason.BAD_HEADER
    return fields


def user_digest(user_id: str | None) -> str:
    """A user (a record's key) as 16 hex digits of its SHA-256: how storage paths and the table's
    erasure records (`app.data.metadata.ERASED_PREFIX`) name a user without showing the id."""
    return hashlib.sha256((user_id or "").encode()).hexdigest()[:16]


def dead_letter_folder(user_id: str | None) -> str:
    """The folder under `<storage>/dlq/<topic>/` that holds a user's dead-letter payloads (those
    too large for the DLQ topic): named by a digest of the record's key, so `argus erase --user`
    finds them without Kafka and the path shows no user id."""
    return "user-" + user_digest(user_id)
