"""Distribution-shift statistics in numpy: the population stability index and a kernel MMD
two-sample test with a permutation p-value (`app.ops.drift` runs them on served traffic).

Why not alibi-detect for the MMD test: alibi-detect 0.13.0 needs numpy<2, pillow 10.4, pandas,
opencv and transformers (it would downgrade the pinned numpy 2.4.6 and pillow 13.0.0); the test
is thirty lines of numpy.
"""

from __future__ import annotations

import numpy as np

EPSILON = 1e-4
"""Floor of a bin's share, so an empty bin does not make the PSI infinite."""
PERMUTATIONS = 200


def psi(reference: np.ndarray, current: np.ndarray, bins: int = 10) -> float:
    """Population stability index of `current` against `reference`, on reference quantile bins."""
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)[1:-1]))
    expected = np.bincount(np.searchsorted(edges, reference), minlength=len(edges) + 1) / len(reference)
    actual = np.bincount(np.searchsorted(edges, current), minlength=len(edges) + 1) / len(current)
    expected, actual = np.clip(expected, EPSILON, None), np.clip(actual, EPSILON, None)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def categorical_psi(reference: dict[str, float], current: dict[str, float]) -> float:
    names = sorted(set(reference) | set(current))
    expected = np.clip(np.array([reference.get(n, 0.0) for n in names]), EPSILON, None)
    actual = np.clip(np.array([current.get(n, 0.0) for n in names]), EPSILON, None)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def mmd_test(
    x: np.ndarray, y: np.ndarray, permutations: int = PERMUTATIONS, seed: int = 0
) -> tuple[float, float]:
    """Kernel two-sample test of samples x [n, d] and y [m, d] (n, m >= 2): the unbiased MMD² under
    an RBF kernel exp(-|a-b|² / h), h the median pairwise squared distance of the pooled sample
    (the median heuristic), and its p-value over `permutations` seeded relabellings of the pool."""
    z = np.concatenate([x, y]).astype(np.float64)
    n, m = len(x), len(y)
    norms = np.sum(z * z, axis=1)
    distances = np.maximum(norms[:, None] + norms[None, :] - 2 * z @ z.T, 0.0)
    pairs = distances[np.triu_indices(n + m, 1)]
    bandwidth = float(np.median(pairs))
    if bandwidth <= 0:  # over half the pairs coincide (saturated one-hot outputs): the others decide
        if not (pairs > 0).any():
            return 0.0, 1.0  # one point repeated: nothing tells the samples apart
        bandwidth = float(np.median(pairs[pairs > 0]))
    kernel = np.exp(-distances / bandwidth)
    np.fill_diagonal(kernel, 0.0)  # unbiased: no point is compared with itself
    rng = np.random.default_rng(seed)
    in_x = np.zeros((permutations + 1, n + m))
    in_x[0, :n] = 1.0  # row 0: the observed split; the others: random relabellings
    for row in in_x[1:]:
        row[rng.permutation(n + m)[:n]] = 1.0
    # One product gives every split's within-x sum; the cross and within-y sums follow from it.
    kx = in_x @ kernel
    xx = np.einsum("pi,pi->p", kx, in_x)
    xy = kx.sum(axis=1) - xx
    yy = kernel.sum() - xx - 2 * xy
    statistics = xx / (n * (n - 1)) + yy / (m * (m - 1)) - 2 * xy / (n * m)
    p_value = (1 + np.sum(statistics[1:] >= statistics[0])) / (1 + permutations)
    return float(statistics[0]), float(p_value)
