"""Poison records never stop ingest (issue #14, item 3): one of each kind, published among good
records through the real embedded broker and ingested once on the real local Ray. Each bad one
lands exactly once in the dead-letter topic with its reason and source coordinates, each good one
exactly once in the table, and the commit accounts for every record sent."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import time
import zlib
from collections import Counter

from kafka import KafkaConsumer, TopicPartition
from PIL import Image

from app.config import IngestConfig
from app.data import synth
from app.data.ingest import ingest
from app.data.records import SCHEMA_VERSION, record_headers
from app.data.table import ImageTable

from conftest import TEST_IMAGE_SIZE

MAX_RECORD_BYTES = 4096


class RawHeaderKey(str):
    """A header key whose wire bytes are not UTF-8. kafka-python takes keys as str and writes
    `key.encode("utf-8")`; this str hands it the raw bytes instead (what a non-Python producer may
    send), so the broker really stores a key that confluent-kafka cannot decode."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawHeaderKey:
        key = super().__new__(cls, raw.decode("utf-8", "replace"))
        key.raw = raw
        return key

    def encode(self, *args, **kwargs) -> bytes:
        return self.raw


def _encoded(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (TEST_IMAGE_SIZE, TEST_IMAGE_SIZE), (200, 30, 30)).save(out, format=fmt)
    return out.getvalue()


def _png_with_empty_iccp_after_idat() -> bytes:
    """A PNG whose pixels are fine but whose empty iCCP chunk after IDAT makes Pillow 13's load()
    raise IndexError (not OSError): before the fix it escaped the decoder and failed the batch."""
    png = _encoded("PNG")
    iend = png.rindex(b"IEND") - 4
    chunk = struct.pack(">I", 0) + b"iCCP" + struct.pack(">I", zlib.crc32(b"iCCP"))
    return png[:iend] + chunk + png[iend:]


def _headers(label="normal", event_time=None, device_id=b"dev-1", **extra) -> list[tuple[str, bytes]]:
    headers = [("schema", SCHEMA_VERSION.encode())]
    if event_time is not None:
        headers.append(("event_time", event_time))
    if label is not None:
        headers.append(("label", label if isinstance(label, bytes) else label.encode()))
    if device_id is not None:
        headers.append(("device_id", device_id))
    return headers + list(extra.items())


