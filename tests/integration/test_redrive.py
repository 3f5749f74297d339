"""`argus redrive` against the real embedded broker and a real local Ray: dead letters whose failure
no longer applies go into the table exactly once, whatever the DLQ holds twice or out of place."""

from __future__ import annotations

import dataclasses
import io
import json
import time

import ray
import torch
from kafka import KafkaConsumer, TopicPartition
from PIL import Image

from app.config import IngestConfig
from app.data import synth
from app.data.ingest import ingest
from app.data.records import dead_letter_folder
from app.data.redrive import redrive
from app.data.selection import chw_images
from app.data.table import ImageTable
from app.transform import normalize_pixels, preprocess

from conftest import ERASED_LETTER_HEADERS, MetricsWatcher, run_cli, send, settings_args


def table_of(settings) -> ImageTable:
    return ImageTable.at(settings.storage, settings.catalog, settings.table)


def coordinates_of(rows: list[dict]) -> list[tuple[int, int]]:
    return [(r["kafka_partition"], r["kafka_offset"]) for r in rows]


def labelled(n: int, seed: int, labels: list[str]) -> list[tuple]:
    """`n` valid 32 px records, their labels taken from `labels` in turn."""
    generated = synth.generate(n, seed=seed, size=32, late_fraction=0.0, corrupt_fraction=0.0)
    return [(r.user_id, r.value, labels[i % len(labels)], r.event_time_ms) for i, r in enumerate(generated)]


def consume(settings, topic: str, expected: int, timeout_s: float = 30) -> list:
    consumer = KafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, consumer_timeout_ms=2000
    )
    consumer.assign([TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)])
    consumer.seek_to_beginning()
    records: list = []
    deadline = time.monotonic() + timeout_s
    while len(records) < expected and time.monotonic() < deadline:
        records.extend(consumer)
    consumer.close()
    return records


def publish_dead_letter(settings, record, **changed: str) -> None:
    """Publish a copy of DLQ `record`, with the headers in `changed` replaced."""
    headers = [(k, changed[k].encode() if k in changed else v) for k, v in record.headers]
    producer = settings.kafka_connection().producer()
    producer.send(settings.dlq_topic, key=record.key, value=record.value, headers=headers).get(timeout=30)
    producer.close()


def source_of(record) -> tuple[int, int]:
    headers = dict(record.headers)
    return int(headers["source_partition"]), int(headers["source_offset"])


