"""The federated server and client cores as plain functions: FedAvg on hand-made updates, the
update guard, FedProx's pull, the privacy accountant, how users are dealt to clients, config checks."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import GaussianPrivacyEvent
from torch import nn

from app import model as core
from app.errors import ConfigError
from app.fl import FederateConfig
from app.fl.grid import assign_message_id, stamp_task_identity
from app.fl.privacy import GaussianAccountant
from app.fl.server_app import build_strategy
from app.fl.task import ClientData, ProximalLoss, local_train, partition_users

stamp_task_identity()  # as a running ServerApp has


class _NodesOnly:
    def __init__(self, n):
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _replies(deltas: list[dict], examples: list[int]) -> list[Message]:
    replies = []
    for node, (delta, n) in enumerate(zip(deltas, examples), start=1):
        instruction = Message(RecordDict(), node, "train")
        assign_message_id(instruction, f"m{node}")
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in delta.items()}),
                "metrics": MetricRecord({"num-examples": n, "train_loss": 0.0, "train_accuracy": 0.0}),
            }
        )
        replies.append(Message(content, reply_to=instruction))
    return replies


GLOBAL = {"w": np.array([[1, 2], [3, 4]], dtype=np.float32), "b": np.array([0.5, -0.5], dtype=np.float32)}


def _strategy(n: int, examples=None, **overrides):
    strategy = build_strategy(
        FederateConfig(clients=n, clients_per_round=n, **{"min_clients": 1, **overrides}), examples
    )
    strategy.configure_train(
        1, ArrayRecord({k: Array(v) for k, v in GLOBAL.items()}), ConfigRecord(), _NodesOnly(n)
    )
    return strategy


def test_fedavg_of_hand_made_updates_is_the_example_weighted_mean_exactly():
    deltas = [
        {"w": np.array([[1, 0], [0, -1]]), "b": np.array([2, 2])},
        {"w": np.array([[-3, 1], [5, 0]]), "b": np.array([0, -4])},
        {"w": np.array([[8, 8], [-8, 2]]), "b": np.array([1, 1])},
    ]
    examples = [1, 3, 4]
    for dtype, wire in ((np.float16, "fp16"), (np.float32, "fp32")):
        typed = [{k: v.astype(dtype) for k, v in d.items()} for d in deltas]
        arrays, _ = _strategy(3, update_dtype=wire).aggregate_train(1, _replies(typed, examples))
        for key in GLOBAL:
            weighted = sum(n * (GLOBAL[key].astype(np.float64) + d[key]) for d, n in zip(deltas, examples))
            expected = weighted / sum(examples)
            assert arrays[key].numpy().dtype == np.float32  # fp16 on the wire, fp32 in aggregation
            assert np.array_equal(arrays[key].numpy(), expected.astype(np.float32)), key
    # Where the server knows each client's (training, validation) rows, the training count weighs:
    # a claim that differs from it is rejected (test_fl_malformed.py), never weighed.
    known = {1: (1, 9), 2: (3, 9), 3: (4, 9)}
    typed = [{k: v.astype(np.float16) for k, v in d.items()} for d in deltas]
    arrays, _ = _strategy(3, known).aggregate_train(1, _replies(typed, examples))
    weighted = sum(n * (GLOBAL["w"].astype(np.float64) + d["w"]) for d, n in zip(deltas, examples))
    assert np.array_equal(arrays["w"].numpy(), (weighted / 8).astype(np.float32))


def test_guard_rejects_non_finite_and_outlying_updates_and_abandons_thin_rounds():
    good = {"w": np.ones((2, 2), np.float16), "b": np.zeros(2, np.float16)}
    nan = {"w": np.full((2, 2), np.nan, np.float16), "b": np.zeros(2, np.float16)}
    huge = {"w": np.full((2, 2), 1000, np.float16), "b": np.zeros(2, np.float16)}
    strategy = _strategy(4)
    arrays, _ = strategy.aggregate_train(1, _replies([good, nan, huge, good], [2, 2, 2, 6]))
    assert strategy.last.accepted == 2 and strategy.last.rejected == {"non_finite": 1, "outlier": 1}
    assert np.array_equal(arrays["w"].numpy(), GLOBAL["w"] + 1)
    strategy = _strategy(4, min_clients=3)
    assert strategy.aggregate_train(1, _replies([good, nan, huge, good], [1, 1, 1, 1])) == (None, None)
    assert strategy.last.abandoned
    strategy = _strategy(2)
    _, _ = strategy.aggregate_train(1, _replies([{"w": np.ones((2, 2), np.float32)}, good], [1, 1]))
    assert strategy.last.rejected == {"arrays": 1}


def test_fedprox_term_pulls_local_weights_towards_the_global_model():
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    anchor = copy.deepcopy(linear)
    with torch.no_grad():
        linear.weight.add_(1.0)
    loss = ProximalLoss(nn.CrossEntropyLoss(), linear, mu=0.7)
    loss._anchor = [p.detach().clone() for p in anchor.parameters()]
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    loss(linear(x), y).backward()
    proximal_grad = linear.weight.grad.clone()
    linear.zero_grad()
    nn.CrossEntropyLoss()(linear(x), y).backward()
    assert torch.allclose(proximal_grad - linear.weight.grad, 0.7 * torch.ones_like(proximal_grad))

    pixels = torch.randint(0, 256, (48, 3, 16, 16), dtype=torch.uint8)
    data = ClientData(pixels, torch.randint(0, 3, (48,)), torch.empty(0), torch.empty(0))
    start = core.build_model("cnn", 3)

    def drift(mu):
        local = copy.deepcopy(start)
        local_train(local, data, epochs=3, batch_size=16, lr=0.05, mu=mu, seed=1, augment="none")
        return sum((a - b).pow(2).sum() for a, b in zip(local.parameters(), start.parameters())).sqrt().item()

    assert drift(mu=5.0) < 0.5 * drift(mu=0.0)


def test_gaussian_accountant_without_sampling_is_the_rdp_bound_at_its_orders():
    accountant = GaussianAccountant(1e-5)
    for z in (1.0, 1.0, 0.5):
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=2, population_size=10))
    # dp-accounting's default Rényi orders; its conversion skips the ones nearest 1
    orders = np.array([1 + x / 10 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])
    orders = orders[orders > 1.01]
    rdp = orders * (1 + 1 + 4) / 2
    bound = min(rdp + np.log1p(-1 / orders) - np.log(1e-5 * orders) / (orders - 1))
    assert accountant.get_privacy_spent().epsilon == pytest.approx(bound, rel=1e-9)
    assert accountant.get_privacy_spent().num_releases == 3
    # never worse than the classic bound S + 2·sqrt(S·ln(1/δ)) it replaced
    s = 1 / 2 + 1 / 2 + 2
    assert accountant.get_privacy_spent().epsilon < s + 2 * math.sqrt(s * math.log(1e5))


def test_users_are_dealt_whole_and_every_client_gets_some():
    users = [f"user-{i:04d}" for i in range(50)] * 3
    parts = partition_users(users, 7, seed=1)
    assert sorted(u for p in parts for u in p) == sorted(set(users)) and min(map(len, parts)) == 7
    assert parts == partition_users(reversed(users), 7, seed=1) != partition_users(users, 7, seed=2)


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        (dict(clients_per_round=11), "--clients-per-round"),
        (dict(strategy="fedsgd"), "--strategy"),
        (dict(dp_noise=1.0), "--dp-noise needs --dp-clip"),
        (dict(strategy="fedprox", mu=0.0), "fedprox needs --mu"),
        (dict(update_dtype="int8"), "--update-dtype"),
        (dict(inject_faults=("12:nan",)), "fault '12:nan'"),
        (dict(num_cpus_per_client=0), "--num-cpus-per-client"),
        (dict(min_clients=6), "--min-clients"),
        (dict(augment="heavy"), "--augment"),
        (dict(client_sampling="bernoulli"), "--client-sampling"),
        (dict(dp_clip=1.0, dp_noise=1.0, dp_max_epsilon=0), "--dp-max-epsilon must be > 0"),
        (dict(dp_clip=1.0, dp_max_epsilon=5.0), "--dp-max-epsilon needs"),  # no noise: nothing accounted
        (dict(dp_clip=1.0, dp_noise=1.0, strategy="krum", dp_max_epsilon=5.0), "--dp-max-epsilon needs"),
    ],
)
def test_bad_configuration_is_a_config_error_naming_the_flag(bad, names):
    FederateConfig()  # the defaults are valid: each error below is the bad value's own
    with pytest.raises(ConfigError, match=re.escape(names)):
        FederateConfig(**bad)


def test_clients_fine_tune_a_registered_model_with_small_steps_unless_told():
    from app.fl.config import FINE_TUNE_LR, FRESH_LR

    assert FederateConfig().client_lr(fine_tuning=False) == FRESH_LR == 0.05
    assert FederateConfig().client_lr(fine_tuning=True) == FINE_TUNE_LR < FRESH_LR / 10
    assert FederateConfig(lr=0.1).client_lr(fine_tuning=True) == 0.1
