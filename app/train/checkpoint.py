"""Training checkpoints: what an epoch saves, how a worker group resumes from it, and the one safe
way to read one back.

A checkpoint is a plain dict of tensors and containers in `checkpoint.pt`: model, optimiser,
schedule, loss scaler, RNG state, the history so far and the lineage (the table snapshot id and
the classes). It is read with torch's `weights_only` loader, so a checkpoint whose pickle would
run code is refused before any of it runs.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from app import model as core

if TYPE_CHECKING:
    import ray.train

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"


def load_checkpoint(checkpoint: ray.train.Checkpoint) -> dict:
    """A checkpoint's state: tensors and plain containers only (weights_only), never pickled code."""
    with checkpoint.as_directory() as directory:
        return torch.load(Path(directory, CHECKPOINT_FILE), map_location="cpu", weights_only=True)


def resume(
    checkpoint: ray.train.Checkpoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler | None,
    rank: int,
) -> tuple[int, list[dict]]:
    """Load a checkpoint into this worker's objects; returns (the epoch to start at, the history)."""
    state = load_checkpoint(checkpoint)
    core.unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    else:  # a checkpoint from before the schedule: it starts over, the weights carry on
        log.warning("rank %d: the checkpoint has no schedule state; the schedule starts again", rank)
    if scaler and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"][rank % len(state["rng"])])
    log.info("rank %d resumed from the checkpoint of epoch %d", rank, state["epoch"])
    return state["epoch"] + 1, state["history"]


def report_epoch(metrics: dict, state: dict | None) -> None:
    """Every rank reports the epoch's metrics; the rank passing `state` (rank 0) saves it with them.
    Ray Train copies the folder to the run's storage before `report` returns."""
    import ray.train

    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if state is not None:
            torch.save(state, Path(directory, CHECKPOINT_FILE))
            checkpoint = ray.train.Checkpoint.from_directory(directory)
        ray.train.report(metrics, checkpoint=checkpoint)


def epoch_state(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler | None,
    epoch: int,
    history: list[dict],
    snapshot_id: int,
    classes: tuple[str, ...],
) -> dict:
    """Everything a resumed run needs to carry on as if uninterrupted, plus the run's lineage."""
    return {
        "model": core.unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler else None,
        "epoch": epoch,
        "rng": [torch.get_rng_state()],
        "history": history,
        "table_snapshot_id": snapshot_id,
        "classes": list(classes),
    }
