"""Differential privacy in the federated server, without Ray: noise no one can recompute from the
run's parameters, a mean over the fixed sampled count, client sampling that a resumed run repeats,
clients' metrics kept out of the record, and the accountant against Google's dp-accounting."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import GaussianPrivacyEvent

from app import model as core
from app.fl import FederateConfig
from app.fl.grid import RoundTraffic, assign_message_id, stamp_task_identity
from app.fl.privacy import GaussianAccountant, fresh_generator, private_mean
from app.fl.server_app import Federation, build_server_app, build_strategy, round_sampling
from app.fl.task import model_arrays

stamp_task_identity()  # as a running ServerApp has

GLOBAL = {"w": np.zeros((300, 300), np.float32), "b": np.zeros(7, np.float32)}


class _Nodes:
    def __init__(self, n):
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _reply(instruction: Message, delta: dict, examples: int = 10) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in delta.items()}),
            "metrics": MetricRecord({"num-examples": examples, "train_loss": 0.5, "train_accuracy": 0.5}),
        }
    )
    return Message(content, reply_to=instruction)


def _round(strategy, deltas_by_node: dict[int, dict], nodes: int, server_round: int = 1):
    """configure_train + aggregate_train as the rounds call them; nodes answer with `deltas_by_node`."""
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    messages = strategy.configure_train(server_round, arrays, ConfigRecord(), _Nodes(nodes))
    replies = []
    for message in messages:
        assign_message_id(message, uuid.uuid4().hex)
        if message.metadata.dst_node_id in deltas_by_node:
            replies.append(_reply(message, deltas_by_node[message.metadata.dst_node_id]))
    return strategy.aggregate_train(server_round, replies)


def _delta(value: float) -> dict:
    return {k: np.full(v.shape, value, np.float16) for k, v in GLOBAL.items()}


def test_two_dp_runs_with_the_same_seed_add_different_noise_that_numpy_seeding_does_not_fix():
    deltas = [{k: np.ones(v.shape, np.float32) * 1e-3 for k, v in GLOBAL.items()} for _ in range(3)]
    exact = private_mean(deltas, clip=1.0, denominator=4, noise_multiplier=0.0, rng=np.random.default_rng(0))
    # At the aggregation function: the released means differ, by noise of std z·C/n.
    np.random.seed(0)
    first = private_mean(deltas, clip=1.0, denominator=4, noise_multiplier=2.0, rng=fresh_generator())
    np.random.seed(0)
    second = private_mean(deltas, clip=1.0, denominator=4, noise_multiplier=2.0, rng=fresh_generator())
    noise_a, noise_b = first["w"] - exact["w"], second["w"] - exact["w"]
    assert not np.allclose(noise_a, noise_b)
    assert abs(noise_a.std() / (2.0 * 1.0 / 4) - 1) < 0.02 and abs(noise_a.mean()) < 0.01
    assert abs(np.corrcoef(noise_a.ravel(), noise_b.ravel())[0, 1]) < 0.02

    # Through the strategy, both runs seeded alike as the rounds seed them: different releases, and
    # NumPy's global generator (which Flower's DP wrapper would draw from) is left as it was.
    cfg = FederateConfig(clients=4, clients_per_round=4, min_clients=1, dp_clip=1.0, dp_noise=1.0, seed=0)
    released = []
    for _ in range(2):
        np.random.seed(0)
        state = np.random.get_state()[1].copy()
        with round_sampling(cfg, 1):
            arrays, train_metrics = _round(build_strategy(cfg), {n: _delta(1e-3) for n in (1, 2, 3, 4)}, 4)
        assert np.array_equal(np.random.get_state()[1], state)
        assert train_metrics is None  # clients' losses do not leave them under DP
        released.append(arrays["w"].numpy())
    assert not np.allclose(released[0], released[1])


def test_the_dp_mean_divides_by_the_sampled_count_whoever_replied_and_clips_each_update():
    cfg = FederateConfig(clients=4, clients_per_round=4, min_clients=1, dp_clip=1.0, dp_noise=0.0)
    small, big = _delta(1e-3), _delta(1.0)  # big's norm is ~300: clipped to 1
    bad = {**_delta(1e-3), "b": np.full(7, np.nan, np.float16)}
    arrays, _ = _round(build_strategy(cfg), {1: small, 2: big, 3: bad}, 4)  # node 4 dropped
    norm_big = np.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in big.values()))
    for key in GLOBAL:
        expected = (small[key].astype(np.float64) + big[key] / norm_big) / 4  # / 4 sampled, not / 2
        assert np.allclose(arrays[key].numpy(), expected, rtol=1e-5, atol=1e-8), key


def _sampled(cfg: FederateConfig, rounds, fresh_each_round: bool = False) -> list[list[int]]:
    """The nodes each round's configure_train picks, sampled as the rounds sample them."""
    strategy, ids = build_strategy(cfg), []
    arrays = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    for server_round in rounds:
        if fresh_each_round:  # what a resumed run has: a new strategy, no earlier rounds
            strategy = build_strategy(cfg)
        with round_sampling(cfg, server_round):
            messages = strategy.configure_train(server_round, arrays, ConfigRecord(), _Nodes(cfg.clients))
        ids.append(sorted(m.metadata.dst_node_id for m in messages))
    return ids


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_without_dp_sampled_clients_depend_on_the_seed_and_round_only(sampling):
    def config(seed):
        return FederateConfig(clients=40, clients_per_round=8, client_sampling=sampling, seed=seed)

    unbroken = _sampled(config(3), range(1, 31))
    assert _sampled(config(3), range(1, 31)) == unbroken
    assert _sampled(config(3), range(21, 31), fresh_each_round=True) == unbroken[20:]
    assert _sampled(config(4), range(1, 31)) != unbroken
    sizes = [len(ids) for ids in unbroken]
    if sampling == "fixed":
        assert set(sizes) == {8}
    else:  # each client with probability 8/40: sizes vary around 8
        assert len(set(sizes)) > 2 and 6 < np.mean(sizes) < 10


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_under_dp_two_runs_with_the_same_seed_sample_different_clients(sampling):
    """The accountant's amplification by sampling needs a sample nobody can recompute; --seed is
    logged with the run, so under DP it decides nothing about who is sampled."""
    cfg = FederateConfig(
        clients=40, clients_per_round=8, client_sampling=sampling, seed=3, dp_clip=1.0, dp_noise=1.0
    )
    first, second = _sampled(cfg, range(1, 31)), _sampled(cfg, range(1, 31))
    assert first != second
    # Round by round, as often as independent draws coincide (fixed: 1 in C(40, 8)), not always.
    assert sum(a == b for a, b in zip(first, second)) <= 2
    sizes = [len(ids) for ids in first]
    if sampling == "fixed":
        assert set(sizes) == {8}
    else:
        assert len(set(sizes)) > 2 and 6 < np.mean(sizes) < 10


