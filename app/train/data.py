"""Training's input: one pinned table snapshot as Ray datasets cut into event-time slices, the
class weights, and the share of the cluster Ray Data gets beside the training workers.

The newest `--val-fraction` of records by event time is held out (`app.selection`): its older half
picks the best epoch, its newest half, never seen by that choice, judges promotion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from app import model as core
from app.config import Settings, TrainConfig
from app.data.selection import TableRead, chw_images
from app.selection import TEST, TRAIN, VALIDATION, EventTimeSplit
from app.transform import decode_pixels, encode_labels, resize_pixels

if TYPE_CHECKING:
    import ray.data
    import ray.train

log = logging.getLogger(__name__)

MATERIALIZE_SHARE = 0.25
"""Input (all three event-time slices) that fits in this share of the driver node's object store is
held there."""
FEATURE_BYTES = core.FEATURE_DIM * 4
INPUT_TASK_CPUS = 0
"""Training's input tasks reserve no CPU. An elastic group may hold every CPU of a node (after a
node loss it restarts on what is left), and the reads that feed it, or the rebuilding of blocks lost
with the node, must still run: with a quarter CPU each they waited for good (tests/integration/
test_multinode.py). They are light beside the training step they feed."""


@dataclass
class Datasets:
    """The three event-time slices of the table snapshot, as Ray datasets of (input, label_index)."""

    train: ray.data.Dataset
    val: ray.data.Dataset
    test: ray.data.Dataset
    split: EventTimeSplit


def build_datasets(
    settings: Settings, read: TableRead, classes: list[str], val_fraction: float, features: bool
) -> Datasets:
    """Train, validation and test datasets of the snapshot's data files, cut at event-time
    quantiles (`app.selection`)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # reproducible shards
    # Ray 2.57's parquet reader (datasource V2) lists files in 1-CPU tasks that take no
    # `ray_remote_args`: behind workers that hold every CPU they never run. The V1 reader honours
    # INPUT_TASK_CPUS.
    context.use_datasource_v2 = False
    paths = list(read.files)  # exactly the snapshot's rows: Argus writes no delete files
    column = "features" if features else "image"
    size = settings.image_size
    # Pixels stored at another size (or at several) come with their sources (`select` checked):
    # resize those; otherwise every row's pixels are size x size.
    resize = not features and read.image_size != size
    stored = "features" if features else "source" if resize else "pixels"
    # No hive partitioning: `event_date` is in the files themselves, and Ray would add it again.
    read_args = {"file_extensions": ["parquet"], "partitioning": None}
    times = ray.data.read_parquet(
        paths, columns=["event_time_ms", "label"], ray_remote_args={"num_cpus": INPUT_TASK_CPUS}, **read_args
    ).to_pandas()
    split = EventTimeSplit.of(times[times["label"].isin(classes)]["event_time_ms"].to_numpy(), val_fraction)
    record_bytes = FEATURE_BYTES if features else 3 * size * size  # uint8 pixels
    input_bytes = (split.train + split.val + split.test) * record_bytes
    held = input_bytes <= MATERIALIZE_SHARE * _driver_object_store_bytes()
    # Held blocks die with the node that made them, and Ray's lineage rebuild of Ray Data's
    # generator outputs can hang until the fetch times out (ray-project/ray#46425; seen in CI after
    # a node loss). Made on the driver's node, they die only with the driver.
    placement = {"scheduling_strategy": _on_driver_node()} if held else {}

    def task_args() -> dict:  # fresh each time: Ray Data fills in the dict it is given
        return {"num_cpus": INPUT_TASK_CPUS, **placement}

    dataset = ray.data.read_parquet(
        paths, columns=[stored, "label", "event_time_ms"], ray_remote_args=task_args(), **read_args
    )

    def labelled(batch):
        # One map does label filter, slice tag, decoding and projection: a separate filter or
        # select_columns op would schedule 1-CPU tasks.
        rows = np.isin(batch["label"], classes)
        if rows.any():  # an empty tensor column would not convert to Arrow
            if features:
                inputs = np.stack(batch["features"][rows]).astype(np.float32, copy=False)
            elif resize:
                inputs = resize_pixels([decode_pixels(v, size) for v in batch["source"][rows]], size).numpy()
            else:
                inputs = chw_images(list(batch["pixels"][rows]), size, size)
            yield {
                column: inputs,
                "label_index": encode_labels(batch["label"][rows], classes),
                "slice": split.slice_of(batch["event_time_ms"][rows]).astype(np.int8),
            }

    rows = dataset.map_batches(labelled, batch_format="numpy", **task_args())
    if held:
        # Read once, not once per slice and epoch: the epochs then stream from memory, and no read
        # task competes with the training workers for the cores.
        log.info("holding the input (%.1f MB) in the driver node's object store", input_bytes / 1e6)
        rows = rows.materialize()
    else:
        log.info(
            "streaming the input (%.1f MB, over %.0f%% of the driver node's object store) from storage "
            "every epoch",
            input_bytes / 1e6,
            100 * MATERIALIZE_SHARE,
        )

    def event_slice(wanted: int):
        def keep(batch):
            chosen = batch["slice"] == wanted
            if chosen.any():
                yield {column: batch[column][chosen], "label_index": batch["label_index"][chosen]}

        sliced = rows.map_batches(keep, batch_format="numpy", **task_args())
        return sliced.materialize() if held else sliced

    return Datasets(event_slice(TRAIN), event_slice(VALIDATION), event_slice(TEST), split)


def _driver_object_store_bytes() -> float:
    import ray

    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    return node["Resources"].get("object_store_memory", 0)


def _on_driver_node():
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Hard: input tasks take no CPU, so the driver's node can always run them.
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def class_weights(label_counts: dict[str, int], classes: list[str]) -> list[float]:
    """Inverse-frequency weights, mean 1: rare classes count as much as common ones in the loss."""
    counts = np.array([label_counts.get(c, 0) for c in classes], dtype=np.float64)
    weights = np.where(counts > 0, counts.sum() / np.maximum(counts, 1) / len(classes), 0.0)
    return (weights / weights[weights > 0].mean()).tolist()


def data_config(cfg: TrainConfig) -> ray.train.DataConfig:
    """Ray Train leaves Ray Data the cluster minus the training workers' resources, counting an
    elastic group at its maximum: `1-4` at 0.8 CPU on 2 CPUs would leave Data nothing. Elastic runs
    leave Data what the smallest group would leave; Ray's scheduler still places Data's
    quarter-CPU tasks only where CPUs are really free."""
    import ray
    import ray.train
    from ray.data import ExecutionOptions, ExecutionResources

    if not isinstance(cfg.num_workers, tuple):
        return ray.train.DataConfig()
    guaranteed = cfg.num_workers[0] * (0 if cfg.use_gpu else cfg.cpus_per_worker)
    data_cpus = max(0.25, ray.cluster_resources().get("CPU", 1) - guaranteed)
    return ray.train.DataConfig(
        execution_options=ExecutionOptions(resource_limits=ExecutionResources(cpu=data_cpus))
    )
