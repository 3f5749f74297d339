"""Publish behaviour images to Kafka as CONTRACT.md §1 records, batched like a device gateway.

python -m app produce --synthetic 2000        # procedural images (app.data.synth), non-IID users
python -m app produce --from-dir DIR          # DIR/<label>/<image files>
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from app.config import ProduceConfig, Settings
from app.data.kafka import KafkaConnection, ensure_topics
from app.data.records import record_headers

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp"}


@dataclass
class ProduceReport:
    records: int
    bytes: int
    seconds: float

    def __str__(self) -> str:
        rate = self.records / max(self.seconds, 1e-9)
        mbps = self.bytes / max(self.seconds, 1e-9) / 1e6
        return (
            f"produced {self.records} records ({self.bytes / 1e6:.1f} MB) in {self.seconds:.1f}s: "
            f"{rate:.0f} records/s, {mbps:.2f} MB/s"
        )


def produce(settings: Settings, cfg: ProduceConfig, kafka: KafkaConnection) -> ProduceReport:
    """`python -m app produce`: publish synthetic or directory images as CONTRACT.md §1 records."""
    ensure_topics(kafka, settings.topic, settings.dlq_topic, settings.partitions, settings.replication_factor)
    records = _synthetic_records(settings, cfg) if cfg.synthetic else _directory_records(cfg.from_dir)
    producer = kafka.producer(cfg.linger_ms, cfg.batch_bytes)
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
    from app.data import synth

    classes = settings.classes or synth.DEFAULT_CLASSES
    for record in synth.generate(
        cfg.synthetic,
        seed=cfg.seed,
        classes=classes,
        users=cfg.users,
        size=cfg.source_image_size,
        late_fraction=cfg.late_fraction,
        corrupt_fraction=cfg.corrupt_fraction,
    ):
        yield (
            record.user_id,
            record.value,
            record_headers(record.label, record.event_time_ms, record.device_id),
        )


def _directory_records(root: str) -> Iterator[tuple[str, bytes, list]]:
    """DIR/<label>/<file>: the directory's name is the user id, the file's mtime the event time."""
    files = sorted(p for p in Path(root).glob("*/*") if p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        raise ValueError(f"no images found under {root}/<label>/ (extensions {sorted(IMAGE_EXTENSIONS)})")
    user_id = Path(root).resolve().name
    for path in files:
        yield (
            user_id,
            path.read_bytes(),
            record_headers(path.parent.name, int(path.stat().st_mtime * 1000), None),
        )
