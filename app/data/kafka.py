"""Kafka clients, as every stage creates them: admin and topics, producer, consumers, for CONTRACT.md
§1 records (their headers: `app.data.records`; what a partition holds, proven: `app.data.probe`;
the exact range reader: `app.data.kafka_range`; the `--kafka-config` properties they apply:
`app.data.kafka_config`).

kafka-python produces and administers; confluent-kafka (librdkafka) reads, as Ray Data does. Every
client comes from a `KafkaConnection` (bootstrap servers + the file's properties), which travels to
Ray tasks by pickling, so a read or write task connects exactly as the driver does.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from app.data.kafka_config import PRODUCER_ONLY, kafka_python_options
from app.data.records import header_fields, message_headers
from app.errors import ConfigError

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""The largest request the producer sends and the largest message consumers fetch; also the DLQ's
`max.message.bytes` when the source topic's cannot be read."""


@dataclass(frozen=True)
class KafkaConnection:
    """How Argus reaches Kafka: bootstrap servers and librdkafka properties (`--kafka-config`).

    Picklable; every client Argus creates comes from one of its methods. The properties are kept out
    of repr, since they may hold passwords.
    """

    bootstrap_servers: str
    properties: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "properties", dict(self.properties))
        kafka_python_options(self.properties)

    def consumer(self, **extra):
        """A confluent-kafka consumer for bounded reads; `extra` overrides Argus's defaults."""
        from confluent_kafka import Consumer

        config = {
            "bootstrap.servers": self.bootstrap_servers,
            "group.id": f"argus-reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "fetch.max.bytes": MAX_MESSAGE_BYTES,
            "message.max.bytes": MAX_MESSAGE_BYTES,
            # One consumer reads one partition: librdkafka's 1 MiB per-partition fetch would
            # make every round trip carry ~100 images.
            "max.partition.fetch.bytes": 16 * 1024 * 1024,
            # Bounded reads end at a known offset: waiting up to 500 ms (the default) at the log's
            # end for more data only delays the EOF that proves the end.
            "fetch.wait.max.ms": 10,
            "session.timeout.ms": 6000,
            # Records of aborted transactions are never ingested; their offsets, and transaction
            # markers, are gaps the reader counts as skipped.
            "isolation.level": "read_committed",
        }
        config.update({k: v for k, v in self.properties.items() if k not in PRODUCER_ONLY})
        config.update(extra)
        return Consumer(config)

    def _kafka_python(self, defaults: dict) -> dict:
        return {
            "bootstrap_servers": self.bootstrap_servers,
            **defaults,
            **kafka_python_options(self.properties),
        }

    @property
    def uses_tls(self) -> bool:
        return self.properties.get("security.protocol", "").upper() in ("SSL", "SASL_SSL")

    def check_tls(self, timeout_s: float = 10.0) -> None:
        """Where the properties ask for TLS, shake hands with the bootstrap servers as kafka-python
        does (same CA, client certificate, hostname check) and raise ConfigError naming the TLS
        failure: the Kafka clients themselves only report an unreachable cluster, after retrying."""
        import socket
        import ssl

        if not self.uses_tls:
            return
        options = kafka_python_options(self.properties)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = options.get("ssl_check_hostname", True)
        try:
            if options.get("ssl_cafile"):
                context.load_verify_locations(options["ssl_cafile"])
            else:
                context.load_default_certs()
            if options.get("ssl_certfile"):
                context.load_cert_chain(
                    options["ssl_certfile"], options.get("ssl_keyfile"), options.get("ssl_password")
                )
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"TLS files of the Kafka properties do not load: {exc}") from None
        failures = []
        for server in self.bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
                    with context.wrap_socket(raw, server_hostname=host):
                        return
            except ssl.SSLError as exc:
                failures.append(f"{server.strip()}: {str(exc).split(' (_ssl.c')[0]}")
            except OSError:
                continue  # unreachable is check_reachable's to report; another server may answer
        if failures:
            ca = self.properties.get("ssl.ca.location", "the system's CA certificates")
            raise ConfigError(f"TLS handshake with Kafka failed ({'; '.join(failures)}; CA: {ca})")

    def _connect(self, factory, **kwargs):
        from kafka.errors import KafkaError

        try:
            return factory(**kwargs)
        except KafkaError:
            self.check_tls()  # a TLS failure says what it is; anything else stays as it was
            raise

    def producer(self, linger_ms: int = 20, batch_bytes: int = 256 * 1024):
        """A kafka-python producer: acks=all and retries, since a gateway must not lose what devices
        sent; linger batches records."""
        from kafka import KafkaProducer

        defaults = {
            "acks": "all",
            "linger_ms": linger_ms,
            "batch_size": batch_bytes,
            "max_request_size": MAX_MESSAGE_BYTES,
            "retries": 5,
            "client_id": "argus-producer",
        }
        return self._connect(KafkaProducer, **self._kafka_python(defaults))

    def admin(self):
        from kafka import KafkaAdminClient

        defaults = {"client_id": "argus-admin"}
        return self._connect(KafkaAdminClient, **self._kafka_python(defaults))


