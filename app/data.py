"""Collect and preprocess: publish behaviour images to Kafka, and turn a topic into snapshots.

    python -m app produce --synthetic 2000      # CONTRACT.md §1 records, batched like a gateway
    python -m app ingest                        # Kafka → Ray Data → <storage>/snapshots/<id>/

Ingest reads every partition from where the last durable snapshot ended to its true end (the
embedded broker under-reports high watermarks, so the end is probed, never trusted), preprocesses
in an actor pool with the one transform training and serving share, writes Parquet plus a
manifest under a temporary name, renames it into place, and only then commits the offsets. The
manifests are the offset ledger, so a run killed anywhere and rerun yields each record once.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image

from app import metrics
from app.config import IMAGENET_MEAN, IMAGENET_STD, IngestConfig, ProduceConfig, Settings

if TYPE_CHECKING:
    import ray.data
    import torch

log = logging.getLogger(__name__)

MAX_BLOCK_BYTES = 16 * 1024 * 1024
"""Ingest's Ray Data block size: a read task passes its records on every `records_per_block` or this
many bytes, and transforms split larger outputs."""
SCHEMA_VERSION = "ubi.v1"
MANIFEST = "_manifest.json"
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp"}
MAX_IMAGE_PIXELS = 40_000_000
"""Decompression-bomb guard: larger declared images are rejected before decoding."""
FAULT_ENV = "ARGUS_FAULT"
"""Fault injection for tests: `after_write` or `before_commit` kills ingest at that point."""


# ---------------------------------------------------------------- the shared transform


class BadImage(ValueError):
    """The bytes are not a decodable image (or are a decompression bomb)."""


def decode_image(value: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode JPEG/PNG/WebP bytes to RGB, checking the declared size before decoding pixels."""
    if not value:
        raise BadImage("empty image")
    try:
        image = Image.open(io.BytesIO(value))
        width, height = image.size
        if width * height > max_pixels:
            raise BadImage(f"image of {width}x{height} pixels exceeds the {max_pixels} pixel limit")
        image.load()
        return image.convert("RGB")
    except BadImage:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImage(f"undecodable image: {exc}") from exc


def normalize(images: Sequence[np.ndarray], size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """uint8 HWC pixels → float32 [N, 3, size, size]: resize (bilinear, antialiased), ImageNet-normalise.

    Resizes while the pixels are still uint8 (torch's vectorised integer path, several times faster
    than resizing float copies) and normalises the whole batch in one op. Runs where the tensors
    are sent, so GPU actors do the resize and normalisation on the GPU.
    """
    import torch

    resized = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=device)
    for i, image in enumerate(images):
        resized[i] = resize_uint8(torch.from_numpy(image).to(device, non_blocking=True).permute(2, 0, 1), size)
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255
    return resized.float().sub_(mean).div_(std)


def resize_uint8(image: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 [3, H, W] → uint8 [3, size, size], bilinear with antialiasing: what torchvision's
    `resize` computes, with torch alone (importing torchvision costs each worker ~3 s). On CPU torch
    resizes uint8 natively (vectorised); elsewhere it resizes a float copy and rounds back."""
    import torch
    import torch.nn.functional as F

    if image.shape[-2:] == (size, size):
        return image
    batch = image.unsqueeze(0)
    if image.device.type == "cpu":
        return F.interpolate(batch, size=[size, size], mode="bilinear", align_corners=False, antialias=True)[0]
    resized = F.interpolate(batch.float(), size=[size, size], mode="bilinear", align_corners=False, antialias=True)
    return resized.round_().to(torch.uint8)[0]


def preprocess(values: Sequence[bytes], size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The one transform: encoded image bytes → normalised [N, 3, size, size] (raises BadImage)."""
    return normalize([decode_pixels(v) for v in values], size, device)


def decode_pixels(value: bytes) -> np.ndarray:
    """Encoded bytes → uint8 HWC pixels: the decode half of the transform (raises BadImage).

    numpy, not torch, so decoding never waits for torch's import (see `Preprocessor`). np.array
    makes the one writable copy torch.from_numpy needs; asarray(...).copy() is 4x slower."""
    return np.array(decode_image(value))


def image_statistics(tensor: torch.Tensor) -> dict[str, float]:
    """Per-channel mean and standard deviation of one transformed image [3, H, W]: the features
    drift detection compares between training snapshots and served traffic."""
    means, stds = tensor.mean((1, 2)).tolist(), tensor.std((1, 2)).tolist()
    return {**{f"mean_{c}": m for c, m in zip("rgb", means)}, **{f"std_{c}": s for c, s in zip("rgb", stds)}}


def encode_labels(labels: Iterable[str], classes: Sequence[str]) -> np.ndarray:
    """Label names → class indices in `classes`; an unknown label raises KeyError."""
    index = {name: i for i, name in enumerate(classes)}
    return np.array([index[label] for label in labels], dtype=np.int64)


# ---------------------------------------------------------------- producing


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
    return KafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", linger_ms=linger_ms,
                         batch_size=batch_bytes, max_request_size=64 * 1024 * 1024,
                         retries=5, client_id="argus-producer")


