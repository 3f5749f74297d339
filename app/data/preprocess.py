"""Ingest's preprocessing: an actor pool that cleans and transforms raw Kafka rows.

Each actor runs the one transform (`app.transform`) on batches of raw records: undecodable values,
oversized records and images, bad or oversized headers and unknown labels become rows with an
`error` and its fixed `reason` (`app.errors.Reason`): dead letters, with their original bytes. Good
rows get the resized uint8 pixels [3, size, size] (normalisation runs where the model does: the
training step and serving), their encoded bytes with `--keep-source`, and ResNet-50 features when
asked. Memory follows the batch's output, not its images' decoded size (`PIXEL_BUDGET`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray
import ray.data

from app.config import IngestConfig, Settings
from app.data.metadata import Erasures
from app.errors import Reason
from app.transform import BadImage, decode_pixels, normalize_pixels, resize_pixels

log = logging.getLogger(__name__)

# Logical CPUs of the ingest stages. Per cluster CPU there is at most one Kafka read task, one
# snapshot write task (`app.data.kafka_range.IO_TASK_CPUS`, 0.25 each) and one preprocessing actor:
# 0.25 + 0.25 + 0.5 = 1, so every stage can be placed at once (a pool holding every CPU would leave
# the reads and writes unscheduled and hang) while the OS shares the cores among them.
PREPROCESS_ACTOR_CPUS = 0.5


PIXEL_BUDGET = 24_000_000
"""Decoded pixels an actor holds before it resizes them (72 MB of RGB). Each image is reduced right
after decoding (`decode_pixels(value, size)`), so a batch of any size holds at most this much
besides its output, however large its images were when encoded."""


def _decode_or_error(value: bytes, size: int) -> np.ndarray | tuple[Reason, str]:
    """uint8 HWC pixels reduced toward `size`, or why the bytes are not an image (a dead letter's
    reason and `error`). Never raises: one record's failure, whatever it is, is that record's dead
    letter, not the batch's."""
    try:
        return decode_pixels(value, size)
    except BadImage as exc:
        return exc.reason, str(exc)
    except MemoryError:  # np.array's copy of the decoded image
        return Reason.OUT_OF_MEMORY, "undecodable image: out of memory while decoding"


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
        erasures: Erasures | None = None,
    ):
        # Decoding dominates (~0.4–0.8 ms a 128 px PNG against ~0.15 ms to resize and normalise on
        # CPU) and Pillow releases the GIL while it decodes, so a GPU actor, one per GPU, decodes in threads.
        self.decode_threads = decode_threads
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
        self.erasures = erasures or Erasures()
        self.backbone = None
        if features == "resnet50":
            from app.model import feature_backbone

            self.backbone = feature_backbone(weights).to(self._device_future.result()).eval()

    def _problem(self, batch: dict[str, np.ndarray], i: int) -> tuple[str, str] | None:
        """Why row `i` of a batch is a dead letter before its value is decoded: reason, `error`."""
        if self.erasures.covers(batch["key"][i], int(batch["partition"][i]), int(batch["offset"][i])):
            return Reason.ERASED, "the record's user was erased (argus erase --user)"
        if batch["header_error"][i]:
            return batch["header_reason"][i], batch["header_error"][i]
        value, label = batch["value"][i], batch["label"][i]
        if not len(value):
            return Reason.EMPTY_VALUE, "empty value"
        if len(value) > self.max_record_bytes:
            return (
                Reason.RECORD_TOO_LARGE,
                f"record of {len(value)} bytes exceeds the {self.max_record_bytes} byte limit",
            )
        if self.classes is not None and label is not None and label not in self.classes:
            return Reason.UNKNOWN_LABEL, f"unknown label {label!r}"  # at most FIELD_LIMITS bytes
        return None

    def _decoded(self, values: list[bytes]):
        """Each value's `_decode_or_error`, in order, at most a few in flight (a decoder thread pool's
        `map` would decode the whole batch before the first result is taken)."""
        if self.decoder is None:
            for value in values:
                yield _decode_or_error(value, self.image_size)
            return
        step = 2 * self.decode_threads
        for start in range(0, len(values), step):
            chunk = values[start : start + step]
            yield from self.decoder.map(_decode_or_error, chunk, [self.image_size] * len(chunk))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["offset"])
        # A nullable int column arrives as floats with NaN for "no gap" (or None, as objects).
        gap_ends = [int(g) if g is not None and g == g else -1 for g in batch["gap_end"]]
        problems = [None if gap_ends[i] >= 0 else self._problem(batch, i) for i in range(n)]
        candidates = [i for i in range(n) if problems[i] is None and gap_ends[i] < 0]
        images = np.zeros((n, 3, self.image_size, self.image_size), dtype=np.uint8)
        features = np.zeros((n, 2048), dtype=np.float32) if self.backbone is not None else None
        held: list[np.ndarray] = []
        held_rows: list[int] = []
        held_pixels = 0

        def resize_held() -> None:  # dead letters keep a zero image
            nonlocal held_pixels
            if not held:
                return
            pixels = resize_pixels(held, self.image_size, self._device_future.result())
            images[held_rows] = pixels.cpu().numpy()
            if features is not None:
                import torch

                with torch.inference_mode():
                    features[held_rows] = self.backbone(normalize_pixels(pixels)).cpu().numpy()
            held.clear()
            held_rows.clear()
            held_pixels = 0

        for i, result in zip(candidates, self._decoded([batch["value"][i] for i in candidates])):
            if isinstance(result, tuple):
                problems[i] = result
                continue
            held.append(result)
            held_rows.append(i)
            held_pixels += result.shape[0] * result.shape[1]
            if held_pixels >= PIXEL_BUDGET:
                resize_held()
        resize_held()
        errors = [problem[1] if problem else None for problem in problems]
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
        out["reason"] = np.array([str(problem[0]) if problem else None for problem in problems], dtype=object)
        out["gap_end"] = np.array(gap_ends, dtype=np.int64)  # -1: a record; else offsets it declares skipped
        # Dead letters keep their original bytes for the DLQ topic (an erased user's, nothing); good
        # rows keep the tensor only.
        kept = [errors[i] and problems[i][0] != Reason.ERASED for i in range(n)]
        out["value"] = np.array([batch["value"][i] if kept[i] else b"" for i in range(n)], dtype=object)
        out["value_size"] = np.array([len(v) for v in batch["value"]], dtype=np.int64)
        out["image"] = images
        if self.keep_source:  # a new image size can then be cut from the snapshot, not from Kafka
            out["source"] = np.array(
                [b"" if errors[i] else batch["value"][i] for i in range(n)], dtype=object
            )
        if features is not None:
            out["features"] = features
        return out


def preprocess_batches(
    dataset: ray.data.Dataset,
    settings: Settings,
    cfg: IngestConfig,
    preprocessor: type[Preprocessor] = Preprocessor,
    erasures: Erasures | None = None,
) -> ray.data.Dataset:
    """`dataset.map_batches(preprocessor)` in an actor pool sized as ingest runs it (the bench
    passes a subclass that times its batches); the records `erasures` covers become dead letters
    that hold nothing of them.

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
            erasures=erasures,
        ),
        batch_size=cfg.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=cfg.concurrency or actors),
        **actor_resources,
    )
