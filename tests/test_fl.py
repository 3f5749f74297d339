"""Federated learning: Flower's strategies and our ClientApp on real Ray actors, on CPU; plus the
server's aggregation, FedProx and the privacy accountant as plain functions."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import sys
import time

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import GaussianPrivacyEvent
from flwr.supercore.task_identity import TaskIdentity
from torch import nn

from app import fl
from app import model as core
from app.config import ConfigError

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as a running ServerApp has


def _schemas(report, message_type):
    return [json.loads(s) for s in report.wire if json.loads(s)["type"] == message_type]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rounds_learn_on_non_iid_users_register_and_resume(trained, ray_cluster):
    import mlflow

    from conftest import MetricsWatcher

    settings, snapshot, _, _, _ = trained
    cfg = fl.FederateConfig(rounds=2, clients=4, clients_per_round=4, local_epochs=1, batch_size=16, lr=0.05,
                            augment=False, seed=3, num_cpus_per_client=1.0, run_name="fl-learn")
    with MetricsWatcher(ray_cluster, "ray_argus_fl_round_seconds", "ray_argus_fl_round_bytes") as watcher:
        report = fl.federate(settings, cfg)

    assert [row["round"] for row in report.history] == [1, 2]
    assert all(row["updates_accepted"] == 4 and row["clients_failed"] == 0 for row in report.history)

    # What crossed from the client actors: the model's float arrays as fp16 deltas and three
    # numbers per train reply; three numbers per evaluate reply. No pixels, no other arrays.
    expected = {k: ["float16", list(v.shape)] for k, v in core.build_model("cnn", 6).state_dict().items()
                if v.is_floating_point()}
    train, evaluate = _schemas(report, "train"), _schemas(report, "evaluate")
    assert train and all(s["arrays"] == {"arrays": expected} and s["configs"] == {} for s in train)
    scalars = {"num-examples": "int", "train_accuracy": "float", "train_loss": "float"}
    assert all(s["metrics"] == {"metrics": scalars} for s in train)
    assert evaluate and all(s["arrays"] == {} and s["configs"] == {} for s in evaluate)
    scalars = {"num-examples": "int", "val_accuracy": "float", "val_loss": "float"}
    assert all(s["metrics"] == {"metrics": scalars} for s in evaluate)
    assert sum(report.wire.values()) == 2 * 4 + 2 * 4
    fp16_bytes = sum(math.prod(shape) * 2 for _, shape in expected.values())
    assert fp16_bytes <= report.history[0]["bytes_up"] / 4 < 1.1 * fp16_bytes

    mlflow.set_tracking_uri(settings.tracking_uri)
    client = mlflow.MlflowClient()
    version = client.get_model_version(settings.model_name, report.version)
    assert version.tags["training_kind"] == "federated"
    assert version.tags["snapshot_ids"] == snapshot.snapshot_id
    run = client.get_run(report.run_id)
    assert run.data.params["rounds"] == "2" and run.data.params["clients"] == "4"
    assert run.data.params["dp_clip"] == "None" and run.data.params["snapshots"] == snapshot.snapshot_id
    assert {"curves.png", "history.json", "model"} <= {a.path for a in client.list_artifacts(report.run_id)}
    assert len(client.get_metric_history(report.run_id, "val_accuracy")) == 2
    assert all(any('run="fl-learn"' in line for line in lines) for lines in watcher.seen.values()), watcher.seen

    again = fl.federate(settings, dataclasses.replace(cfg, rounds=3))
    assert (again.resumed_from, again.rounds_run) == (2, 1)
    assert [row["round"] for row in again.history] == [1, 2, 3] and again.history[:2] == report.history
    assert again.metrics["val_accuracy"] > 0.4, again.history  # chance is 1/6


@pytest.mark.timeout(600)
def test_nan_update_and_killed_client_leave_the_round_to_the_rest_with_dp(trained):
    from app import registry

    settings, _, _, _, _ = trained
    cfg = fl.FederateConfig(rounds=1, clients=4, clients_per_round=4, min_clients=2, local_epochs=1, batch_size=32,
                            augment=False, init_from="champion", dp_clip=5.0, dp_noise=0.5, num_cpus_per_client=1.0,
                            inject_faults=("0:nan", "1:crash"), run_name="fl-faults")
    report = fl.federate(settings, cfg)

    row = report.history[0]
    counts = row["clients_sampled"], row["clients_failed"], row["updates_rejected"], row["updates_accepted"]
    assert counts == (4, 1, 1, 2)
    assert row["abandoned"] == 0
    assert report.init_version == registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    accountant = fl.GaussianAccountant(1e-5)
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=0.5 * 2 / 4, sample_size=2, population_size=4))
    assert report.epsilon == pytest.approx(accountant.get_privacy_spent().epsilon)
    model = registry.load(settings.tracking_uri, settings.model_name, report.version).model
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert len(_schemas(report, "train")) == 1  # the NaN update crossed with the same schema, then was rejected


def test_init_from_a_model_that_does_not_fit_is_a_clear_error(trained):
    settings, _, _, _, _ = trained
    with pytest.raises(ConfigError, match="arch 'cnn'"):
        fl.federate(dataclasses.replace(settings, model="resnet18"),
                    fl.FederateConfig(rounds=1, clients=2, clients_per_round=2, init_from="champion"))
    with pytest.raises(ConfigError, match="users"):
        fl.federate(settings, fl.FederateConfig(rounds=1, clients=5000, clients_per_round=2))


# ---------------------------------------------------------------- the Grid over Ray actors

echo_app = ClientApp()


@echo_app.train()
def _echo(message: Message, context) -> Message:
    partition = int(context.node_config["partition-id"])
    config = message.content["config"]
    if partition in config.get("slow", []):
        time.sleep(600)
    if partition in config.get("crash", []):
        os._exit(1)
    return Message(RecordDict({"metrics": MetricRecord({"partition": partition})}), reply_to=message)


def _echo_round(grid, config: dict, timeout: float | None = None) -> tuple[list[int], int]:
    content = RecordDict({"config": ConfigRecord(config)})
    replies = grid.send_and_receive([Message(content, node, "train") for node in grid.get_node_ids()], timeout=timeout)
    return sorted(int(r.content["metrics"]["partition"]) for r in replies if not r.has_error()), \
        sum(r.has_error() for r in replies)


@pytest.mark.timeout(600)
def test_grid_drops_slow_and_dead_clients_and_heals_its_pool(ray_cluster):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the echo ClientApp travels by value
    grid = fl.RayGrid(4, num_actors=4, num_cpus=0.25, app_ref=echo_app)
    try:
        assert _echo_round(grid, {"slow": [-1]}) == ([0, 1, 2, 3], 0)  # every actor started
        started = time.monotonic()
        assert _echo_round(grid, {"slow": [1], "crash": [2]}, timeout=15) == ([0, 3], 1)
        assert time.monotonic() - started < 60
        assert (grid.last["timed_out"], grid.last["failed"], grid.last["replied"]) == (1, 1, 2)
        # Flower's own pool would now hold a dead actor; ours replaced both, so all four answer.
        assert _echo_round(grid, {"slow": [-1]}) == ([0, 1, 2, 3], 0)
        assert grid.num_actors == 4 and len(grid._idle) == 4
    finally:
        grid.close()


# ---------------------------------------------------------------- aggregation, FedProx, privacy


class _NodesOnly:
    def __init__(self, n):
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _replies(deltas: list[dict], examples: list[int]) -> list[Message]:
    replies = []
    for node, (delta, n) in enumerate(zip(deltas, examples), start=1):
        instruction = Message(RecordDict(), node, "train")
        instruction.metadata.__dict__["_message_id"] = f"m{node}"
        content = RecordDict({"arrays": ArrayRecord({k: fl.Array(v) for k, v in delta.items()}),
                              "metrics": MetricRecord({"num-examples": n, "train_loss": 0.0, "train_accuracy": 0.0})})
        replies.append(Message(content, reply_to=instruction))
    return replies


GLOBAL = {"w": np.array([[1, 2], [3, 4]], dtype=np.float32), "b": np.array([0.5, -0.5], dtype=np.float32)}


def _strategy(n: int, **overrides):
    strategy = fl.build_strategy(fl.FederateConfig(clients=n, clients_per_round=n, **{"min_clients": 1, **overrides}))
    strategy.configure_train(1, ArrayRecord({k: fl.Array(v) for k, v in GLOBAL.items()}), ConfigRecord(), _NodesOnly(n))
    return strategy


def test_fedavg_of_hand_made_updates_is_the_example_weighted_mean_exactly():
    deltas = [{"w": np.array([[1, 0], [0, -1]]), "b": np.array([2, 2])},
              {"w": np.array([[-3, 1], [5, 0]]), "b": np.array([0, -4])},
              {"w": np.array([[8, 8], [-8, 2]]), "b": np.array([1, 1])}]
    examples = [1, 3, 4]
    for dtype in (np.float16, np.float32):
        typed = [{k: v.astype(dtype) for k, v in d.items()} for d in deltas]
        arrays, _ = _strategy(3).aggregate_train(1, _replies(typed, examples))
        for key in GLOBAL:
            weighted = sum(n * (GLOBAL[key].astype(np.float64) + d[key]) for d, n in zip(deltas, examples))
            expected = weighted / sum(examples)
            assert arrays[key].numpy().dtype == np.float32  # fp16 on the wire, fp32 in aggregation
            assert np.array_equal(arrays[key].numpy(), expected.astype(np.float32)), key


def test_guard_rejects_non_finite_and_outlying_updates_and_abandons_thin_rounds():
    good = {"w": np.ones((2, 2), np.float16), "b": np.zeros(2, np.float16)}
    nan = {"w": np.full((2, 2), np.nan, np.float16), "b": np.zeros(2, np.float16)}
    huge = {"w": np.full((2, 2), 1000, np.float16), "b": np.zeros(2, np.float16)}
    strategy = _strategy(4)
    arrays, _ = strategy.aggregate_train(1, _replies([good, nan, huge, good], [2, 2, 2, 6]))
    assert strategy.last["accepted"] == 2 and strategy.last["rejected"] == {"non_finite": 1, "outlier": 1}
    assert np.array_equal(arrays["w"].numpy(), GLOBAL["w"] + 1)
    strategy = _strategy(4, min_clients=3)
    assert strategy.aggregate_train(1, _replies([good, nan, huge, good], [1, 1, 1, 1])) == (None, None)
    assert strategy.last["abandoned"]
    strategy = _strategy(2)
    _, _ = strategy.aggregate_train(1, _replies([{"w": np.ones((2, 2), np.float32)}, good], [1, 1]))
    assert strategy.last["rejected"] == {"malformed": 1}


def test_fedprox_term_pulls_local_weights_towards_the_global_model():
    torch.manual_seed(0)
    linear = nn.Linear(3, 2)
    anchor = copy.deepcopy(linear)
    with torch.no_grad():
        linear.weight.add_(1.0)
    loss = fl.ProximalLoss(nn.CrossEntropyLoss(), linear, mu=0.7)
    loss._anchor = [p.detach().clone() for p in anchor.parameters()]
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 1])
    loss(linear(x), y).backward()
    proximal_grad = linear.weight.grad.clone()
    linear.zero_grad()
    nn.CrossEntropyLoss()(linear(x), y).backward()
    assert torch.allclose(proximal_grad - linear.weight.grad, 0.7 * torch.ones_like(proximal_grad))

    data = fl.ClientData(torch.randn(48, 3, 16, 16), torch.randint(0, 3, (48,)), torch.empty(0), torch.empty(0))
    start = core.build_model("cnn", 3)

    def drift(mu):
        local = copy.deepcopy(start)
        fl.local_train(local, data, epochs=3, batch_size=16, lr=0.05, mu=mu, seed=1, augment=False)
        return sum((a - b).pow(2).sum() for a, b in zip(local.parameters(), start.parameters())).sqrt().item()

    assert drift(mu=5.0) < 0.5 * drift(mu=0.0)


def test_gaussian_accountant_matches_the_rdp_bound():
    accountant = fl.GaussianAccountant(1e-5)
    for z in (1.0, 1.0, 0.5):
        accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=2, population_size=10))
    orders = np.linspace(1.001, 500, 400_000)
    brute = min(orders * (1 + 1 + 4) / 2 + math.log(1e5) / (orders - 1))
    assert accountant.get_privacy_spent().epsilon == pytest.approx(brute, rel=1e-6)
    assert accountant.get_privacy_spent().num_releases == 3


def test_users_are_dealt_whole_and_every_client_gets_some():
    users = [f"user-{i:04d}" for i in range(50)] * 3
    parts = fl.partition_users(users, 7, seed=1)
    assert sorted(u for p in parts for u in p) == sorted(set(users)) and min(map(len, parts)) == 7
    assert parts == fl.partition_users(reversed(users), 7, seed=1) != fl.partition_users(users, 7, seed=2)


@pytest.mark.parametrize("bad", [dict(clients_per_round=11), dict(strategy="fedsgd"), dict(dp_noise=1.0),
                                 dict(strategy="fedprox", mu=0.0), dict(update_dtype="int8"),
                                 dict(inject_faults=("12:nan",)), dict(num_cpus_per_client=0), dict(min_clients=6)])
def test_bad_configuration_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        fl.FederateConfig(**bad)
