"""Producing and ingesting against the real embedded broker and a real local Ray.

Every consumed offset must land exactly once: in the Iceberg table or in the dead-letter topic.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from kafka import KafkaConsumer, TopicPartition
from PIL import Image

from app.config import IngestConfig, ProduceConfig
from app.data import synth
from app.data.ingest import ingest
from app.data.probe import partitions_of
from app.data.produce import produce
from app.data.records import SCHEMA_VERSION, dead_letter_folder, record_headers
from app.data.selection import chw_images
from app.data.table import ImageTable
from app.transform import normalize_pixels, preprocess

from conftest import ROOT, child_env, run_cli, send, settings_args


def consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30) -> list:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=2000,
    )
    partitions = consumer.partitions_for_topic(topic) or set()
    consumer.assign([TopicPartition(topic, p) for p in partitions])
    consumer.seek_to_beginning()
    records = []
    import time

    deadline = time.monotonic() + timeout_s
    while len(records) < expected and time.monotonic() < deadline:
        records.extend(consumer)
    consumer.close()
    return records


def table_of(settings) -> ImageTable:
    return ImageTable.at(settings.storage, settings.catalog, settings.table)


def snapshot_rows(settings, snapshot_id: int | None = None) -> list[dict]:
    """The table's rows as of `snapshot_id` (default: now)."""
    table = table_of(settings)
    return table.scan(snapshot_id or table.current_snapshot_id()).to_pylist()


def coordinates_of(rows) -> list[tuple[int, int]]:
    return [(r["kafka_partition"], r["kafka_offset"]) for r in rows]


def summary(settings, snapshot_id: int) -> dict[str, str]:
    return table_of(settings).load().snapshot_by_id(snapshot_id).summary.additional_properties


def valid_records(n: int, seed: int, size: int = 32) -> list[tuple]:
    return [
        (r.user_id, r.value, r.label, r.event_time_ms)
        for r in synth.generate(n, seed=seed, size=size, late_fraction=0.0, corrupt_fraction=0.0)
    ]


def test_produce_synthetic_follows_the_contract(settings):
    report = produce(
        settings,
        ProduceConfig(synthetic=40, corrupt_fraction=0.0, source_image_size=32),
        settings.kafka_connection(),
    )
    assert report.records == 40 and report.bytes > 0
    records = consume_all(settings.bootstrap_servers, settings.topic, 40)
    assert len(records) == 40
    partition_of_user = {}
    for record in records:
        headers = {k: v.decode() for k, v in record.headers}
        user = record.key.decode()
        assert user.startswith("user-")
        assert partition_of_user.setdefault(user, record.partition) == record.partition  # users keep order
        assert headers["schema"] == SCHEMA_VERSION and headers["label"] in synth.DEFAULT_CLASSES
        assert int(headers["event_time"]) > 1_600_000_000_000 and headers["device_id"].startswith("dev-")
        image = Image.open(io.BytesIO(record.value))
        assert image.format == "PNG" and image.size == (32, 32)


def test_produce_from_dir(settings, tmp_path):
    for label in ("normal", "ransom_note"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (20, 20), (i * 50, 10, 10)).save(tmp_path / "images" / label / f"{i}.png")
    (tmp_path / "images" / "normal" / "notes.txt").write_text("not an image: skipped by extension")
    result = run_cli("produce", "--from-dir", str(tmp_path / "images"), *settings_args(settings))
    assert result.returncode == 0, result.stderr
    assert "produced 4 records" in result.stdout and "records/s" in result.stdout
    labels = Counter(
        dict(r.headers)["label"].decode() for r in consume_all(settings.bootstrap_servers, settings.topic, 4)
    )
    assert labels == {"normal": 2, "ransom_note": 2}


