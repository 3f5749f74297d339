"""`--kafka-config`: one librdkafka properties file, checked once and mapped onto both client
libraries (confluent-kafka reads, kafka-python produces and administers)."""

from __future__ import annotations

import pickle

import pytest
from kafka import KafkaAdminClient, KafkaProducer

from app.config import Settings, env_defaults
from app.data.kafka import KafkaConnection
from app.data.kafka_config import (
    ARGUS_OWNED,
    KAFKA_PYTHON_ARGS,
    LIBRDKAFKA_ONLY,
    kafka_python_options,
    load_kafka_config,
)
from app.errors import ConfigError

from conftest import make_tls_files


@pytest.fixture
def tls(tmp_path):
    return make_tls_files(tmp_path / "tls")


def write(tmp_path, text: str):
    path = tmp_path / "kafka.properties"
    path.write_text(text)
    return path


def test_a_properties_file_parses_with_comments_blank_lines_and_spaces(tmp_path, tls):
    path = write(
        tmp_path,
        f"""# the cluster's TLS and SCRAM settings
! also a comment

security.protocol = SASL_SSL
ssl.ca.location={tls["ca"]}
sasl.mechanism=SCRAM-SHA-512
sasl.username=argus
sasl.password=pa=ss#word
""",
    )
    assert load_kafka_config(path) == {
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": str(tls["ca"]),
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "argus",
        "sasl.password": "pa=ss#word",  # only the first '=' splits; '#' inside a value is kept
    }


def test_one_file_configures_kafka_python_too(tls):
    options = kafka_python_options(
        {
            "security.protocol": "sasl_ssl",
            "ssl.ca.location": str(tls["ca"]),
            "ssl.certificate.location": "/c.pem",
            "ssl.key.location": "/k.pem",
            "ssl.key.password": "kp",
            "ssl.endpoint.identification.algorithm": "none",
            "sasl.mechanisms": "scram-sha-256",
            "sasl.username": "u",
            "sasl.password": "p",
            "client.id": "argus-eu",
            "request.timeout.ms": "45000",
            "socket.keepalive.enable": "true",  # librdkafka only: no kafka-python argument
        }
    )
    assert options == {
        "security_protocol": "SASL_SSL",
        "ssl_cafile": str(tls["ca"]),
        "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem",
        "ssl_password": "kp",
        "ssl_check_hostname": False,
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "u",
        "sasl_plain_password": "p",
        "client_id": "argus-eu",
        "request_timeout_ms": 45000,
    }
    assert kafka_python_options({"ssl.endpoint.identification.algorithm": "https"}) == {
        "ssl_check_hostname": True
    }


def test_every_mapped_argument_exists_in_kafka_python_producer_and_admin():
    for name, (argument, _) in KAFKA_PYTHON_ARGS.items():
        assert argument in KafkaProducer.DEFAULT_CONFIG, name
        assert argument in KafkaAdminClient.DEFAULT_CONFIG, name


def test_every_property_argus_accepts_is_a_real_librdkafka_property():
    """librdkafka refuses an unknown name when a client is built, which needs no broker."""
    from confluent_kafka import Consumer, KafkaException

    for name in sorted(set(KAFKA_PYTHON_ARGS) | LIBRDKAFKA_ONLY):
        try:
            Consumer({"group.id": "g", name: "1"}).close()
        except KafkaException as exc:  # a bad value for a known name is fine here
            assert "No such configuration property" not in str(exc), name


def consumer_configuration(connection: KafkaConnection, **extra) -> dict[str, str]:
    """What librdkafka itself holds for a consumer `connection` builds: its `debug=conf` dump
    (every property not at librdkafka's default), read from the client's own log."""
    import logging
    import time

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(f"test-kafka-conf-{id(lines)}")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    consumer = connection.consumer(**extra, logger=logger)
    try:
        deadline = time.monotonic() + 30
        while not any("Client configuration" in line for line in lines) and time.monotonic() < deadline:
            consumer.poll(0.1)  # the client's log is delivered by poll
    finally:
        consumer.close()
    dump = [line.split("]: ", 1)[-1] for line in lines if line.startswith("CONF ")]
    return dict(line.strip().split(" = ", 1) for line in dump if " = " in line)


def test_a_consumer_gets_the_properties_over_argus_defaults(tls):
    connection = KafkaConnection(
        "127.0.0.1:9",
        {
            "security.protocol": "SSL",
            "ssl.ca.location": str(tls["ca"]),
            "client.id": "argus-eu",
            "socket.timeout.ms": "12345",  # librdkafka-only: still the consumer's
            "request.timeout.ms": "9",  # producer-only in librdkafka: kept off the consumer
            "debug": "conf",
        },
    )
    config = consumer_configuration(connection, **{"group.id": "mine"})
    assert config["security.protocol"].upper() == "SSL"
    assert config["ssl.ca.location"] == str(tls["ca"])
    assert config["client.id"] == "argus-eu" and config["socket.timeout.ms"] == "12345"
    assert "request.timeout.ms" not in config
    # Argus's defaults stay under the properties; what the caller passes wins over both.
    assert config["isolation.level"] == "read_committed" and config["enable.auto.commit"] == "false"
    assert config["enable.partition.eof"] == "true" and config["session.timeout.ms"] == "6000"
    assert config["group.id"] == "mine"


