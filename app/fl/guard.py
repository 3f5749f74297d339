"""The guard in front of Flower's strategies: every client reply is checked before any strategy
sees it (`check_update`, `check_metrics`), the round's accepted updates go to the strategy as
weights, or, under differential privacy, into the clipped and noised release (`privacy.py`).
`server_app.build_strategy` puts it in front of the strategy `--strategy` names."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord
from flwr.common.constant import SType
from flwr.serverapp import strategy as flwr_strategy

from app.fl.privacy import GaussianRelease, clip_update, fresh_generator, gaussian_noise, private_mean

log = logging.getLogger(__name__)

REJECTIONS = (
    "sender",
    "records",
    "arrays",
    "dtype",
    "shape",
    "non_finite",
    "num_examples",
    "metrics",
    "outlier",
)
"""Why the guard turns a train reply away: not from a sampled node (or twice), other records than
one ArrayRecord and one MetricRecord, other arrays than the model's or not numpy `.npy` bytes, the
wrong dtype or shape, NaN/Inf, an example count the server does not know, metrics it does not
expect, and (without DP) a norm far above the round's median."""
TRAIN_METRICS = frozenset({"num-examples", "train_loss", "train_accuracy"})
EVALUATE_METRICS = frozenset({"num-examples", "val_loss", "val_accuracy"})
WIRE_DTYPES = {"fp16": "float16", "fp32": "float32"}
MAX_CLAIMED_EXAMPLES = 10_000_000
"""The most examples a client may claim where the server does not know its size (hand-made tests);
`federate` always knows: each client's count must then match its partition's."""
_NPY_HEADER_BYTES = 1 << 16
"""Room for an `.npy` header beyond an array's data: a reply's bytes are bounded before they load."""


class Rejected(Exception):
    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


@dataclass
class GuardOutcome:
    """What the guard did with one round's train replies."""

    sampled: int = 0
    received: int = 0
    failed: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rejections by kind (`REJECTIONS`)."""
    accepted: int = 0
    abandoned: bool = False
    evaluate_rejected: int = 0


# ---------------------------------------------------------------- one reply


def check_update(
    reply: Message, global_arrays: Mapping[str, np.ndarray], wire_dtype: np.dtype
) -> dict[str, np.ndarray]:
    """The fp32 delta a train reply carries, or `Rejected`: exactly one ArrayRecord with the global
    model's arrays as numpy `.npy` bytes in `wire_dtype`, all finite, and one MetricRecord."""
    content = reply.content
    if (
        set(content.array_records) != {"arrays"}
        or set(content.metric_records) != {"metrics"}
        or (content.config_records)
    ):
        raise Rejected("records", f"records {sorted(content.keys())}")
    record = content.array_records["arrays"]
    if set(record) != set(global_arrays):
        raise Rejected("arrays", "its arrays are not the model's")
    delta = {}
    for key, array in record.items():
        want = global_arrays[key]
        if array.stype != SType.NUMPY:
            raise Rejected("arrays", f"array {key} is serialised as {array.stype!r}")
        if array.dtype != wire_dtype.name:
            raise Rejected("dtype", f"array {key} is {array.dtype}, not {wire_dtype.name}")
        if tuple(array.shape) != want.shape:
            raise Rejected("shape", f"array {key} is {list(array.shape)}, not {list(want.shape)}")
        if len(array.data) > want.size * wire_dtype.itemsize + _NPY_HEADER_BYTES:
            raise Rejected("shape", f"array {key} carries {len(array.data)} bytes")
        try:
            value = array.numpy()  # np.load(allow_pickle=False): object arrays refuse to load
        except (ValueError, TypeError, OSError, EOFError) as exc:
            raise Rejected("arrays", f"array {key} is not .npy of plain numbers: {exc}") from None
        if value.dtype != wire_dtype or value.shape != want.shape:
            raise Rejected("dtype", f"array {key} declares {array.dtype} but holds {value.dtype}")
        delta[key] = value.astype(np.float32)
    if not all(np.isfinite(v).all() for v in delta.values()):
        raise Rejected("non_finite", "NaN/Inf in the update")
    return delta