def test_ingest_is_exact_and_resumable(settings, ray_cluster, monkeypatch, caplog):
    import dataclasses

    import app.data.ingest

    monkeypatch.setattr(app.data.ingest, "PROGRESS_INTERVAL_S", 0.2)  # the write takes seconds here
    caplog.set_level(logging.INFO, logger="app.data.ingest")
    settings = dataclasses.replace(settings, classes=synth.DEFAULT_CLASSES)
    valid = valid_records(60, seed=1)
    now = max(r[3] for r in valid)
    late = [("user-late", valid[0][1], "normal", now - 5 * 3600 * 1000)]  # far behind the watermark
    corrupt = [(f"user-bad-{i}", b"\x89PNG not really" + bytes([i]), "normal", now) for i in range(5)]
    unknown = [(f"user-alien-{i}", valid[i][1], "alien_label", now) for i in range(5)]
    oversized = [("user-big", b"\x00" * 5000, "normal", now)]
    coordinates = send(settings, valid + late + corrupt + unknown + oversized)
    good, bad = set(coordinates[:61]), set(coordinates[61:])

    # A group of its own: another test's watch may still be a member of the default one.
    cfg = IngestConfig(max_record_bytes=4096, allowed_lateness_s=3600, group=f"g-{settings.topic}")
    first = ingest(settings, cfg, settings.kafka_connection())
    assert first.snapshot_id and first.records == 61 and first.dlq == 11
    assert any(r.getMessage().endswith("of 72 offsets written as records so far") for r in caplog.records)
    rows = snapshot_rows(settings, first.snapshot_id)
    assert set(coordinates_of(rows)) == good and len(rows) == 61
    committed = summary(settings, first.snapshot_id)
    assert committed["argus.dlq.records"] == "11" and committed["argus.records.late"] == "1"
    ranges = json.loads(committed["argus.kafka.ranges"])
    assert sum(end - start for start, end in ranges.values()) == 72
    assert json.loads(committed["argus.kafka.committed"]) == {p: end for p, (_, end) in ranges.items()}
    assert sum(json.loads(committed["argus.dlq.errors"]).values()) == 11
    assert {r["height"] for r in rows} == {32} and "source" not in rows[0]

    # The table holds uint8 pixels; normalised as the training step does, they are what serving
    # computes from the same bytes, bit for bit.
    by_coordinate = {(r["kafka_partition"], r["kafka_offset"]): r for r in rows}
    for (partition, offset), record in list(zip(coordinates, valid))[:5]:
        row = by_coordinate[(partition, offset)]
        stored = torch.as_tensor(chw_images([row["pixels"]], row["height"], row["width"])[0])
        assert stored.dtype == torch.uint8 and stored.shape == (3, 32, 32)
        assert torch.equal(normalize_pixels(stored[None])[0], preprocess([record[1]], 32)[0])

    dead = consume_all(settings.bootstrap_servers, settings.dlq_topic, 11)
    assert len(dead) == 11
    dead_sources = {
        (int(dict(d.headers)["source_partition"]), int(dict(d.headers)["source_offset"])) for d in dead
    }
    assert dead_sources == bad
    errors = Counter(dict(d.headers)["error"].decode().split(":")[0].split(" ")[0] for d in dead)
    assert errors == {"undecodable": 5, "unknown": 5, "record": 1}

    again = ingest(settings, cfg, settings.kafka_connection())
    assert again.snapshot_id is None and "nothing new" in str(again)
    assert len(table_of(settings).load().snapshots()) == 1

    more = send(settings, valid_records(20, seed=2))
    second = ingest(settings, cfg, settings.kafka_connection())
    assert second.records == 20 and second.dlq == 0
    assert set(coordinates_of(snapshot_rows(settings, second.snapshot_id))) == good | set(more)
    assert set(coordinates_of(snapshot_rows(settings, first.snapshot_id))) == good  # pinned: as it was

    committed = KafkaConsumer(bootstrap_servers=settings.bootstrap_servers, group_id=cfg.group)
    ends = {p: e for p, (_, e) in second.offsets.items()}
    for partition, end in ends.items():
        assert committed.committed(TopicPartition(settings.topic, partition)) == end
    committed.close()