@pytest.mark.parametrize(
    "text, message",
    [
        ("compression.codec=lz4\n", "unknown Kafka property 'compression.codec'"),
        ("no.such.thing=1\n", "unknown Kafka property 'no.such.thing'"),
        ("group.id=mine\n", "'group.id' in {path} is set by Argus itself"),
        ("bootstrap.servers=k:9092\n", "'bootstrap.servers' in {path} is set by Argus itself"),
        ("enable.auto.commit=true\n", "set by Argus itself"),
        (
            "ssl.keystore.location=/ks.p12\n",
            "'ssl.keystore.location' in {path} is not supported: kafka-python",
        ),
        ("ssl.cipher.suites=HIGH\n", "'ssl.cipher.suites' in {path} is not supported"),
        ("sasl.oauthbearer.config=x\n", "not supported"),
        ("enable.ssl.certificate.verification=false\n", "not supported"),
        ("security.protocol=TLS\n", "security.protocol='TLS' in {path}: expected one of PLAINTEXT"),
        ("ssl.endpoint.identification.algorithm=maybe\n", "expected https or none"),
        ("sasl.mechanism=OAUTHBEARER\n", "OAUTHBEARER needs a token provider"),
        ("request.timeout.ms=soon\n", "request.timeout.ms='soon'"),
        ("security.protocol\n", "{path}:1: expected key=value"),
        ("client.id=a\nclient.id=b\n", "{path}:2: Kafka property 'client.id' is set twice"),
        ("ssl.ca.location=/nowhere/ca.pem\n", "ssl.ca.location in {path}: no such file '/nowhere/ca.pem'"),
    ],
)
def test_a_bad_file_is_a_config_error_naming_the_property_and_the_file(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        load_kafka_config(path)
    assert message.format(path=path) in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--kafka-config '.*absent.properties': No such file"):
        load_kafka_config(tmp_path / "absent.properties")


def test_the_connection_itself_refuses_what_the_file_would(tmp_path):
    with pytest.raises(ConfigError, match="set by Argus itself"):
        KafkaConnection("k:9092", {"group.id": "g"})


def test_settings_load_the_file_and_give_a_picklable_connection(tmp_path, monkeypatch, tls):
    path = write(tmp_path, f"security.protocol=SSL\nssl.ca.location={tls['ca']}\nsasl.password=secret\n")
    settings = Settings(bootstrap_servers="k1:9093,k2:9093", kafka_config=str(path), replication_factor=3)
    connection = settings.kafka_connection()
    assert connection == KafkaConnection("k1:9093,k2:9093", load_kafka_config(path))
    assert settings.kafka_connection("127.0.0.1:1").bootstrap_servers == "127.0.0.1:1"
    assert pickle.loads(pickle.dumps(connection)) == connection  # travels to Ray tasks
    assert "secret" not in repr(connection) and "secret" not in repr(settings)
    monkeypatch.setenv("KAFKA_CONFIG", str(path))
    assert env_defaults()["kafka_config"] == str(path)
    with pytest.raises(ConfigError, match="--replication-factor must be >= 1"):
        Settings(replication_factor=0)


def test_argus_owned_properties_cover_what_consumers_and_producers_set():
    consumer_defaults = {"bootstrap.servers", "group.id", "enable.auto.commit", "enable.partition.eof"}
    assert consumer_defaults | {"fetch.max.bytes", "message.max.bytes", "acks", "linger.ms"} <= ARGUS_OWNED


def test_the_retraining_job_keeps_the_kafka_config(tmp_path, tls):
    from app.ops.retrain import retraining_entrypoint
    from app.registry import ModelCard

    path = write(tmp_path, f"security.protocol=SSL\nssl.ca.location={tls['ca']}\n")
    settings = Settings(
        bootstrap_servers="k:9093", kafka_config=str(path), storage=str(tmp_path / "s"), replication_factor=2
    )
    card = ModelCard("cnn", ["a", "b"], 32, False, "train", [], {})
    entrypoint = retraining_entrypoint(settings, card)
    assert entrypoint.count(f"--kafka-config {path.resolve()}") == 2  # ingest and train
    assert "--replication-factor 2" in entrypoint


def test_cli_exits_2_with_one_line_for_a_bad_kafka_config(tmp_path, cli):
    path = write(tmp_path, "security.protocol=SSL\nssl.truststore.location=/etc/kafka/trust.jks\n")
    result = cli("ingest", "--bootstrap-servers", "127.0.0.1:1", "--kafka-config", str(path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "ssl.truststore.location" in lines[0] and str(path) in lines[0]


def test_cli_reads_kafka_config_from_the_environment(tmp_path, cli):
    path = write(tmp_path, "linger.ms=5\n")
    result = cli("produce", "--synthetic", "1", env={"KAFKA_CONFIG": str(path)})
    assert result.returncode == 2, result.stderr
    assert "'linger.ms'" in result.stderr and "set by Argus itself" in result.stderr
