"""The server: the guard in front of Flower's strategies and its DP release, the privacy
accountant, the server-side evaluation on the central test slice, and the rounds as a Flower
`ServerApp` (sample → train → guard + aggregate → evaluate on clients → evaluate centrally →
checkpoint)."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import random
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord
from flwr.common.constant import SType
from flwr.serverapp import GaussianPrivacyEvent, Grid, PrivacySpent, ServerApp
from flwr.serverapp import strategy as flwr_strategy
from torch import nn
from tqdm import tqdm

from app import metrics
from app.fl.checkpoint import save_checkpoint
from app.fl.config import MEAN_STRATEGIES, FederateConfig
from app.fl.task import CPU, evaluate_pixels, load_arrays

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the guard and the strategies

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


@dataclass(frozen=True)
class GaussianRelease:
    """Differential privacy on the aggregate: each update clipped to L2 norm `clip`, Gaussian noise
    of std `noise_multiplier`·clip/`denominator` on the result. For a mean strategy the server
    averages itself, over the fixed `denominator` (the sampled or expected count, never the number
    that replied), so one client moves the mean by at most clip/denominator."""

    clip: float
    noise_multiplier: float
    denominator: float
    mean: bool


def fresh_generator() -> np.random.Generator:
    """A generator seeded with 256 bits from the OS's CSPRNG, new for each release: DP noise never
    comes from --seed or NumPy's global state, and the seed is neither stored nor logged, so nobody
    holding the run's parameters can recompute the noise and subtract it."""
    return np.random.default_rng(secrets.randbits(256))


def clip_update(delta: dict[str, np.ndarray], clip: float) -> dict[str, np.ndarray]:
    """`delta` scaled to L2 norm at most `clip` over all its arrays (Flower's flat clipping), float64."""
    norm = math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in delta.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: v.astype(np.float64) * scale for k, v in delta.items()}


