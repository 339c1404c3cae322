"""Comparisons between schemes on per-sample metrics (docs/evaluation.md): Mann-Whitney U with the
rank-biserial correlation, two-sample Kolmogorov-Smirnov, multivariate energy distance on the
6D clouds with a permutation p-value, Spearman rho, and confidence intervals of means.
scipy.stats does the statistics wherever it has them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.spatial.distance import cdist

from .._arrays import KvqrsError


@dataclass(frozen=True)
class TestResult:
    """A statistic, its p-value and an effect size (NaN-free; see each function)."""

    statistic: float
    pvalue: float
    effect: float


def _clean(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    return a[np.isfinite(a)]


def mann_whitney(a, b) -> TestResult:
    """Two-sided Mann-Whitney U of ``a`` against ``b``; effect is the rank-biserial
    correlation ``2 U / (n_a n_b) - 1`` (+1: every ``a`` above every ``b``).

    Identical samples (all ties) give U = n_a n_b / 2, p = 1, effect 0.
    """
    a, b = _clean(a), _clean(b)
    if len(a) == 0 or len(b) == 0:
        return TestResult(0.0, 1.0, 0.0)
    if np.ptp(np.concatenate([a, b])) == 0:
        return TestResult(len(a) * len(b) / 2.0, 1.0, 0.0)
    res = stats.mannwhitneyu(a, b, alternative="two-sided")
    return TestResult(float(res.statistic), float(res.pvalue), float(2.0 * res.statistic / (len(a) * len(b)) - 1.0))


def kolmogorov_smirnov(a, b) -> TestResult:
    """Two-sample KS test; effect is the statistic D itself."""
    a, b = _clean(a), _clean(b)
    if len(a) == 0 or len(b) == 0:
        return TestResult(0.0, 1.0, 0.0)
    res = stats.ks_2samp(a, b)
    return TestResult(float(res.statistic), float(res.pvalue), float(res.statistic))


def energy_distance(x, y, permutations: int = 999, seed: int = 0) -> TestResult:
    """Multivariate energy distance ``2 E|X-Y| - E|X-X'| - E|Y-Y'|`` (Szekely & Rizzo) between
    two clouds ``(n, k)`` and ``(m, k)``, with a permutation p-value ``(1 + #{E_perm >= E}) /
    (1 + permutations)``.

    Each coordinate is standardised by the pooled standard deviation first (the 6D point mixes
    dB and radians); constant coordinates are left as they are. Effect is the distance itself.
    """
    if permutations < 1:
        raise KvqrsError(f"permutations: expected >= 1, got {permutations}")
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.size == 0 or y.size == 0:
        return TestResult(0.0, 1.0, 0.0)
    x = x.reshape(len(x), -1)
    y = y.reshape(len(y), -1)
    z = np.concatenate([x, y])
    sd = z.std(axis=0)
    z = (z - z.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    dist = cdist(z, z)
    n = len(x)

    def stat(idx: np.ndarray) -> float:
        a, b = idx[:n], idx[n:]
        return float(2 * dist[np.ix_(a, b)].mean() - dist[np.ix_(a, a)].mean() - dist[np.ix_(b, b)].mean())

    base = np.arange(len(z))
    observed = stat(base)
    rng = np.random.default_rng(seed)
    exceed = sum(stat(rng.permutation(base)) >= observed - 1e-12 for _ in range(permutations))
    return TestResult(observed, (1 + exceed) / (1 + permutations), observed)


def spearman(x, y) -> TestResult:
    """Spearman rank correlation; a constant input gives rho 0 and p 1 (not NaN)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return TestResult(0.0, 1.0, 0.0)
    res = stats.spearmanr(x, y)
    return TestResult(float(res.statistic), float(res.pvalue), float(res.statistic))


def mean_ci(x, confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and Student-t confidence interval ``(mean, low, high)``; one sample gives a zero-width
    interval, an empty one ``(0, 0, 0)``."""
    if not 0 < confidence < 1:
        raise KvqrsError(f"confidence: expected a level in (0, 1), got {confidence}")
    a = _clean(x)
    if len(a) == 0:
        return 0.0, 0.0, 0.0
    m = float(a.mean())
    if len(a) < 2 or np.ptp(a) == 0:
        return m, m, m
    half = float(stats.sem(a) * stats.t.ppf(0.5 + confidence / 2, len(a) - 1))
    return m, m - half, m + half
