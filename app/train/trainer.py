"""Distributed training: snapshots → Ray Train `TorchTrainer` (DDP, ring all-reduce) → registry.

    python -m app train --model cnn --image-size 64 --epochs 3 --num-workers 2

Data streams from Parquet through Ray Data into each worker's shard. Snapshots hold uint8
pixels: each step augments (`--augment`) and normalises its batch on the worker's device. The newest
`--val-fraction` of records by event time is held out (`app.selection`): its older half picks the
best epoch, its newest half, never seen by that choice, judges promotion. AdamW with a warmup-then-
cosine schedule per step. Every epoch checkpoints model, optimiser, schedule, scaler, RNG state and
lineage; a lost worker restarts the group from the last checkpoint; ranks compare parameter
checksums and the run fails loudly if they differ.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from app import metrics as dashboard
from app import model as core
from app import registry
from app.config import Settings, TrainConfig
from app.data.snapshot import Manifest, data_file_uris, discover_classes, select_snapshots
from app.selection import TEST, TRAIN, VALIDATION, EventTimeSplit, Verdict, promote_if_better
from app.transform import augment, decode_pixels, encode_labels, normalize_pixels, resize_pixels

if TYPE_CHECKING:
    import ray.data
    import ray.train

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
MATERIALIZE_SHARE = 0.25
"""Train and validation slices that fit in this share of the object store are held there."""
FEATURE_BYTES = core.FEATURE_DIM * 4
SHUFFLE_BATCHES = 16
"""Training batches are drawn from a buffer of this many batches' rows, reshuffled each epoch."""
INPUT_TASK_CPUS = 0
"""Training's input tasks reserve no CPU. An elastic group may hold every CPU of a node (after a
node loss it restarts on what is left), and the reads that feed it, or the rebuilding of blocks lost
with the node, must still run: with a quarter CPU each they waited for good (tests/integration/
test_multinode.py). They are light beside the training step they feed."""