class _ScriptedGrid:
    """Answers every train message with a small update and every evaluate message with metrics;
    records which nodes each round asked, and of what type."""

    def __init__(self, num_nodes: int, arrays: ArrayRecord, malformed: int | None = None):
        self.num_nodes, self.malformed, self.asked, self.last = num_nodes, malformed, [], RoundTraffic()
        self.shapes = {k: a.numpy().shape for k, a in arrays.items()}

    def get_node_ids(self):
        return list(range(1, self.num_nodes + 1))

    def send_and_receive(self, messages, *, timeout=None):
        self.last, replies = RoundTraffic(), []
        for message in messages:
            assign_message_id(message, uuid.uuid4().hex)
            node, kind = message.metadata.dst_node_id, message.metadata.message_type
            self.asked.append((int(message.content["config"]["server-round"]), kind, node))
            if kind == "train":
                dtype = np.float64 if node == self.malformed else np.float16
                delta = {k: np.full(s, 1e-4, dtype) for k, s in self.shapes.items()}
                replies.append(_reply(message, delta))
            else:
                metrics = MetricRecord({"num-examples": 5, "val_loss": 1.0, "val_accuracy": 0.5})
                replies.append(Message(RecordDict({"metrics": metrics}), reply_to=message))
        self.last.sent = self.last.replied = len(replies)
        return replies


def _federation(cfg, tmp_path, start_round=0):
    model = core.build_model("cnn", 2)
    return Federation(
        cfg=cfg,
        model=model,
        arrays=model_arrays(model),
        classes=["a", "b"],
        data_files=[],
        checkpoint_uri=str(tmp_path / "checkpoints"),
        fingerprint={"arch": "cnn", "image_size": 16},
        val_from=0,
        test_from=0,
        start_round=start_round,
        accountant=GaussianAccountant(cfg.dp_delta, poisson=cfg.client_sampling == "poisson")
        if cfg.dp
        else None,
    )


def _run(fed, malformed=None):
    grid = _ScriptedGrid(fed.cfg.clients, fed.arrays, malformed)
    build_server_app(fed, build_strategy(fed.cfg))(
        grid=grid,
        context=Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
    )
    return grid.asked


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_dp_rounds_record_no_client_metrics_and_a_resumed_plain_run_samples_what_an_unbroken_one_did(
    tmp_path, sampling
):
    common = dict(rounds=4, clients=6, clients_per_round=3, min_clients=1, client_sampling=sampling, seed=5)
    private = _federation(FederateConfig(**common, dp_clip=1.0, dp_noise=1.0), tmp_path / "dp")
    asked = _run(private)
    assert {kind for _, kind, _ in asked} == {"train"}  # no client evaluation under DP
    released = False  # a secret Poisson draw may leave a round too few clients: it releases nothing
    for row in private.history:
        assert not {"train_loss", "train_accuracy", "val_loss", "val_accuracy"} & row.keys()
        released |= row["abandoned"] == 0
        assert (row["epsilon"] > 0) == released
    # Without DP clients evaluate too, and a run resumed after round 2 asks who an unbroken one did.
    plain = _federation(FederateConfig(**common), tmp_path / "plain")
    plain_asked = _run(plain)
    assert {kind for _, kind, _ in plain_asked} == {"train", "evaluate"}
    assert all({"train_loss", "val_accuracy"} <= row.keys() for row in plain.history)
    resumed = _federation(FederateConfig(**common), tmp_path / "resumed", start_round=2)
    assert _run(resumed) == [a for a in plain_asked if a[0] > 2]


