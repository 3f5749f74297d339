"""Kafka clients, as every stage creates them: admin, producer, consumers, the end probe and the
exact range reader (CONTRACT.md §1 records).

kafka-python produces and administers; confluent-kafka (librdkafka) reads, as Ray Data does.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa

log = logging.getLogger(__name__)

SCHEMA_VERSION = "ubi.v1"
MAX_BLOCK_BYTES = 16 * 1024 * 1024
"""Ingest's Ray Data block size: a read task passes its records on every `records_per_block` or this
many bytes, and transforms split larger outputs."""


def admin_client(bootstrap_servers: str):
    from kafka import KafkaAdminClient

    return KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="argus-admin")


def ensure_topics(bootstrap_servers: str, topics: Sequence[str], partitions: int) -> None:
    """Create the topics that do not exist yet; existing ones keep their partition count."""
    from kafka.admin import NewTopic

    admin = admin_client(bootstrap_servers)
    try:
        missing = [t for t in topics if t not in set(admin.list_topics())]
        if missing:
            admin.create_topics([NewTopic(t, partitions, 1) for t in missing])
            log.info("created topics %s with %d partitions", missing, partitions)
    finally:
        admin.close()


def make_producer(bootstrap_servers: str, linger_ms: int = 20, batch_bytes: int = 256 * 1024):
    from kafka import KafkaProducer

    # acks=all and retries: a gateway must not lose what devices sent; linger batches records.
    return KafkaProducer(
        bootstrap_servers=bootstrap_servers,
        acks="all",
        linger_ms=linger_ms,
        batch_size=batch_bytes,
        max_request_size=64 * 1024 * 1024,
        retries=5,
        client_id="argus-producer",
    )


def record_headers(label: str | None, event_time_ms: int, device_id: str | None) -> list[tuple[str, bytes]]:
    headers = [("schema", SCHEMA_VERSION.encode()), ("event_time", str(int(event_time_ms)).encode())]
    if label is not None:
        headers.append(("label", label.encode()))
    if device_id is not None:
        headers.append(("device_id", device_id.encode()))
    return headers


RAW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("kafka_timestamp", pa.int64()),
        ("key", pa.string()),
        ("value", pa.binary()),
        ("label", pa.string()),
        ("event_time", pa.int64()),
        ("device_id", pa.string()),
        ("schema", pa.string()),
        ("header_error", pa.string()),
        ("late", pa.bool_()),
    ]
)


def make_consumer(bootstrap_servers: str, **extra):
    from confluent_kafka import Consumer

    config = {
        "bootstrap.servers": bootstrap_servers,
        "group.id": f"argus-reader-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "fetch.max.bytes": 64 * 1024 * 1024,
        "message.max.bytes": 64 * 1024 * 1024,
        # One consumer reads one partition: librdkafka's 1 MiB per-partition fetch would
        # make every round trip carry ~100 images.
        "max.partition.fetch.bytes": 16 * 1024 * 1024,
        # Bounded reads end at a known offset: waiting up to 500 ms (the default) at the log's
        # end for more data only delays the EOF that proves the end.
        "fetch.wait.max.ms": 10,
        "session.timeout.ms": 6000,
    }
    config.update(extra)
    return Consumer(config)


def partitions_of(bootstrap_servers: str, topic: str) -> list[int]:
    consumer = make_consumer(bootstrap_servers)
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        topic_metadata = metadata.topics.get(topic)
        if topic_metadata is None or topic_metadata.error is not None:
            raise RuntimeError(f"topic {topic!r} not found on {bootstrap_servers}")
        return sorted(topic_metadata.partitions)
    finally:
        consumer.close()


def probe_end_offsets(
    bootstrap_servers: str, topic: str, partitions: Iterable[int], timeout_s: float = 60.0
) -> dict[int, int]:
    """The true end (last offset + 1) of each partition, proven by reading past the reported one.

    A broker may report the first offset of its last batch + 1 as the high watermark. Reading from
    reported - 1 until the partition signals EOF returns that whole last batch, so the last offset
    seen is the real end, and the EOF right after it is the proof that nothing follows.
    """
    from confluent_kafka import KafkaError, TopicPartition

    consumer = make_consumer(bootstrap_servers)
    try:
        ends, assignments = {}, []
        for partition in partitions:
            low, reported = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            ends[partition] = reported
            if reported > low:
                assignments.append(TopicPartition(topic, partition, max(low, reported - 1)))
        pending = {tp.partition for tp in assignments}
        consumer.assign(assignments)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"probing end offsets of {topic} timed out for partitions {sorted(pending)}"
                )
            message = consumer.poll(1.0)
            if message is None:
                continue
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard(message.partition())
                    continue
                raise RuntimeError(f"probing {topic}[{message.partition()}]: {message.error()}")
            ends[message.partition()] = max(ends[message.partition()], message.offset() + 1)
        return ends
    finally:
        consumer.close()


def header_fields(headers) -> dict:
    values = {k: v for k, v in (headers or [])}

    def text(name):
        raw = values.get(name)
        return raw.decode("utf-8", "replace") if raw is not None else None

    fields = {
        "label": text("label"),
        "device_id": text("device_id"),
        "schema": text("schema"),
        "event_time": None,
        "header_error": None,
    }
    raw_time = text("event_time")
    if raw_time is not None:
        try:
            fields["event_time"] = int(raw_time)
        except ValueError:
            fields["header_error"] = f"event_time header {raw_time!r} is not an integer"
    return fields


def read_partition_range(
    bootstrap_servers: str,
    topic: str,
    partition: int,
    start: int,
    end: int,
    records_per_block: int,
    watermark_ms: int,
    allowed_lateness_ms: int,
    stall_timeout_s: float = 60.0,
) -> Iterator[pa.Table]:
    """Every record of [start, end) of one partition, as Arrow blocks, or an error: never fewer.

    Lateness is judged against the partition's running event-time watermark (the highest event
    time seen so far, seeded from the previous snapshot), as a stream processor would.
    """
    from confluent_kafka import KafkaError, TopicPartition

    consumer = make_consumer(bootstrap_servers)
    consumer.assign([TopicPartition(topic, partition, start)])
    rows: dict[str, list] = {name: [] for name in RAW_SCHEMA.names}
    next_offset, last_progress = start, time.monotonic()
    try:
        while next_offset < end:
            messages = consumer.consume(min(records_per_block, end - next_offset), timeout=1.0)
            if not messages and time.monotonic() - last_progress > stall_timeout_s:
                raise RuntimeError(f"{topic}[{partition}] stalled at offset {next_offset} before {end}")
            for message in messages:
                if message.error():
                    if message.error().code() == KafkaError._PARTITION_EOF:
                        if next_offset < end:
                            raise RuntimeError(f"{topic}[{partition}] ended at {next_offset}, expected {end}")
                        continue
                    raise RuntimeError(f"reading {topic}[{partition}]: {message.error()}")
                offset = message.offset()
                if offset >= end:
                    break
                last_progress = time.monotonic()
                next_offset = offset + 1
                fields = header_fields(message.headers())
                _, timestamp = message.timestamp()
                event_time = fields["event_time"] if fields["event_time"] is not None else timestamp
                watermark_ms = max(watermark_ms, event_time)
                fields.update(
                    partition=partition,
                    offset=offset,
                    kafka_timestamp=timestamp,
                    event_time=event_time,
                    late=event_time < watermark_ms - allowed_lateness_ms,
                    key=message.key().decode("utf-8", "replace") if message.key() else None,
                    value=message.value() or b"",
                )
                for name in RAW_SCHEMA.names:
                    rows[name].append(fields[name])
            if len(rows["offset"]) >= records_per_block or sum(map(len, rows["value"])) >= MAX_BLOCK_BYTES:
                yield pa.Table.from_pydict(rows, schema=RAW_SCHEMA)
                rows = {name: [] for name in RAW_SCHEMA.names}
        if rows["offset"]:
            yield pa.Table.from_pydict(rows, schema=RAW_SCHEMA)
    finally:
        consumer.close()


def commit_offsets(bootstrap_servers: str, group: str, topic: str, ends: dict[int, int]) -> None:
    """Commit `ends` as the consumer group's offsets, so Kafka's own lag tools see the ledger."""
    from confluent_kafka import TopicPartition

    client = make_consumer(bootstrap_servers, **{"group.id": group})
    try:
        client.commit(offsets=[TopicPartition(topic, p, e) for p, e in ends.items()], asynchronous=False)
    finally:
        client.close()
