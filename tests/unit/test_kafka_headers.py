"""CONTRACT.md §1 headers → raw-row fields (app.data.records.header_fields): every header a producer can
send either parses or becomes the record's `header_error` (a dead letter), never an exception, and
the row's event time always fits int64 and a `datetime`. No broker."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pyarrow as pa
import pytest

from app.data.catalog import table_schema
from app.data.kafka import RAW_SCHEMA
from app.data.records import FIELD_LIMITS, MAX_EVENT_TIME_MS, header_fields, record_headers
from app.data.table import conform

NOW = 1_700_000_000_000


def event_date(event_time_ms: int) -> date:
    """The table's `event_date` partition of a row at `event_time_ms`, as a commit derives it."""
    row = pa.table(
        {
            "kafka_partition": pa.array([0], pa.int32()),
            "kafka_offset": [0],
            "user_id": ["u"],
            "label": ["l"],
            "event_time_ms": [event_time_ms],
            "device_id": ["d"],
            "pixels": [b""],
            "height": pa.array([0], pa.int32()),
            "width": pa.array([0], pa.int32()),
        }
    )
    return conform(row, table_schema().as_arrow()).column("event_date")[0].as_py()


def test_a_valid_record_parses():
    fields = header_fields(record_headers("phishing_page", NOW, "dev-7"), NOW + 5, record_key=b"user-1")
    assert fields == {
        "key": "user-1",
        "label": "phishing_page",
        "device_id": "dev-7",
        "schema": "ubi.v1",
        "event_time": NOW,
        "header_error": None,
        "header_reason": None,
    }


@pytest.mark.parametrize("value", [0, 1, NOW, MAX_EVENT_TIME_MS])
def test_event_times_from_1970_to_the_end_of_9999_are_valid(value):
    fields = header_fields([("event_time", str(value).encode())], NOW)
    assert fields["header_error"] is None and fields["event_time"] == value
    event_date(fields["event_time"])  # the table's partition exists for every valid time


def test_the_limit_is_the_last_millisecond_of_9999():
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert epoch + timedelta(milliseconds=MAX_EVENT_TIME_MS) == datetime(
        9999, 12, 31, 23, 59, 59, 999000, UTC
    )
    assert event_date(MAX_EVENT_TIME_MS) == date(9999, 12, 31)
    with pytest.raises((ValueError, OverflowError)):  # year 10000: what crashed the write task
        event_date(MAX_EVENT_TIME_MS + 1)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"yesterday", "event_time header 'yesterday' is not an integer"),
        (b"", "event_time header '' is not an integer"),
        (b"1.7e12", "event_time header '1.7e12' is not an integer"),
        (b" 1700000000000", "event_time header ' 1700000000000' is not an integer"),
        (b"1_700_000_000_000", "event_time header '1_700_000_000_000' is not an integer"),
        ("١٧".encode(), "event_time header '١٧' is not an integer"),  # digits, but not ASCII ones
        (b"-1", "event_time header '-1' is out of range (1970..9999)"),
        (b"-86400000", "event_time header '-86400000' is out of range (1970..9999)"),
        (b"253402300800000", "event_time header '253402300800000' is out of range (1970..9999)"),  # 10000
        (str(2**63).encode(), f"event_time header '{2**63}' is out of range (1970..9999)"),
        (str(-(2**63) - 1).encode(), f"event_time header '{-(2**63) - 1}' is out of range (1970..9999)"),
        (str(2**64 + 1).encode(), f"event_time header '{2**64 + 1}' is out of range (1970..9999)"),
    ],
)
def test_an_invalid_event_time_is_a_header_error_with_a_safe_stand_in(raw, reason):
    fields = header_fields([("label", b"normal"), ("event_time", raw)], NOW)
    assert fields["header_error"] == reason
    assert fields["event_time"] == NOW  # the Kafka timestamp: the row still fits int64
    assert fields["label"] == "normal"
    pa.Table.from_pylist([_row(fields)], schema=RAW_SCHEMA)  # what crashed the read task for 2**63


def test_a_huge_event_time_is_out_of_range_without_converting_it():
    fields = header_fields([("event_time", b"9" * 100_000)], NOW)
    assert fields["header_error"] == f"event_time header '{'9' * 40}'… is out of range (1970..9999)"
    assert header_fields([("event_time", b"0" * 30 + str(NOW).encode())], NOW)["event_time"] == NOW


