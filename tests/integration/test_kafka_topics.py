"""Topics Argus creates: partitions, replication factor, and a DLQ that takes what its source took."""

from __future__ import annotations

import uuid

from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from app.data.kafka import DLQ_HEADER_ROOM, MAX_MESSAGE_BYTES, KafkaConnection, ensure_topics


def max_message_bytes(kafka: KafkaConnection, topic: str) -> int | None:
    admin = kafka.admin()
    try:
        described = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all"
        )
    finally:
        admin.close()
    value = described["topic"][topic].get("max.message.bytes")
    return int(value["value"]) if value else None


def test_the_dlq_accepts_at_least_what_its_source_topic_accepts(broker):
    kafka = KafkaConnection(broker)
    big = f"big-{uuid.uuid4().hex[:8]}"
    admin = kafka.admin()
    try:
        admin.create_topics(
            [NewTopic(big, 2, 1, topic_configs={"max.message.bytes": str(200 * 1024 * 1024)})]
        )
    finally:
        admin.close()

    ensure_topics(kafka, big, f"{big}.dlq", partitions=2)

    assert max_message_bytes(kafka, f"{big}.dlq") == 200 * 1024 * 1024 + DLQ_HEADER_ROOM


def test_topics_get_partitions_replication_and_a_dlq_limit(broker):
    kafka = KafkaConnection(broker)
    topic = f"t-{uuid.uuid4().hex[:8]}"

    ensure_topics(kafka, topic, f"{topic}.dlq", partitions=3, replication_factor=1)
    ensure_topics(kafka, topic, f"{topic}.dlq", partitions=5, replication_factor=1)  # exists: unchanged

    consumer = kafka.consumer()
    try:
        metadata = consumer.list_topics(timeout=10).topics
    finally:
        consumer.close()
    for name in (topic, f"{topic}.dlq"):
        assert sorted(metadata[name].partitions) == [0, 1, 2]
        assert all(len(p.replicas) == 1 for p in metadata[name].partitions.values())
    # Tansu reports no max.message.bytes for a topic created without one: the producer's limit then.
    source = max_message_bytes(kafka, topic)
    expected = MAX_MESSAGE_BYTES if source is None else source + DLQ_HEADER_ROOM
    assert max_message_bytes(kafka, f"{topic}.dlq") == expected
