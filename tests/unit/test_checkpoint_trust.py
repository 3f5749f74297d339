"""A training checkpoint is data, never code: one whose pickle would run something is refused
(torch's weights_only loader) before any of it runs, while a real one loads."""

from __future__ import annotations

import pickle

import pytest
import torch
from ray.train import Checkpoint

from app.model import build_model
from app.train.trainer import CHECKPOINT_FILE, _load_checkpoint


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
        _load_checkpoint(Checkpoint.from_directory(str(folder)))
    assert not marker.exists()

    del state["payload"]
    torch.save(state, folder / CHECKPOINT_FILE)
    assert _load_checkpoint(Checkpoint.from_directory(str(folder)))["epoch"] == 2