def gaussian_noise(
    like: dict[str, np.ndarray], std: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    return {k: rng.normal(0.0, std, v.shape) if std > 0 else np.zeros(v.shape) for k, v in like.items()}


def private_mean(
    deltas: list[dict[str, np.ndarray]],
    *,
    clip: float,
    denominator: float,
    noise_multiplier: float,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """Σ clip(Δᵢ) / denominator + N(0, (z·clip/denominator)²) per coordinate, in float64.

    A client that dropped or was rejected adds a zero update, so the sum's sensitivity stays `clip`
    whatever the clients do; dividing by the count that replied would let them scale it."""
    total = {k: np.zeros(v.shape) for k, v in deltas[0].items()} if deltas else {}
    for delta in deltas:
        for key, value in clip_update(delta, clip).items():
            total[key] += value
    noise = gaussian_noise(total, noise_multiplier * clip / denominator, rng)
    return {k: total[k] / denominator + noise[k] for k in total}


class _SampledNodes:
    """A grid that shows Flower's sampling only the nodes a Poisson draw picked."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


class GuardedStrategy(flwr_strategy.Strategy):
    """What the server does with replies before (or instead of) a Flower strategy aggregating them.

    Replies are taken in node order (deterministic sums); each must come from a node sampled this
    round, once, and hold exactly one ArrayRecord with the global model's arrays as numpy `.npy`
    bytes (loaded with allow_pickle=False: nothing from a client is unpickled) in the wire dtype
    `update_dtype`, all finite, and one MetricRecord with exactly `TRAIN_METRICS`, an example count
    the server knows (`examples`, by node) and bounded losses and accuracies. Others are rejected and
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

    def _check(self, reply: Message) -> tuple[dict[str, np.ndarray], float, int]:
        """(fp32 delta, L2 norm, examples the server counts) of one reply, or `Rejected`."""
        content = reply.content
        if (
            set(content.array_records) != {"arrays"}
            or set(content.metric_records) != {"metrics"}
            or (content.config_records)
        ):
            raise Rejected("records", f"records {sorted(content.keys())}")
        record = content.array_records["arrays"]
        if set(record) != set(self._global):
            raise Rejected("arrays", "its arrays are not the model's")
        delta = {}
        for key, array in record.items():
            want = self._global[key]
            if array.stype != SType.NUMPY:
                raise Rejected("arrays", f"array {key} is serialised as {array.stype!r}")
            if array.dtype != self.wire_dtype.name:
                raise Rejected("dtype", f"array {key} is {array.dtype}, not {self.wire_dtype.name}")
            if tuple(array.shape) != want.shape:
                raise Rejected("shape", f"array {key} is {list(array.shape)}, not {list(want.shape)}")
            if len(array.data) > want.size * self.wire_dtype.itemsize + _NPY_HEADER_BYTES:
                raise Rejected("shape", f"array {key} carries {len(array.data)} bytes")
            try:
                value = array.numpy()  # np.load(allow_pickle=False): object arrays refuse to load
            except (ValueError, TypeError, OSError, EOFError) as exc:
                raise Rejected("arrays", f"array {key} is not .npy of plain numbers: {exc}") from None
            if value.dtype != self.wire_dtype or value.shape != want.shape:
                raise Rejected("dtype", f"array {key} declares {array.dtype} but holds {value.dtype}")
            delta[key] = value.astype(np.float32)
        if not all(np.isfinite(v).all() for v in delta.values()):
            raise Rejected("non_finite", "NaN/Inf in the update")
        examples = self._check_metrics(content.metric_records["metrics"], reply.metadata.src_node_id)
        norm = math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in delta.values()))
        return delta, norm, examples

    def _check_metrics(self, reply_metrics: MetricRecord, node: int, evaluate: bool = False) -> int:
        """The examples the server counts for `node`, if its metrics are the expected keys and values."""
        keys = EVALUATE_METRICS if evaluate else TRAIN_METRICS
        if "num-examples" not in reply_metrics:
            raise Rejected("num_examples", "no num-examples")
        if set(reply_metrics) != keys:
            raise Rejected("metrics", f"metric keys {sorted(reply_metrics)}, expected {sorted(keys)}")
        claimed = reply_metrics["num-examples"]
        known = self.examples[node][int(evaluate)] if self.examples and node in self.examples else None
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

    def aggregate_train(self, server_round, replies):
        replies = sorted(replies, key=lambda m: m.metadata.src_node_id)
        self.last = GuardOutcome(
            sampled=len(self._sampled), received=len(replies), failed=sum(r.has_error() for r in replies)
        )
        senders = collections.Counter(r.metadata.src_node_id for r in replies)
        checked = []
        for reply in (r for r in replies if not r.has_error()):
            node = reply.metadata.src_node_id
            try:
                if node not in self._sampled or senders[node] > 1:
                    raise Rejected("sender", f"not sampled this round, or {senders[node]} replies")
                if reply.metadata.message_type != MessageType.TRAIN:
                    raise Rejected("sender", f"a {reply.metadata.message_type!r} reply")
                checked.append((reply, *self._check(reply)))
            except Rejected as rejection:
                self._reject(server_round, node, rejection)
        if self.outlier_factor and not self.privacy and len(checked) >= 3:
            median = float(np.median([norm for _, _, norm, _ in checked]))
            keep = []
            for item in checked:
                if item[2] > self.outlier_factor * median:
                    why = f"update norm {item[2]:.3g} > {self.outlier_factor:g} x the median {median:.3g}"
                    self._reject(server_round, item[0].metadata.src_node_id, Rejected("outlier", why))
                else:
                    keep.append(item)
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
        privacy = self.privacy
        if privacy is not None and privacy.mean:
            step = private_mean(
                [delta for _, delta, _, _ in checked],
                clip=privacy.clip,
                denominator=privacy.denominator,
                noise_multiplier=privacy.noise_multiplier,
                rng=self.noise_source(),
            )
            return ArrayRecord({k: Array((self._global[k] + step[k]).astype(np.float32)) for k in step}), None
        for reply, delta, _, examples in checked:
            if privacy is not None:
                delta = clip_update(delta, privacy.clip)
            weights = {k: Array((self._global[k] + delta[k]).astype(np.float32)) for k in self._global}
            reply.content["arrays"] = ArrayRecord(weights)
            reply.content["metrics"]["weight"] = 1.0 if privacy is not None else float(examples)
        arrays, train_metrics = self.inner.aggregate_train(server_round, [reply for reply, *_ in checked])
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
                examples = self._check_metrics(reply_metrics, node, evaluate=True)
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


# ---------------------------------------------------------------- privacy

RDP_ORDERS = np.array([1 + x / 10 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024])
"""Rényi orders: dp-accounting's defaults, so both convert to the same epsilon."""


def _log_add(a: float, b: float) -> float:
    low, high = min(a, b), max(a, b)
    return high if low == -math.inf else math.log1p(math.exp(low - high)) + high


def _log_comb(n: float, k: float) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _log_erfc(x: float) -> float:
    value = math.erfc(x)
    if value > 0:
        return math.log(value)
    # erfc underflows past x ≈ 26: its asymptotic series
    return -math.log(math.pi) / 2 - math.log(x) - x * x - 0.5 / x**2 + 0.625 / x**4 - 37 / 24 / x**6