def test_every_poison_record_is_a_dead_letter_and_ingest_completes(settings, ray_cluster):
    settings = dataclasses.replace(settings, classes=synth.DEFAULT_CLASSES)
    valid = list(synth.generate(20, seed=7, size=TEST_IMAGE_SIZE, late_fraction=0.0, corrupt_fraction=0.0))
    good = [(r.user_id, r.value, record_headers(r.label, r.event_time_ms, "dev-1"), None) for r in valid]
    image, t = valid[0].value, str(max(r.event_time_ms for r in valid)).encode()
    year_10000 = 253_402_300_800_000
    # (key, value, headers, Kafka timestamp) and the `error` it must get (exactly, or a prefix ending ": ").
    poison = {
        "event_time not an integer": (
            ("user-p1", image, _headers(event_time=b"yesterday"), None),
            "event_time header 'yesterday' is not an integer",
        ),
        "event_time before 1970": (
            ("user-p2", image, _headers(event_time=b"-86400000"), None),
            "event_time header '-86400000' is out of range (1970..9999)",
        ),
        "event_time in year 10000 (crashed the write task)": (
            ("user-p3", image, _headers(event_time=str(year_10000).encode()), None),
            f"event_time header '{year_10000}' is out of range (1970..9999)",
        ),
        "event_time 2**63 (crashed the read task)": (
            ("user-p4", image, _headers(event_time=str(2**63).encode()), None),
            f"event_time header '{2**63}' is out of range (1970..9999)",
        ),
        "event_time beyond 64 bits": (
            ("user-p5", image, _headers(event_time=str(2**64 + 1).encode()), None),
            f"event_time header '{2**64 + 1}' is out of range (1970..9999)",
        ),
        "no event_time and a Kafka timestamp in year 10000": (
            ("user-p6", image, _headers(), year_10000),
            f"Kafka timestamp {year_10000} is out of range (1970..9999) and there is no event_time header",
        ),
        "label not UTF-8": (
            ("user-p7", image, _headers(label=b"norm\xffal", event_time=t), None),
            "header label is not UTF-8: b'norm\\xffal'",
        ),
        "device_id not UTF-8": (
            ("user-p8", image, _headers(event_time=t, device_id=b"\xc3\x28"), None),
            "header device_id is not UTF-8: b'\\xc3('",
        ),
        "header key not UTF-8": (
            ("user-p9", image, _headers(event_time=t) + [(RawHeaderKey(b"trace\xffid"), b"1")], None),
            "header key b'trace\\xffid' is not UTF-8",
        ),
        "empty value": (("user-p10", b"", _headers(event_time=t), None), "empty value"),
        "null value": (("user-p11", None, _headers(event_time=t), None), "empty value"),
        "Pillow raises IndexError": (
            ("user-p12", _png_with_empty_iccp_after_idat(), _headers(event_time=t), None),
            "undecodable image: IndexError: ",
        ),
        "a GIF": (
            ("user-p13", _encoded("GIF"), _headers(event_time=t), None),
            "undecodable image: not a JPEG, PNG or WebP image",
        ),
        "unknown label": (
            ("user-p14", image, _headers(label="alien_label", event_time=t), None),
            "unknown label 'alien_label'",
        ),
        "oversized": (
            ("user-p15", b"\x00" * 5000, _headers(event_time=t), None),
            f"record of 5000 bytes exceeds the {MAX_RECORD_BYTES} byte limit",
        ),
        # Headers and keys without a limit once reached the DLQ whole, and a commit's counts as keys.
        "a 600 KB label": (
            ("user-p16", image, _headers(label="x" * 600_000, event_time=t), None),
            "header label of 600000 bytes is over its 128 byte limit: " + repr(b"x" * 40) + "…",
        ),
        "a 100 KB device_id": (
            ("user-p17", image, _headers(event_time=t, device_id=b"d" * 100_000), None),
            "header device_id of 100000 bytes is over its 256 byte limit: " + repr(b"d" * 40) + "…",
        ),
        "a 10 KB key": (
            ("u" * 10_000, image, _headers(event_time=t), None),
            "key of 10000 bytes is over its 256 byte limit: " + repr(b"u" * 40) + "…",
        ),
    }
    reasons = {  # each dead letter's fixed `error_reason`, by its entry
        **dict.fromkeys(list(poison)[:9], "bad_header"),
        "empty value": "empty_value",
        "null value": "empty_value",
        "Pillow raises IndexError": "undecodable_image",
        "a GIF": "undecodable_image",
        "unknown label": "unknown_label",
        "oversized": "record_too_large",
        "a 600 KB label": "header_too_long",
        "a 100 KB device_id": "header_too_long",
        "a 10 KB key": "header_too_long",
    }
    # Poison interleaved with good records, so every block and batch mixes both.
    bad_records = [record for record, _ in poison.values()]
    records = [r for pair in zip(good, bad_records + [None] * len(good)) for r in pair if r is not None]
    coordinates = _send(settings, records)
    sent = dict(zip(coordinates, records))
    good_at = {c for c, r in sent.items() if r in good}
    reason_at = {c: reason for c, r in sent.items() for record, reason in poison.values() if r is record}
    code_at = {
        c: reasons[name] for c, r in sent.items() for name, (record, _) in poison.items() if r is record
    }
    assert len(good_at) == 20 and len(reason_at) == len(poison) == 18

    report = ingest(
        settings,
        IngestConfig(max_record_bytes=MAX_RECORD_BYTES, allowed_lateness_s=3600),
        settings.kafka_connection(),
    )
    assert report.snapshot_id and report.records == 20 and report.dlq == len(poison)

    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    summary = table.load().snapshot_by_id(report.snapshot_id).summary.additional_properties
    assert json.loads(summary["argus.dlq.errors"]) == Counter(reasons.values())  # by fixed reason, not text
    ranges = json.loads(summary["argus.kafka.ranges"])
    assert sum(end - start for start, end in ranges.values()) == len(records)
    rows = table.scan(report.snapshot_id, ["kafka_partition", "kafka_offset", "event_time_ms"]).to_pylist()
    assert Counter((r["kafka_partition"], r["kafka_offset"]) for r in rows) == Counter(good_at)  # each once
    assert all(0 <= r["event_time_ms"] <= 253_402_300_799_999 for r in rows)

    dead = _consume(settings, settings.dlq_topic, len(poison))
    by_source = Counter(
        (int(h["source_partition"]), int(h["source_offset"])) for h in map(_text_headers, dead)
    )
    assert by_source == Counter(reason_at.keys())  # each bad one exactly once, at its own coordinates
    for record in dead:
        headers = _text_headers(record)
        source = (int(headers["source_partition"]), int(headers["source_offset"]))
        expected, (key, value, _, _) = reason_at[source], sent[source]
        assert headers["source_topic"] == settings.topic
        assert headers["error_reason"] == code_at[source], (source, headers)
        if expected.endswith(": "):
            assert headers["error"].startswith(expected), (source, headers["error"])
        else:
            assert headers["error"] == expected, (source, headers["error"])
        assert record.value == (value or b"")  # the original bytes
        # A key or header over its limit is left out of the dead letter (its `error` quotes it).
        assert record.key == (key.encode() if len(key) <= 256 else b""), source
        assert len(record.key) + sum(len(k) + len(v) for k, v in record.headers) < 2000, source


def _send(settings, records) -> list[tuple[int, int]]:
    """Publish (key, value, headers, timestamp_ms) through a batching producer, as devices do;
    return each record's (partition, offset)."""
    producer = settings.kafka_connection().producer(linger_ms=50)
    futures = [
        producer.send(settings.topic, key=key.encode(), value=value, headers=headers, timestamp_ms=timestamp)
        for key, value, headers, timestamp in records
    ]
    producer.flush()
    producer.close()
    return [(f.get().partition, f.get().offset) for f in futures]


def _consume(settings, topic: str, expected: int, timeout_s: float = 30) -> list:
    """Every record of `topic`, waiting for at least `expected`, then for stragglers (a duplicate)."""
    consumer = KafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=2000,
    )
    consumer.assign([TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()])
    consumer.seek_to_beginning()
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < expected and time.monotonic() < deadline:
        records.extend(consumer)
    records.extend(consumer)  # one more quiet period: a duplicate would show here
    consumer.close()
    return records


def _text_headers(record) -> dict[str, str]:
    return {k: v.decode() for k, v in record.headers}
