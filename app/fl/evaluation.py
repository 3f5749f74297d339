"""The server-side evaluation: after every round the global model is judged on the central test
slice, which no client reads (`federate` cuts it with `app.selection.EventTimeSplit`)."""

from __future__ import annotations

import copy

import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import nn

from app.fl.task import CPU, evaluate_pixels, load_arrays


class CentralEvaluation:
    """The global model judged on the central test slice, on the server, after every round.

    Called as Flower's `Strategy.start(evaluate_fn=...)` calls its hook, `(round, arrays) →
    MetricRecord` (`test_accuracy`, `test_loss`); `evaluate(model)` scores any model on the same
    rows (the champion, when `--promote-if-better` compares). Pixels stay uint8 and are normalised
    batch by batch on `device`.
    """

    def __init__(
        self,
        model: nn.Module,
        images: torch.Tensor,
        labels: torch.Tensor,
        num_classes: int,
        device: torch.device = CPU,
    ):
        self.model = copy.deepcopy(model).to(device)  # the caller's model keeps its weights and device
        self.images, self.labels, self.num_classes, self.device = images, labels, num_classes, device

    def evaluate(self, model: nn.Module) -> dict:
        return evaluate_pixels(
            model.to(self.device), self.images, self.labels, self.num_classes, device=self.device
        )

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        load_arrays(self.model, arrays)
        result = self.evaluate(self.model)
        return MetricRecord({"test_accuracy": float(result["accuracy"]), "test_loss": float(result["loss"])})
