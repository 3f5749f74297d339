"""The server's side of the rounds as a Flower `ServerApp`: the strategy `--strategy` names behind
the guard (`build_strategy`), and each round sample → train → guard + aggregate → evaluate on the
clients → evaluate centrally → checkpoint (`build_server_app`). The guard is `guard.py`, the DP
release and accountant `privacy.py`, the central evaluation `evaluation.py`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import GaussianPrivacyEvent, Grid, ServerApp
from flwr.serverapp import strategy as flwr_strategy
from torch import nn
from tqdm import tqdm

from app import metrics
from app.fl.checkpoint import save_checkpoint
from app.fl.config import MEAN_STRATEGIES, FederateConfig
from app.fl.guard import GuardedStrategy
from app.fl.privacy import GaussianAccountant, GaussianRelease
from app.fl.secure import secure_train
from app.fl.task import load_arrays

log = logging.getLogger(__name__)


def build_strategy(
    cfg: FederateConfig, examples: Mapping[int, tuple[int, int]] | None = None
) -> GuardedStrategy:
    """The Flower strategy for `cfg.strategy` behind the guard, which clips and noises under DP.

    `examples`: each node's (training, validation) rows as the server counts them (`partition_sizes`)."""
    evaluate = cfg.evaluate_clients or cfg.clients
    poisson = cfg.client_sampling == "poisson"
    common = {
        # Under Poisson sampling the guard has drawn the nodes already: Flower takes all it is shown.
        "fraction_train": 1.0 if poisson else cfg.clients_per_round / cfg.clients,
        "min_train_nodes": 0 if poisson else cfg.clients_per_round,
        "fraction_evaluate": evaluate / cfg.clients,
        "min_evaluate_nodes": evaluate,
        "min_available_nodes": 0 if poisson else cfg.clients_per_round,
        "weighted_by_key": "weight",
    }
    strategies = {
        "fedavg": lambda: flwr_strategy.FedAvg(**common),
        "fedprox": lambda: flwr_strategy.FedProx(**common, proximal_mu=cfg.mu),
        "fedmedian": lambda: flwr_strategy.FedMedian(**common),
        "fedtrimmedavg": lambda: flwr_strategy.FedTrimmedAvg(**common, beta=cfg.trimmed_beta),
        "krum": lambda: flwr_strategy.Krum(**common, num_malicious_nodes=cfg.krum_malicious),
    }
    privacy = None
    if cfg.dp:
        # Not Flower's DifferentialPrivacyServerSideFixedClipping: it draws its noise from NumPy's
        # global generator (flwr.supercore.differential_privacy.add_gaussian_noise_inplace), which
        # the rounds seed, and averages over the updates that arrived.
        privacy = GaussianRelease(
            clip=cfg.dp_clip,
            noise_multiplier=cfg.dp_noise,
            denominator=float(cfg.clients_per_round),  # q·N under Poisson sampling: the same number
            mean=cfg.strategy in MEAN_STRATEGIES,
        )
    return GuardedStrategy(
        strategies[cfg.strategy](),
        min_clients=cfg.min_clients,
        outlier_factor=cfg.outlier_factor,
        update_dtype=cfg.update_dtype,
        examples=examples,
        privacy=privacy,
        sampling_rate=cfg.clients_per_round / cfg.clients if poisson else None,
    )


# ---------------------------------------------------------------- the rounds


@contextlib.contextmanager
def _seeded(*parts: int):
    """Seed Python's global RNG, which Flower's client sampling (and the Poisson draw) use, then
    restore it: a round's clients depend on (seed, round) only, so a resumed run samples what an
    unbroken one would. DP noise never comes from here (`fresh_generator`)."""
    saved = random.getstate()
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + part) % 2**32
    random.seed(seed)
    try:
        yield
    finally:
        random.setstate(saved)


@contextlib.contextmanager
def _secretly_seeded():
    """Seed Python's global RNG from the OS's CSPRNG (neither stored nor logged), then restore it:
    under DP a round's clients are a sample nobody can recompute, as the accountant's amplification
    by sampling assumes, whereas --seed is logged with the run."""
    saved = random.getstate()
    random.seed(secrets.randbits(256))
    try:
        yield
    finally:
        random.setstate(saved)


def round_sampling(cfg: FederateConfig, server_round: int):
    """The randomness of one round's client sample: (seed, round) without DP, a secret under DP."""
    return _secretly_seeded() if cfg.dp else _seeded(cfg.seed, server_round)


def _postprocess(arrays: ArrayRecord) -> ArrayRecord:
    """fp32 global arrays; BatchNorm variances kept non-negative after DP noise (post-processing)."""
    out = {}
    for key, array in arrays.items():
        value = np.asarray(array.numpy(), dtype=np.float32)
        out[key] = Array(np.maximum(value, 0) if key.endswith("running_var") else value)
    return ArrayRecord(out)


def round_event(cfg: FederateConfig) -> GaussianPrivacyEvent:
    """The DP release of one round, as the accountant composes it: the mean divides by the fixed
    count whoever replied, so its noise multiplier is z."""
    return GaussianPrivacyEvent(
        noise_multiplier=cfg.dp_noise, sample_size=cfg.clients_per_round, population_size=cfg.clients
    )