def test_an_ingest_while_its_group_has_a_member_commits_and_mirrors_the_offsets_later(
    settings, ray_cluster, caplog
):
    """Kafka refuses a commit from outside a group that has members (a watch on it, or a killed one
    until its session times out). The table's commit is the commit, so the ingest still succeeds;
    the group's offsets catch up with the next ingest once the group is empty."""
    import time

    caplog.set_level(logging.WARNING, logger="app.data.kafka")
    cfg = IngestConfig(group=f"g-{settings.topic}")
    send(settings, valid_records(6, seed=5))
    member = settings.kafka_connection().consumer(**{"group.id": cfg.group, "session.timeout.ms": 6000})
    member.subscribe([settings.topic])
    deadline = time.monotonic() + 30
    while not member.assignment() and time.monotonic() < deadline:
        member.poll(0.2)
    assert member.assignment(), "the member never joined"
    try:
        first = ingest(settings, cfg, settings.kafka_connection())
    finally:
        member.close()
    assert first.records == 6
    assert any(f"consumer group {cfg.group}'s offsets" in r.getMessage() for r in caplog.records)
    assert sum(table_of(settings).committed().values()) == 6

    send(settings, valid_records(3, seed=6))
    second = ingest(settings, cfg, settings.kafka_connection())
    assert second.records == 3
    committed = KafkaConsumer(bootstrap_servers=settings.bootstrap_servers, group_id=cfg.group)
    for partition, (_, end) in second.offsets.items():
        assert committed.committed(TopicPartition(settings.topic, partition)) == end
    committed.close()


def test_records_without_a_label_or_schema_header_are_kept_as_unlabelled_ubi_v1(settings, ray_cluster):
    """CONTRACT.md §1: `label` is absent on unlabelled traffic, and a record with another or no
    `schema` header is read as ubi.v1 if its value decodes; only one that does not decode is a
    dead letter. A configured class list does not turn an absent label into an unknown one."""
    import dataclasses

    settings = dataclasses.replace(settings, classes=synth.DEFAULT_CLASSES)
    [(key, image, label, event_time)] = valid_records(1, seed=41)
    event = ("event_time", str(event_time).encode())
    sent = {
        "no label": [event, ("schema", SCHEMA_VERSION.encode())],
        "no schema": [event, ("label", label.encode())],
        "neither": [event],
        "another schema": [event, ("schema", b"ubi.v9"), ("label", label.encode())],
    }
    producer = settings.kafka_connection().producer()
    futures = {
        name: producer.send(settings.topic, key=key.encode(), value=image, headers=headers)
        for name, headers in sent.items()
    }
    futures["undecodable"] = producer.send(
        settings.topic, key=key.encode(), value=b"not an image", headers=[event]
    )
    producer.flush()
    producer.close()
    where = {name: (f.get().partition, f.get().offset) for name, f in futures.items()}

    report = ingest(settings, IngestConfig(), settings.kafka_connection())
    assert report.records == 4 and report.dlq == 1
    rows = {(r["kafka_partition"], r["kafka_offset"]): r for r in snapshot_rows(settings, report.snapshot_id)}
    assert set(rows) == {where[name] for name in sent}
    assert {name: rows[where[name]]["label"] for name in sent} == {
        "no label": None,
        "no schema": label,
        "neither": None,
        "another schema": label,
    }
    assert json.loads(summary(settings, report.snapshot_id)["argus.dlq.errors"]) == {"undecodable_image": 1}
    [dead] = consume_all(settings.bootstrap_servers, settings.dlq_topic, 1)
    headers = {k: v.decode() for k, v in dead.headers}
    assert headers["error"].startswith("undecodable")
    assert (int(headers["source_partition"]), int(headers["source_offset"])) == where["undecodable"]


@pytest.mark.parametrize("fault", ["after_write", "before_commit", "after_commit"])
def test_ingest_killed_then_rerun_loses_and_duplicates_nothing(settings, ray_cluster, fault):
    import ray

    coordinates = send(settings, valid_records(30, seed=3))
    args = ["ingest", *settings_args(settings), "--ray-address", ray.get_runtime_context().gcs_address]
    killed = run_cli(*args, env={"ARGUS_FAULT": fault})
    assert killed.returncode == 137, killed.stderr[-2000:]
    ingest(settings, IngestConfig(), settings.kafka_connection())  # the rerun, on the same Ray
    again = ingest(settings, IngestConfig(), settings.kafka_connection())
    assert str(again).startswith("nothing new"), again
    rows = snapshot_rows(settings)
    assert sorted(coordinates_of(rows)) == sorted(coordinates)