def test_redrive_after_adding_a_class_ingests_exactly_the_newly_valid_records_once(settings, ray_cluster):
    ab = dataclasses.replace(settings, classes=("a", "b"))
    abc = dataclasses.replace(settings, classes=("a", "b", "c"))
    records = labelled(24, seed=61, labels=["a", "b", "c"])
    now = max(r[3] for r in records)
    undecodable = [(f"user-bad-{i}", b"\x89PNG not really" + bytes([i]), "c", now) for i in range(2)]
    coordinates = send(settings, records + undecodable)
    accepted = {xy for xy, r in zip(coordinates, records) if r[2] != "c"}
    newly_valid = {xy for xy, r in zip(coordinates, records) if r[2] == "c"}
    bad = set(coordinates[len(records) :])
    cfg = IngestConfig(group=f"g-{settings.topic}")

    first = ingest(ab, cfg, settings.kafka_connection())
    assert first.records == 16 and first.dlq == 10
    table = table_of(settings)
    committed, watermarks = table.committed(), table.watermarks()

    # What a crashed ingest's rerun leaves: a dead letter published twice. And two that must stay
    # out: one of another topic, one beyond the committed offset (an ingest not committed yet owns it).
    letters = consume(settings, settings.dlq_topic, 10)
    assert {source_of(d) for d in letters} == newly_valid | bad
    c_letter = next(d for d in letters if source_of(d) in newly_valid)
    publish_dead_letter(settings, c_letter)
    publish_dead_letter(settings, c_letter, source_topic="another-topic")
    p, _ = source_of(c_letter)
    publish_dead_letter(settings, c_letter, source_offset=str(committed[p] + 3))

    exported = ("ray_argus_records_redriven_total", "ray_argus_redrive_stayed_dead_total")
    with MetricsWatcher(ray_cluster, *exported, match=f'topic="{settings.topic}"') as watched:
        report = redrive(abc, cfg, settings.kafka_connection())
    assert (report.read, report.redriven, report.duplicates) == (13, 8, 1), report
    assert watched.seen[exported[0]][-1].endswith(" 8.0"), watched.seen
    assert 'reason="undecodable_image"' in watched.seen[exported[1]][-1], watched.seen
    assert watched.seen[exported[1]][-1].endswith(" 2.0"), watched.seen
    assert (report.pending, report.other_topics, report.in_table) == (1, 1, 0), report
    assert dict(report.stayed_dead) == {"undecodable_image": 2}, report
    rows = table.scan(report.snapshot_id).to_pylist()
    assert sorted(coordinates_of(rows)) == sorted(accepted | newly_valid)  # each once
    assert {(r["kafka_partition"], r["kafka_offset"]) for r in rows if r["label"] == "c"} == newly_valid
    summary = table.load().snapshot_by_id(report.snapshot_id).summary.additional_properties
    assert (
        summary["argus.redrive.records"] == "8" and summary["argus.redrive.dlq_topic"] == settings.dlq_topic
    )
    assert json.loads(summary["argus.redrive.stayed_dead"]) == {"undecodable_image": 2}
    assert "argus.kafka.ranges" not in summary
    assert table.committed() == committed and table.watermarks() == watermarks

    # A redriven row is what ingest would have made of the record: the same pixels, bit for bit,
    # and the record's own Kafka timestamp.
    by_coordinate = {(r["kafka_partition"], r["kafka_offset"]): r for r in rows}
    xy, record = next((xy, r) for xy, r in zip(coordinates, records) if r[2] == "c")
    row = by_coordinate[xy]
    stored = torch.as_tensor(chw_images([row["pixels"]], row["height"], row["width"])[0])
    assert torch.equal(normalize_pixels(stored[None])[0], preprocess([record[1]], 32)[0])
    assert (row["user_id"], row["event_time_ms"], row["device_id"]) == (record[0], record[3], "dev-1")
    sent = {(r.partition, r.offset): r for r in consume(settings, settings.topic, len(coordinates))}
    assert row["kafka_timestamp_ms"] == sent[xy].timestamp

    # Again, as a user runs it: nothing new, nothing committed.
    snapshots = len(table.load().snapshots())
    args = ["redrive", *settings_args(settings), "--classes", "a,b,c"]
    again = run_cli(*args, "--ray-address", ray.get_runtime_context().gcs_address)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "redriven 0 of 13 dead letters" in again.stdout and "(nothing committed)" in again.stdout
    assert "already in the table 8; duplicates 1" in again.stdout, again.stdout
    assert len(table.load().snapshots()) == snapshots

    # The table's offsets were left where they were: the next ingest goes on from them.
    more = send(settings, labelled(3, seed=62, labels=["a"]))
    following = ingest(ab, cfg, settings.kafka_connection())
    assert following.records == 3 and following.dlq == 0
    rows = table.scan(following.snapshot_id).to_pylist()
    assert sorted(coordinates_of(rows)) == sorted(accepted | newly_valid | set(more))


def uncompressed_png(colour: tuple[int, int, int]) -> bytes:
    """A 32 px PNG whose size does not depend on its pixels: a tampered copy can keep the size."""
    out = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(out, format="PNG", compress_level=0)
    return out.getvalue()


def test_a_dead_letter_stored_as_a_payload_is_redriven_and_a_tampered_one_stays_dead(settings, ray_cluster):
    ab = dataclasses.replace(settings, classes=("a", "b"))
    now = 1_767_225_600_000
    records = [(f"user-{i}", uncompressed_png((40 * i, 0, 0)), "ac"[i % 2], now + i) for i in range(4)]
    coordinates = send(settings, records)
    report = ingest(ab, IngestConfig(dlq_max_bytes=600), settings.kafka_connection())
    assert report.records == 2 and report.dlq == 2
    letters = consume(settings, settings.dlq_topic, 2)
    assert all(d.value == b"" and "payload_uri" in dict(d.headers) for d in letters)

    kept, tampered = (source_of(d) for d in letters)
    user = dict(zip(coordinates, records))[tampered][0]
    stored = settings.local_storage_path / "dlq" / settings.topic / dead_letter_folder(user)
    payload = stored / f"{tampered[0]}-{tampered[1]}.bin"
    other = uncompressed_png((0, 200, 0))  # a valid image of the same size: only the digest tells
    assert len(other) == payload.stat().st_size and other != payload.read_bytes()
    payload.write_bytes(other)

    abc = dataclasses.replace(settings, classes=("a", "b", "c"))
    redriven = redrive(abc, IngestConfig(), settings.kafka_connection())
    assert (redriven.read, redriven.redriven) == (2, 1), redriven
    assert dict(redriven.stayed_dead) == {"bad_payload": 1}, redriven
    rows = table_of(settings).scan(redriven.snapshot_id).to_pylist()
    assert sorted(coordinates_of(rows)) == sorted(
        {xy for xy, r in zip(coordinates, records) if r[2] == "a"} | {kept}
    )