def check_metrics(reply_metrics: MetricRecord, known: int | None, evaluate: bool = False) -> int:
    """The examples the server counts for a reply whose metrics are exactly the expected keys, with
    bounded values and an example count that matches `known` (the client's partition, where the
    server knows it), or `Rejected`."""
    keys = EVALUATE_METRICS if evaluate else TRAIN_METRICS
    if "num-examples" not in reply_metrics:
        raise Rejected("num_examples", "no num-examples")
    if set(reply_metrics) != keys:
        raise Rejected("metrics", f"metric keys {sorted(reply_metrics)}, expected {sorted(keys)}")
    claimed = reply_metrics["num-examples"]
    if type(claimed) is not int or claimed < (0 if evaluate else 1):
        raise Rejected("num_examples", f"num-examples {claimed!r}")
    if known is None and claimed > MAX_CLAIMED_EXAMPLES:
        raise Rejected("num_examples", f"num-examples {claimed} > {MAX_CLAIMED_EXAMPLES}")
    if known is not None and claimed != known:
        raise Rejected("num_examples", f"num-examples {claimed}; its partition holds {known}")
    for key in keys - {"num-examples"}:
        value = reply_metrics[key]
        bound = 1.0 if key.endswith("accuracy") else math.inf
        if type(value) not in (int, float) or not 0 <= value <= bound:
            raise Rejected("metrics", f"{key} {value!r}")
    return claimed if known is None else known


def _norm(delta: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in delta.values()))


# ---------------------------------------------------------------- the round


