"""Ingest's preprocessing: an actor pool that cleans and transforms raw Kafka rows.

Each actor runs the one transform (`app.transform`) on batches of raw records: undecodable values,
oversized records, bad headers and unknown labels become rows with an `error` (dead letters, with
their original bytes); good rows get the resized uint8 pixels [3, size, size] (normalisation runs
where the model does: the training step and serving), their encoded bytes with `--keep-source`,
and ResNet-50 features when asked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
import ray.data

from app.config import IngestConfig, Settings
from app.transform import BadImage, decode_pixels, normalize_pixels, resize_pixels

log = logging.getLogger(__name__)

# Logical CPUs of the ingest stages. Per cluster CPU there is at most one Kafka read task, one
# snapshot write task (`app.data.kafka_range.IO_TASK_CPUS`, 0.25 each) and one preprocessing actor:
# 0.25 + 0.25 + 0.5 = 1, so every stage can be placed at once (a pool holding every CPU would leave
# the reads and writes unscheduled and hang) while the OS shares the cores among them.
PREPROCESS_ACTOR_CPUS = 0.5


def _decode_or_error(value: bytes) -> np.ndarray | str:
    """uint8 HWC pixels, or why the bytes are not an image (a dead letter's `error`). Never raises:
    one record's failure, whatever it is, is that record's dead letter, not the batch's."""
    try:
        return decode_pixels(value)
    except BadImage as exc:
        return str(exc)
    except Exception as exc:  # decode_pixels raises only BadImage; np.array may still run out of memory
        return f"undecodable image: {type(exc).__name__}: {exc}"


def _import_torch_device():
    from app.model import local_device  # imports torch

    return local_device()


class Preprocessor:
    """Actor-pool UDF: raw Kafka rows → cleaned, normalised rows with an `error` for dead letters."""

    def __init__(
        self,
        image_size: int,
        classes: Sequence[str] | None,
        max_record_bytes: int,
        features: str | None = None,
        weights: str | None = None,
        decode_threads: int = 1,
        keep_source: bool = False,
    ):
        # Decoding dominates (~0.4–0.8 ms a 128 px PNG against ~0.15 ms to resize and normalise on
        # CPU) and Pillow releases the GIL while it decodes, so a GPU actor, one per GPU, decodes in threads.
        self.decoder = (
            ThreadPoolExecutor(decode_threads, thread_name_prefix="decode") if decode_threads > 1 else None
        )
        # Importing torch takes a new actor 1–1.5 s; it runs while the first batch decodes, which
        # needs only Pillow and numpy (each ingest, and each `watch` micro-batch, starts new actors).
        self._device_future = ThreadPoolExecutor(1, thread_name_prefix="import-torch").submit(
            _import_torch_device
        )
        self.image_size = image_size
        self.classes = set(classes) if classes else None
        self.max_record_bytes = max_record_bytes
        self.keep_source = keep_source
        self.backbone = None
        if features == "resnet50":
            from app.model import feature_backbone

            self.backbone = feature_backbone(weights).to(self._device_future.result()).eval()

    def _problem(self, row_value: bytes, label: str | None, header_error: str | None) -> str | None:
        if header_error:
            return header_error
        if not len(row_value):
            return "empty value"
        if len(row_value) > self.max_record_bytes:
            return f"record of {len(row_value)} bytes exceeds the {self.max_record_bytes} byte limit"
        if self.classes is not None and label is not None and label not in self.classes:
            return f"unknown label {label!r}"
        return None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["offset"])
        # A nullable int column arrives as floats with NaN for "no gap" (or None, as objects).
        gap_ends = [int(g) if g is not None and g == g else -1 for g in batch["gap_end"]]
        errors = [
            None
            if gap_ends[i] >= 0
            else self._problem(batch["value"][i], batch["label"][i], batch["header_error"][i])
            for i in range(n)
        ]
        candidates = [i for i in range(n) if errors[i] is None and gap_ends[i] < 0]
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
        images = None if all_good else np.zeros((n, 3, self.image_size, self.image_size), dtype=np.uint8)
        if good:
            pixels = resize_pixels(decoded, self.image_size, self._device_future.result())
            if images is None:
                images = pixels.cpu().numpy()  # every row good (the usual case): no scatter copy
            else:
                images[good] = pixels.cpu().numpy()  # dead letters keep a zero image
            if self.backbone is not None:
                import torch

                with torch.inference_mode():
                    features = self.backbone(normalize_pixels(pixels)).cpu().numpy()
        out = {
            k: batch[k]
            for k in (
                "partition",
                "offset",
                "kafka_timestamp",
                "key",
                "label",
                "event_time",
                "device_id",
                "late",
                "schema",
            )
        }
        out["error"] = np.array(errors, dtype=object)
        out["gap_end"] = np.array(gap_ends, dtype=np.int64)  # -1: a record; else offsets it declares skipped
        # Dead letters keep their original bytes for the DLQ topic; good rows keep the tensor only.
        out["value"] = np.array([batch["value"][i] if errors[i] else b"" for i in range(n)], dtype=object)
        out["value_size"] = np.array([len(v) for v in batch["value"]], dtype=np.int64)
        out["image"] = images
        if self.keep_source:  # a new image size can then be cut from the snapshot, not from Kafka
            out["source"] = np.array(
                [b"" if errors[i] else batch["value"][i] for i in range(n)], dtype=object
            )
        if self.backbone is not None:
            feature_column = np.zeros((n, 2048), dtype=np.float32)
            if good:
                feature_column[good] = features
            out["features"] = feature_column
        return out


def preprocess_batches(
    dataset: ray.data.Dataset,
    settings: Settings,
    cfg: IngestConfig,
    preprocessor: type[Preprocessor] = Preprocessor,
) -> ray.data.Dataset:
    """`dataset.map_batches(preprocessor)` in an actor pool sized as ingest runs it (the bench
    passes a subclass that times its batches).

    On CPU, one actor per core decoding in one thread: Pillow releases the GIL while it decodes,
    but resize, normalise and Ray's batch handling do not, so an actor's extra decode threads
    mostly wait for the GIL (measured: 2 actors × 1 thread ≈ 1.3× 1 actor × 2 threads on 2 cores).
    On GPU, one actor per GPU, decoding in as many threads as the cluster has CPUs per GPU. The
    pool starts with one actor and grows while batches queue, so it never waits for CPUs that Serve
    or training hold.
    """
    resources = ray.cluster_resources()
    cpus = max(1, int(resources.get("CPU", 1)))
    if cfg.use_gpu:
        if not resources.get("GPU"):
            log.warning(
                "--use-gpu: the Ray cluster has no GPU now; the preprocessing actors wait until "
                "the autoscaler adds a GPU node (a cluster that cannot will wait forever)"
            )
        gpus = max(1, int(resources.get("GPU", 1)))
        actors, decode_threads, actor_resources = gpus, max(1, cpus // gpus), dict(num_cpus=0, num_gpus=1)
    else:
        actors, decode_threads, actor_resources = cpus, 1, dict(num_cpus=PREPROCESS_ACTOR_CPUS)
    return dataset.map_batches(
        preprocessor,
        fn_constructor_kwargs=dict(
            image_size=settings.image_size,
            classes=settings.classes,
            max_record_bytes=cfg.max_record_bytes,
            features=cfg.features,
            weights=cfg.weights,
            decode_threads=cfg.decode_threads or decode_threads,
            keep_source=cfg.keep_source,
        ),
        batch_size=cfg.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cfg.concurrency or actors),
        **actor_resources,
    )