# ---------------------------------------------------------------- what runs on each worker


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything a training worker needs, fixed by the driver (Ray passes it as a dict)."""

    run_name: str
    model: str
    features: bool
    backbone_weights: str | None
    classes: tuple[str, ...]
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    label_smoothing: float
    warmup_fraction: float
    train_records: int
    seed: int
    amp: str
    grad_accum: int
    balance: str
    augment: str
    class_weights: tuple[float, ...]
    snapshot_ids: tuple[str, ...]
    threads: int
    fail_at_epoch: int | None
    """Fault injection: rank 1 dies mid-way through this epoch, once per run."""
    fault_marker: str
    steps_per_epoch_hint: int

    @property
    def input_column(self) -> str:
        return "features" if self.features else "image"

    def steps_per_epoch(self, world_size: int) -> int:
        """Optimiser steps of one epoch for this worker group (what the schedule is laid out over)."""
        batches = -(-self.train_records // (self.batch_size * world_size))
        return max(1, -(-batches // self.grad_accum))


def _batches(shard, cfg: WorkerConfig, device: torch.device, seed: int, training: bool):
    """(inputs, targets) on `device`: uint8 pixels arrive as they are stored (a quarter of float32's
    bytes through Ray Data) and are augmented and normalised there, in one batched op each. Training
    batches are drawn from a shuffle buffer, in a new order each epoch; `seed` fixes it, and the
    augmentation and resampling drawn with it."""
    column = cfg.input_column
    generator = torch.Generator().manual_seed(seed)
    shuffle = {"local_shuffle_buffer_size": SHUFFLE_BATCHES * cfg.batch_size, "local_shuffle_seed": seed}
    for batch in shard.iter_torch_batches(
        batch_size=cfg.batch_size,
        drop_last=False,
        dtypes={column: torch.float32 if cfg.features else torch.uint8, "label_index": torch.int64},
        device=device,
        **(shuffle if training else {}),
    ):
        inputs, targets = batch[column], batch["label_index"]
        if training and cfg.balance == "sampler":
            # Streaming data has no global index, so balance within each batch by resampling.
            weights = torch.as_tensor(cfg.class_weights)[targets.cpu()]
            pick = torch.multinomial(weights, len(targets), replacement=True, generator=generator).to(device)
            inputs, targets = inputs[pick], targets[pick]
        if not cfg.features:
            inputs = normalize_pixels(augment(inputs, cfg.augment, generator) if training else inputs)
        yield inputs, targets


def _all_equal_checksums(model: nn.Module) -> str:
    import torch.distributed as dist

    checksum = core.parameter_checksum(model)
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, checksum)
        if len(set(gathered)) != 1:
            raise RuntimeError(f"parameter checksums differ across ranks: {gathered}")
    return checksum


def _reduce_confusion(confusion: list[list[int]], device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    tensor = torch.tensor(confusion, dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.cpu()


def _maybe_inject_fault(cfg: WorkerConfig, epoch: int, step: int, steps_hint: int) -> None:
    """Kill rank 1 half-way through epoch `fail_at_epoch`, once per run (a marker file remembers)."""
    import ray.train

    if cfg.fail_at_epoch != epoch or ray.train.get_context().get_world_rank() != 1:
        return
    marker = Path(cfg.fault_marker)
    if step >= max(1, steps_hint // 2) and not marker.exists():
        # Die once the controller holds the previous epoch's checkpoint: Ray Train registers a
        # report only when it polls the workers, and a worker that dies first takes it along.
        ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(time.time()))
        log.error("fault injection: rank 1 exits mid-epoch %d", epoch)
        os._exit(1)


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    cfg = WorkerConfig(**config)

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = ray.train.torch.get_device()
    num_classes = len(cfg.classes)

    model = core.build_model(cfg.model, num_classes, features=cfg.features, weights=cfg.backbone_weights)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(model)
    optimizer = core.adamw(model, cfg.lr, cfg.weight_decay)
    # Laid out over the steps of the group that starts the run; a resumed run continues its count.
    scheduler = core.warmup_cosine(
        optimizer, cfg.epochs * cfg.steps_per_epoch(context.get_world_size()), cfg.warmup_fraction
    )
    amp = core.amp_dtype(cfg.amp, device)
    scaler = torch.amp.GradScaler(device.type) if amp == torch.float16 else None
    weights = torch.tensor(cfg.class_weights, dtype=torch.float32, device=device)
    loss_fn = nn.CrossEntropyLoss(
        weight=weights if cfg.balance == "weights" else None, label_smoothing=cfg.label_smoothing
    )

    start_epoch, history = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        state = _load_checkpoint(checkpoint)
        core.unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            scheduler.load_state_dict(state["scheduler"])
        else:  # a checkpoint from before the schedule: it starts over, the weights carry on
            log.warning("rank %d: the checkpoint has no schedule state; the schedule starts again", rank)
        if scaler and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"][rank % len(state["rng"])])
        start_epoch, history = state["epoch"] + 1, state["history"]
        log.info("rank %d resumed from the checkpoint of epoch %d", rank, state["epoch"])

    for epoch in range(start_epoch, cfg.epochs):
        started = time.perf_counter()
        epoch_seed = cfg.seed * 1000 + epoch * 10 + rank
        train_batches = _batches(ray.train.get_dataset_shard("train"), cfg, device, epoch_seed, True)
        if cfg.fail_at_epoch is not None:
            train_batches = _with_fault(train_batches, cfg, epoch)
        stats = core.train_epoch(
            model,
            train_batches,
            optimizer,
            loss_fn,
            device=device,
            amp=amp,
            scaler=scaler,
            grad_accum=cfg.grad_accum,
            scheduler=scheduler,
        )
        train_seconds = time.perf_counter() - started
        val = core.evaluate(
            model,
            _batches(ray.train.get_dataset_shard("val"), cfg, device, epoch_seed, False),
            num_classes,
            device=device,
        )
        confusion = _reduce_confusion(val["confusion"], device)
        support = confusion.sum(1)
        recall = [(confusion[i, i] / support[i]).item() if support[i] else None for i in range(num_classes)]
        checksum = _all_equal_checksums(model)
        seconds = time.perf_counter() - started
        metrics = {
            "epoch": epoch,
            "train_loss": stats["loss"],
            "train_accuracy": stats["accuracy"],
            "val_accuracy": (confusion.diag().sum() / max(int(support.sum()), 1)).item(),
            "val_examples": int(support.sum()),
            "epoch_seconds": seconds,
            "images_per_second": stats["examples"] * context.get_world_size() / seconds,
            # The training pass alone, data path included (the epoch adds validation and a checkpoint).
            "train_images_per_second": stats["examples"] * context.get_world_size() / train_seconds,
            "workers": context.get_world_size(),
            "lr": scheduler.get_last_lr()[0],
            "steps": scheduler.last_epoch,
            "finished_at": time.time(),
            "checksum": checksum,
            "per_class_recall": recall,
        }
        history.append({k: v for k, v in metrics.items() if k != "per_class_recall"})
        if rank == 0:
            for gauge, key in (
                ("argus_train_loss", "train_loss"),
                ("argus_train_val_accuracy", "val_accuracy"),
                ("argus_train_images_per_second", "images_per_second"),
                ("argus_train_epoch_seconds", "epoch_seconds"),
            ):
                dashboard.set_gauge(gauge, metrics[key], run=cfg.run_name)
        with tempfile.TemporaryDirectory() as directory:
            report_checkpoint = None
            if rank == 0:
                torch.save(
                    {
                        "model": core.unwrap(model).state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict() if scaler else None,
                        "epoch": epoch,
                        "rng": [torch.get_rng_state()],
                        "history": history,
                        "snapshots": list(cfg.snapshot_ids),
                        "classes": list(cfg.classes),
                    },
                    Path(directory, CHECKPOINT_FILE),
                )
                report_checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report(metrics, checkpoint=report_checkpoint)


def _with_fault(batches, cfg: WorkerConfig, epoch: int):
    steps_hint = cfg.steps_per_epoch_hint
    for step, batch in enumerate(batches):
        _maybe_inject_fault(cfg, epoch, step, steps_hint)
        yield batch


# ---------------------------------------------------------------- the driver


@dataclass
class TrainReport:
    version: str
    run_id: str
    metrics: dict
    epochs: int
    classes: list[str]
    checksum: str
    verdict: Verdict | None = None
    """The test-slice comparison with the champion, when `--promote-if-better` asked for it."""


@dataclass
class Datasets:
    """The three event-time slices of the snapshots, as Ray datasets of (input, label_index)."""

    train: ray.data.Dataset
    val: ray.data.Dataset
    test: ray.data.Dataset
    split: EventTimeSplit


def build_datasets(
    settings: Settings, manifests: list[Manifest], classes: list[str], val_fraction: float, features: bool
) -> Datasets:
    """Train, validation and test datasets cut at event-time quantiles (`app.selection`)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # reproducible shards
    # Ray 2.57's parquet reader (datasource V2) lists files in 1-CPU tasks that take no
    # `ray_remote_args`: behind workers that hold every CPU they never run. The V1 reader honours
    # INPUT_TASK_CPUS.
    context.use_datasource_v2 = False
    paths = data_file_uris(settings, manifests)  # only the files the manifests list, checked
    column = "features" if features else "image"
    # Snapshots cut at another size keep their sources (`select_snapshots` checked): resize those.
    resize = not features and any(m.image_size != settings.image_size for m in manifests)
    stored = "source" if resize else column
    size = settings.image_size
    read_args = {"file_extensions": ["parquet"], "ray_remote_args": {"num_cpus": INPUT_TASK_CPUS}}
    times = ray.data.read_parquet(paths, columns=["event_time", "label"], **read_args).to_pandas()
    split = EventTimeSplit.of(times[times["label"].isin(classes)]["event_time"].to_numpy(), val_fraction)
    dataset = ray.data.read_parquet(paths, columns=[stored, "label", "event_time"], **read_args)

    def labelled(batch):
        # One map does label filter, slice tag and projection: a separate filter or select_columns
        # op would schedule 1-CPU tasks.
        rows = np.isin(batch["label"], classes)
        if rows.any():  # an empty tensor column would not convert to Arrow
            inputs = batch[stored][rows]
            if resize:
                inputs = resize_pixels([decode_pixels(v) for v in inputs], size).numpy()
            yield {
                column: inputs,
                "label_index": encode_labels(batch["label"][rows], classes),
                "slice": split.slice_of(batch["event_time"][rows]).astype(np.int8),
            }

    rows = dataset.map_batches(labelled, batch_format="numpy", num_cpus=INPUT_TASK_CPUS)
    record_bytes = FEATURE_BYTES if features else 3 * size * size  # uint8 pixels
    input_bytes = (split.train + split.val + split.test) * record_bytes
    held = input_bytes <= MATERIALIZE_SHARE * _object_store_bytes()
    if held:
        # Read once, not once per slice and epoch: the epochs then stream from memory, and no read
        # task competes with the training workers for the cores.
        log.info("holding the input (%.1f MB) in the object store", input_bytes / 1e6)
        rows = rows.materialize()
    else:
        log.info(
            "streaming the input (%.1f MB, over %.0f%% of the object store) from storage every epoch",
            input_bytes / 1e6,
            100 * MATERIALIZE_SHARE,
        )

    def event_slice(wanted: int):
        def keep(batch):
            chosen = batch["slice"] == wanted
            if chosen.any():
                yield {column: batch[column][chosen], "label_index": batch["label_index"][chosen]}

        sliced = rows.map_batches(keep, batch_format="numpy", num_cpus=INPUT_TASK_CPUS)
        return sliced.materialize() if held else sliced

    return Datasets(event_slice(TRAIN), event_slice(VALIDATION), event_slice(TEST), split)


