"""Producing and ingesting against the real embedded broker and a real local Ray.

Every consumed offset must land exactly once: in a snapshot or in the dead-letter topic.
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
from app.data.produce import produce
from app.data.records import SCHEMA_VERSION, record_headers
from app.data.snapshot import MANIFEST, SnapshotStore
from app.transform import normalize_pixels, preprocess

from conftest import ROOT, child_env, run_cli, settings_args


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


def snapshots_of(settings) -> SnapshotStore:
    return SnapshotStore.at(settings.uri())


def list_manifests(settings) -> list:
    return snapshots_of(settings).manifests()


def snapshot_rows(settings, snapshot_id: str) -> list[dict]:
    import ray.data

    uri = snapshots_of(settings).uri(snapshot_id)
    return ray.data.read_parquet(uri, file_extensions=["parquet"]).take_all()


def send(settings, records) -> list[tuple[int, int]]:
    """Publish (key, value, label, event_time) through a batching producer; return (partition, offset)s."""
    producer = settings.kafka_connection().producer(linger_ms=50)
    futures = [
        producer.send(
            settings.topic, key=key.encode(), value=value, headers=record_headers(label, event_time, "dev-1")
        )
        for key, value, label, event_time in records
    ]
    producer.flush()
    producer.close()
    return [(f.get().partition, f.get().offset) for f in futures]


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
    assert {(r["partition"], r["offset"]) for r in rows} == good and len(rows) == 61
    manifest = json.loads(open(f"{snapshots_of(settings).uri(first.snapshot_id)}/{MANIFEST}").read())
    assert manifest["records"] == 61 and manifest["dlq"] == 11
    assert manifest["classes"] == list(synth.DEFAULT_CLASSES)
    assert manifest["normalization"]["mean"] == [0.485, 0.456, 0.406] and manifest["image_size"] == 32
    assert manifest["pixels"] == "uint8" and manifest["source"] is False
    assert sum(o["end"] - o["start"] for o in manifest["offsets"].values()) == 72
    assert manifest["event_time"]["late_records"] == 1
    assert [r["key"] for r in rows if r["late"]] == ["user-late"]

    # Snapshots hold uint8 pixels; normalised as the training step does, they are what serving
    # computes from the same bytes, bit for bit.
    by_coordinate = {(r["partition"], r["offset"]): r for r in rows}
    for (partition, offset), record in list(zip(coordinates, valid))[:5]:
        stored = torch.as_tensor(np.array(by_coordinate[(partition, offset)]["image"]))
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
    assert len(list_manifests(settings)) == 1

    more = send(settings, valid_records(20, seed=2))
    second = ingest(settings, cfg, settings.kafka_connection())
    assert second.records == 20 and second.dlq == 0
    assert {(r["partition"], r["offset"]) for r in snapshot_rows(settings, second.snapshot_id)} == set(more)

    committed = KafkaConsumer(bootstrap_servers=settings.bootstrap_servers, group_id=cfg.group)
    ends = {p: e for p, (_, e) in second.offsets.items()}
    for partition, end in ends.items():
        assert committed.committed(TopicPartition(settings.topic, partition)) == end
    committed.close()


def test_an_ingest_while_its_group_has_a_member_commits_and_mirrors_the_offsets_later(
    settings, ray_cluster, caplog
):
    """Kafka refuses a commit from outside a group that has members (a watch on it, or a killed one
    until its session times out). The snapshot and the ledger are the commit, so the ingest still
    succeeds; the group's offsets catch up with the next ingest once the group is empty."""
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
    ledger = json.loads(open(f"{settings.storage}/offsets/{cfg.group}.json").read())
    assert sum(ledger["offsets"].values()) == 6

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
    rows = {(r["partition"], r["offset"]): r for r in snapshot_rows(settings, report.snapshot_id)}
    assert set(rows) == {where[name] for name in sent}
    assert {name: rows[where[name]]["label"] for name in sent} == {
        "no label": None,
        "no schema": label,
        "neither": None,
        "another schema": label,
    }
    manifest = list_manifests(settings)[0]
    assert manifest.label_counts == {label: 2} and manifest.dlq_errors == {"undecodable_image": 1}
    [dead] = consume_all(settings.bootstrap_servers, settings.dlq_topic, 1)
    headers = {k: v.decode() for k, v in dead.headers}
    assert headers["error"].startswith("undecodable")
    assert (int(headers["source_partition"]), int(headers["source_offset"])) == where["undecodable"]


