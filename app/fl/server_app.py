"""The server: the guard in front of Flower's strategies, the privacy accountant, the server-side
evaluation on the central test slice, and the rounds as a Flower `ServerApp` (sample → train →
guard + aggregate → evaluate on clients → evaluate centrally → checkpoint)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import GaussianPrivacyEvent, Grid, PrivacySpent, ServerApp
from flwr.serverapp import strategy as flwr_strategy
from torch import nn
from tqdm import tqdm

from app import metrics
from app.fl.checkpoint import save_checkpoint
from app.fl.config import FederateConfig
from app.fl.task import CPU, evaluate_pixels, load_arrays

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the guard and the strategies


@dataclass
class GuardOutcome:
    """What the guard did with one round's train replies."""

    received: int = 0
    failed: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rejections by kind: malformed, non_finite, outlier."""
    accepted: int = 0
    abandoned: bool = False


class GuardedStrategy(flwr_strategy.Strategy):
    """What the server does with updates before a Flower strategy aggregates them.

    Replies are taken in node order (deterministic sums); each update must hold exactly the global
    model's arrays, all finite; with three or more, a norm above `outlier_factor` × the median is
    rejected. Accepted fp16/fp32 deltas become fp32 weights (global + delta) with an aggregation
    `weight`: the client's example count, or 1 under differential privacy. Fewer than
    `min_clients` accepted updates abandon the round. `last` describes the latest round.
    """

    def __init__(
        self,
        inner: flwr_strategy.Strategy,
        *,
        min_clients: int,
        outlier_factor: float | None,
        uniform_weights: bool,
    ):
        self.inner, self.min_clients = inner, min_clients
        self.outlier_factor, self.uniform_weights = outlier_factor, uniform_weights
        self._global: dict[str, np.ndarray] = {}
        self.last = GuardOutcome()

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round, arrays, config, grid):
        self._global = {k: np.asarray(a.numpy(), dtype=np.float32) for k, a in arrays.items()}
        return self.inner.configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def _check(self, reply: Message) -> tuple[str | None, str, dict[str, np.ndarray], float]:
        """(rejection kind or None, why, fp32 delta, L2 norm) of one reply."""
        records = reply.content.array_records
        if list(records) != ["arrays"] or len(reply.content.metric_records) != 1:
            return "malformed", f"records {list(records)}", {}, 0.0
        record = records["arrays"]
        if set(record) != set(self._global):
            return "malformed", "its arrays are not the model's", {}, 0.0
        delta = {}
        for key, array in record.items():
            value = array.numpy()
            if value.dtype not in (np.float16, np.float32) or value.shape != self._global[key].shape:
                return "malformed", f"array {key} is {value.dtype}{list(value.shape)}", {}, 0.0
            delta[key] = value.astype(np.float32)
        if not all(np.isfinite(v).all() for v in delta.values()):
            return "non_finite", "NaN/Inf in the update", {}, 0.0
        norm = math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in delta.values()))
        return None, "", delta, norm

    def aggregate_train(self, server_round, replies):
        replies = sorted(replies, key=lambda m: m.metadata.src_node_id)
        self.last = GuardOutcome(received=len(replies), failed=sum(r.has_error() for r in replies))
        checked = []
        for reply in (r for r in replies if not r.has_error()):
            kind, why, delta, norm = self._check(reply)
            if kind:
                self._reject(server_round, reply, kind, why)
            else:
                checked.append((reply, delta, norm))
        if self.outlier_factor and len(checked) >= 3:
            median = float(np.median([norm for *_, norm in checked]))
            keep = []
            for reply, delta, norm in checked:
                if norm > self.outlier_factor * median:
                    self._reject(
                        server_round,
                        reply,
                        "outlier",
                        f"update norm {norm:.3g} > {self.outlier_factor:g} x the median {median:.3g}",
                    )
                else:
                    keep.append((reply, delta, norm))
            checked = keep
        self.last.accepted = len(checked)
        if len(checked) < self.min_clients:
            log.warning(
                "round %d abandoned: %d valid update(s), fewer than --min-clients %d; the model stays",
                server_round,
                len(checked),
                self.min_clients,
            )
            self.last.abandoned = True
            return None, None
        for reply, delta, _ in checked:
            weights = {k: Array(self._global[k] + delta[k]) for k in self._global}
            reply.content["arrays"] = ArrayRecord(weights)
            reply_metrics = reply.content["metrics"]
            reply_metrics["weight"] = 1.0 if self.uniform_weights else float(reply_metrics["num-examples"])
        return self.inner.aggregate_train(server_round, [reply for reply, *_ in checked])

    def _reject(self, server_round: int, reply: Message, kind: str, why: str) -> None:
        self.last.rejected[kind] = self.last.rejected.get(kind, 0) + 1
        log.warning(
            "round %d: update from node %d rejected (%s): %s",
            server_round,
            reply.metadata.src_node_id,
            kind,
            why,
        )

    def aggregate_evaluate(self, server_round, replies):
        valid = [
            r
            for r in replies
            if not r.has_error()
            and r.content.metric_records
            and next(iter(r.content.metric_records.values())).get("num-examples", 0) > 0
        ]
        for reply in valid:
            reply_metrics = next(iter(reply.content.metric_records.values()))
            reply_metrics["weight"] = float(reply_metrics["num-examples"])
        return self.inner.aggregate_evaluate(server_round, valid) if valid else None


def build_strategy(cfg: FederateConfig) -> GuardedStrategy:
    """The Flower strategy for `cfg.strategy`, in Flower's DP wrapper when clipping, behind the guard."""
    evaluate = cfg.evaluate_clients or cfg.clients
    common = {
        "fraction_train": cfg.clients_per_round / cfg.clients,
        "min_train_nodes": cfg.clients_per_round,
        "fraction_evaluate": evaluate / cfg.clients,
        "min_evaluate_nodes": evaluate,
        "min_available_nodes": cfg.clients_per_round,
        "weighted_by_key": "weight",
    }
    strategies = {
        "fedavg": lambda: flwr_strategy.FedAvg(**common),
        "fedprox": lambda: flwr_strategy.FedProx(**common, proximal_mu=cfg.mu),
        "fedmedian": lambda: flwr_strategy.FedMedian(**common),
        "fedtrimmedavg": lambda: flwr_strategy.FedTrimmedAvg(**common, beta=cfg.trimmed_beta),
        "krum": lambda: flwr_strategy.Krum(**common, num_malicious_nodes=cfg.krum_malicious),
    }
    inner = strategies[cfg.strategy]()
    if cfg.dp:
        inner = flwr_strategy.DifferentialPrivacyServerSideFixedClipping(
            inner, cfg.dp_noise, cfg.dp_clip, cfg.clients_per_round
        )
    return GuardedStrategy(
        inner,
        min_clients=cfg.min_clients,
        outlier_factor=None if cfg.dp else cfg.outlier_factor,
        uniform_weights=cfg.dp,
    )