def _object_store_bytes() -> float:
    import ray

    return ray.cluster_resources().get("object_store_memory", 0)


def class_weights(manifests: list[Manifest], classes: list[str]) -> list[float]:
    """Inverse-frequency weights, mean 1: rare classes count as much as common ones in the loss."""
    counts = np.array([sum(m.label_counts.get(c, 0) for m in manifests) for c in classes], dtype=np.float64)
    weights = np.where(counts > 0, counts.sum() / np.maximum(counts, 1) / len(classes), 0.0)
    return (weights / weights[weights > 0].mean()).tolist()


def train(settings: Settings, cfg: TrainConfig) -> TrainReport:
    """`python -m app train`: fit on snapshots, log to MLflow, register the best epoch's model."""
    import ray.train
    from ray.train.torch import TorchTrainer

    manifests = select_snapshots(settings, cfg.snapshots)
    classes = discover_classes(manifests, settings.classes)
    if len(classes) < 2:
        raise ValueError(f"training needs at least two classes; the snapshots have {classes}")
    features = all(m.features for m in manifests)
    backbone_weights = manifests[0].features_weights if features else cfg.weights
    arch = "resnet50" if features else settings.model
    data = build_datasets(settings, manifests, classes, cfg.val_fraction, features)
    split = data.split
    log.info(
        "training on %d records; the newest %d pick the epoch (event time >= %d), the %d after them "
        "judge it (event time >= %d)",
        split.train,
        split.val,
        split.val_from,
        split.test,
        split.test_from,
    )

    run_name = cfg.run_name or time.strftime("train-%Y%m%d-%H%M%S")
    storage_path = settings.uri("checkpoints", "train")
    if settings.is_local_storage:
        os.makedirs(storage_path, exist_ok=True)
    worker_config = WorkerConfig(
        run_name=run_name,
        model=arch,
        features=features,
        backbone_weights=backbone_weights,
        classes=tuple(classes),
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        label_smoothing=cfg.label_smoothing,
        warmup_fraction=cfg.warmup_fraction,
        train_records=split.train,
        seed=cfg.seed,
        amp=cfg.amp,
        grad_accum=cfg.grad_accum,
        balance=cfg.balance,
        augment=cfg.augment,
        class_weights=tuple(class_weights(manifests, classes)),
        snapshot_ids=tuple(m.snapshot_id for m in manifests),
        threads=max(1, int(cfg.cpus_per_worker)) if not cfg.use_gpu else 4,
        fail_at_epoch=cfg.fail_at_epoch,
        fault_marker=f"{storage_path}/{run_name}/.fault-fired",
        steps_per_epoch_hint=max(1, split.train // (cfg.batch_size * cfg.max_workers)),
    )
    progress = _EpochLines(cfg.epochs)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=dataclasses.asdict(worker_config),
        # A (min, max) pair makes the worker group elastic: it starts with what fits and grows.
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers,
            use_gpu=cfg.use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker},
            elastic_resize_monitor_interval_s=cfg.resize_check_s,
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_accuracy", checkpoint_score_order="max"
            ),
            callbacks=[progress.callback],
        ),
        datasets={"train": data.train, "val": data.val},
        dataset_config=_data_config(cfg),
    )
    with progress:
        result = trainer.fit()
    if result.error:
        raise RuntimeError(f"training failed: {result.error}")
    best_checkpoint, best_metrics = max(result.best_checkpoints, key=lambda cm: cm[1]["val_accuracy"])
    state = _load_checkpoint(best_checkpoint)
    history = _load_checkpoint(result.checkpoint)["history"]  # the latest one has every epoch
    net = core.build_model(arch, len(classes), features=features, weights=backbone_weights)
    net.load_state_dict(state["model"])
    test_accuracy = partial(_accuracy_on, data.test, "features" if features else "image", len(classes))
    candidate_accuracy = test_accuracy(net.eval())
    log.info(
        "best epoch %d: validation %.3f, test slice %.3f",
        best_metrics["epoch"],
        best_metrics["val_accuracy"],
        candidate_accuracy,
    )

    card = registry.ModelCard(
        arch=arch,
        classes=classes,
        image_size=settings.image_size,
        features=features,
        training_kind="ddp",
        snapshots=[m.lineage() for m in manifests],
        metrics={
            "val_accuracy": best_metrics["val_accuracy"],
            "test_accuracy": candidate_accuracy,
            "train_loss": best_metrics["train_loss"],
            "epoch": best_metrics["epoch"],
        },
        split=split.to_dict(),
    )
    params = {
        **{k: v for k, v in asdict(cfg).items() if k != "snapshots"},
        "model": settings.model,
        "image_size": settings.image_size,
        "classes": ",".join(classes),
        "snapshots": ",".join(worker_config.snapshot_ids),
    }
    recall = {
        f"val_recall.{name}": r for name, r in zip(classes, best_metrics["per_class_recall"]) if r is not None
    }
    run_id = registry.log_run(
        settings,
        run_name=run_name,
        params=params,
        history=history,
        step="epoch",
        metrics={
            **recall,
            "best_val_accuracy": best_metrics["val_accuracy"],
            "test_accuracy": candidate_accuracy,
        },
        title=f"{run_name} ({settings.model})",
    )
    version = registry.register(settings.tracking_uri, settings.model_name, run_id, net, card)
    verdict = None
    if cfg.promote_if_better:
        verdict = promote_if_better(settings, version, run_id, card, candidate_accuracy, test_accuracy)
    report_metrics = {**best_metrics, "test_accuracy": candidate_accuracy}
    return TrainReport(
        version, run_id, report_metrics, len(history), classes, history[-1]["checksum"], verdict
    )


