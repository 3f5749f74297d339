"""Federated learning: Flower's strategies and our ClientApp on real Ray actors, on CPU, against
a table snapshot and a registry that real ingest and training made."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import time

import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from app import model as core
from app.errors import ConfigError
from app.fl import FederateConfig, federate
from app.fl.grid import RayGrid, stamp_task_identity

stamp_task_identity()  # as a running ServerApp has


def _schemas(report, message_type):
    return [json.loads(s) for s in report.wire if json.loads(s)["type"] == message_type]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rounds_learn_on_non_iid_users_register_and_resume(trained, ray_cluster):
    import mlflow

    from app import registry

    from conftest import MetricsWatcher

    settings, snapshot, _, _, _ = trained
    cfg = FederateConfig(
        rounds=2,
        clients=4,
        clients_per_round=4,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        augment="none",
        seed=3,
        num_cpus_per_client=1.0,
        run_name="fl-learn",
    )
    with MetricsWatcher(ray_cluster, "ray_argus_fl_round_seconds", "ray_argus_fl_round_bytes") as watcher:
        report = federate(settings, cfg)

    assert [row["round"] for row in report.history] == [1, 2]
    assert all(row["updates_accepted"] == 4 and row["clients_failed"] == 0 for row in report.history)
    # No --init-from: it fine-tuned the session's champion (the fixture trained and registered it).
    assert report.init_version == registry.resolve(settings.tracking_uri, settings.model_name, "champion")

    # What crossed from the client actors: the model's float arrays as fp16 deltas and three
    # numbers per train reply; three numbers per evaluate reply. No pixels, no other arrays.
    expected = {
        k: ["float16", list(v.shape)]
        for k, v in core.build_model("cnn", 6).state_dict().items()
        if v.is_floating_point()
    }
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
    # Lineage: the table snapshot the ingest committed (the current one: no --snapshots given).
    assert version.tags["argus.table_snapshot_id"] == str(snapshot.snapshot_id)
    run = client.get_run(report.run_id)
    assert run.data.params["rounds"] == "2" and run.data.params["clients"] == "4"
    assert run.data.params["dp_clip"] == "None"
    assert run.data.params["table_snapshot_id"] == str(snapshot.snapshot_id)
    card = registry.load(settings.tracking_uri, settings.model_name, report.version).card
    assert card.table_snapshot_id == snapshot.snapshot_id and card.lineage["table"] == settings.table
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.name == str(snapshot.snapshot_id)
    assert {"curves.png", "history.json", "model"} <= {a.path for a in client.list_artifacts(report.run_id)}
    assert len(client.get_metric_history(report.run_id, "val_accuracy")) == 2
    # The server judged each round's global model on the central test slice, which no client read.
    assert len(client.get_metric_history(report.run_id, "test_accuracy")) == 2
    assert report.test_split["test"] > 0 and report.verdict is None
    assert report.metrics["test_accuracy"] == report.history[-1]["test_accuracy"]
    assert version.tags["metric.test_accuracy"] == f"{report.metrics['test_accuracy']:.4f}"
    assert all(any('run="fl-learn"' in line for line in lines) for lines in watcher.seen.values()), (
        watcher.seen
    )

    again = federate(settings, dataclasses.replace(cfg, rounds=3))
    assert (again.resumed_from, again.rounds_run) == (2, 1)
    assert [row["round"] for row in again.history] == [1, 2, 3] and again.history[:2] == report.history
    assert again.metrics["val_accuracy"] > 0.4, again.history  # chance is 1/6


@pytest.mark.timeout(600)
def test_nan_update_and_killed_client_leave_the_round_to_the_rest_with_dp(trained, caplog):
    from app import registry

    settings, _, _, _, _ = trained
    cfg = FederateConfig(
        rounds=1,
        clients=4,
        clients_per_round=4,
        min_clients=2,
        local_epochs=1,
        batch_size=32,
        augment="none",
        init_from="champion",
        dp_clip=5.0,
        dp_noise=0.5,
        num_cpus_per_client=1.0,
        inject_faults=("0:nan", "1:crash"),
        run_name="fl-faults",
    )
    report = federate(settings, cfg)

    row = report.history[0]
    counts = row["clients_sampled"], row["clients_failed"], row["updates_rejected"], row["updates_accepted"]
    assert counts == (4, 1, 1, 2)
    assert row["abandoned"] == 0
    assert report.init_version == registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    assert row["rejected_non_finite"] == 1
    # The mean divided by the 4 sampled, not the 2 aggregated: the release's multiplier stays 0.5,
    # and epsilon is dp-accounting's for one unamplified Gaussian release at z = 0.5.
    from dp_accounting import GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    assert report.epsilon == pytest.approx(RdpAccountant().compose(GaussianDpEvent(0.5)).get_epsilon(1e-5))
    # The card says what the privacy promise is, and that it started from the champion, which
    # was trained without DP on these users' images (the run warned so).
    privacy = registry.load(settings.tracking_uri, settings.model_name, report.version).card.privacy
    assert privacy == {
        "epsilon": report.epsilon, "delta": 1e-5, "noise_multiplier": 0.5, "clip": 5.0, "rounds": 1,
        "releases": 1, "client_sampling": "fixed", "sampling_rate": 1.0, "sampling_secret": True,
        "accountant": "dp-accounting RdpAccountant, rdp-gaussian", "max_epsilon": None, "stopped": None,
        "init_version": report.init_version, "init_without_dp": True,
    }  # fmt: skip
    assert "was trained without differential privacy" in caplog.text
    # Under DP the clients' own losses and accuracies stay with them: no client evaluation either.
    assert not {"train_loss", "train_accuracy", "val_loss", "val_accuracy"} & row.keys()
    assert not _schemas(report, "evaluate")
    model = registry.load(settings.tracking_uri, settings.model_name, report.version).model
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert (
        len(_schemas(report, "train")) == 1
    )  # the NaN update crossed with the same schema, then was rejected


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_promote_if_better_keeps_a_better_champion_and_promotes_a_better_model(trained):
    from app import registry

    trained_settings, _, _, train_report, _ = trained
    # A registered name of its own, so the session's champion stays what the serve tests expect.
    settings = dataclasses.replace(trained_settings, model_name="argus-fl-promote")
    uri = settings.tracking_uri
    centralised = registry.load(uri, trained_settings.model_name, train_report.version)
    with registry.start_run(uri, registry.artifact_root(settings), "centralised-copy") as run:
        pass
    good = registry.register(uri, settings.model_name, run.info.run_id, centralised.model, centralised.card)
    assert registry.resolve(uri, settings.model_name, "champion") == good

    # Worse: one round from scratch at a learning rate that barely moves the weights.
    base = FederateConfig(
        init_from=None,
        rounds=1,
        clients=4,
        clients_per_round=4,
        batch_size=32,
        augment="none",
        num_cpus_per_client=1.0,
        promote_if_better=True,
    )
    worse = federate(settings, dataclasses.replace(base, lr=1e-6, run_name="fl-worse"))
    verdict = worse.verdict
    assert not verdict.promoted and verdict.champion_version == good, verdict
    assert verdict.candidate_accuracy == worse.metrics["test_accuracy"] == worse.history[-1]["test_accuracy"]
    assert verdict.champion_accuracy > verdict.candidate_accuracy
    assert f"champion v{good}" in verdict.reason and f"kept v{good} as champion" in str(worse)
    assert registry.resolve(uri, settings.model_name, "champion") == good
    card = registry.load(uri, settings.model_name, worse.version).card
    assert card.metrics["test_accuracy"] == worse.metrics["test_accuracy"]

    # Better: the same fine-tuned from the centralised model, against the worse one made champion.
    registry.promote(uri, settings.model_name, worse.version)
    registry.promote(uri, settings.model_name, good, alias="centralised")
    better = federate(
        settings, dataclasses.replace(base, lr=1e-3, init_from="centralised", run_name="fl-better")
    )
    assert better.verdict.promoted and better.verdict.champion_version == worse.version, better.verdict
    assert better.verdict.champion_accuracy == pytest.approx(worse.metrics["test_accuracy"])
    assert registry.resolve(uri, settings.model_name, "champion") == better.version


def test_init_from_a_model_that_does_not_fit_is_a_clear_error(trained, caplog):
    from app import registry
    from app.fl.run import _initial_model

    settings, _, _, _, _ = trained
    classes = registry.load(settings.tracking_uri, settings.model_name, "1").card.classes
    champion = registry.resolve(settings.tracking_uri, settings.model_name, "champion")
    # By default (auto) the champion is fine-tuned where it fits, and a fresh model starts where not.
    assert _initial_model(settings, FederateConfig(), classes)[1] == champion
    assert (
        _initial_model(dataclasses.replace(settings, model="resnet18"), FederateConfig(), classes)[1] is None
    )
    assert "does not fit this run" in caplog.text and "start from a fresh model" in caplog.text
    assert _initial_model(settings, FederateConfig(init_from="none"), classes)[1] is None
    with pytest.raises(ConfigError, match="arch 'cnn'"):
        federate(
            dataclasses.replace(settings, model="resnet18"),
            FederateConfig(rounds=1, clients=2, clients_per_round=2, init_from="champion"),
        )
    with pytest.raises(ConfigError, match="users"):
        federate(settings, FederateConfig(rounds=1, clients=5000, clients_per_round=2))
    with pytest.raises(ConfigError, match="has no snapshot 12345"):
        federate(settings, FederateConfig(rounds=1, clients=2, clients_per_round=2, snapshots=12345))
    budget = FederateConfig(
        rounds=3, clients=2, clients_per_round=2, dp_clip=1.0, dp_noise=0.5, dp_max_epsilon=1
    )
    with pytest.raises(ConfigError, match="--dp-max-epsilon 1: one round alone spends epsilon"):
        federate(settings, budget)


# ---------------------------------------------------------------- the Grid over Ray actors

echo_app = ClientApp()


@echo_app.train()
def _echo(message: Message, context) -> Message:
    partition = int(context.node_config["partition-id"])
    config = message.content["config"]
    if partition in config.get("slow", []):
        threading.Event().wait()  # a straggler that never answers
    if partition in config.get("crash", []):
        os._exit(1)
    return Message(RecordDict({"metrics": MetricRecord({"partition": partition})}), reply_to=message)


def _echo_round(grid, config: dict, timeout: float | None = None) -> tuple[list[int], list[int]]:
    """(partitions whose results came back, partitions whose replies are errors) of one round."""
    content = RecordDict({"config": ConfigRecord(config)})
    replies = grid.send_and_receive(
        [Message(content, node, "train") for node in grid.get_node_ids()], timeout=timeout
    )
    results = sorted(int(r.content["metrics"]["partition"]) for r in replies if not r.has_error())
    errors = sorted(r.metadata.src_node_id - 1 for r in replies if r.has_error())  # node i is partition i-1
    return results, errors


@pytest.mark.timeout(600)
def test_grid_drops_slow_and_dead_clients_and_heals_its_pool(ray_cluster):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the echo ClientApp travels by value
    grid = RayGrid(4, num_actors=4, num_cpus=0.25, app_ref=echo_app)
    try:
        assert _echo_round(grid, {"slow": [-1]}) == ([0, 1, 2, 3], [])  # every actor started
        # Partition 1 never answers and 2's process dies: the round ends at its deadline with the
        # results of 0 and 3 (a grid that waited for 1 would never return), 2 an error reply, and 1
        # counted as timed out, with no reply at all.
        assert _echo_round(grid, {"slow": [1], "crash": [2]}, timeout=15) == ([0, 3], [2])
        assert (grid.last.sent, grid.last.replied, grid.last.failed, grid.last.timed_out) == (4, 2, 1, 1)
        # Flower's own pool would now hold a dead actor and a busy one; ours replaced both, so all
        # four answer.
        assert _echo_round(grid, {"slow": [-1]}) == ([0, 1, 2, 3], [])
        assert grid.num_actors == 4 and len(grid._idle) == 4
    finally:
        grid.close()


@pytest.mark.timeout(300)
def test_an_actor_that_dies_between_rounds_fails_no_client(ray_cluster):
    """An idle actor whose node is lost between its last message and the next round is found dead
    and replaced before the round, not sent a client that then fails."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    grid = RayGrid(2, num_actors=2, num_cpus=0.25, app_ref=echo_app)
    try:
        assert _echo_round(grid, {}) == ([0, 1], [])
        lost = grid._idle[0]
        ray.kill(lost, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):
            while True:  # until the kill has landed
                ray.get(lost.ping.remote(), timeout=60)
                time.sleep(0.1)
        assert _echo_round(grid, {}) == ([0, 1], [])
        assert grid.last.failed == 0 and len(grid._idle) == 2
    finally:
        grid.close()
