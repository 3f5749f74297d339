"""`--kafka-config`: one file of librdkafka properties (`security.protocol`, `ssl.*`, `sasl.*`, ...)
for every Kafka client Argus creates. confluent-kafka takes them as they are; this is the one place
they are checked and mapped onto kafka-python's arguments, so one file configures both libraries
and a property neither understands is an error (exit 2), never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from app.errors import ConfigError


def _upper(choices: tuple[str, ...]) -> Callable[[str], str]:
    def convert(value: str) -> str:
        if value.upper() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value.upper()

    return convert


def _hostname_check(value: str) -> bool:
    if value.lower() not in ("https", "none"):
        raise ValueError("expected https or none")
    return value.lower() == "https"


def _sasl_mechanism(value: str) -> str:
    if value.upper() == "OAUTHBEARER":
        raise ValueError(
            "OAUTHBEARER needs a token provider, which a properties file cannot give kafka-python"
        )
    return _upper(("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI"))(value)


KAFKA_PYTHON_ARGS: dict[str, tuple[str, Callable[[str], object]]] = {
    "security.protocol": ("security_protocol", _upper(("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"))),
    "ssl.ca.location": ("ssl_cafile", str),
    "ssl.certificate.location": ("ssl_certfile", str),
    "ssl.key.location": ("ssl_keyfile", str),
    "ssl.key.password": ("ssl_password", str),
    "ssl.crl.location": ("ssl_crlfile", str),
    "ssl.endpoint.identification.algorithm": ("ssl_check_hostname", _hostname_check),
    "sasl.mechanism": ("sasl_mechanism", _sasl_mechanism),
    "sasl.mechanisms": ("sasl_mechanism", _sasl_mechanism),
    "sasl.username": ("sasl_plain_username", str),
    "sasl.password": ("sasl_plain_password", str),
    "sasl.kerberos.service.name": ("sasl_kerberos_service_name", str),
    "client.id": ("client_id", str),
    "request.timeout.ms": ("request_timeout_ms", int),
    "metadata.max.age.ms": ("metadata_max_age_ms", int),
    "connections.max.idle.ms": ("connections_max_idle_ms", int),
    "reconnect.backoff.ms": ("reconnect_backoff_ms", int),
    "reconnect.backoff.max.ms": ("reconnect_backoff_max_ms", int),
    "retry.backoff.ms": ("retry_backoff_ms", int),
    "socket.send.buffer.bytes": ("send_buffer_bytes", int),
    "socket.receive.buffer.bytes": ("receive_buffer_bytes", int),
}
"""librdkafka property → (kafka-python argument of KafkaProducer and KafkaAdminClient, converter)."""

PRODUCER_ONLY = frozenset({"request.timeout.ms"})
"""Mapped properties librdkafka accepts on producers only: Argus's librdkafka clients are consumers."""

LIBRDKAFKA_ONLY = frozenset(
    {
        "socket.timeout.ms",
        "socket.connection.setup.timeout.ms",
        "socket.keepalive.enable",
        "socket.nagle.disable",
        "socket.max.fails",
        "broker.address.family",
        "broker.address.ttl",
        "topic.metadata.refresh.interval.ms",
        "api.version.request.timeout.ms",
        "client.rack",
        "debug",
        "log.connection.close",
        "log_level",
    }
)
"""librdkafka properties with no kafka-python equivalent that do not touch security: applied to the
confluent-kafka consumers, skipped for kafka-python's producer and admin."""

ARGUS_OWNED = frozenset(
    {
        "bootstrap.servers",
        "metadata.broker.list",
        "group.id",
        "enable.auto.commit",
        "enable.auto.offset.store",
        "auto.offset.reset",
        "enable.partition.eof",
        "isolation.level",
        "fetch.max.bytes",
        "fetch.min.bytes",
        "fetch.wait.max.ms",
        "max.partition.fetch.bytes",
        "message.max.bytes",
        "receive.message.max.bytes",
        "session.timeout.ms",
        "acks",
        "request.required.acks",
        "linger.ms",
        "queue.buffering.max.ms",
        "batch.size",
        "batch.num.messages",
        "retries",
        "message.send.max.retries",
        "enable.idempotence",
        "transactional.id",
    }
)
"""Properties Argus sets itself (its exactly-once reads and acknowledged writes depend on them)."""

SECURITY_PREFIXES = ("security.", "ssl.", "sasl.", "enable.ssl.", "enable.sasl.", "ssl_")


def kafka_python_options(properties: Mapping[str, str], source: str = "the Kafka properties") -> dict:
    """Check librdkafka `properties` and return the kafka-python arguments they mean.

    Raises ConfigError naming the property and `source` for a property Argus sets itself, a security
    property kafka-python has no equivalent for (its producer would connect without it), a property
    neither library understands, or a bad value.
    """
    options: dict[str, object] = {}
    for name, value in properties.items():
        if name in ARGUS_OWNED:
            raise ConfigError(f"Kafka property {name!r} in {source} is set by Argus itself; remove it")
        if name in KAFKA_PYTHON_ARGS:
            argument, convert = KAFKA_PYTHON_ARGS[name]
            try:
                options[argument] = convert(value)
            except ValueError as exc:
                raise ConfigError(f"Kafka property {name}={value!r} in {source}: {exc}") from None
        elif name.startswith(SECURITY_PREFIXES):
            raise ConfigError(
                f"Kafka property {name!r} in {source} is not supported: kafka-python (Argus's producer "
                "and admin) has no equivalent, and they would connect without it"
            )
        elif name not in LIBRDKAFKA_ONLY:
            raise ConfigError(
                f"unknown Kafka property {name!r} in {source}: neither librdkafka nor kafka-python "
                "settings Argus can apply (see README, 'Secured Kafka')"
            )
    return options


def load_kafka_config(path: str | Path) -> dict[str, str]:
    """Parse a librdkafka properties file: `key=value` lines, `#` or `!` comments, blank lines.

    The properties are checked (`kafka_python_options`) and files they name must exist; any problem
    is a ConfigError naming the file.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--kafka-config {str(path)!r}: {exc.strerror or exc}") from None
    properties: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "!")):
            continue
        name, sep, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise ConfigError(f"{path}:{number}: expected key=value, got {line[:60]!r}")
        if name in properties:
            raise ConfigError(f"{path}:{number}: Kafka property {name!r} is set twice")
        properties[name] = value
    kafka_python_options(properties, str(path))
    for name, value in properties.items():
        if name.endswith(".location") and not Path(value).is_file():
            raise ConfigError(f"Kafka property {name} in {path}: no such file {value!r}")
    return properties
