"""A training checkpoint is data, never code: one whose pickle would run something is refused
(torch's weights_only loader) before any of it runs, while a real one loads."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray.train import Checkpoint

from app.model import build_model
from app.train.checkpoint import CHECKPOINT_FILE, epoch_state, load_checkpoint, resume


class _WritesAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    marker = tmp_path / "ran"
    state = {"model": build_model("cnn", 3).state_dict(), "epoch": 2, "payload": _WritesAFile(marker)}
    torch.save(state, folder / CHECKPOINT_FILE)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_checkpoint(Checkpoint.from_directory(str(folder)))
    assert not marker.exists()

    del state["payload"]
    torch.save(state, folder / CHECKPOINT_FILE)
    assert load_checkpoint(Checkpoint.from_directory(str(folder)))["epoch"] == 2


def test_what_an_epoch_saves_loads_safely_and_resumes_a_worker(tmp_path):
    """The loop's checkpoint (history rows with lists included) passes the weights_only loader,
    and `resume` puts model, optimiser, schedule and RNG back where the epoch left them."""
    from app import model as core

    torch.manual_seed(0)
    net = build_model("cnn", 3)
    optimizer = core.adamw(net, lr=1e-2, weight_decay=0.05)
    schedule = core.warmup_cosine(optimizer, total_steps=10, warmup_fraction=0.2)
    for _ in range(3):
        net(torch.randn(4, 3, 16, 16)).sum().backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    history = [{"epoch": 4, "checksum": "abc", "train_examples_per_class": [5, 6, 7]}]
    state = epoch_state(
        model=net,
        optimizer=optimizer,
        scheduler=schedule,
        scaler=None,
        epoch=4,
        history=history,
        snapshot_id=4242,
        classes=("a", "b", "c"),
    )
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    torch.save(state, folder / CHECKPOINT_FILE)
    next_draw = torch.rand(1)  # what the saved RNG state yields next

    fresh = build_model("cnn", 3)
    fresh_optimizer = core.adamw(fresh, lr=1e-2, weight_decay=0.05)
    fresh_schedule = core.warmup_cosine(fresh_optimizer, total_steps=10, warmup_fraction=0.2)
    start, resumed_history = resume(
        Checkpoint.from_directory(str(folder)),
        model=fresh,
        optimizer=fresh_optimizer,
        scheduler=fresh_schedule,
        scaler=None,
        rank=1,
    )
    assert (start, resumed_history) == (5, history)
    lineage = load_checkpoint(Checkpoint.from_directory(str(folder)))
    assert (lineage["table_snapshot_id"], lineage["classes"]) == (4242, ["a", "b", "c"])
    assert core.parameter_checksum(fresh) == core.parameter_checksum(net)
    assert fresh_schedule.last_epoch == 3 and fresh_schedule.get_last_lr() == schedule.get_last_lr()
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 3
    assert torch.equal(torch.rand(1), next_draw)