def test_ingest_with_use_gpu_puts_the_preprocessing_actors_on_gpus(settings, ray_cluster):
    """The `--use-gpu` pool asks one GPU and no CPU per actor. The tests' Ray has one logical GPU
    and no CUDA, so the same code runs on CPU and the snapshot must still be complete."""
    import ray
    import ray.data

    from app.data.preprocess import Preprocessor, preprocess_batches

    coordinates = send(settings, valid_records(20, seed=4))
    report = ingest(settings, IngestConfig(use_gpu=True), settings.kafka_connection())
    assert report.records == 20
    rows = snapshot_rows(settings, report.snapshot_id)
    assert sorted(coordinates_of(rows)) == sorted(coordinates)

    class ResourceProbe(Preprocessor):  # the pool as ingest sizes it; each batch says what its actor holds
        def __call__(self, batch):
            held = json.dumps(ray.get_runtime_context().get_assigned_resources(), sort_keys=True)
            return {"held": np.array([held] * len(batch["id"]))}

    probe = preprocess_batches(ray.data.range(8), settings, IngestConfig(use_gpu=True), ResourceProbe)
    assert {row["held"] for row in probe.take_all()} == {json.dumps({"GPU": 1.0})}


def test_two_ingests_started_together_commit_every_offset_once(settings, ray_cluster):
    """No lease: both read, the catalog takes one commit, and the loser, refused, plans again from
    the table and finds nothing left (or commits what came after)."""
    import ray

    coordinates = send(settings, valid_records(40, seed=6))
    args = ["ingest", *settings_args(settings), "--ray-address", ray.get_runtime_context().gcs_address]
    racers = [
        subprocess.Popen(
            [sys.executable, "-m", "app", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(PYTHONPATH=str(ROOT)),
            cwd=ROOT,
        )
        for _ in range(2)
    ]
    outputs = [racer.communicate(timeout=300) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], [err[-2000:] for _, err in outputs]
    firsts = sorted(out.strip().split(":")[0].split(" ")[0] for out, _ in outputs)
    assert firsts == ["nothing", "table"], outputs
    rows = snapshot_rows(settings)
    assert sorted(coordinates_of(rows)) == sorted(coordinates)
    assert len(table_of(settings).load().snapshots()) == 1


def test_a_second_table_from_a_time_holds_the_later_offsets_once_at_its_own_size(settings, ray_cluster):
    """`ingest --table OTHER --from TIME` beside the default table: the new table starts each
    partition at its first record at or after TIME (found by reading around the broker's answer,
    which the embedded broker gets wrong), at its own image size, once; its first commit records
    every partition, so later runs resume there and `--from` no longer matters."""
    import dataclasses
    import datetime
    import time

    now_ms = int(time.time() * 1000)
    producer = settings.kafka_connection().producer(linger_ms=50)
    sent = []
    for i, (key, value, label, event_time) in enumerate(valid_records(30, seed=8)):
        kafka_time = now_ms - 2 * 3600 * 1000 if i < 12 else now_ms  # the first 12, two hours ago
        headers = record_headers(label, event_time, "dev-1")
        sent.append(
            producer.send(
                settings.topic, key=key.encode(), value=value, headers=headers, timestamp_ms=kafka_time
            )
        )
    producer.flush()
    producer.close()
    coordinates = [(f.get().partition, f.get().offset) for f in sent]
    old, recent = set(coordinates[:12]), set(coordinates[12:])
    first = ingest(settings, IngestConfig(), settings.kafka_connection())
    assert first.records == 30

    other = dataclasses.replace(settings, table="argus.images_48", image_size=48)
    an_hour_ago = datetime.datetime.fromtimestamp(now_ms / 1000 - 3600, datetime.UTC).isoformat()
    cfg = IngestConfig(start_from=an_hour_ago)
    second = ingest(other, cfg, other.kafka_connection())
    rows = snapshot_rows(other, second.snapshot_id)
    assert sorted(coordinates_of(rows)) == sorted(recent)
    assert {(r["height"], r["width"]) for r in rows} == {(48, 48)}
    committed = summary(other, second.snapshot_id)
    assert committed["argus.kafka.from"] == an_hour_ago
    # Every partition is committed, at its end: those that hold only old records too.
    ends = {p: 0 for p in partitions_of(settings.kafka_connection(), settings.topic)}
    ends.update({p: max(o for q, o in coordinates if q == p) + 1 for p, _ in coordinates})
    assert json.loads(committed["argus.kafka.committed"]) == {str(p): end for p, end in ends.items()}
    assert str(ingest(other, cfg, other.kafka_connection())).startswith("nothing new")

    more = send(settings, valid_records(5, seed=9))
    resumed = ingest(other, IngestConfig(start_from="earliest"), other.kafka_connection())
    assert sorted(coordinates_of(snapshot_rows(other))) == sorted(recent | set(more))
    assert resumed.records == 5
    assert sorted(coordinates_of(snapshot_rows(settings))) == sorted(
        old | recent
    )  # the first table as it was

    earliest = dataclasses.replace(settings, table="argus.images_all")
    ingest(earliest, IngestConfig(start_from="earliest"), earliest.kafka_connection())
    assert sorted(coordinates_of(snapshot_rows(earliest))) == sorted(old | recent | set(more))


def test_transaction_markers_and_aborted_records_are_skipped_offsets_not_a_failure(settings, ray_cluster):
    """A transactional producer leaves offsets no read_committed consumer receives: a marker after
    each transaction (the last one at the end of the log, where the reader meets EOF before the
    end offset) and the records of aborted transactions."""
    from kafka import KafkaProducer

    from app.data.kafka import ensure_topics

    ensure_topics(settings.kafka_connection(), settings.topic, settings.dlq_topic, settings.partitions)
    producer = KafkaProducer(
        bootstrap_servers=settings.bootstrap_servers, transactional_id=f"tx-{settings.topic}"
    )
    producer.init_transactions()
    committed, aborted = valid_records(12, seed=21), valid_records(4, seed=22)
    for batch, commit in ((committed[:6], True), (aborted, False), (committed[6:], True)):
        producer.begin_transaction()
        for key, value, label, event_time in batch:
            producer.send(
                settings.topic,
                key=key.encode(),
                value=value,
                headers=record_headers(label, event_time, "dev-1"),
            )
        producer.commit_transaction() if commit else producer.abort_transaction()
    producer.close()

    report = ingest(settings, IngestConfig(), settings.kafka_connection())
    assert report.records == 12 and report.dlq == 0
    committed_summary = summary(settings, report.snapshot_id)
    ranges = json.loads(committed_summary["argus.kafka.ranges"])
    skipped = int(committed_summary["argus.kafka.skipped"])
    assert skipped > 0 and 12 + skipped == sum(end - start for start, end in ranges.values())
    rows = snapshot_rows(settings, report.snapshot_id)
    assert sorted(r["user_id"] for r in rows) == sorted(key for key, *_ in committed)
    assert ingest(settings, IngestConfig(), settings.kafka_connection()).snapshot_id is None


def test_a_dead_letter_too_large_for_the_dlq_topic_goes_to_storage_with_a_pointer(settings, ray_cluster):
    import hashlib

    big = bytes(range(256)) * 24  # 6144 bytes, not an image
    [(_, image, _, _)] = valid_records(1, seed=32)
    # A 600 KB label once went into the dead letter twice (header and `error`): over any DLQ limit.
    long_label = ("user-label", image, "x" * 600_000, 1_700_000_000_000)
    coordinates = send(
        settings,
        valid_records(5, seed=31) + [("user-big", big, "normal", 1_700_000_000_000), long_label],
    )
    report = ingest(settings, IngestConfig(dlq_max_bytes=4000), settings.kafka_connection())
    assert report.records == 5 and report.dlq == 2
    dead = {
        (int(h["source_partition"]), int(h["source_offset"])): (record, h)
        for record in consume_all(settings.bootstrap_servers, settings.dlq_topic, 2)
        for h in [{k: v.decode() for k, v in record.headers}]
    }
    pointer, headers = dead[coordinates[-2]]
    assert pointer.value == b"" and headers["error"].startswith("undecodable")
    assert headers["error_reason"] == "undecodable_image"
    stored = (
        settings.local_storage_path
        / "dlq"
        / settings.topic
        / dead_letter_folder("user-big")  # erase --user finds a user's payloads there
        / f"{coordinates[-2][0]}-{coordinates[-2][1]}.bin"
    )
    assert headers["payload_uri"] == str(stored) and stored.read_bytes() == big
    assert (
        headers["payload_size"] == str(len(big))
        and headers["payload_sha256"] == hashlib.sha256(big).hexdigest()
    )
    labelled, headers = dead[coordinates[-1]]
    assert headers["error_reason"] == "header_too_long" and "label" not in headers
    assert headers["error"].startswith("header label of 600000 bytes is over its 128 byte limit: b'xxx")
    assert labelled.value == image  # small enough for the topic without its label
    assert len(labelled.value) + sum(len(k) + len(v) for k, v in labelled.headers) < 4000