@pytest.mark.parametrize("sampling", ["fixed", "poisson"])
def test_rounds_stop_before_the_one_that_would_pass_the_privacy_budget(tmp_path, sampling):
    q = 3 / 6 if sampling == "poisson" else None  # fixed-size samples are counted unamplified
    budget = (_dp_accounting_epsilon(1.0, q, 3, 1e-5) + _dp_accounting_epsilon(1.0, q, 4, 1e-5)) / 2
    cfg = FederateConfig(
        rounds=10, clients=6, clients_per_round=3, min_clients=1, client_sampling=sampling,
        dp_clip=1.0, dp_noise=1.0, dp_max_epsilon=budget,
    )  # fmt: skip
    fed = _federation(cfg, tmp_path)
    asked = _run(fed)
    # Three releases; a Poisson round that drew too few clients was abandoned and released nothing.
    rounds = len(fed.history)
    assert [row["abandoned"] for row in fed.history].count(0) == 3 and {a[0] for a in asked} <= set(
        range(1, rounds + 1)
    )
    assert fed.history[-1]["epsilon"] == pytest.approx(_dp_accounting_epsilon(1.0, q, 3, 1e-5), rel=1e-9)
    assert fed.history[-1]["epsilon"] <= budget
    assert fed.stopped.startswith(f"privacy budget: round {rounds + 1} would bring epsilon to")


def test_round_metrics_count_rejections_by_reason(tmp_path):
    cfg = FederateConfig(rounds=1, clients=3, clients_per_round=3, min_clients=1, seed=1)
    fed = _federation(cfg, tmp_path)
    _run(fed, malformed=2)
    row = fed.history[0]
    assert (row["updates_accepted"], row["updates_rejected"], row["rejected_dtype"]) == (2, 1, 1)
    assert row["abandoned"] == 0


# ---------------------------------------------------------------- the accountant vs dp-accounting


def _dp_accounting_epsilon(z: float, q: float | None, rounds: int, delta: float) -> float:
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.rdp import RdpAccountant

    event = GaussianDpEvent(z) if q is None else PoissonSampledDpEvent(q, GaussianDpEvent(z))
    return RdpAccountant().compose(event, rounds).get_epsilon(delta)


@pytest.mark.parametrize(
    ("z", "q", "rounds", "delta"),
    [
        (1.0, 0.01, 1000, 1e-5),
        (1.1, 0.05, 100, 1e-5),
        (0.8, 0.1, 50, 1e-6),
        (2.0, 0.2, 200, 1e-5),
        (4.0, 0.5, 10, 1e-3),
        (0.6, 0.02, 300, 1e-5),
    ],
)
def test_poisson_accountant_agrees_with_dp_accounting(z, q, rounds, delta):
    accountant = GaussianAccountant(delta, poisson=True)
    population = 1000
    event = GaussianPrivacyEvent(
        noise_multiplier=z, sample_size=round(q * population), population_size=population
    )
    accountant.compose(event, rounds)
    ours = accountant.get_privacy_spent().epsilon
    assert ours == pytest.approx(_dp_accounting_epsilon(z, q, rounds, delta), rel=1e-9)
    # the subsampling's amplification, against the same releases counted without it
    unamplified = GaussianAccountant(delta)
    unamplified.compose(event, rounds)
    assert ours < unamplified.get_privacy_spent().epsilon


@pytest.mark.parametrize(
    ("z", "rounds", "delta"), [(1.0, 1, 1e-5), (0.5, 5, 1e-5), (3.0, 100, 1e-6), (10.0, 1000, 1e-3)]
)
def test_unamplified_accountant_agrees_with_dp_accounting(z, rounds, delta):
    accountant = GaussianAccountant(delta)
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=5, population_size=10), rounds)
    ours = accountant.get_privacy_spent().epsilon
    assert ours == pytest.approx(_dp_accounting_epsilon(z, None, rounds, delta), rel=1e-9)


def test_accountant_state_round_trips_through_its_releases():
    accountant = GaussianAccountant(1e-5, poisson=True)
    accountant.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=5, population_size=50), 7)
    again = GaussianAccountant(1e-5, accountant.releases, poisson=True)  # as a checkpoint restores it
    assert again.get_privacy_spent() == accountant.get_privacy_spent()
