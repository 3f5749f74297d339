"""The dead-letter topic read back: each dead letter, the record it stands for, and its stored payload.

A dead letter (`app.data.sink`) carries the record's key and value, or a pointer to its value under
`<storage>/dlq/`, its CONTRACT.md §1 headers, its source coordinates and why it failed. All of it
is untrusted: coordinates must be plain numbers, and a stored payload is read only at the name the
sink gives it and only with the size and SHA-256 its headers name. `app.data.redrive` decides
which of them go into the table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from app.data import kafka, probe
from app.data.records import dead_letter_folder, header_fields, message_headers
from app.errors import Reason
from app.storage import Store, sha256

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 120.0
"""Longest the read of the dead-letter topic may take before the redrive fails."""


@dataclass(frozen=True)
class DeadLetter:
    """One record of the dead-letter topic, as read."""

    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    """The last value of each header; {} when they could not be read."""
    timestamp: int
    """The dead letter's own Kafka timestamp."""

    @classmethod
    def of(cls, message) -> DeadLetter:
        try:  # never message.headers(): see message_headers
            raw = message_headers(message) or []
        except Exception:  # a header key that is not UTF-8: no source coordinates, stays dead
            raw = []
        headers = {k: v for k, v in raw if isinstance(k, str) and v is not None}
        return cls(message.key(), message.value() or b"", headers, message.timestamp()[1])

    def text(self, name: str) -> str | None:
        value = self.headers.get(name)
        return None if value is None else value.decode("utf-8", "replace")

    @property
    def user(self) -> str:
        return self.key.decode("utf-8", "replace") if self.key else ""

    def source(self) -> tuple[str, int, int] | None:
        """(topic, partition, offset) of the record it stands for; None when not stated."""
        topic, partition, offset = (
            self.text(h) for h in ("source_topic", "source_partition", "source_offset")
        )
        if topic is None or natural(partition) is None or natural(offset) is None:
            return None
        return topic, natural(partition), natural(offset)

    def reason(self) -> str | None:
        """The `error_reason` it was dead-lettered with. A dead letter from before reasons existed
        has only its `error`, which names a header problem (the one kind that must stay dead)."""
        reason = self.text("error_reason")
        if reason is not None:
            return reason
        error = self.text("error") or ""
        return Reason.BAD_HEADER if "header" in error or error.startswith("Kafka timestamp") else None


def natural(text: str | None) -> int | None:
    """The number in a header that must hold one (ASCII digits, at most 19), else None."""
    if text is None or not (text.isascii() and text.isdigit()) or len(text) > 19:
        return None
    return int(text)


@dataclass
class Candidate:
    """A dead letter that may pass now, and the raw row (`kafka.RAW_SCHEMA`) of its record."""

    letter: DeadLetter
    row: dict
    source_timestamp: int | None
    """The record's own Kafka timestamp (None for dead letters written before they carried it)."""

    @property
    def coordinates(self) -> tuple[int, int]:
        return self.row["partition"], self.row["offset"]


def read_dead_letters(
    connection: kafka.KafkaConnection, dlq_topic: str, timeout_s: float = READ_TIMEOUT_S
) -> list[DeadLetter]:
    """Every record of `dlq_topic` from each partition's log start to its proven end
    (`probe.probe_partitions`: a broker may report less); [] when the topic does not exist."""
    from confluent_kafka import KafkaError, TopicPartition

    consumer = connection.consumer()
    try:
        metadata = consumer.list_topics(dlq_topic, timeout=10).topics.get(dlq_topic)
        if metadata is None or metadata.error is not None:
            log.info("redrive: there is no dead-letter topic %s", dlq_topic)
            return []
        probed = probe.probe_partitions(connection, dlq_topic, sorted(metadata.partitions), timeout_s)
        ends = {p: ends.end for p, ends in probed.items() if ends.end > ends.log_start}
        consumer.assign([TopicPartition(dlq_topic, p, probed[p].log_start) for p in ends])
        letters: list[DeadLetter] = []
        deadline = time.monotonic() + timeout_s
        while ends:
            if time.monotonic() > deadline:
                raise RuntimeError(f"reading {dlq_topic} timed out for partitions {sorted(ends)}")
            message = consumer.poll(1.0)
            if message is None:
                continue
            p = message.partition()
            if message.error():
                if message.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading {dlq_topic}[{p}]: {message.error()}")
                if p in ends and message.offset() >= ends[p]:
                    del ends[p]
                continue
            if p not in ends or message.offset() >= ends[p]:  # written since the probe: the next run's
                ends.pop(p, None)
                continue
            letters.append(DeadLetter.of(message))
            if message.offset() >= ends[p] - 1:
                del ends[p]
        return letters
    finally:
        consumer.close()


def candidate(letter: DeadLetter, partition: int, offset: int) -> Candidate:
    """The raw row of the record a dead letter stands for, as the Kafka reader made it; the value
    is loaded later, once the record is known to be missing from the table."""
    source_timestamp = natural(letter.text("source_timestamp"))
    names = ("schema", "event_time", "label", "device_id")  # as `record_headers` wrote them
    original = [(name, letter.headers[name]) for name in names if name in letter.headers]
    # `event_time` falls back to the Kafka timestamp only when the header is absent, which a dead
    # letter's never is (`record_headers` always writes it).
    timestamp = source_timestamp if source_timestamp is not None else letter.timestamp
    row = header_fields(original, timestamp, None, letter.key)
    row.update(
        partition=partition,
        offset=offset,
        kafka_timestamp=timestamp,
        late=False,
        value=b"",
        gap_end=None,
    )
    return Candidate(letter, row, source_timestamp)


def stored_payload(letter: DeadLetter, topic: str, partition: int, offset: int, dlq: Store) -> bytes | str:
    """A dead letter's stored value, or why it is not to be used. The headers are untrusted: the
    payload is read only at the name the sink gives it under `<storage>/dlq/`, and only if it has
    the size and SHA-256 they name."""
    relative = f"{topic}/{dead_letter_folder(letter.user)}/{partition}-{offset}.bin"
    uri, size, digest = (letter.text(h) for h in ("payload_uri", "payload_size", "payload_sha256"))
    if uri != dlq.uri(relative):
        return f"its payload_uri {(uri or '')[:200]!r} is not {dlq.uri(relative)!r}"
    if natural(size) is None or not digest:
        return "its payload_size or payload_sha256 is missing"
    stored = dlq.fs.get_file_info(dlq.path(relative)).size
    if stored != natural(size):  # a missing file has no size; a wrong size is not read at all
        return f"the payload holds {stored} bytes, not {size}"
    value = dlq.read(relative)
    if len(value) != stored or sha256(value) != digest:
        return "the payload's SHA-256 is not its payload_sha256"
    return value