# ---------------------------------------------------------------- privacy


class GaussianAccountant:
    """Privacy spent by Gaussian releases, composed in Rényi DP without sampling amplification.

    A release with noise multiplier z costs α/(2z²) at order α (Mironov 2017); releases add up, and
    the best order gives ε = S + 2·sqrt(S·ln(1/δ)) with S = Σ 1/(2z²). It has the shape of Flower's
    `PrivacyAccountant` (`compose`, `get_privacy_spent`), without the optional dp-accounting package.
    """

    def __init__(self, delta: float, noise_multipliers: Iterable[float] = ()):
        self.delta, self.noise_multipliers = delta, list(noise_multipliers)

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        self.noise_multipliers += [event.noise_multiplier] * count

    def get_privacy_spent(self) -> PrivacySpent:
        s = sum(1 / (2 * z * z) for z in self.noise_multipliers)
        epsilon = s + 2 * math.sqrt(s * math.log(1 / self.delta))
        return PrivacySpent(
            epsilon=epsilon,
            delta=self.delta,
            num_releases=len(self.noise_multipliers),
            accounting_method="rdp-gaussian",
        )


# ---------------------------------------------------------------- server-side evaluation


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


# ---------------------------------------------------------------- the rounds


@contextlib.contextmanager
def _seeded(*parts: int):
    """Seed Python's and NumPy's global RNGs (Flower samples and adds DP noise with them), then restore."""
    saved = random.getstate(), np.random.get_state()
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def _postprocess(arrays: ArrayRecord) -> ArrayRecord:
    """fp32 global arrays; BatchNorm variances kept non-negative after DP noise (post-processing)."""
    out = {}
    for key, array in arrays.items():
        value = np.asarray(array.numpy(), dtype=np.float32)
        out[key] = Array(np.maximum(value, 0) if key.endswith("running_var") else value)
    return ArrayRecord(out)