class _EpochLines:
    """One line per epoch on the driver while `fit` runs (Ray's own report lines stay in its logs):
    a Train callback, run on the controller, passes rank 0's metrics through a queue to a thread.
    Progress lines are best effort: nothing here may fail a run."""

    def __init__(self, epochs: int):
        import ray.train
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        class Relay(ray.train.UserCallback):
            def __init__(self, queue):
                self.queue = queue

            def after_report(self, run_context, metrics, checkpoint):
                try:
                    self.queue.put(metrics[0], timeout=5)
                except Exception:  # the queue gone or full: lose a progress line, not the run
                    log.debug("epoch line dropped", exc_info=True)

        # On the driver's node: a 0-CPU actor may land anywhere, and one on a node that dies would
        # take the progress lines with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.epochs = epochs
        self.queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})
        self.callback = Relay(self.queue)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)

    def __enter__(self):
        self._thread.start()

    def __exit__(self, *exc):
        self._done.set()  # every report is in the queue once `fit` returns: the thread drains it
        self._thread.join()
        self.queue.shutdown()

    def _relay(self) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                m = self.queue.get(timeout=0.5)
            except Empty:
                if self._done.is_set():
                    return
                continue
            except Exception:  # the queue's actor is gone: no more lines
                log.debug("epoch lines stopped", exc_info=True)
                return
            log.info(
                "epoch %d/%d: train loss %.3f, validation accuracy %.3f, %.0f images/s, %.1fs",
                m["epoch"] + 1,
                self.epochs,
                m["train_loss"],
                m["val_accuracy"],
                m["images_per_second"],
                m["epoch_seconds"],
            )


