"""A federated server no client can crash or steer: each malformed train reply, built from real
Flower Message/ArrayRecord objects as the server receives them, is rejected and counted by kind,
and the round goes on with the rest, weighted by the example counts the server knows."""

from __future__ import annotations

import io
import uuid

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from app.fl import FederateConfig
from app.fl.grid import assign_message_id, stamp_task_identity
from app.fl.server_app import build_strategy
from app.fl.task import load_client_data, partition_sizes
from app.selection import EventTimeSplit

stamp_task_identity()  # as a running ServerApp has

GLOBAL = {"w": np.array([[1, 2], [3, 4]], dtype=np.float32), "b": np.array([0.5, -0.5], dtype=np.float32)}
KNOWN = {1: (10, 4), 2: (30, 4), 3: (20, 4)}
"""(training, validation) rows per node, as the server counts them; node 3 is the one that misbehaves."""
GOOD = {"w": np.full((2, 2), 0.25, np.float16), "b": np.full(2, -0.25, np.float16)}
METRICS = {"num-examples": 20, "train_loss": 0.7, "train_accuracy": 0.4}

UNPICKLED = []


class _Payload:
    """Would record that it was unpickled: the server must never do that to a client's bytes."""

    def __reduce__(self):
        return UNPICKLED.append, ("unpickled",)


def _pickled_object_array() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.array([_Payload()] * 4, dtype=object).reshape(2, 2), allow_pickle=True)
    return buffer.getvalue()


def _npy(value: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, value, allow_pickle=False)
    return buffer.getvalue()


def _arrays(**replace) -> ArrayRecord:
    record = ArrayRecord({k: Array(v) for k, v in GOOD.items()})
    for key, array in replace.items():
        if array is None:
            del record[key]
        else:
            record[key] = array
    return record


def _content(arrays=None, metrics=None, **extra) -> RecordDict:
    records = {
        "arrays": arrays if arrays is not None else _arrays(),
        "metrics": MetricRecord(METRICS if metrics is None else metrics),
    }
    return RecordDict({**records, **extra})


BAD = {
    "object array (pickled bytes)": (
        "arrays",
        _content(
            _arrays(
                w=Array(dtype="float16", shape=(2, 2), stype="numpy.ndarray", data=_pickled_object_array())
            )
        ),
    ),
    "torch serialisation": (
        "arrays",
        _content(_arrays(w=Array(dtype="float16", shape=(2, 2), stype="torch.tensor", data=b"\0" * 8))),
    ),
    "missing array": ("arrays", _content(_arrays(b=None))),
    "extra array": ("arrays", _content(_arrays(extra=Array(np.zeros(2, np.float16))))),
    "float64 where float16 is on the wire": ("dtype", _content(_arrays(w=Array(np.zeros((2, 2)))))),
    "int32": ("dtype", _content(_arrays(w=Array(np.zeros((2, 2), np.int32))))),
    "float16 declared, float64 inside": (
        "dtype",
        _content(
            _arrays(
                w=Array(dtype="float16", shape=(2, 2), stype="numpy.ndarray", data=_npy(np.zeros((2, 2))))
            )
        ),
    ),
    "wrong shape": ("shape", _content(_arrays(w=Array(np.zeros((4,), np.float16))))),
    "oversized payload": (
        "shape",
        _content(
            _arrays(w=Array(dtype="float16", shape=(2, 2), stype="numpy.ndarray", data=b"\0" * 200_000))
        ),
    ),
    "NaN": ("non_finite", _content(_arrays(w=Array(np.full((2, 2), np.nan, np.float16))))),
    "Inf": ("non_finite", _content(_arrays(b=Array(np.array([np.inf, 0], np.float16))))),
    "num-examples missing": ("num_examples", _content(metrics={"train_loss": 0.7, "train_accuracy": 0.4})),
    "num-examples zero": ("num_examples", _content(metrics={**METRICS, "num-examples": 0})),
    "num-examples negative": ("num_examples", _content(metrics={**METRICS, "num-examples": -20})),
    "num-examples huge": ("num_examples", _content(metrics={**METRICS, "num-examples": 10**12})),
    "num-examples not the partition's": ("num_examples", _content(metrics={**METRICS, "num-examples": 21})),
    "num-examples a float": ("num_examples", _content(metrics={**METRICS, "num-examples": 20.0})),
    "num-examples a list": ("num_examples", _content(metrics={**METRICS, "num-examples": [20]})),
    "unexpected metric key": ("metrics", _content(metrics={**METRICS, "weight": 1e9})),
    "accuracy out of range": ("metrics", _content(metrics={**METRICS, "train_accuracy": 7.0})),
    "non-finite loss": ("metrics", _content(metrics={**METRICS, "train_loss": float("nan")})),
    "an extra record": ("records", _content(config=ConfigRecord({"x": 1}))),
    "two array records": ("records", _content(more=_arrays())),
    "no metrics": ("records", RecordDict({"arrays": _arrays()})),
}