@pytest.mark.parametrize("fault", ["after_write", "before_manifest", "before_commit"])
def test_ingest_killed_then_rerun_loses_and_duplicates_nothing(settings, ray_cluster, fault):
    import ray

    coordinates = send(settings, valid_records(30, seed=3))
    args = ["ingest", *settings_args(settings), "--ray-address", ray.get_runtime_context().gcs_address]
    killed = run_cli(*args, env={"ARGUS_FAULT": fault})
    assert killed.returncode == 137, killed.stderr[-2000:]
    ingest(settings, IngestConfig(), settings.kafka_connection())  # the rerun, on the same Ray
    again = ingest(settings, IngestConfig(), settings.kafka_connection())
    assert str(again).startswith("nothing new"), again
    manifests = list_manifests(settings)
    rows = [row for m in manifests for row in snapshot_rows(settings, m.snapshot_id)]
    assert len(rows) == 30 and {(r["partition"], r["offset"]) for r in rows} == set(coordinates)


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
    assert {(r["partition"], r["offset"]) for r in rows} == set(coordinates)

    class ResourceProbe(Preprocessor):  # the pool as ingest sizes it; each batch says what its actor holds
        def __call__(self, batch):
            held = json.dumps(ray.get_runtime_context().get_assigned_resources(), sort_keys=True)
            return {"held": np.array([held] * len(batch["id"]))}

    probe = preprocess_batches(ray.data.range(8), settings, IngestConfig(use_gpu=True), ResourceProbe)
    assert {row["held"] for row in probe.take_all()} == {json.dumps({"GPU": 1.0})}


def test_one_writer_at_a_time_the_other_says_so_and_writes_nothing(settings, ray_cluster):
    import ray

    from app.data.ingest import ingest_lease

    coordinates = send(settings, valid_records(40, seed=6))
    args = ["ingest", *settings_args(settings), "--ray-address", ray.get_runtime_context().gcs_address]
    with ingest_lease(snapshots_of(settings).store, settings.topic).held():  # a writer that is mid-way
        held = run_cli(*args)
    assert held.returncode == 0, held.stderr[-2000:]
    assert held.stdout.strip().startswith("another ingest is writing") and len(held.stdout.splitlines()) == 1
    assert not list_manifests(settings)
    assert not list((settings.local_storage_path / "snapshots").glob("**/*.parquet"))

    # Two started together: whichever loses writes nothing, and every offset lands exactly once.
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
    assert firsts in (["another", "snapshot"], ["nothing", "snapshot"]), outputs
    rows = [row for m in list_manifests(settings) for row in snapshot_rows(settings, m.snapshot_id)]
    assert sorted((r["partition"], r["offset"]) for r in rows) == sorted(coordinates)


def test_a_snapshot_committed_meanwhile_over_the_same_offsets_aborts_the_commit(settings, ray_cluster):
    from app.data.plan import check_no_overlap

    send(settings, valid_records(10, seed=8))
    first = ingest(settings, IngestConfig(), settings.kafka_connection())
    snapshots, after = snapshots_of(settings), {p: (end, end + 5) for p, (_, end) in first.offsets.items()}
    check_no_overlap(snapshots, settings.topic, after)  # after it: fine
    partition, (start, end) = next(iter(first.offsets.items()))
    with pytest.raises(RuntimeError, match=f"snapshot {first.snapshot_id} was committed meanwhile"):
        check_no_overlap(snapshots, settings.topic, {partition: (end - 1, end + 3)})


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
    manifest = list_manifests(settings)[0]
    skipped = sum(r.skipped for r in manifest.offsets.values())
    assert skipped > 0 and all(
        r.records + r.dlq + r.skipped == r.end - r.start for r in manifest.offsets.values()
    )
    rows = snapshot_rows(settings, report.snapshot_id)
    assert sorted(r["key"] for r in rows) == sorted(key for key, *_ in committed)
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


def test_migrate_moves_real_snapshots_into_the_table_each_offset_once(settings, ray_cluster):
    """Two real ingests (dead letters included) in the old layout, `argus migrate`, then the table
    read through PyIceberg alone: every snapshot row once with its pixels, the offsets continued."""
    from pyiceberg.catalog.sql import SqlCatalog

    from app.__main__ import main

    cfg = IngestConfig()
    produce(settings, ProduceConfig(synthetic=40, seed=3, corrupt_fraction=0.1), settings.kafka_connection())
    first = ingest(settings, cfg, settings.kafka_connection())
    send(settings, valid_records(10, seed=4))
    second = ingest(settings, cfg, settings.kafka_connection())
    assert first.dlq > 0 and second.records == 10
    rows = snapshot_rows(settings, first.snapshot_id) + snapshot_rows(settings, second.snapshot_id)

    assert main(["migrate", *settings_args(settings)]) == 0
    catalog = SqlCatalog(
        "argus",
        uri=f"sqlite:///{settings.local_storage_path / 'catalog.db'}",
        warehouse=f"file://{settings.local_storage_path / 'warehouse'}",
    )
    table = catalog.load_table("argus.behavior_images")
    migrated = {(r["kafka_partition"], r["kafka_offset"]): r for r in table.scan().to_arrow().to_pylist()}
    assert len(migrated) == len(rows) == first.records + second.records
    for row in rows:
        copy = migrated[(row["partition"], row["offset"])]
        assert copy["pixels"] == np.array(row["image"]).transpose(1, 2, 0).tobytes()
        assert (copy["user_id"], copy["label"], copy["event_time_ms"]) == (
            row["key"],
            row["label"],
            row["event_time"],
        )
    summaries = [s.summary.additional_properties for s in table.snapshots()]
    assert [int(s["argus.dlq.records"]) for s in summaries] == [first.dlq, second.dlq]
    ends = {str(p): end for p, (_, end) in {**first.offsets, **second.offsets}.items()}
    assert json.loads(summaries[-1]["argus.kafka.committed"]) == ends
