"""What runs on each Ray Train worker: `train_loop_per_worker` and its typed `WorkerConfig`.

Each worker streams its shard of the table snapshot through Ray Data, augments and normalises each batch
on its device, takes `core.train_epoch` (DDP, AMP, gradient accumulation), evaluates on its
validation shard, checks that every rank holds the same parameters, and reports the epoch with a
checkpoint (`app.train.checkpoint`). The driver (`app.train.trainer`) builds the config and starts
the group.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from app import metrics as dashboard
from app import model as core
from app.train.checkpoint import epoch_state, report_epoch, resume
from app.transform import augment, normalize_pixels

log = logging.getLogger(__name__)

SHUFFLE_BATCHES = 16
"""Training batches are drawn from a buffer of this many batches' rows, reshuffled each epoch."""


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
    snapshot_id: int
    """The table snapshot the run reads: its checkpoints record it."""
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


def _counting_classes(batches: Iterable, counts: torch.Tensor) -> Iterator:
    """Pass batches through, adding each one's targets to `counts` (what the model was shown)."""
    for inputs, targets in batches:
        counts += torch.bincount(targets, minlength=len(counts))
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


def _summed_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

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


def _with_fault(batches, cfg: WorkerConfig, epoch: int):
    steps_hint = cfg.steps_per_epoch_hint
    for step, batch in enumerate(batches):
        _maybe_inject_fault(cfg, epoch, step, steps_hint)
        yield batch


def train_loop_per_worker(config: dict) -> None:
    import ray.train
    import ray.train.torch

    cfg = WorkerConfig(**config)

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    num_classes = len(cfg.classes)

    model = core.build_model(cfg.model, num_classes, features=cfg.features, weights=cfg.backbone_weights)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(model)
    optimizer = core.adamw(model, cfg.lr, cfg.weight_decay)
    # Laid out over the steps of the group that starts the run; a resumed run continues its count.
    scheduler = core.warmup_cosine(
        optimizer, cfg.epochs * cfg.steps_per_epoch(world_size), cfg.warmup_fraction
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
        start_epoch, history = resume(
            checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, rank=rank
        )

    for epoch in range(start_epoch, cfg.epochs):
        started = time.perf_counter()
        epoch_seed = cfg.seed * 1000 + epoch * 10 + rank
        shown = torch.zeros(num_classes, dtype=torch.int64, device=device)
        train_batches = _batches(ray.train.get_dataset_shard("train"), cfg, device, epoch_seed, True)
        train_batches = _counting_classes(train_batches, shown)
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
        confusion = _summed_over_ranks(torch.tensor(val["confusion"], dtype=torch.int64, device=device))
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
            "images_per_second": stats["examples"] * world_size / seconds,
            # The training pass alone, data path included (the epoch adds validation and a checkpoint).
            "train_images_per_second": stats["examples"] * world_size / train_seconds,
            "workers": world_size,
            "lr": scheduler.get_last_lr()[0],
            "steps": scheduler.last_epoch,
            "micro_batches": stats["micro_batches"],  # this rank's; equal shards give every rank as many
            # Every rank's training examples by class, after `--balance sampler` resampled them.
            "train_examples_per_class": _summed_over_ranks(shown).tolist(),
            "finished_at": time.time(),
            "checksum": checksum,
            "per_class_recall": recall,
        }
        history.append({k: v for k, v in metrics.items() if k != "per_class_recall"})
        state = None
        if rank == 0:
            for gauge, key in (
                ("argus_train_loss", "train_loss"),
                ("argus_train_val_accuracy", "val_accuracy"),
                ("argus_train_images_per_second", "images_per_second"),
                ("argus_train_epoch_seconds", "epoch_seconds"),
            ):
                dashboard.set_gauge(gauge, metrics[key], run=cfg.run_name)
            state = epoch_state(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                epoch=epoch,
                history=history,
                snapshot_id=cfg.snapshot_id,
                classes=cfg.classes,
            )
        report_epoch(metrics, state)
