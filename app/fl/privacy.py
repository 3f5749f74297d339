"""Differential privacy on the federated aggregate: each update clipped, Gaussian noise from a fresh
CSPRNG-seeded generator on the mean over a fixed count (`GaussianRelease`, `private_mean`), and the
accountant that turns the releases into an epsilon (`GaussianAccountant`, dp-accounting's Rényi DP). The guard
(`guard.py`) applies the release; the rounds (`server_app.py`) compose one event per round."""

from __future__ import annotations

import collections
import functools
import logging
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


class GaussianAccountant:
    """Privacy spent by the model releases, user-level (one client's updates added or removed),
    composed in Rényi DP by Google's dp-accounting (`RdpAccountant`), with the shape of Flower's
    `PrivacyAccountant` (`compose`, `get_privacy_spent`). Amplification only where its assumption
    holds: under Poisson client sampling (`poisson`) from a secret source, a release of an event
    with sample_size n of population_size N is the Poisson-subsampled Gaussian at rate n/N;
    fixed-size sampling is counted without amplification, which holds whatever the sample.
    `releases` lists (z, q) per release: what a checkpoint keeps to restore the accountant."""

    def __init__(self, delta: float, releases: Iterable[Iterable[float]] = (), *, poisson: bool = False):
        self.delta, self.poisson = delta, poisson
        self.releases: list[list[float]] = [[float(z), float(q)] for z, q in releases]

    def release(self, event: GaussianPrivacyEvent) -> list[float]:
        """The (z, q) this accountant counts `event` as."""
        q = event.sample_size / event.population_size if self.poisson else 1.0
        return [float(event.noise_multiplier), q]

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        self.releases += [self.release(event) for _ in range(count)]

    def get_privacy_spent(self, more: Iterable[Iterable[float]] = ()) -> PrivacySpent:
        """ε at `delta` for the releases so far (and `more`, not yet made: what one more round would
        bring the total to)."""
        releases = [*map(tuple, self.releases), *map(tuple, more)]
        return PrivacySpent(
            epsilon=_epsilon(tuple(collections.Counter(releases).items()), self.delta) if releases else 0.0,
            delta=self.delta,
            num_releases=len(releases),
            accounting_method="rdp-poisson-gaussian" if self.poisson else "rdp-gaussian",
        )


@functools.lru_cache(maxsize=256)
def _epsilon(counted: tuple[tuple[tuple[float, float], int], ...], delta: float) -> float:
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # a low order that does not converge drops out; it says so per order
    try:
        for (z, q), count in counted:
            gaussian = GaussianDpEvent(z)
            accountant.compose(gaussian if q == 1.0 else PoissonSampledDpEvent(q, gaussian), count)
        return float(accountant.get_epsilon(delta))
    finally:
        absl.setLevel(level)