def record_headers(label: str | None, event_time_ms: int, device_id: str | None) -> list[tuple[str, bytes]]:
    headers = [("schema", SCHEMA_VERSION.encode()), ("event_time", str(int(event_time_ms)).encode())]
    if label is not None:
        headers.append(("label", label.encode()))
    if device_id is not None:
        headers.append(("device_id", device_id.encode()))
    return headers


@dataclass
class ProduceReport:
    records: int
    bytes: int
    seconds: float

    def __str__(self) -> str:
        rate = self.records / max(self.seconds, 1e-9)
        mbps = self.bytes / max(self.seconds, 1e-9) / 1e6
        return f"produced {self.records} records ({self.bytes / 1e6:.1f} MB) in {self.seconds:.1f}s: " \
               f"{rate:.0f} records/s, {mbps:.2f} MB/s"


def produce(settings: Settings, cfg: ProduceConfig, bootstrap_servers: str) -> ProduceReport:
    """`python -m app produce`: publish synthetic or directory images as CONTRACT.md §1 records."""
    ensure_topics(bootstrap_servers, [settings.topic, settings.dlq_topic], settings.partitions)
    records = _synthetic_records(settings, cfg) if cfg.synthetic else _directory_records(cfg.from_dir)
    producer = make_producer(bootstrap_servers, cfg.linger_ms, cfg.batch_bytes)
    count = size = 0
    start = time.perf_counter()
    failures: list[BaseException] = []
    try:
        for key, value, headers in records:
            future = producer.send(settings.topic, key=key.encode(), value=value, headers=headers)
            future.add_errback(failures.append)
            count += 1
            size += len(value)
        producer.flush()
    finally:
        producer.close()
    if failures:
        raise RuntimeError(f"{len(failures)} of {count} records were not acknowledged: {failures[0]}")
    return ProduceReport(count, size, time.perf_counter() - start)


def _synthetic_records(settings: Settings, cfg: ProduceConfig) -> Iterator[tuple[str, bytes, list]]:
    from app import synth

    classes = settings.classes or synth.DEFAULT_CLASSES
    for record in synth.generate(cfg.synthetic, seed=cfg.seed, classes=classes, users=cfg.users,
                                 size=cfg.source_image_size, late_fraction=cfg.late_fraction,
                                 corrupt_fraction=cfg.corrupt_fraction):
        yield record.user_id, record.value, record_headers(record.label, record.event_time_ms, record.device_id)


