"""Secured Kafka over real TLS: stunnel terminates TLS in front of an embedded broker that
advertises the TLS port, so every client Argus creates (admin, producer, end probe, Ray read tasks,
DLQ producer, offset commit, lag watch) reaches the broker only through TLS.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from types import SimpleNamespace

import pytest

from app.config import IngestConfig, ProduceConfig, Settings
from app.data.broker import EmbeddedBroker
from app.data.ingest import ingest
from app.data.kafka import MAX_MESSAGE_BYTES
from app.data.probe import partitions_of, probe_end_offsets
from app.data.produce import produce
from app.data.table import ImageTable
from app.data.watch import measure_lag
from app.net import accepts, free_port

from conftest import TEST_IMAGE_SIZE, make_tls_files, missing_dependency, run_cli, settings_args

STUNNEL = shutil.which("stunnel") or shutil.which("stunnel4")


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory):
    """An embedded broker on a plain port that advertises the TLS port stunnel listens on."""
    if STUNNEL is None:
        missing_dependency("stunnel is not installed: .ci/run installs the Debian package stunnel4")
    root = tmp_path_factory.mktemp("tls")
    files = make_tls_files(root / "pki")
    plain_port, tls_port = free_port(), free_port()
    broker = EmbeddedBroker(
        port=plain_port, log_path=root / "tansu.log", advertised_url=f"tcp://127.0.0.1:{tls_port}"
    ).start()
    stunnel_log = root / "stunnel.log"
    config = root / "stunnel.conf"
    config.write_text(
        "foreground = yes\n"
        "pid =\n"
        f"output = {stunnel_log}\n"
        "[kafka]\n"
        f"accept = 127.0.0.1:{tls_port}\n"
        f"connect = 127.0.0.1:{plain_port}\n"
        f"cert = {files['server_cert']}\n"
        f"key = {files['server_key']}\n"
    )
    stunnel = subprocess.Popen(
        [STUNNEL, str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not accepts("127.0.0.1", tls_port):
            assert stunnel.poll() is None, (
                stunnel_log.read_text() if stunnel_log.exists() else "stunnel exited"
            )
            assert time.monotonic() < deadline, "stunnel did not listen within 20s"
            time.sleep(0.1)
        yield SimpleNamespace(bootstrap=f"127.0.0.1:{tls_port}", root=root, stunnel_log=stunnel_log, **files)
    finally:
        os.killpg(stunnel.pid, signal.SIGTERM)
        stunnel.wait(10)
        broker.stop()


def tls_settings(tls_broker, tmp_path, ca) -> Settings:
    tmp_path.mkdir(parents=True, exist_ok=True)
    properties = tmp_path / "kafka.properties"
    properties.write_text(f"# TLS to the test broker\nsecurity.protocol=SSL\nssl.ca.location={ca}\n")
    return Settings(
        bootstrap_servers=tls_broker.bootstrap,
        kafka_config=str(properties),
        topic=f"t-{uuid.uuid4().hex[:8]}",
        storage=str(tmp_path / "data"),
        image_size=TEST_IMAGE_SIZE,
        model="cnn",
        partitions=2,
    )


def committed_offsets(settings: Settings, group: str) -> dict[int, int]:
    from confluent_kafka import TopicPartition

    consumer = settings.kafka_connection().consumer(**{"group.id": group})
    try:
        partitions = [TopicPartition(settings.topic, p) for p in range(settings.partitions)]
        return {tp.partition: tp.offset for tp in consumer.committed(partitions, timeout=10)}
    finally:
        consumer.close()


def test_produce_and_ingest_over_tls_with_the_right_ca(tls_broker, tmp_path, ray_cluster):
    from kafka.admin import ConfigResource, ConfigResourceType

    settings = tls_settings(tls_broker, tmp_path, tls_broker.ca)
    kafka = settings.kafka_connection()
    connections_before = tls_broker.stunnel_log.read_text().count("accepted connection")

    # Corrupt records make the write tasks' DLQ producer publish over TLS too.
    config = ProduceConfig(synthetic=20, seed=3, source_image_size=TEST_IMAGE_SIZE, corrupt_fraction=0.25)
    assert produce(settings, config, kafka).records == 20
    report = ingest(settings, IngestConfig(), kafka)

    assert report.records + report.dlq == 20 and report.dlq >= 1, report
    table = ImageTable.at(settings.storage, settings.catalog, settings.table)
    rows = table.scan(report.snapshot_id, ["kafka_partition", "kafka_offset"]).to_pylist()
    assert len({(row["kafka_partition"], row["kafka_offset"]) for row in rows}) == report.records
    assert sum(e - s for s, e in report.offsets.values()) == 20
    dlq_partitions = partitions_of(kafka, settings.dlq_topic)
    assert sum(probe_end_offsets(kafka, settings.dlq_topic, dlq_partitions).values()) == report.dlq
    ends = {p: end for p, (_, end) in report.offsets.items()}
    assert {p: o for p, o in committed_offsets(settings, IngestConfig().group).items() if p in ends} == ends
    assert measure_lag(settings, kafka).total == 0  # the lag watch's probe and consumer over TLS too

    # The DLQ accepts whatever its source topic accepted: Tansu reports no max.message.bytes for a
    # topic created without one, so the DLQ gets the producer's limit.
    admin = kafka.admin()
    try:
        described = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t) for t in (settings.topic, settings.dlq_topic)],
            config_filter="all",
        )["topic"]
    finally:
        admin.close()
    limit = {t: int(c.get("max.message.bytes", {}).get("value", 0)) for t, c in described.items()}
    assert limit[settings.dlq_topic] >= max(limit[settings.topic], MAX_MESSAGE_BYTES), limit

    # Every client went through stunnel: the broker advertises only the TLS port.
    assert tls_broker.stunnel_log.read_text().count("accepted connection") > connections_before + 3


def test_a_wrong_ca_fails_in_one_line_and_commits_nothing(tls_broker, tmp_path):
    good = tls_settings(tls_broker, tmp_path / "good", tls_broker.ca)
    produce(
        good,
        ProduceConfig(synthetic=20, source_image_size=TEST_IMAGE_SIZE, corrupt_fraction=0.0),
        good.kafka_connection(),
    )
    wrong = tls_settings(tls_broker, tmp_path / "wrong", tls_broker.wrong_ca)

    result = run_cli("ingest", *settings_args(good), "--kafka-config", wrong.kafka_config, timeout=120)

    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "TLS handshake with Kafka failed" in lines[0] and "CERTIFICATE_VERIFY_FAILED" in lines[0], lines
    assert str(tls_broker.wrong_ca) in lines[0]
    assert not (good.local_storage_path / "catalog.db").exists()  # no table, not even an empty one
    assert all(offset < 0 for offset in committed_offsets(good, IngestConfig().group).values())