def _strategy(**overrides):
    cfg = FederateConfig(**{"clients": 3, "clients_per_round": 3, "min_clients": 2, **overrides})
    strategy = build_strategy(cfg, KNOWN)
    messages = strategy.configure_train(
        1, ArrayRecord({k: Array(v) for k, v in GLOBAL.items()}), ConfigRecord(), _Nodes(3)
    )
    return strategy, {m.metadata.dst_node_id: m for m in messages}


class _Nodes:
    def __init__(self, n):
        self.n = n

    def get_node_ids(self):
        return list(range(1, self.n + 1))


def _answer(instruction: Message, content: RecordDict) -> Message:
    assign_message_id(instruction, instruction.metadata.message_id or uuid.uuid4().hex)
    return Message(content, reply_to=instruction)


def _good(instruction: Message, node: int) -> Message:
    return _answer(instruction, _content(metrics={**METRICS, "num-examples": KNOWN[node][0]}))


def _expected_mean(nodes=(1, 2)) -> dict[str, np.ndarray]:
    total = sum(KNOWN[n][0] for n in nodes)
    return {
        k: (sum(KNOWN[n][0] * (v.astype(np.float64) + GOOD[k]) for n in nodes) / total).astype(np.float32)
        for k, v in GLOBAL.items()
    }


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_reply_is_rejected_by_kind_and_the_round_goes_on(case):
    kind, content = BAD[case]
    strategy, sent = _strategy()
    for message in sent.values():
        assign_message_id(message, uuid.uuid4().hex)
    replies = [_good(sent[1], 1), _good(sent[2], 2), _answer(sent[3], content)]
    arrays, train_metrics = strategy.aggregate_train(1, replies)
    assert strategy.last.rejected == {kind: 1} and strategy.last.accepted == 2, strategy.last
    assert not strategy.last.abandoned
    expected = _expected_mean()
    for key in GLOBAL:
        assert np.array_equal(arrays[key].numpy(), expected[key]), key
    assert train_metrics["train_loss"] == pytest.approx(0.7)
    assert UNPICKLED == []


def test_replies_from_unsampled_or_repeating_nodes_are_rejected():
    strategy, sent = _strategy(clients_per_round=2)  # 2 of 3 sampled
    unsampled = next(n for n in KNOWN if n not in sent)
    for message in sent.values():
        assign_message_id(message, uuid.uuid4().hex)
    first, second = sorted(sent)
    stranger = Message(RecordDict(), unsampled, "train")
    assign_message_id(stranger, "m-stranger")
    replies = [_good(sent[first], first), _good(sent[second], second), _good(sent[second], second)]
    replies.append(_good(stranger, unsampled))
    assert strategy.aggregate_train(1, replies) == (None, None)  # both of `second`'s go; 1 < min 2
    assert strategy.last.rejected == {"sender": 3} and strategy.last.abandoned


def test_too_many_malformed_replies_abandon_the_round():
    strategy, sent = _strategy()
    for message in sent.values():
        assign_message_id(message, uuid.uuid4().hex)
    replies = [_good(sent[1], 1)] + [_answer(sent[n], BAD["NaN"][1]) for n in (2, 3)]
    assert strategy.aggregate_train(1, replies) == (None, None)
    assert strategy.last.rejected == {"non_finite": 2} and strategy.last.abandoned


def test_malformed_evaluations_are_left_out_and_counted():
    strategy, sent = _strategy()
    messages = strategy.configure_evaluate(
        1, ArrayRecord({k: Array(v) for k, v in GLOBAL.items()}), ConfigRecord(), _Nodes(3)
    )
    replies = []
    for message, metrics in zip(
        sorted(messages, key=lambda m: m.metadata.dst_node_id),
        [
            {"num-examples": 4, "val_loss": 1.0, "val_accuracy": 0.25},
            {"num-examples": 4, "val_loss": 3.0, "val_accuracy": 0.75},
            {"num-examples": 10**9, "val_loss": 0.0, "val_accuracy": 1.0},  # claims to outweigh both
        ],
        strict=True,
    ):
        assign_message_id(message, uuid.uuid4().hex)
        replies.append(Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=message))
    result = strategy.aggregate_evaluate(1, replies)
    assert result["val_accuracy"] == pytest.approx(0.5) and strategy.last.evaluate_rejected == 1


def test_the_server_counts_each_clients_rows_as_the_client_loads_them(tmp_path):
    from test_fl_split import CLASSES, _snapshot

    files, event_times = _snapshot(tmp_path)
    split = EventTimeSplit.of(event_times, 0.2)
    sizes = partition_sizes(files, 5, 3, tuple(CLASSES), split.val_from, split.test_from)
    for partition in range(5):
        data = load_client_data(files, partition, 5, 3, tuple(CLASSES), split.val_from, split.test_from)
        assert sizes[partition] == (len(data.train_y), len(data.val_y))
    assert all(train > 0 for train, _ in sizes)