def over_budget(cfg: FederateConfig, accountant: GaussianAccountant | None) -> float | None:
    """The epsilon one more round would bring the run to, if that is past --dp-max-epsilon; else None."""
    if accountant is None or cfg.dp_max_epsilon is None:
        return None
    after = accountant.get_privacy_spent(more=[accountant.release(round_event(cfg))]).epsilon
    return after if after > cfg.dp_max_epsilon else None


@dataclass
class Federation:
    """What the ServerApp's rounds need and leave behind."""

    cfg: FederateConfig
    model: nn.Module
    arrays: ArrayRecord
    classes: list[str]
    data_files: list[str]
    """The Parquet files of the table snapshot the run reads (URIs): what simulated clients read."""
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
    init_without_dp: bool = False
    """Under DP: the starting model was trained without it (`ModelCard.privacy`)."""
    stopped: str | None = None
    """Why the rounds ended before `cfg.rounds`, if they did (the privacy budget)."""

    def client_config(self, server_round: int) -> ConfigRecord:
        cfg = self.cfg
        config = {
            "arch": self.fingerprint["arch"],
            "classes": list(self.classes),
            "image-size": int(self.fingerprint["image_size"]),
            # Devices train on their own images: where the central data lives is not theirs to know.
            "data-files": list(self.data_files) if cfg.engine == "simulation" else [],
            "seed": cfg.seed,
            "val-from": self.val_from,
            "test-from": self.test_from,
            "local-epochs": cfg.local_epochs,
            "batch-size": cfg.batch_size,
            "lr": cfg.client_lr(fine_tuning=self.init_version is not None),
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
                "privacy_releases": self.accountant.releases if self.accountant else [],
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
    join the round's row. The grid must count its traffic (`RayGrid`, `DeviceGrid`): each row
    reads its `last`."""
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
            disable=not sys.stderr.isatty(),  # elsewhere (a pipe, a log file) a line per round instead
        )
        for server_round in progress:
            if (epsilon := over_budget(cfg, fed.accountant)) is not None:
                fed.stopped = (
                    f"privacy budget: round {server_round} would bring epsilon to {epsilon:.3f}, "
                    f"past --dp-max-epsilon {cfg.dp_max_epsilon:g}"
                )
                log.warning("stopping after round %d of %d: %s", server_round - 1, cfg.rounds, fed.stopped)
                break
            started = time.perf_counter()
            with round_sampling(cfg, server_round):
                # a fresh ConfigRecord per call: strategies add their keys to the one they are given
                messages = strategy.configure_train(
                    server_round, arrays, fed.client_config(server_round), grid
                )
                if cfg.secure_aggregation:  # the server learns only the sum of the updates
                    aggregated, train_metrics, traffic, guard = secure_train(
                        grid,
                        list(messages),
                        arrays,
                        server_round=server_round,
                        clip=cfg.dp_clip,
                        noise_multiplier=cfg.dp_noise,
                        denominator=float(cfg.clients_per_round) if cfg.dp else None,
                        timeout_s=cfg.round_timeout_s,
                    )
                else:
                    replies = grid.send_and_receive(messages, timeout=cfg.round_timeout_s)
                    traffic = grid.last  # the evaluate call below starts a new RoundTraffic
                    aggregated, train_metrics = strategy.aggregate_train(server_round, replies)
                    guard = strategy.last
                if aggregated is not None:
                    arrays = _postprocess(aggregated)
                evaluation = None
                if not cfg.dp:  # clients' own losses and accuracies would leave them unnoised
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
                **{f"rejected_{kind}": count for kind, count in sorted(guard.rejected.items())},
                "updates_accepted": guard.accepted,
                "abandoned": int(guard.abandoned),
                "bytes_up": traffic.bytes_up,
                "bytes_down": traffic.bytes_down,
                "round_seconds": time.perf_counter() - started,
            }
            if guard.evaluate_rejected:
                row["evaluations_rejected"] = guard.evaluate_rejected
            if fed.accountant is not None and not guard.abandoned:
                fed.accountant.compose(round_event(cfg))
            if fed.accountant is not None:
                row["epsilon"] = fed.accountant.get_privacy_spent().epsilon
            fed.end_round(server_round, arrays, row)
            if progress.disable:
                log.info(
                    "round %d/%d: validation accuracy %.3f, test slice %.3f, %d updates accepted, "
                    "%d rejected, %d clients dropped, %.1fs",
                    server_round,
                    cfg.rounds,
                    row.get("val_accuracy", float("nan")),
                    row.get("test_accuracy", float("nan")),
                    guard.accepted,
                    row["updates_rejected"],
                    row["clients_failed"] + row["clients_timed_out"],
                    row["round_seconds"],
                )
            progress.set_postfix(
                val_acc=f"{row.get('val_accuracy', float('nan')):.3f}",
                test_acc=f"{row.get('test_accuracy', float('nan')):.3f}",
                ok=guard.accepted,
                rejected=row["updates_rejected"],
                dropped=row["clients_failed"] + row["clients_timed_out"],
            )
        progress.close()

    return server_app