# ---------------------------------------------------------------- topics
DLQ_HEADER_ROOM = 64 * 1024
"""Bytes a dead letter may carry beyond its source record: the error and source headers."""


def _max_message_bytes(admin, topic: str) -> int | None:
    """The topic's `max.message.bytes`, or None where the broker does not say."""
    from kafka.admin import ConfigResource, ConfigResourceType

    try:
        resource = ConfigResource(ConfigResourceType.TOPIC, topic)
        described = admin.describe_configs([resource], config_filter="all")
        return int(described["topic"][topic]["max.message.bytes"]["value"])
    except Exception as exc:  # an old or minimal broker: fall back to what the producer sends
        log.debug("max.message.bytes of %s unknown: %s", topic, exc)
        return None


def ensure_topics(
    kafka: KafkaConnection, topic: str, dlq_topic: str, partitions: int, replication_factor: int = 1
) -> None:
    """Create the topic and its DLQ where they do not exist yet; existing ones keep their settings.

    The DLQ is created with a `max.message.bytes` of at least the source topic's (plus room for the
    dead-letter headers), so every record the topic accepted fits as a dead letter; where the broker
    does not report the source's, the producer's limit (MAX_MESSAGE_BYTES).
    """
    from kafka.admin import NewTopic
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    admin = kafka.admin()
    try:
        existing = set(admin.list_topics())
        if topic not in existing:
            try:
                admin.create_topics([NewTopic(topic, partitions, replication_factor)])
                log.info(
                    "created topic %s: %d partitions, replication %d", topic, partitions, replication_factor
                )  # noqa: E501
            except TopicAlreadyExistsError:  # another writer starting at the same time created it
                pass
        if dlq_topic not in existing:
            source = _max_message_bytes(admin, topic)
            limit = MAX_MESSAGE_BYTES if source is None else source + DLQ_HEADER_ROOM
            configs = {"max.message.bytes": str(limit)}
            try:
                admin.create_topics(
                    [NewTopic(dlq_topic, partitions, replication_factor, topic_configs=configs)]
                )
            except TopicAlreadyExistsError:  # another writer starting at the same time created it
                return
            except KafkaError as exc:
                if dlq_topic in set(admin.list_topics()):
                    raise
                log.warning(
                    "the broker refused %s for %s (%s): creating it with the broker's defaults",
                    configs,
                    dlq_topic,
                    exc,
                )
                admin.create_topics([NewTopic(dlq_topic, partitions, replication_factor)])
            log.info("created topic %s with max.message.bytes %d", dlq_topic, limit)
    finally:
        admin.close()


def raw_row(message, watermark_ms: int, allowed_lateness_ms: int) -> tuple[dict, int]:
    """One consumed record as a `RAW_SCHEMA` row (its headers' fields, late against the partition's
    event-time watermark) and the watermark after it; a dead letter's stand-in time moves none."""
    _, timestamp = message.timestamp()
    try:  # never message.headers(): see message_headers
        headers, unreadable = message_headers(message), None
    except Exception as exc:
        headers, unreadable = None, exc
    row = header_fields(headers, timestamp, unreadable, message.key())
    event_time = row["event_time"]
    if row["header_error"] is None:
        watermark_ms = max(watermark_ms, event_time)
    row.update(
        partition=message.partition(),
        offset=message.offset(),
        kafka_timestamp=timestamp,
        late=event_time < watermark_ms - allowed_lateness_ms,
        value=message.value() or b"",
        gap_end=None,
    )
    return row, watermark_ms


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
        ("header_reason", pa.string()),
        ("late", pa.bool_()),
        ("gap_end", pa.int64()),
    ]
)
"""Rows of a read task. A row whose `gap_end` is set is no record: it declares that the broker never
returns offsets [offset, gap_end) (transaction markers, aborted or compacted records)."""


def commit_offsets(kafka: KafkaConnection, group: str, topic: str, ends: dict[int, int]) -> bool:
    """Commit `ends` as the consumer group's offsets, so Kafka's own lag tools see the ledger;
    False (logged) when the broker refuses. The ledger is the truth and is already written, so a
    refusal costs only the mirror: a commit from outside the group is refused while the group has
    members (a watch on it, or a killed one until its session times out: UNKNOWN_MEMBER_ID)."""
    from confluent_kafka import KafkaException, TopicPartition

    client = kafka.consumer(**{"group.id": group})
    try:
        client.commit(offsets=[TopicPartition(topic, p, e) for p, e in ends.items()], asynchronous=False)
        return True
    except KafkaException as e:
        log.warning(
            "consumer group %s's offsets for %s not updated (%s); the ledger has them, and the next "
            "commit mirrors them",
            group,
            topic,
            e.args[0].str() if e.args else e,
        )
        return False
    finally:
        client.close()