@dataclass
class Federation:
    """What the ServerApp's rounds need and leave behind."""

    cfg: FederateConfig
    model: nn.Module
    arrays: ArrayRecord
    classes: list[str]
    snapshot_uris: list[str]
    checkpoint_uri: str
    fingerprint: dict
    val_from: int
    """Event time at which the central split's validation slice starts."""
    test_from: int
    """Event time at which the central test slice starts: no client reads a record from it on."""
    run_name: str = ""
    init_version: str | None = None
    start_round: int = 0
    history: list = dataclasses.field(default_factory=list)
    accountant: GaussianAccountant | None = None

    def client_config(self, server_round: int) -> ConfigRecord:
        cfg = self.cfg
        config = {
            "arch": self.fingerprint["arch"],
            "classes": list(self.classes),
            "snapshots": list(self.snapshot_uris),
            "seed": cfg.seed,
            "val-from": self.val_from,
            "test-from": self.test_from,
            "local-epochs": cfg.local_epochs,
            "batch-size": cfg.batch_size,
            "lr": cfg.lr,
            "update-dtype": cfg.update_dtype,
            "augment": cfg.augment,
        }
        if cfg.inject_faults:
            config["faults"] = list(cfg.inject_faults)
        return ConfigRecord(config)

    def end_round(self, server_round: int, arrays: ArrayRecord, row: dict) -> None:
        self.arrays = arrays
        self.history.append(row)
        metrics.set_gauge("argus_fl_round_seconds", row["round_seconds"], run=self.run_name)
        metrics.set_gauge("argus_fl_round_bytes", row["bytes_up"], run=self.run_name)
        load_arrays(self.model, arrays)
        save_checkpoint(
            self.checkpoint_uri,
            server_round,
            self.model,
            {
                "round": server_round,
                "history": self.history,
                "fingerprint": self.fingerprint,
                "init_version": self.init_version,
                "noise_multipliers": self.accountant.noise_multipliers if self.accountant else [],
            },
        )


def build_server_app(
    fed: Federation,
    strategy: GuardedStrategy,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
) -> ServerApp:
    """The rounds, as a Flower ServerApp: sample → train → guard + aggregate → evaluate on the
    clients → `evaluate_fn` on the server → checkpoint.

    `evaluate_fn` is the hook of Flower's `Strategy.start`, called where it calls it (after each
    round's client evaluation; the round-0 call is left out, since rows are rounds). Its metrics
    join the round's row. The grid must be a `RayGrid`: each row reads its `last` traffic."""
    server_app = ServerApp()
    cfg = fed.cfg

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays = fed.arrays
        progress = tqdm(
            range(fed.start_round + 1, cfg.rounds + 1),
            desc="federated rounds",
            unit="round",
            initial=fed.start_round,
            total=cfg.rounds,
        )
        for server_round in progress:
            started = time.perf_counter()
            with _seeded(cfg.seed, server_round):  # the same clients and noise as an unbroken run
                # a fresh ConfigRecord per call: strategies add their keys to the one they are given
                messages = strategy.configure_train(
                    server_round, arrays, fed.client_config(server_round), grid
                )
                replies = grid.send_and_receive(messages, timeout=cfg.round_timeout_s)
                traffic = grid.last  # the evaluate call below starts a new RoundTraffic
                aggregated, train_metrics = strategy.aggregate_train(server_round, replies)
                guard = strategy.last
                if aggregated is not None:
                    arrays = _postprocess(aggregated)
                messages = strategy.configure_evaluate(
                    server_round, arrays, fed.client_config(server_round), grid
                )
                evaluation = strategy.aggregate_evaluate(
                    server_round, grid.send_and_receive(messages, timeout=cfg.round_timeout_s)
                )
            central = evaluate_fn(server_round, arrays) if evaluate_fn else None
            row = {
                "round": server_round,
                **{
                    k: float(v)
                    for k, v in (train_metrics or {}).items()
                    if k in ("train_loss", "train_accuracy")
                },
                **{k: float(v) for k, v in (evaluation or {}).items() if k in ("val_loss", "val_accuracy")},
                **{k: float(v) for k, v in (central or {}).items()},
                "clients_sampled": traffic.sent,
                "clients_failed": traffic.failed,
                "clients_timed_out": traffic.timed_out,
                "updates_rejected": sum(guard.rejected.values()),
                "updates_accepted": guard.accepted,
                "abandoned": int(guard.abandoned),
                "bytes_up": traffic.bytes_up,
                "bytes_down": traffic.bytes_down,
                "round_seconds": time.perf_counter() - started,
            }
            if fed.accountant is not None and not guard.abandoned:
                # the noise was calibrated for the sampled count; m accepted updates make it z·m/n
                z = cfg.dp_noise * guard.accepted / traffic.sent
                fed.accountant.compose(
                    GaussianPrivacyEvent(
                        noise_multiplier=z, sample_size=guard.accepted, population_size=cfg.clients
                    )
                )
            if fed.accountant is not None:
                row["epsilon"] = fed.accountant.get_privacy_spent().epsilon
            fed.end_round(server_round, arrays, row)
            progress.set_postfix(
                val_acc=f"{row.get('val_accuracy', float('nan')):.3f}",
                test_acc=f"{row.get('test_accuracy', float('nan')):.3f}",
                ok=guard.accepted,
                rejected=row["updates_rejected"],
                dropped=row["clients_failed"] + row["clients_timed_out"],
            )
        progress.close()

    return server_app
