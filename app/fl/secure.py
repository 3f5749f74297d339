"""Secure aggregation (#27): a round's training through Flower's SecAgg+ protocol, so the server
learns only the sum of the devices' updates, never one of them.

Flower 1.42 ships SecAgg+ as a legacy workflow (`SecAggPlusWorkflow`, which needs a
`LegacyContext` and a legacy `Strategy`) and a client mod (`secaggplus_mod`). `secure_train` runs
the workflow for one round of our own loop (`server_app`): our strategy samples the devices as in
any round, `_OneRound` hands them the round's arrays and config as legacy `FitIns` and keeps the
unmasked sum. Each device clips its own update to L2 norm `clip` (the server cannot clip what it
cannot see) and weighs it 1, so the sum's sensitivity is `clip` whatever it trained on. The server
adds Gaussian noise to the sum under DP and divides by the fixed denominator (the sampled count),
never by the number that answered, as `privacy.private_mean` does. A device that drops after the
key sharing leaves its masks to be rebuilt from the others' shares: the round goes on while at
least `reconstruction_threshold` devices answer. Robust aggregators (median, Krum, trimmed mean)
need each update and are refused with secure aggregation."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common import FitIns, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from app.fl.grid import RoundTraffic
from app.fl.privacy import fresh_generator, gaussian_noise
from app.fl.task import SECURE_CLIP, SECURE_KEYS

log = logging.getLogger(__name__)

MIN_DEVICES = 3
"""SecAgg+ shares each secret among more than two devices."""
CLIPPING_RANGE = 8.0
"""SecAgg+'s per-coordinate range without DP (Flower's default). Under DP it is the clip: an update
of L2 norm at most `clip` has no coordinate beyond ±`clip`, so the clamp loses nothing and the
quantisation step is 2·clip / 2²²."""


@dataclasses.dataclass
class SecureOutcome:
    """What a secure round tells the row: who was asked, who answered, no per-update verdicts."""

    accepted: int = 0
    abandoned: bool = True
    rejected: dict = dataclasses.field(default_factory=dict)
    evaluate_rejected: int = 0


class _OneRound(Strategy):
    """The legacy strategy SecAgg+ drives for one round: the devices our strategy sampled, the
    round's FitIns, and the unmasked sum. Everything else a legacy strategy does is not used."""

    def __init__(self, grid: Grid, node_ids: list[int], config: ConfigRecord):
        self.grid, self.node_ids, self.config = grid, node_ids, config
        self.summed: list[np.ndarray] | None = None
        self.answered = 0
        self.metrics: list[dict] = []

    def configure_fit(self, server_round, parameters, client_manager):
        fit = FitIns(parameters, dict(self.config))
        return [(GridClientProxy(node, self.grid, self.grid.run.run_id), fit) for node in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):
        # Every result carries the same unmasked vector: the mean of the answering devices' updates
        # (each weighs 1), so their sum is that mean times how many answered.
        self.answered = len(results)
        mean = parameters_to_ndarrays(results[0][1].parameters)
        self.summed = [np.asarray(m, dtype=np.float64) * self.answered for m in mean]
        self.metrics = [dict(res.metrics) for _, res in results]
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def release_sum(
    summed: dict[str, np.ndarray],
    *,
    answered: int,
    clip: float | None,
    noise_multiplier: float,
    denominator: float | None,
    rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
    """The round's step from the unmasked sum: under DP (`clip`) Gaussian noise of std
    `noise_multiplier`·`clip` on the sum, then the fixed `denominator` (a device that dropped adds
    nothing, and the step's sensitivity stays clip/denominator); without, the mean of the `answered`."""
    if clip:
        noise = gaussian_noise(summed, noise_multiplier * clip, rng or fresh_generator())
        return {k: (summed[k] + noise[k]) / denominator for k in summed}
    return {k: summed[k] / answered for k in summed}


def threshold(devices: int) -> int:
    """Shares that rebuild a device's secrets: a majority of the round's devices, at least 2. The
    round survives the loss of the rest after key sharing; fewer than this colluding with the server
    learn nothing."""
    return max(2, devices // 2 + 1)


def secure_train(
    grid: Grid,
    messages: list,
    arrays: ArrayRecord,
    *,
    server_round: int,
    clip: float | None,
    noise_multiplier: float,
    denominator: float | None,
    timeout_s: float,
) -> tuple[ArrayRecord | None, dict | None, RoundTraffic, SecureOutcome]:
    """One round's training over SecAgg+ for the devices `messages` (our strategy's sampled train
    messages) are addressed to: the new global arrays (None when too few answered), the mean train
    metrics, the round's traffic and its outcome. With `clip` (DP) each device clips its update to
    that L2 norm and the sum gets noise of std `noise_multiplier`·`clip` before it is divided by
    `denominator`; without, the step is the answering devices' plain mean."""
    keys = list(arrays.keys())
    node_ids = [message.metadata.dst_node_id for message in messages]
    outcome, traffic = SecureOutcome(), RoundTraffic(sent=len(node_ids))
    if len(node_ids) < MIN_DEVICES:
        log.warning(
            "round %d: %d device(s) sampled; secure aggregation needs %d: no update this round",
            server_round,
            len(node_ids),
            MIN_DEVICES,
        )
        return None, None, traffic, outcome
    config = messages[0].content["config"]  # the strategy's own keys (FedProx's mu) included
    round_config = ConfigRecord(
        {**dict(config), SECURE_KEYS: keys, **({SECURE_CLIP: float(clip)} if clip else {})}
    )
    strategy = _OneRound(grid, node_ids, round_config)
    context = LegacyContext(
        Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        config=ServerConfig(num_rounds=server_round),
        strategy=strategy,
    )
    current = [arrays[k].numpy() for k in keys]
    # The workflow reads the round's arrays in order from here (legacy parameters have no names).
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord(
        {str(i): Array(np.ascontiguousarray(value)) for i, value in enumerate(current)}
    )
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: server_round}
    )
    SecAggPlusWorkflow(
        num_shares=len(node_ids),  # every device holds a share of every other's secrets
        reconstruction_threshold=threshold(len(node_ids)),
        # Each device weighs 1: a max weight of 1 leaves its vector unscaled before quantisation
        # (Flower's default of 1000 scales it by 1/1000 first, costing three digits).
        max_weight=1.0,
        clipping_range=float(clip) if clip else CLIPPING_RANGE,
        timeout=timeout_s,
    )(grid, context)
    traffic.replied = strategy.answered
    traffic.timed_out = traffic.sent - strategy.answered
    if strategy.summed is None:
        log.warning("round %d: secure aggregation halted (too few devices answered)", server_round)
        return None, None, traffic, outcome
    step = release_sum(
        dict(zip(keys, strategy.summed, strict=True)),
        answered=strategy.answered,
        clip=clip,
        noise_multiplier=noise_multiplier,
        denominator=denominator,
    )
    new = ArrayRecord({k: Array((arrays[k].numpy() + step[k]).astype(np.float32)) for k in keys})
    outcome.accepted, outcome.abandoned = strategy.answered, False
    metrics = {
        name: sum(m[name] for m in strategy.metrics) / len(strategy.metrics)
        for name in ("train_loss", "train_accuracy")
        if all(name in m and math.isfinite(m[name]) for m in strategy.metrics)
    }
    return new, metrics, traffic, outcome
