"""What a topic's partitions hold, proven by reading rather than trusted from the broker: their log
start and true end (a broker may report less than the end: the embedded one does), and the first
offset at or after a time (`ingest --from TIMESTAMP`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from app.data.kafka import KafkaConnection


def partitions_of(kafka: KafkaConnection, topic: str) -> list[int]:
    consumer = kafka.consumer()
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        topic_metadata = metadata.topics.get(topic)
        if topic_metadata is None or topic_metadata.error is not None:
            raise RuntimeError(f"topic {topic!r} not found on {kafka.bootstrap_servers}")
        return sorted(topic_metadata.partitions)
    finally:
        consumer.close()


@dataclass(frozen=True)
class PartitionEnds:
    """What a probe proved about one partition."""

    log_start: int
    """The first offset the broker still holds (retention deleted everything before it)."""
    end: int
    """The true end: last offset + 1."""
    visible_end: int
    """Records are delivered up to here; from here to `end` there may be only offsets no consumer
    ever receives (a transaction's commit marker), which the reader may then count as skipped."""


def probe_partitions(
    kafka: KafkaConnection, topic: str, partitions: Iterable[int], timeout_s: float = 60.0
) -> dict[int, PartitionEnds]:
    """Log start and true end of each partition, the end proven by reading past the reported one.

    A broker may report the first offset of its last batch + 1 as the high watermark. Reading from
    reported - 1 until the partition signals EOF returns that whole last batch, so the last offset
    seen is the real end, and the EOF right after it is the proof that nothing follows. When that
    read delivers nothing, offsets from reported - 1 on are markers, not records.
    """
    from confluent_kafka import KafkaError, TopicPartition

    consumer = kafka.consumer()
    try:
        lows, reported, seen, assignments = {}, {}, {}, []
        for partition in partitions:
            lows[partition], reported[partition] = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=10
            )
            if reported[partition] > lows[partition]:
                assignments.append(
                    TopicPartition(topic, partition, max(lows[partition], reported[partition] - 1))
                )
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
            seen[message.partition()] = max(seen.get(message.partition(), -1), message.offset())
        probed = {}
        for p in lows:
            end = max(reported[p], seen.get(p, -1) + 1)
            visible = seen[p] + 1 if p in seen else max(lows[p], reported[p] - 1)
            probed[p] = PartitionEnds(lows[p], end, visible)
        return probed
    finally:
        consumer.close()


def offsets_at_time(
    kafka: KafkaConnection, topic: str, probed: dict[int, PartitionEnds], timestamp_ms: int
) -> dict[int, int]:
    """Per partition, the offset of the first record whose Kafka timestamp is at or after
    `timestamp_ms` (the partition's end when none is), assuming timestamps grow along the log as
    Kafka's time index does.

    The broker's answer (ListOffsets by time) is a hint that is checked by reading the records
    around it: the embedded broker answers the log start for every time. Where the check fails,
    a binary search reads ~log2(n) single records instead."""
    from confluent_kafka import TopicPartition

    consumer = kafka.consumer()
    try:
        hints = consumer.offsets_for_times(
            [TopicPartition(topic, p, timestamp_ms) for p in probed], timeout=10
        )
        hinted = {tp.partition: tp.offset if tp.offset >= 0 else probed[tp.partition].end for tp in hints}

        def first_at(partition: int, offset: int) -> tuple[int, int] | None:
            """(offset, timestamp) of the first record at or after `offset`; None past the last."""
            return _first_record(consumer, topic, partition, offset, probed[partition].end)

        starts = {}
        for p, ends in probed.items():
            hint = min(max(hinted.get(p, ends.log_start), ends.log_start), ends.end)
            at_hint = first_at(p, hint)
            before = first_at(p, hint - 1) if hint > ends.log_start else None
            if (at_hint is None or at_hint[1] >= timestamp_ms) and (
                before is None or before[0] >= hint or before[1] < timestamp_ms
            ):
                starts[p] = hint
                continue
            low, high = ends.log_start, ends.end
            while low < high:
                middle = (low + high) // 2
                found = first_at(p, middle)
                if found is None or found[1] >= timestamp_ms:
                    high = middle
                else:
                    low = found[0] + 1
            starts[p] = low
        return starts
    finally:
        consumer.close()


def _first_record(consumer, topic: str, partition: int, offset: int, end: int) -> tuple[int, int] | None:
    from confluent_kafka import KafkaError, TopicPartition

    if offset >= end:
        return None
    consumer.assign([TopicPartition(topic, partition, offset)])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        message = consumer.poll(1.0)
        if message is None:
            continue
        if message.error():
            if message.error().code() == KafkaError._PARTITION_EOF:
                return None
            raise RuntimeError(f"reading {topic}[{partition}] at {offset}: {message.error()}")
        if message.offset() >= offset:
            return message.offset(), message.timestamp()[1]
    raise RuntimeError(f"reading {topic}[{partition}] at {offset} timed out")


def probe_end_offsets(
    kafka: KafkaConnection, topic: str, partitions: Iterable[int], timeout_s: float = 60.0
) -> dict[int, int]:
    """The true end (last offset + 1) of each partition (see `probe_partitions`)."""
    return {p: probed.end for p, probed in probe_partitions(kafka, topic, partitions, timeout_s).items()}
