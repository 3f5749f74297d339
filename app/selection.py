"""Honest selection and promotion: the event-time split, and the champion comparison.

    oldest ─────────── train ───────────┬── validation ──┬── test ── newest
                                     val_from         test_from

The newest `val_fraction` of records by event time is held out and cut in two at its event-time
median: validation picks the best epoch, and the test slice, which nothing that chose the model
ever saw, judges the candidate against the champion. Training and federated learning split the
same snapshots the same way, so a centralised and a federated version are judged on one slice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

log = logging.getLogger(__name__)

TRAIN, VALIDATION, TEST = 0, 1, 2


@dataclass(frozen=True)
class EventTimeSplit:
    """Where the event-time slices start, and how many records each holds."""

    val_from: int
    test_from: int
    train: int
    val: int
    test: int

    @classmethod
    def of(cls, event_times: np.ndarray, val_fraction: float) -> EventTimeSplit:
        """Split at the (1 − val_fraction) and (1 − val_fraction / 2) event-time quantiles; every
        slice must hold records (ValueError otherwise)."""
        if not 0 < val_fraction < 1:
            raise ValueError(f"--val-fraction must lie in (0, 1), not {val_fraction}")
        times = np.asarray(event_times, dtype=np.int64)
        if len(times) == 0:
            raise ValueError("no labelled records to split")
        val_from = int(np.quantile(times, 1 - val_fraction))
        test_from = int(np.quantile(times, 1 - val_fraction / 2))
        slices = np.where(times >= test_from, TEST, np.where(times >= val_from, VALIDATION, TRAIN))
        train, val, test = (int((slices == s).sum()) for s in (TRAIN, VALIDATION, TEST))
        if not (train and val and test):
            raise ValueError(
                f"the event-time split left {train} train, {val} validation and {test} test records "
                f"(--val-fraction {val_fraction}); ingest more records or spread their event times"
            )
        return cls(val_from, test_from, train, val, test)

    def slice_of(self, event_times: np.ndarray) -> np.ndarray:
        """TRAIN, VALIDATION or TEST for each event time."""
        times = np.asarray(event_times, dtype=np.int64)
        return np.where(times >= self.test_from, TEST, np.where(times >= self.val_from, VALIDATION, TRAIN))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate version takes the alias, and the test-slice figures that decided it."""

    promoted: bool
    reason: str
    candidate_accuracy: float
    champion_version: str | None = None
    champion_accuracy: float | None = None

    def metrics(self) -> dict[str, float]:
        """What the candidate's MLflow run records of the comparison (its own test accuracy it has)."""
        figures = {"promoted": float(self.promoted)}
        if self.champion_accuracy is not None:
            figures["champion_test_accuracy"] = self.champion_accuracy
        return figures


def promote_if_better(
    settings,
    version: str,
    run_id: str,
    card,
    candidate_accuracy: float,
    test_accuracy: Callable[[object], float],
) -> Verdict:
    """Move the serving alias to `version` only if its test-slice accuracy beats the champion's on
    the same slice (`test_accuracy(model)` evaluates a model there); a tie keeps the champion, and
    so does a champion with other classes, image size or inputs (not comparable). The figures go
    to the version's MLflow run and tags."""
    from app import registry

    champion = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    verdict = Verdict(True, "no champion yet", candidate_accuracy)
    if champion == version:  # registration gives the first version of a name the alias
        verdict = Verdict(True, f"the first version of {settings.model_name}", candidate_accuracy)
    elif champion is not None:
        current = registry.load(settings.tracking_uri, settings.model_name, champion)
        fits = (current.card.classes, current.card.image_size, current.card.features) == (
            card.classes,
            card.image_size,
            card.features,
        )
        if not fits:
            verdict = Verdict(
                False,
                f"champion v{champion} has other classes, image size or inputs: not comparable",
                candidate_accuracy,
                champion,
            )
        else:
            accuracy = test_accuracy(current.model.eval())
            better = candidate_accuracy > accuracy
            verdict = Verdict(
                better,
                f"test slice: v{version} {candidate_accuracy:.3f} "
                f"{'>' if better else '<='} champion v{champion} {accuracy:.3f}",
                candidate_accuracy,
                champion,
                accuracy,
            )
    if verdict.promoted:
        registry.promote(settings.tracking_uri, settings.model_name, version)
    registry.record_metrics(settings.tracking_uri, settings.model_name, version, run_id, verdict.metrics())
    outcome = "promoted" if verdict.promoted else "kept the champion, not"
    log.info("%s v%s: %s", outcome, version, verdict.reason)
    return verdict