class _SampledNodes:
    """A grid that shows Flower's sampling only the nodes a Poisson draw picked."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


@dataclass
class _Accepted:
    reply: Message
    delta: dict[str, np.ndarray]
    norm: float
    examples: int


class GuardedStrategy(flwr_strategy.Strategy):
    """What the server does with replies before (or instead of) a Flower strategy aggregating them.

    Replies are taken in node order (deterministic sums); each must come from a node sampled this
    round, once, and pass `check_update` in the wire dtype `update_dtype` and `check_metrics`
    against the example count the server knows (`examples`, by node). Others are rejected and
    counted by kind (`REJECTIONS`); with three or more left and no DP, a norm above
    `outlier_factor` × the median is rejected too. Accepted deltas become fp32 weights (global +
    delta) weighted by the server's count of each client's examples. Under `privacy`, updates are
    clipped and noised (`GaussianRelease`), weights are uniform and clients' metrics are dropped.
    Fewer than `min_clients` accepted updates abandon the round. Under Poisson sampling
    (`sampling_rate`), each node joins the round with that probability, drawn from Python's
    `random`, which the rounds seed. `last` describes the latest round.
    """

    def __init__(
        self,
        inner: flwr_strategy.Strategy,
        *,
        min_clients: int,
        outlier_factor: float | None,
        update_dtype: str = "fp16",
        examples: Mapping[int, tuple[int, int]] | None = None,
        privacy: GaussianRelease | None = None,
        sampling_rate: float | None = None,
        noise_source: Callable[[], np.random.Generator] = fresh_generator,
    ):
        self.inner, self.min_clients, self.outlier_factor = inner, min_clients, outlier_factor
        self.wire_dtype = np.dtype(WIRE_DTYPES[update_dtype])
        self.examples, self.privacy, self.sampling_rate = examples, privacy, sampling_rate
        self.noise_source = noise_source
        self._global: dict[str, np.ndarray] = {}
        self._sampled: set[int] = set()
        self.last = GuardOutcome()

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round, arrays, config, grid):
        self._global = {k: np.asarray(a.numpy(), dtype=np.float32) for k, a in arrays.items()}
        if self.sampling_rate is not None:
            grid = _SampledNodes([n for n in grid.get_node_ids() if random.random() < self.sampling_rate])
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self._sampled = {m.metadata.dst_node_id for m in messages}
        return messages

    def configure_evaluate(self, server_round, arrays, config, grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def _known(self, node: int, evaluate: bool) -> int | None:
        """The (training or validation) rows the server counts for `node`, where it knows them."""
        return self.examples[node][int(evaluate)] if self.examples and node in self.examples else None

    def _screen(self, server_round: int, replies: list[Message]) -> list[_Accepted]:
        """The replies that pass every check, in node order; the others counted in `last`."""
        senders = collections.Counter(r.metadata.src_node_id for r in replies)
        accepted = []
        for reply in (r for r in replies if not r.has_error()):
            node = reply.metadata.src_node_id
            try:
                if node not in self._sampled or senders[node] > 1:
                    raise Rejected("sender", f"not sampled this round, or {senders[node]} replies")
                if reply.metadata.message_type != MessageType.TRAIN:
                    raise Rejected("sender", f"a {reply.metadata.message_type!r} reply")
                delta = check_update(reply, self._global, self.wire_dtype)
                examples = check_metrics(reply.content.metric_records["metrics"], self._known(node, False))
                accepted.append(_Accepted(reply, delta, _norm(delta), examples))
            except Rejected as rejection:
                self._reject(server_round, node, rejection)
        if not self.outlier_factor or self.privacy or len(accepted) < 3:
            return accepted
        median = float(np.median([item.norm for item in accepted]))
        keep = []
        for item in accepted:
            if item.norm > self.outlier_factor * median:
                why = f"update norm {item.norm:.3g} > {self.outlier_factor:g} x the median {median:.3g}"
                self._reject(server_round, item.reply.metadata.src_node_id, Rejected("outlier", why))
            else:
                keep.append(item)
        return keep

    def aggregate_train(self, server_round, replies):
        replies = sorted(replies, key=lambda m: m.metadata.src_node_id)
        self.last = GuardOutcome(
            sampled=len(self._sampled), received=len(replies), failed=sum(r.has_error() for r in replies)
        )
        accepted = self._screen(server_round, replies)
        self.last.accepted = len(accepted)
        if len(accepted) < self.min_clients:
            log.warning(
                "round %d abandoned: %d valid update(s), fewer than --min-clients %d; the model stays",
                server_round,
                len(accepted),
                self.min_clients,
            )
            self.last.abandoned = True
            return None, None
        privacy = self.privacy
        if privacy is not None and privacy.mean:
            step = private_mean(
                [item.delta for item in accepted],
                clip=privacy.clip,
                denominator=privacy.denominator,
                noise_multiplier=privacy.noise_multiplier,
                rng=self.noise_source(),
            )
            return ArrayRecord({k: Array((self._global[k] + step[k]).astype(np.float32)) for k in step}), None
        for item in accepted:
            delta = clip_update(item.delta, privacy.clip) if privacy is not None else item.delta
            weights = {k: Array((self._global[k] + delta[k]).astype(np.float32)) for k in self._global}
            item.reply.content["arrays"] = ArrayRecord(weights)
            item.reply.content["metrics"]["weight"] = 1.0 if privacy is not None else float(item.examples)
        arrays, train_metrics = self.inner.aggregate_train(server_round, [item.reply for item in accepted])
        if privacy is None or arrays is None:
            return arrays, train_metrics
        # A median or Krum has no mean's sensitivity: noised as Flower's wrapper does, not accounted.
        values = {k: np.asarray(a.numpy(), dtype=np.float64) for k, a in arrays.items()}
        noise = gaussian_noise(
            values, privacy.noise_multiplier * privacy.clip / privacy.denominator, self.noise_source()
        )
        return ArrayRecord({k: Array((values[k] + noise[k]).astype(np.float32)) for k in values}), None

    def _reject(self, server_round: int, node: int, rejection: Rejected) -> None:
        self.last.rejected[rejection.kind] = self.last.rejected.get(rejection.kind, 0) + 1
        log.warning(
            "round %d: update from node %d rejected (%s): %s",
            server_round,
            node,
            rejection.kind,
            rejection.why,
        )

    def aggregate_evaluate(self, server_round, replies):
        valid = []
        for reply in sorted((r for r in replies if not r.has_error()), key=lambda m: m.metadata.src_node_id):
            node = reply.metadata.src_node_id
            try:
                content = reply.content
                if set(content.keys()) != {"metrics"} or not content.metric_records:
                    raise Rejected("records", f"records {sorted(content.keys())}")
                reply_metrics = content.metric_records["metrics"]
                examples = check_metrics(reply_metrics, self._known(node, True), evaluate=True)
            except Rejected as rejection:
                self.last.evaluate_rejected += 1
                log.warning(
                    "round %d: evaluation from node %d rejected: %s", server_round, node, rejection.why
                )
                continue
            if examples > 0:
                reply_metrics["weight"] = float(examples)
                valid.append(reply)
        return self.inner.aggregate_evaluate(server_round, valid) if valid else None
