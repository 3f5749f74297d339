"""The one error type a command turns into a clear line and exit status 2, and the reasons a record
becomes a dead letter."""

from enum import StrEnum


class ConfigError(ValueError):
    """A bad argument or setting: the CLI prints it as one line and exits 2."""


class Reason(StrEnum):
    """Why a record is a dead letter, as a fixed code: its DLQ record's `error_reason` header and the
    key of a commit's `dlq_errors` counts (the `error` header says it in words, values shortened)."""

    BAD_HEADER = "bad_header"
    """A header that is not UTF-8, an `event_time` that is not an integer in 1970..9999."""
    HEADER_TOO_LONG = "header_too_long"
    """A `label`, `device_id`, `schema` or key over its byte limit (`app.data.records.FIELD_LIMITS`)."""
    EMPTY_VALUE = "empty_value"
    RECORD_TOO_LARGE = "record_too_large"
    """A value over `--max-record-bytes`."""
    UNKNOWN_LABEL = "unknown_label"
    UNDECODABLE_IMAGE = "undecodable_image"
    IMAGE_TOO_LARGE = "image_too_large"
    """More pixels than `app.transform.MAX_IMAGE_PIXELS`, even at a JPEG's smallest decoding scale."""
    OUT_OF_MEMORY = "out_of_memory"
    """Decoding ran out of memory: the record's dead letter, not the ingest's crash."""
    ERASED = "erased"
    """The record's user was erased (`argus erase --user`) after it was sent (`app.data.metadata.
    Erasures`): its dead letter holds only its coordinates, and redrive leaves it and the user's
    earlier dead letters dead."""
    BAD_PAYLOAD = "bad_payload"
    """`redrive` only: a dead letter's stored value (`payload_uri`) is outside `<storage>/dlq/`,
    missing, or not the size and SHA-256 its headers name."""
