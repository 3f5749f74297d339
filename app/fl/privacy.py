"""Differential privacy on the federated aggregate: each update clipped, Gaussian noise from a fresh
CSPRNG-seeded generator on the mean over a fixed count (`GaussianRelease`, `private_mean`), and the
Rényi-DP accountant that turns the releases into an epsilon (`GaussianAccountant`). The guard
(`guard.py`) applies the release; the rounds (`server_app.py`) compose one event per round."""

from __future__ import annotations

import collections
import functools
import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from flwr.serverapp import GaussianPrivacyEvent, PrivacySpent

# ---------------------------------------------------------------- the release


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


# ---------------------------------------------------------------- the accountant


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