def _directory_records(root: str) -> Iterator[tuple[str, bytes, list]]:
    """DIR/<label>/<file>: the directory's name is the user id, the file's mtime the event time."""
    files = sorted(p for p in Path(root).glob("*/*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise ValueError(f"no images found under {root}/<label>/ (extensions {sorted(IMAGE_EXTENSIONS)})")
    user_id = Path(root).resolve().name
    for path in files:
        yield user_id, path.read_bytes(), record_headers(path.parent.name, int(path.stat().st_mtime * 1000), None)


# ---------------------------------------------------------------- reading Kafka with Ray Data

RAW_SCHEMA = pa.schema([
    ("partition", pa.int32()), ("offset", pa.int64()), ("kafka_timestamp", pa.int64()),
    ("key", pa.string()), ("value", pa.binary()), ("label", pa.string()),
    ("event_time", pa.int64()), ("device_id", pa.string()), ("schema", pa.string()),
    ("header_error", pa.string()), ("late", pa.bool_()),
])


def _consumer(bootstrap_servers: str, **extra):
    from confluent_kafka import Consumer

    config = {"bootstrap.servers": bootstrap_servers, "group.id": f"argus-reader-{uuid.uuid4().hex[:8]}",
              "enable.auto.commit": False, "enable.partition.eof": True,
              "fetch.max.bytes": 64 * 1024 * 1024, "message.max.bytes": 64 * 1024 * 1024,
              # One consumer reads one partition: librdkafka's 1 MiB per-partition fetch would
              # make every round trip carry ~100 images.
              "max.partition.fetch.bytes": 16 * 1024 * 1024,
              # Bounded reads end at a known offset: waiting up to 500 ms (the default) at the log's
              # end for more data only delays the EOF that proves the end.
              "fetch.wait.max.ms": 10,
              "session.timeout.ms": 6000}
    config.update(extra)
    return Consumer(config)


def partitions_of(bootstrap_servers: str, topic: str) -> list[int]:
    consumer = _consumer(bootstrap_servers)
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        topic_metadata = metadata.topics.get(topic)
        if topic_metadata is None or topic_metadata.error is not None:
            raise RuntimeError(f"topic {topic!r} not found on {bootstrap_servers}")
        return sorted(topic_metadata.partitions)
    finally:
        consumer.close()


def probe_end_offsets(bootstrap_servers: str, topic: str, partitions: Iterable[int],
                      timeout_s: float = 60.0) -> dict[int, int]:
    """The true end (last offset + 1) of each partition, proven by reading past the reported one.

    A broker may report the first offset of its last batch + 1 as the high watermark. Reading from
    reported - 1 until the partition signals EOF returns that whole last batch, so the last offset
    seen is the real end, and the EOF right after it is the proof that nothing follows.
    """
    from confluent_kafka import KafkaError, TopicPartition

    consumer = _consumer(bootstrap_servers)
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
                raise RuntimeError(f"probing end offsets of {topic} timed out for partitions {sorted(pending)}")
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


def _header_fields(headers) -> dict:
    values = {k: v for k, v in (headers or [])}

    def text(name):
        raw = values.get(name)
        return raw.decode("utf-8", "replace") if raw is not None else None

    fields = {"label": text("label"), "device_id": text("device_id"), "schema": text("schema"),
              "event_time": None, "header_error": None}
    raw_time = text("event_time")
    if raw_time is not None:
        try:
            fields["event_time"] = int(raw_time)
        except ValueError:
            fields["header_error"] = f"event_time header {raw_time!r} is not an integer"
    return fields


def read_partition_range(bootstrap_servers: str, topic: str, partition: int, start: int, end: int,
                         records_per_block: int, watermark_ms: int, allowed_lateness_ms: int,
                         stall_timeout_s: float = 60.0) -> Iterator[pa.Table]:
    """Every record of [start, end) of one partition, as Arrow blocks, or an error: never fewer.

    Lateness is judged against the partition's running event-time watermark (the highest event
    time seen so far, seeded from the previous snapshot), as a stream processor would.
    """
    from confluent_kafka import KafkaError, TopicPartition

    consumer = _consumer(bootstrap_servers)
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
                fields = _header_fields(message.headers())
                _, timestamp = message.timestamp()
                event_time = fields["event_time"] if fields["event_time"] is not None else timestamp
                watermark_ms = max(watermark_ms, event_time)
                fields.update(partition=partition, offset=offset, kafka_timestamp=timestamp,
                              event_time=event_time, late=event_time < watermark_ms - allowed_lateness_ms,
                              key=message.key().decode("utf-8", "replace") if message.key() else None,
                              value=message.value() or b"")
                for name in RAW_SCHEMA.names:
                    rows[name].append(fields[name])
            if len(rows["offset"]) >= records_per_block or sum(map(len, rows["value"])) >= MAX_BLOCK_BYTES:
                yield pa.Table.from_pydict(rows, schema=RAW_SCHEMA)
                rows = {name: [] for name in RAW_SCHEMA.names}
        if rows["offset"]:
            yield pa.Table.from_pydict(rows, schema=RAW_SCHEMA)
    finally:
        consumer.close()


class KafkaRangeDatasource:
    """A Ray Data datasource over exact per-partition offset ranges, split into read tasks.

    `ray.data.read_kafka` takes one start offset for all partitions and clamps its end to the
    reported high watermark; resuming from a ledger and reading to the proven end needs ranges.
    """

    def __new__(cls, *args, **kwargs):
        # Subclass lazily so importing app.data does not import Ray Data (serving imports this module).
        from ray.data.block import BlockMetadata
        from ray.data.datasource import Datasource, ReadTask

        class _KafkaRangeDatasource(Datasource):
            def __init__(self, bootstrap_servers, topic, ranges, records_per_block, watermarks,
                         allowed_lateness_ms, max_offsets_per_task=20_000):
                self._args = (bootstrap_servers, topic)
                self._ranges = ranges
                self._records_per_block = records_per_block
                self._watermarks = watermarks
                self._allowed_lateness_ms = allowed_lateness_ms
                self._max_offsets_per_task = max_offsets_per_task

            def estimate_inmemory_data_size(self):
                return None

            def get_name(self):
                return "KafkaRange"

            def read_task_count(self) -> int:
                """Pass it as `override_num_blocks`: Ray Data otherwise aims at ~200 blocks and splits
                every task's output into slivers, paying per-object overhead on each."""
                return sum(-(-(end - start) // self._max_offsets_per_task) for start, end in self._ranges.values())

            def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
                tasks = []
                for partition, (start, end) in sorted(self._ranges.items()):
                    for lo in range(start, end, self._max_offsets_per_task):
                        hi = min(end, lo + self._max_offsets_per_task)
                        # Each chunk after the first seeds its watermark from the previous snapshot
                        # only; tasks run in parallel, so cross-chunk order is not observable.
                        args = (*self._args, partition, lo, hi, self._records_per_block,
                                self._watermarks.get(partition, 0), self._allowed_lateness_ms)
                        metadata = BlockMetadata(num_rows=hi - lo, size_bytes=None,
                                                 input_files=[f"kafka://{self._args[1]}/{partition}/{lo}-{hi}"],
                                                 exec_stats=None)
                        tasks.append(ReadTask(lambda a=args: read_partition_range(*a), metadata,
                                              schema=RAW_SCHEMA, per_task_row_limit=per_task_row_limit))
                return tasks

        return _KafkaRangeDatasource(*args, **kwargs)


# Logical CPUs of the ingest stages. Per cluster CPU there is at most one Kafka read task, one
# snapshot write task and one preprocessing actor: 0.25 + 0.25 + 0.5 = 1, so every stage can be
# placed at once (a pool holding every CPU would leave the reads and writes unscheduled and hang)
# while the OS shares the cores among them.
IO_TASK_CPUS = 0.25
PREPROCESS_ACTOR_CPUS = 0.5


def io_concurrency() -> int:
    """At most one read and one write task per cluster CPU: more consumers than cores only contend
    (with the broker too, where it shares the machine), and each task is a worker process in memory."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def read_ranges(source) -> ray.data.Dataset:
    """The Ray Data read of a KafkaRangeDatasource, as ingest runs it (inside `streaming_blocks`)."""
    import ray

    return ray.data.read_datasource(source, ray_remote_args={"num_cpus": IO_TASK_CPUS},
                                    concurrency=io_concurrency(), override_num_blocks=source.read_task_count())


@contextlib.contextmanager
def streaming_blocks(max_block_bytes: int = MAX_BLOCK_BYTES) -> Iterator[None]:
    """Datasets created inside use blocks of at most `max_block_bytes`.

    Ray Data merges what a read task yields into blocks of up to 128 MiB before passing any on, so
    a Kafka read task would hold its whole range (and a 128 MiB block per task in memory) before
    its first record reached the preprocessing actors. A Dataset keeps the context it was created in.
    """
    from ray.data import DataContext

    context = DataContext.get_current()
    previous = context.target_max_block_size
    context.target_max_block_size = max_block_bytes
    try:
        yield
    finally:
        context.target_max_block_size = previous


# ---------------------------------------------------------------- preprocessing actors


def _decode_or_error(value: bytes) -> np.ndarray | str:
    """uint8 HWC pixels, or why the bytes are not an image (a dead letter's `error`)."""
    try:
        return decode_pixels(value)
    except BadImage as exc:
        return str(exc)


def _import_torch_device() -> torch.device:
    from app.model import local_device  # imports torch

    return local_device()


class Preprocessor:
    """Actor-pool UDF: raw Kafka rows → cleaned, normalised rows with an `error` for dead letters."""

    def __init__(self, image_size: int, classes: Sequence[str] | None, max_record_bytes: int,
                 features: str | None = None, weights: str | None = None, decode_threads: int = 1):
        # Decoding dominates (~0.4–0.8 ms a 128 px PNG against ~0.15 ms to resize and normalise on
        # CPU) and Pillow releases the GIL while it decodes, so a GPU actor, one per GPU, decodes in threads.
        self.decoder = ThreadPoolExecutor(decode_threads, thread_name_prefix="decode") if decode_threads > 1 else None
        # Importing torch takes a new actor 1–1.5 s; it runs while the first batch decodes, which
        # needs only Pillow and numpy (each ingest, and each `watch` micro-batch, starts new actors).
        self._device_future = ThreadPoolExecutor(1, thread_name_prefix="import-torch").submit(_import_torch_device)
        self.image_size = image_size
        self.classes = set(classes) if classes else None
        self.max_record_bytes = max_record_bytes
        self.backbone = None
        if features == "resnet50":
            from app.model import feature_backbone

            self.backbone = feature_backbone(weights).to(self._device_future.result()).eval()

    def _problem(self, row_value: bytes, label: str | None, header_error: str | None) -> str | None:
        if header_error:
            return header_error
        if len(row_value) > self.max_record_bytes:
            return f"record of {len(row_value)} bytes exceeds the {self.max_record_bytes} byte limit"
        if self.classes is not None and label is not None and label not in self.classes:
            return f"unknown label {label!r}"
        return None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["offset"])
        errors = [self._problem(batch["value"][i], batch["label"][i], batch["header_error"][i]) for i in range(n)]
        candidates = [i for i in range(n) if errors[i] is None]
        values = [batch["value"][i] for i in candidates]
        pixels = self.decoder.map(_decode_or_error, values) if self.decoder else map(_decode_or_error, values)
        decoded: list[np.ndarray] = []
        good = []
        for i, result in zip(candidates, pixels):
            if isinstance(result, str):
                errors[i] = result
            else:
                decoded.append(result)
                good.append(i)
        all_good = bool(good) and len(good) == n
        images = None if all_good else np.zeros((n, 3, self.image_size, self.image_size), dtype=np.float32)
        if good:
            tensors = normalize(decoded, self.image_size, self._device_future.result())
            if images is None:
                images = tensors.cpu().numpy()  # every row good (the usual case): no scatter copy
            else:
                images[good] = tensors.cpu().numpy()  # dead letters keep a zero image
            if self.backbone is not None:
                import torch

                with torch.inference_mode():
                    features = self.backbone(tensors).cpu().numpy()
        out = {k: batch[k] for k in ("partition", "offset", "kafka_timestamp", "key", "label",
                                     "event_time", "device_id", "late", "schema")}
        out["error"] = np.array(errors, dtype=object)
        # Dead letters keep their original bytes for the DLQ topic; good rows keep the tensor only.
        out["value"] = np.array([batch["value"][i] if errors[i] else b"" for i in range(n)], dtype=object)
        out["value_size"] = np.array([len(v) for v in batch["value"]], dtype=np.int64)
        out["image"] = images
        if self.backbone is not None:
            feature_column = np.zeros((n, 2048), dtype=np.float32)
            if good:
                feature_column[good] = features
            out["features"] = feature_column
        return out


def preprocess_batches(dataset: ray.data.Dataset, settings: Settings, cfg: IngestConfig,
                       preprocessor: type[Preprocessor] = Preprocessor) -> ray.data.Dataset:
    """`dataset.map_batches(preprocessor)` in an actor pool sized as ingest runs it (the bench
    passes a subclass that times its batches).

    On CPU, one actor per core decoding in one thread: Pillow releases the GIL while it decodes,
    but resize, normalise and Ray's batch handling do not, so an actor's extra decode threads
    mostly wait for the GIL (measured: 2 actors × 1 thread ≈ 1.3× 1 actor × 2 threads on 2 cores).
    On GPU, one actor per GPU, decoding in as many threads as the cluster has CPUs per GPU. The
    pool starts with one actor and grows while batches queue, so it never waits for CPUs that Serve
    or training hold.
    """
    import ray

    resources = ray.cluster_resources()
    cpus = max(1, int(resources.get("CPU", 1)))
    if cfg.use_gpu:
        if not resources.get("GPU"):
            log.warning("--use-gpu: the Ray cluster has no GPU now; the preprocessing actors wait until "
                        "the autoscaler adds a GPU node (a cluster that cannot will wait forever)")
        gpus = max(1, int(resources.get("GPU", 1)))
        actors, decode_threads, actor_resources = gpus, max(1, cpus // gpus), dict(num_cpus=0, num_gpus=1)
    else:
        actors, decode_threads, actor_resources = cpus, 1, dict(num_cpus=PREPROCESS_ACTOR_CPUS)
    max_actors = cfg.concurrency or actors
    return dataset.map_batches(
        preprocessor,
        fn_constructor_kwargs=dict(image_size=settings.image_size, classes=settings.classes,
                                   max_record_bytes=cfg.max_record_bytes, features=cfg.features,
                                   weights=cfg.weights, decode_threads=cfg.decode_threads or decode_threads),
        batch_size=cfg.batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max_actors), **actor_resources,
    )


# ---------------------------------------------------------------- snapshot sink and ledger


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    return pafs.FileSystem.from_uri(uri)


def _event_date(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d")


class SnapshotSink:
    """Ray Data sink: good rows → Parquet under the snapshot's temporary dir, by event date;
    dead letters → `<topic>.dlq` with an `error` header and their source coordinates."""

    def __new__(cls, *args, **kwargs):
        from ray.data import Datasink

        class _SnapshotSink(Datasink):
            def __init__(self, staging_uri, bootstrap_servers, topic, dlq_topic):
                self.staging_uri, self.bootstrap_servers = staging_uri, bootstrap_servers
                self.topic, self.dlq_topic = topic, dlq_topic

            def get_name(self):
                return "Snapshot"

            def write(self, blocks, ctx):
                return write_snapshot_blocks(blocks, self.staging_uri, self.bootstrap_servers,
                                             self.topic, self.dlq_topic, f"{ctx.task_idx:05d}")

            def on_write_complete(self, write_result):
                # Runs on the driver's instance: the per-task accounting becomes the manifest.
                self.write_returns = write_result.write_returns

        return _SnapshotSink(*args, **kwargs)


def write_snapshot_blocks(blocks, staging_uri: str, bootstrap_servers: str, topic: str, dlq_topic: str,
                          task_name: str) -> dict:
    """One write task: returns per-partition accounting the driver folds into the manifest."""
    from ray.data.block import BlockAccessor

    fs, root = _filesystem(staging_uri)
    stats = {"partitions": defaultdict(lambda: {"records": 0, "dlq": 0, "min": None, "max": None}),
             "labels": Counter(), "late": 0, "bytes": 0, "event_min": None, "event_max": None,
             "dlq_errors": Counter(), "files": []}
    producer = None
    failures: list[BaseException] = []
    part = 0
    try:
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            stats["bytes"] += pc.sum(table.column("value_size")).as_py() or 0
            errors = table.column("error").to_pylist()
            partitions = table.column("partition").to_pylist()
            offsets = table.column("offset").to_pylist()
            for p, o, e in zip(partitions, offsets, errors):
                entry = stats["partitions"][p]
                entry["dlq" if e else "records"] += 1
                entry["min"] = o if entry["min"] is None else min(entry["min"], o)
                entry["max"] = o if entry["max"] is None else max(entry["max"], o)
            bad = [i for i, e in enumerate(errors) if e]
            if bad:
                producer = producer or make_producer(bootstrap_servers)
                rows = table.take(bad).select(["partition", "offset", "key", "value", "label", "event_time",
                                               "device_id", "error"]).to_pylist()
                for row in rows:
                    headers = record_headers(row["label"], row["event_time"], row["device_id"])
                    headers += [("error", row["error"].encode()), ("source_topic", topic.encode()),
                                ("source_partition", str(row["partition"]).encode()),
                                ("source_offset", str(row["offset"]).encode())]
                    future = producer.send(dlq_topic, key=(row["key"] or "").encode(), value=row["value"],
                                           headers=headers)
                    future.add_errback(failures.append)
                    stats["dlq_errors"][row["error"].split(":")[0]] += 1
            good = table.filter(pc.is_null(table.column("error")))
            if good.num_rows == 0:
                continue
            good = good.drop_columns(["error", "value", "value_size"])
            event_times = good.column("event_time").to_pylist()
            dates = [_event_date(t) for t in event_times]
            stats["labels"].update(l for l in good.column("label").to_pylist() if l is not None)
            stats["late"] += sum(good.column("late").to_pylist())
            lo, hi = min(event_times), max(event_times)
            stats["event_min"] = lo if stats["event_min"] is None else min(stats["event_min"], lo)
            stats["event_max"] = hi if stats["event_max"] is None else max(stats["event_max"], hi)
            good = good.append_column("event_date", pa.array(dates, pa.string()))
            for date in sorted(set(dates)):
                subset = good.filter(pc.equal(good.column("event_date"), date)).drop_columns(["event_date"])
                path = f"{root}/event_date={date}/part-{task_name}-{part:04d}.parquet"
                fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
                pq.write_table(subset, path, filesystem=fs)
                stats["files"].append(path[len(root) + 1:])
                part += 1
        if producer is not None:
            producer.flush()
    finally:
        if producer is not None:
            producer.close()
    if failures:  # an unacknowledged dead letter would be a lost record: fail before anything commits
        raise RuntimeError(f"{len(failures)} dead letters were not acknowledged by {dlq_topic}: {failures[0]}")
    stats["partitions"] = dict(stats["partitions"])
    return stats


@dataclass
class IngestReport:
    snapshot_id: str | None
    records: int
    dlq: int
    offsets: dict[int, tuple[int, int]]
    seconds: float
    value_bytes: int

    def __str__(self) -> str:
        if self.snapshot_id is None:
            return "nothing new to ingest: every partition is at its end; no snapshot written"
        ranges = ", ".join(f"p{p}:[{s},{e})" for p, (s, e) in sorted(self.offsets.items()))
        total = self.records + self.dlq
        return (f"snapshot {self.snapshot_id}: {self.records} records, {self.dlq} to the DLQ, "
                f"{total / max(self.seconds, 1e-9):.0f} records/s, "
                f"{self.value_bytes / max(self.seconds, 1e-9) / 1e6:.2f} MB/s in {self.seconds:.1f}s; "
                f"offsets {ranges}")


def list_manifests(settings: Settings) -> list[dict]:
    """Durable snapshots' manifests, oldest first (ids sort by creation time)."""
    fs, root = _filesystem(settings.uri("snapshots"))
    selector = pafs.FileSelector(root, allow_not_found=True)
    manifests = []
    for info in sorted(fs.get_file_info(selector), key=lambda i: i.base_name):
        if info.type != pafs.FileType.Directory or info.base_name.startswith("."):
            continue
        try:
            with fs.open_input_stream(f"{info.path}/{MANIFEST}") as stream:
                manifests.append(json.loads(stream.read()))
        except FileNotFoundError:
            log.warning("snapshot dir %s has no manifest; ignoring it", info.path)
    return manifests


def ledger_offsets(manifests: Iterable[dict], topic: str) -> tuple[dict[int, int], dict[int, int]]:
    """Where the next ingest starts per partition, and the event-time watermark per partition."""
    starts: dict[int, int] = {}
    watermarks: dict[int, int] = {}
    for manifest in manifests:
        if manifest["topic"] != topic:
            continue
        for partition, entry in manifest["offsets"].items():
            p = int(partition)
            starts[p] = max(starts.get(p, 0), entry["end"])
            if entry.get("watermark") is not None:
                watermarks[p] = max(watermarks.get(p, 0), entry["watermark"])
    return starts, watermarks


def snapshot_uri(settings: Settings, snapshot_id: str) -> str:
    return settings.uri("snapshots", snapshot_id)


def read_manifest(settings: Settings, snapshot_id: str) -> dict:
    fs, root = _filesystem(snapshot_uri(settings, snapshot_id))
    with fs.open_input_stream(f"{root}/{MANIFEST}") as stream:
        return json.loads(stream.read())


def _fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        log.error("fault injection: exiting at %s", point)
        os._exit(137)


def _commit_offsets(settings: Settings, cfg: IngestConfig, bootstrap_servers: str, ends: dict[int, int]) -> None:
    """Mirror the ledger into the consumer group (for lag tools) and <storage>/offsets/<group>.json."""
    from confluent_kafka import TopicPartition

    consumer = _consumer(bootstrap_servers, **{"group.id": cfg.group})
    try:
        consumer.commit(offsets=[TopicPartition(settings.topic, p, e) for p, e in ends.items()], asynchronous=False)
    finally:
        consumer.close()
    fs, path = _filesystem(settings.uri("offsets", f"{cfg.group}.json"))
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    _atomic_write(fs, path, json.dumps({"topic": settings.topic, "offsets": {str(p): e for p, e in ends.items()}},
                                       indent=2).encode())


def _atomic_write(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as stream:
        stream.write(data)
    fs.move(tmp, path)


def _clean_staging(fs: pafs.FileSystem, snapshots_root: str) -> None:
    for info in fs.get_file_info(pafs.FileSelector(snapshots_root, allow_not_found=True)):
        if info.base_name.startswith(".tmp-"):
            log.warning("removing %s left by an interrupted ingest (its offsets were never committed)", info.path)
            fs.delete_dir(info.path)


def ingest(settings: Settings, cfg: IngestConfig, bootstrap_servers: str) -> IngestReport:
    """`python -m app ingest`: one bounded, exactly-once read of the topic into a new snapshot."""
    import ray.data

    started = time.perf_counter()
    ensure_topics(bootstrap_servers, [settings.topic, settings.dlq_topic], settings.partitions)
    fs, snapshots_root = _filesystem(settings.uri("snapshots"))
    fs.create_dir(snapshots_root, recursive=True)
    _clean_staging(fs, snapshots_root)

    previous, watermarks = ledger_offsets(list_manifests(settings), settings.topic)
    partitions = partitions_of(bootstrap_servers, settings.topic)
    starts = {p: previous.get(p, 0) for p in partitions}
    ends = probe_end_offsets(bootstrap_servers, settings.topic, partitions)
    behind = {p: (starts[p], ends[p]) for p in partitions if ends[p] < starts[p]}
    if behind:
        raise RuntimeError(f"the snapshots under {settings.uri('snapshots')} end past the topic's end "
                           f"(partition: (ledger start, topic end) {behind}): they belong to another broker "
                           "or an older incarnation of the topic; use a fresh --storage")
    ranges = {p: (starts[p], ends[p]) for p in partitions if ends[p] > starts[p]}
    if not ranges:
        return IngestReport(None, 0, 0, {}, time.perf_counter() - started, 0)

    snapshot_id = datetime.now(timezone.utc).strftime("snap-%Y%m%dT%H%M%S") + f"-{uuid.uuid4().hex[:6]}"
    staging = f"{snapshots_root}/.tmp-{snapshot_id}"
    staging_uri = settings.uri("snapshots", f".tmp-{snapshot_id}")
    log.info("ingesting %s offsets %s into %s", settings.topic, ranges, snapshot_id)

    source = KafkaRangeDatasource(bootstrap_servers, settings.topic, ranges, cfg.records_per_block,
                                  watermarks, int(cfg.allowed_lateness_s * 1000))
    with streaming_blocks():
        dataset = preprocess_batches(read_ranges(source), settings, cfg)
    sink = SnapshotSink(staging_uri, bootstrap_servers, settings.topic, settings.dlq_topic)
    dataset.write_datasink(sink, ray_remote_args={"num_cpus": IO_TASK_CPUS}, concurrency=io_concurrency())
    manifest = build_manifest(settings, cfg, snapshot_id, ranges, watermarks, sink.write_returns)
    _fault("after_write")
    _atomic_write(fs, f"{staging}/{MANIFEST}", json.dumps(manifest, indent=2, sort_keys=True).encode())
    fs.move(staging, f"{snapshots_root}/{snapshot_id}")
    _fault("before_commit")
    _commit_offsets(settings, cfg, bootstrap_servers, {p: e for p, (_, e) in ranges.items()})
    report = IngestReport(snapshot_id, manifest["records"], manifest["dlq"], ranges,
                          time.perf_counter() - started, manifest["value_bytes"])
    metrics.inc("argus_records_ingested", report.records, topic=settings.topic)
    metrics.inc("argus_dlq_records", report.dlq, topic=settings.topic)
    metrics.set_gauge("argus_ingest_records_per_second", (report.records + report.dlq) / report.seconds,
                      topic=settings.topic)
    metrics.set_gauge("argus_ingest_megabytes_per_second", report.value_bytes / report.seconds / 1e6,
                      topic=settings.topic)
    return report


def build_manifest(settings: Settings, cfg: IngestConfig, snapshot_id: str, ranges: dict[int, tuple[int, int]],
                   previous_watermarks: dict[int, int], write_returns: list[dict]) -> dict:
    """Fold the write tasks' accounting into CONTRACT.md §2's manifest, proving every offset landed.

    Every offset of every range must be in the Parquet files or the DLQ exactly once; anything
    else fails the run before a snapshot becomes visible or an offset is committed.
    """
    per_partition = {p: {"records": 0, "dlq": 0, "min": None, "max": None} for p in ranges}
    labels, dlq_errors, files = Counter(), Counter(), []
    late = value_bytes = 0
    event_min = event_max = None
    for result in write_returns:
        for p, entry in result["partitions"].items():
            target = per_partition[p]
            target["records"] += entry["records"]
            target["dlq"] += entry["dlq"]
            for key, pick in (("min", min), ("max", max)):
                if entry[key] is not None:
                    target[key] = entry[key] if target[key] is None else pick(target[key], entry[key])
        labels.update(result["labels"])
        dlq_errors.update(result["dlq_errors"])
        files.extend(result["files"])
        late += result["late"]
        value_bytes += result["bytes"]
        if result["event_min"] is not None:
            event_min = result["event_min"] if event_min is None else min(event_min, result["event_min"])
            event_max = result["event_max"] if event_max is None else max(event_max, result["event_max"])
    offsets = {}
    for p, (start, end) in sorted(ranges.items()):
        entry = per_partition[p]
        seen = entry["records"] + entry["dlq"]
        if seen != end - start or (seen and (entry["min"] != start or entry["max"] != end - 1)):
            raise RuntimeError(f"partition {p}: expected offsets [{start}, {end}) once each, got {seen} records "
                               f"spanning {entry['min']}..{entry['max']}; nothing committed")
        watermark = max(previous_watermarks.get(p, 0), event_max or 0)
        offsets[str(p)] = {"start": start, "end": end, "records": entry["records"], "dlq": entry["dlq"],
                           "watermark": watermark}
    classes = list(settings.classes) if settings.classes else sorted(labels)
    return {
        "snapshot_id": snapshot_id,
        "format": "argus.snapshot.v1",
        "topic": settings.topic,
        "created_at": datetime.now(timezone.utc).isoformat(),
        "offsets": offsets,
        "records": sum(e["records"] for e in per_partition.values()),
        "dlq": sum(e["dlq"] for e in per_partition.values()),
        "dlq_topic": settings.dlq_topic,
        "dlq_errors": dict(dlq_errors),
        "classes": classes,
        "label_counts": dict(sorted(labels.items())),
        "image_size": settings.image_size,
        "normalization": {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "features": cfg.features,
        "features_weights": cfg.weights if cfg.features else None,
        "event_time": {"min": event_min, "max": event_max, "late_records": late,
                       "allowed_lateness_s": cfg.allowed_lateness_s},
        "value_bytes": value_bytes,
        "files": sorted(files),
    }