@pytest.mark.parametrize("name", ["label", "device_id", "schema", "event_time"])
def test_a_header_value_that_is_not_utf8_is_a_header_error(name):
    headers = [h for h in record_headers("normal", NOW, "dev-1") if h[0] != name] + [(name, b"ok\xff\xfe")]
    fields = header_fields(headers, NOW)
    assert fields["header_error"] == f"header {name} is not UTF-8: b'ok\\xff\\xfe'"
    if name == "event_time":
        assert fields["event_time"] == NOW  # the Kafka timestamp stands in
    else:
        assert fields[name] is None  # never a silently altered value
    pa.Table.from_pylist([_row(fields)], schema=RAW_SCHEMA)


def test_other_headers_are_not_read():
    fields = header_fields(record_headers("normal", NOW, None) + [("traceparent", b"\xff")], NOW)
    assert fields["header_error"] is None


@pytest.mark.parametrize(
    "key, shown",
    [(b"lab\xffel", "b'lab\\xffel'"), ("lab\udcffel", "'lab\\udcffel'")],  # bytes, or surrogateescape text
)
def test_a_header_key_that_is_not_utf8_is_a_header_error(key, shown):
    fields = header_fields([("label", b"normal"), (key, b"x")], NOW)
    assert fields["header_error"] == f"header key {shown} is not UTF-8"
    assert fields["label"] == "normal"


def test_headers_that_confluent_kafka_cannot_return_are_a_header_error():
    """confluent-kafka raises SystemError from a UnicodeDecodeError for a key that is not UTF-8
    (tests/integration/test_poison.py sends one through the broker)."""
    try:
        try:
            b"lab\xffel".decode("utf-8")
        except UnicodeDecodeError as decode_error:
            raise SystemError("<method 'headers'> returned a result with an exception set") from decode_error
    except SystemError as raised:
        unreadable = raised
    fields = header_fields(None, NOW, unreadable)
    assert fields["header_error"] == "header key b'lab\\xffel' is not UTF-8"
    assert fields["event_time"] == NOW and fields["label"] is None

    other = header_fields(None, NOW, RuntimeError("boom"))
    assert other["header_error"] == "headers are unreadable: RuntimeError: boom"


def test_without_an_event_time_header_the_kafka_timestamp_is_the_event_time():
    assert header_fields([("label", b"normal")], NOW) == {
        "key": None,
        "label": "normal",
        "device_id": None,
        "schema": None,
        "event_time": NOW,
        "header_error": None,
        "header_reason": None,
    }
    assert header_fields(None, NOW)["event_time"] == NOW
    assert header_fields([("event_time", None)], NOW)["event_time"] == NOW  # a null header: absent


@pytest.mark.parametrize("timestamp", [-1, MAX_EVENT_TIME_MS + 1])
def test_a_kafka_timestamp_out_of_range_is_a_header_error_only_when_it_is_the_event_time(timestamp):
    fields = header_fields([("label", b"normal")], timestamp)
    assert fields["header_error"] == (
        f"Kafka timestamp {timestamp} is out of range (1970..9999) and there is no event_time header"
    )
    assert fields["event_time"] == 0
    assert header_fields([("event_time", str(NOW).encode())], timestamp)["event_time"] == NOW


def test_every_problem_is_named():
    fields = header_fields([(b"\xff", b"x"), ("label", b"\xff"), ("event_time", b"soon")], NOW)
    assert fields["header_error"] == (
        "header key b'\\xff' is not UTF-8; header label is not UTF-8: b'\\xff'; "
        "event_time header 'soon' is not an integer"
    )
    assert fields["header_reason"] == "bad_header"


@pytest.mark.parametrize("name", ["label", "device_id", "schema", "key"])
def test_a_key_or_header_over_its_limit_is_named_shortened_and_left_out(name):
    limit = FIELD_LIMITS[name]
    fits = header_fields(record_headers("normal", NOW, "dev-1") + [(name, b"a" * limit)], NOW, None, b"u")
    assert fits["header_error"] is None
    huge = b"\xff" + b"a" * 600_000  # not UTF-8 either: its length is what is reported
    headers = [(k, v) for k, v in record_headers("normal", NOW, "dev-1") if k != name]
    if name == "key":
        fields = header_fields(headers, NOW, None, huge)
    else:
        fields = header_fields(headers + [(name, huge)], NOW, None, b"user-1")
    what = "key" if name == "key" else f"header {name}"
    assert fields["header_error"] == (
        f"{what} of 600001 bytes is over its {limit} byte limit: {huge[:40]!r}…"
    )
    assert fields["header_reason"] == "header_too_long"
    assert fields[name] is None  # the dead letter does not carry it
    assert len(fields["header_error"]) < 200


def _row(fields: dict) -> dict:
    return {
        **fields,
        "partition": 0,
        "offset": 0,
        "kafka_timestamp": NOW,
        "key": "u",
        "value": b"v",
        "late": False,
    }