def test_a_redrive_killed_at_each_step_of_its_commit_and_rerun_adds_each_record_once(settings, ray_cluster):
    records = labelled(9, seed=63, labels=["a", "b", "c"])
    coordinates = send(settings, records)
    newly_valid = {xy for xy, r in zip(coordinates, records) if r[2] == "c"}
    ab = dataclasses.replace(settings, classes=("a", "b"))
    first = ingest(ab, IngestConfig(), settings.kafka_connection())
    assert (first.records, first.dlq) == (6, 3)
    table = table_of(settings)
    args = ["redrive", *settings_args(settings), "--classes", "a,b,c"]
    args += ["--ray-address", ray.get_runtime_context().gcs_address]

    for point in ("after_write", "before_commit"):
        snapshots = len(table.load().snapshots())
        killed = run_cli(*args, env={"ARGUS_FAULT": point})
        assert killed.returncode == 137, (point, killed.stderr[-2000:])
        assert len(table.load().snapshots()) == snapshots, point  # nothing committed
    killed = run_cli(*args, env={"ARGUS_FAULT": "after_commit"})
    assert killed.returncode == 137, killed.stderr[-2000:]
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "redriven 0 of 3 dead letters" in rerun.stdout and "already in the table 3" in rerun.stdout
    rows = table.scan(table.current_snapshot_id()).to_pylist()
    assert sorted(coordinates_of(rows)) == sorted(coordinates)  # the 6 ingested and the 3 redriven, once
    assert {xy for xy, r in zip(coordinates_of(rows), rows) if r["label"] == "c"} == newly_valid


def test_an_erased_users_records_in_kafka_stay_out_of_ingest_redrive_and_a_replay_but_later_ones_go_in(
    settings, ray_cluster
):
    ab = dataclasses.replace(settings, classes=("a", "b"))
    image, now = labelled(1, seed=64, labels=["a"])[0][1], 1_767_225_600_000
    before = send(
        settings, [("alice", image, "a", now), ("bob", image, "a", now), ("alice", image, "c", now)]
    )
    assert ingest(ab, IngestConfig(), settings.kafka_connection()).records == 2
    pending = send(settings, [("alice", image, "a", now), ("bob", image, "b", now)])  # sent, not ingested

    erased = run_cli("erase", *settings_args(settings), "--user", "alice")
    assert erased.returncode == 0, erased.stderr[-2000:]
    assert "1 rows of user 'alice' deleted" in erased.stdout and "below the topic's ends" in erased.stdout
    after = send(settings, [("alice", image, "b", now)])  # alice's new data, after the erasure

    table = table_of(settings)
    second = ingest(ab, IngestConfig(), settings.kafka_connection())
    assert (second.records, second.dlq) == (2, 1)
    rows = table.scan(second.snapshot_id).to_pylist()
    assert sorted((r["user_id"], (r["kafka_partition"], r["kafka_offset"])) for r in rows) == sorted(
        [("bob", before[1]), ("bob", pending[1]), ("alice", after[0])]
    )
    # The dead letter of alice's pending record holds nothing of her: no key, value, label or device.
    letters = consume(settings, settings.dlq_topic, 2)
    erased_letter = next(d for d in letters if source_of(d) == pending[0])
    assert (erased_letter.key, erased_letter.value) == (b"", b"")
    assert tuple(k for k, _ in erased_letter.headers) == ERASED_LETTER_HEADERS

    abc = dataclasses.replace(settings, classes=("a", "b", "c"))
    redriven = redrive(abc, IngestConfig(), settings.kafka_connection())
    assert redriven.redriven == 0 and dict(redriven.stayed_dead) == {"erased": 2}, redriven

    # A second table replayed from the topic's start holds no record of alice's from before.
    replay = dataclasses.replace(ab, table="argus.replayed")
    replayed = ingest(replay, IngestConfig(start_from="earliest"), settings.kafka_connection())
    assert (replayed.records, replayed.dlq) == (3, 3)
    rows = table_of(replay).scan(replayed.snapshot_id).to_pylist()
    assert sorted(r["user_id"] for r in rows) == ["alice", "bob", "bob"]
    assert [(r["kafka_partition"], r["kafka_offset"]) for r in rows if r["user_id"] == "alice"] == after