def _accuracy_on(dataset, column: str, num_classes: int, model: nn.Module) -> float:
    """A model's accuracy on a dataset of stored inputs, normalised as the training step does."""

    def batches():
        for batch in dataset.iter_torch_batches(batch_size=256):
            inputs = batch[column]
            yield (inputs.float() if column == "features" else normalize_pixels(inputs)), batch["label_index"]

    return core.evaluate(model, batches(), num_classes, device=torch.device("cpu"))["accuracy"]


def _data_config(cfg: TrainConfig) -> ray.train.DataConfig:
    """Ray Train leaves Ray Data the cluster minus the training workers' resources, counting an
    elastic group at its maximum: `1-4` at 0.8 CPU on 2 CPUs would leave Data nothing. Elastic runs
    leave Data what the smallest group would leave; Ray's scheduler still places Data's
    quarter-CPU tasks only where CPUs are really free."""
    import ray
    from ray.data import ExecutionOptions, ExecutionResources

    if not isinstance(cfg.num_workers, tuple):
        return ray.train.DataConfig()
    guaranteed = cfg.num_workers[0] * (0 if cfg.use_gpu else cfg.cpus_per_worker)
    data_cpus = max(0.25, ray.cluster_resources().get("CPU", 1) - guaranteed)
    return ray.train.DataConfig(
        execution_options=ExecutionOptions(resource_limits=ExecutionResources(cpu=data_cpus))
    )


def _load_checkpoint(checkpoint) -> dict:
    """A checkpoint's state: tensors and plain containers only (weights_only), never pickled code."""
    with checkpoint.as_directory() as directory:
        return torch.load(Path(directory, CHECKPOINT_FILE), map_location="cpu", weights_only=True)
