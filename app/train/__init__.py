"""The training stage: Ray Train's `TorchTrainer` over a table snapshot, registered in MLflow.

`python -m app train` runs it; `train()` is the one entry point."""

from app.train.trainer import train

__all__ = ["train"]