def _log_a(q: float, z: float, alpha: float) -> float:
    """log A_α of the Poisson-subsampled Gaussian (Mironov, Talwar, Zhang 2019): an exact binomial
    sum at integer orders, the two-sided series of their Sec. 3.3 at fractional ones."""
    if float(alpha).is_integer():
        total = -math.inf
        for i in range(int(alpha) + 1):
            term = _log_comb(alpha, i) + i * math.log(q) + (alpha - i) * math.log1p(-q)
            total = _log_add(total, term + (i * i - i) / (2 * z * z))
        return total
    a0 = a1 = last0 = last1 = -math.inf
    z0 = z * z * math.log(1 / q - 1) + 0.5
    for i in range(1000):
        coef, j = _log_comb(alpha, i), alpha - i
        s0 = coef + i * math.log(q) + j * math.log1p(-q)
        s0 += (i * i - i) / (2 * z * z) + math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * z))
        s1 = coef + j * math.log(q) + i * math.log1p(-q)
        s1 += (j * j - j) / (2 * z * z) + math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * z))
        a0, a1 = _log_add(a0, s0), _log_add(a1, s1)
        total = _log_add(a0, a1)
        if s0 < last0 and s1 < last1 and max(s0, s1) < total - 30:
            return total
        last0, last1 = s0, s1
    return math.inf  # not converged: this order drops out


@functools.lru_cache(maxsize=64)
def gaussian_rdp(noise_multiplier: float, sampling_rate: float = 1.0) -> tuple[float, ...]:
    """RDP at `RDP_ORDERS` of one Gaussian release with noise multiplier z, its contributors
    Poisson-sampled at rate q (q = 1: no amplification, α/(2z²))."""
    z, q = noise_multiplier, sampling_rate
    if q == 0:
        return tuple(0.0 for _ in RDP_ORDERS)
    if z == 0:
        return tuple(math.inf for _ in RDP_ORDERS)
    if q == 1:
        return tuple(float(a) / (2 * z * z) for a in RDP_ORDERS)
    return tuple(_log_a(q, z, float(a)) / (float(a) - 1) for a in RDP_ORDERS)


def rdp_epsilon(rdp: Iterable[float], delta: float) -> float:
    """The smallest epsilon over the orders, by the conversion of Canonne, Kamath and Steinke (2020,
    Prop. 12; also dp-accounting's): ε = r + log(1 − 1/α) − log(δα)/(α − 1)."""
    best = math.inf
    for alpha, r in zip(RDP_ORDERS.tolist(), rdp, strict=True):
        if r < 0 or delta**2 + math.expm1(-r) > 0:
            return 0.0
        if alpha > 1.01 and math.isfinite(r):
            best = min(best, r + math.log1p(-1 / alpha) - math.log(delta * alpha) / (alpha - 1))
    return max(0.0, best)


class GaussianAccountant:
    """Privacy spent by the model releases, composed in Rényi DP, user-level (one client's updates
    replaced by zeros), with the shape of Flower's `PrivacyAccountant` (`compose`,
    `get_privacy_spent`) and without the optional dp-accounting package, which the tests check it
    against. Under Poisson client sampling (`poisson`) a release of an event with sample_size n of
    population_size N is the subsampled Gaussian at rate n/N; fixed-size sampling is counted
    without amplification, which holds whatever the sample. `releases` lists (z, q) per release.
    """

    def __init__(self, delta: float, releases: Iterable[Iterable[float]] = (), *, poisson: bool = False):
        self.delta, self.poisson = delta, poisson
        self.releases: list[list[float]] = [[float(z), float(q)] for z, q in releases]

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        q = event.sample_size / event.population_size if self.poisson else 1.0
        self.releases += [[float(event.noise_multiplier), q] for _ in range(count)]

    def get_privacy_spent(self) -> PrivacySpent:
        rdp = np.zeros(len(RDP_ORDERS))
        for (z, q), count in collections.Counter(map(tuple, self.releases)).items():
            rdp += count * np.array(gaussian_rdp(z, q))
        return PrivacySpent(
            epsilon=rdp_epsilon(rdp.tolist(), self.delta) if self.releases else 0.0,
            delta=self.delta,
            num_releases=len(self.releases),
            accounting_method="rdp-poisson-gaussian" if self.poisson else "rdp-gaussian",
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
            disable=not sys.stderr.isatty(),  # elsewhere (a pipe, a log file) a line per round instead
        )
        for server_round in progress:
            started = time.perf_counter()
            with _seeded(cfg.seed, server_round):  # the same clients as an unbroken run
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
                # The mean divides by the fixed count, whoever replied: the noise multiplier is z.
                fed.accountant.compose(
                    GaussianPrivacyEvent(
                        noise_multiplier=cfg.dp_noise,
                        sample_size=cfg.clients_per_round,
                        population_size=cfg.clients,
                    )
                )
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
