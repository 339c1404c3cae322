"""Metrics of docs/evaluation.md (``kvqrs.metrics``): the 6D error point, attention KL and its
summary, routing recall, Fisher score error, A^2 distortion and the statistical comparisons,
on hand-computed cases, against scipy, and on degenerate inputs (always defined, never NaN)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs.metrics import (
    SIX_D_NAMES,
    SNR_CEILING_DB,
    a2_distortion,
    attention_logits,
    direction_angles,
    direction_error,
    energy_distance,
    fisher_score_error,
    key_mse,
    kl_divergence,
    kl_summary,
    kolmogorov_smirnov,
    mann_whitney,
    mean_ci,
    six_d_point,
    snr_db,
    softmax,
    spearman,
    topk_recall,
)

# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------

# Closed forms and scipy re-computations of the same float64 quantity: a few ulps of the result.
EXACT_RTOL = 1e-12
# p-values from scipy reproduced through our wrappers (same call, same data).
PVALUE_RTOL = 1e-10
# Fisher score error vs 2 KL: the second-order expansion KL = Var/2 + O(eps^3); at eps = 1e-3
# on O(1) logits the relative error of the ratio is O(eps) ~ 1e-3; 1% leaves margin.
FISHER_KL_RTOL = 1e-2
# Energy distance of two samples of the same distribution: the permutation p-value is uniform
# (measured over 300 draws: 6% below 0.05, mean 0.50); over SAME_DIST_DRAWS draws its mean must
# stay above this (3 standard errors below 0.5) and few draws may fall below 0.05.
SAME_DIST_DRAWS = 20
SAME_DIST_MEAN_P_MIN = 0.3
SAME_DIST_MAX_SMALL_P = 4
# arccos(cos) of identical vectors: cos rounds to 1 - ulp, arccos of which is ~1.5e-8 rad.
ARCCOS_FLOOR = 1e-7

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


def rng(seed):
    return np.random.default_rng(seed)


# --------------------------------------------------------------------------------------------
# SNR and direction
# --------------------------------------------------------------------------------------------


def test_snr_hand_cases():
    assert snr_db(np.array([[3.0, 4.0]]), np.array([[3.0, 3.0]])) == pytest.approx(10 * math.log10(25), rel=EXACT_RTOL)
    # Pooled over rows (sum of energies), not a mean of per-row SNRs.
    x = np.array([[1.0, 0.0], [0.0, 10.0]])
    xh = np.array([[0.0, 0.0], [0.0, 10.0]])
    assert snr_db(x, xh) == pytest.approx(10 * math.log10(101), rel=EXACT_RTOL)
    assert snr_db(x, 0.9 * x) == pytest.approx(20.0, rel=EXACT_RTOL)  # error 1% of the energy


def test_snr_degenerate_cases_are_defined():
    x = np.array([[1.0, 2.0]])
    assert snr_db(x, x) == SNR_CEILING_DB
    assert snr_db(np.zeros((2, 3)), np.zeros((2, 3))) == SNR_CEILING_DB
    assert snr_db(np.zeros((2, 3)), np.ones((2, 3))) == -SNR_CEILING_DB
    assert snr_db(np.ones((1, 2)), np.ones((1, 2)) + 1e-200) == SNR_CEILING_DB  # below resolution
    assert -SNR_CEILING_DB <= snr_db(np.array([[1e-150]]), np.array([[1e150]])) <= SNR_CEILING_DB


@given(hnp.arrays(np.float64, (4, 5), elements=finite), hnp.arrays(np.float64, (4, 5), elements=finite), st.floats(1e-3, 1e3))
def test_snr_is_scale_invariant_and_bounded(x, xh, c):
    s = snr_db(x, xh)
    assert np.isfinite(s) and -SNR_CEILING_DB <= s <= SNR_CEILING_DB
    if np.sum(x**2) > 0 and np.sum((x - xh) ** 2) > 0:
        assert snr_db(c * x, c * xh) == pytest.approx(s, abs=1e-9)


def test_direction_angle_hand_cases():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [2.0, 0.0]])
    y = np.array([[0.0, 3.0], [1.0, 1.0], [-5.0, 0.0], [7.0, 0.0], [1.0, math.sqrt(3)]])
    np.testing.assert_allclose(direction_angles(x, y), [math.pi / 2, math.pi / 4, math.pi, 0.0, math.pi / 3], atol=1e-7)
    assert direction_error(x, y) == pytest.approx(np.mean([math.pi / 2, math.pi / 4, math.pi, 0.0, math.pi / 3]), abs=1e-7)


def test_direction_angles_of_zero_vectors_are_defined():
    z = np.zeros(3)
    v = np.array([1.0, -2.0, 0.5])
    got = direction_angles(np.stack([z, z, v]), np.stack([z, v, z]))
    np.testing.assert_array_equal(got, [0.0, math.pi / 2, math.pi / 2])
    assert direction_angles(np.zeros((2, 3, 4)), np.zeros((2, 3, 4))).shape == (2, 3)
    assert direction_error(np.zeros((0, 4)), np.zeros((0, 4))) == 0.0


@given(
    hnp.arrays(np.float32, (6, 4), elements=st.floats(allow_nan=False, allow_infinity=False, width=32)),
    hnp.arrays(np.float32, (6, 4), elements=st.floats(allow_nan=False, allow_infinity=False, width=32)),
)
def test_direction_angles_never_nan_on_float32_data(x, y):
    """Any float32 data (subnormals, zeros, float32's extremes) gives angles in [0, pi]."""
    a = direction_angles(x, y)
    assert a.shape == (6,) and np.all(np.isfinite(a)) and np.all((a >= 0) & (a <= math.pi))


def test_direction_angles_never_nan_on_huge_float64():
    x = np.array([[1e200, 0.0]])
    assert np.all(np.isfinite(direction_angles(x, x)))
    assert direction_angles(x, x)[0] == pytest.approx(0.0, abs=1e-7)


def test_key_mse_and_six_d_point():
    r = rng(0)
    k, v = r.standard_normal((16, 8)), r.standard_normal((16, 8))
    kh, vh = k + 0.1 * r.standard_normal(k.shape), v + 0.2 * r.standard_normal(v.shape)
    t, th = r.standard_normal((4, 8)), r.standard_normal((4, 8))
    pt = six_d_point(k, kh, v, vh, t, th)
    assert tuple(pt) == SIX_D_NAMES
    assert pt == {
        "snr_k": snr_db(k, kh),
        "phi_k": direction_error(k, kh),
        "snr_v": snr_db(v, vh),
        "phi_v": direction_error(v, vh),
        "snr_t": snr_db(t, th),
        "phi_t": direction_error(t, th),
    }
    assert key_mse(k, kh) == pytest.approx(np.mean(np.sum((k - kh) ** 2, -1)), rel=EXACT_RTOL)
    exact = six_d_point(k, k, v, v, t, t)
    assert exact["snr_k"] == exact["snr_v"] == exact["snr_t"] == SNR_CEILING_DB
    for name in ("phi_k", "phi_v", "phi_t"):
        assert exact[name] == pytest.approx(0.0, abs=ARCCOS_FLOOR)
    assert pt["snr_k"] > pt["snr_v"]  # smaller key noise, higher SNR


# --------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------


def test_kl_hand_case():
    got = kl_divergence(np.array([0.0, 0.0]), np.array([0.0, math.log(3.0)]))
    assert got == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=EXACT_RTOL)
    # Two queries at once, shape (nq,).
    got2 = kl_divergence(np.array([[0.0, 0.0], [1.0, 1.0]]), np.array([[0.0, math.log(3.0)], [5.0, 5.0]]))
    np.testing.assert_allclose(got2, [0.5 * math.log(2) + 0.5 * math.log(2 / 3), 0.0], atol=1e-15)


@pytest.mark.parametrize("seed", range(5))
def test_kl_equals_scipy_entropy(seed):
    r = rng(seed)
    s, sh = 2 * r.standard_normal((3, 7, 50)), 2 * r.standard_normal((3, 7, 50))
    got = kl_divergence(s, sh)
    assert got.shape == (3, 7)
    p, q = softmax(s), softmax(sh)
    np.testing.assert_allclose(got, scipy.stats.entropy(p, q, axis=-1), rtol=1e-10)


def test_kl_single_token_and_identical_are_zero():
    assert kl_divergence(np.array([[3.0]]), np.array([[-100.0]]))[0] == 0.0
    s = rng(1).standard_normal((4, 9))
    np.testing.assert_allclose(kl_divergence(s, s), 0.0, atol=0)
    np.testing.assert_allclose(kl_divergence(s, s + 17.0), 0.0, atol=1e-12)  # shift invariant


def test_kl_extreme_logits_are_finite():
    cases = [
        (np.array([1e30, -1e30]), np.array([-1e30, 1e30]), 2e30),
        (np.array([0.0, -1e4]), np.array([-1e4, 0.0]), 1e4),
        (np.array([700.0, -700.0, 0.0]), np.array([700.0, -700.0, 0.0]), 0.0),
        (np.array([3e38, -3e38]), np.array([3e38, -3e38]), 0.0),  # float32 extremes
    ]
    for s, sh, want in cases:
        got = kl_divergence(s, sh)
        assert np.isfinite(got) and got >= 0
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


@given(hnp.arrays(np.float64, (3, 6), elements=finite), hnp.arrays(np.float64, (3, 6), elements=finite))
def test_kl_is_finite_and_nonnegative(s, sh):
    kl = kl_divergence(s, sh)
    assert kl.shape == (3,) and np.all(np.isfinite(kl)) and np.all(kl >= 0)


def test_kl_masked_tokens_contribute_zero():
    s = np.array([0.0, 1.0, -np.inf])
    got = kl_divergence(s, np.array([0.0, 1.0, -np.inf]))
    assert got == 0.0


def test_kl_summary():
    kl = np.arange(101, dtype=float).reshape(1, 101)
    assert kl_summary(kl) == {"kl_mean": 50.0, "kl_p99": 99.0, "kl_max": 100.0}
    r = rng(2).exponential(size=(4, 50))
    got = kl_summary(r)
    assert got["kl_mean"] == pytest.approx(r.mean(), rel=EXACT_RTOL)
    assert got["kl_p99"] == pytest.approx(np.percentile(r, 99), rel=EXACT_RTOL)
    assert got["kl_max"] == r.max() and got["kl_mean"] <= got["kl_p99"] <= got["kl_max"]
    assert kl_summary(np.array([])) == {"kl_mean": 0.0, "kl_p99": 0.0, "kl_max": 0.0}


# --------------------------------------------------------------------------------------------
# Routing recall, Fisher score error, A^2 distortion
# --------------------------------------------------------------------------------------------


def test_topk_recall_hand_cases():
    p = np.array([0.4, 0.3, 0.2, 0.1])
    ph = np.array([0.1, 0.2, 0.3, 0.4])
    assert topk_recall(p, ph, k=2) == 0.0
    assert topk_recall(p, ph, k=3) == pytest.approx(2 / 3)
    assert topk_recall(p, p, k=2) == 1.0
    assert topk_recall(p, np.array([0.4, 0.1, 0.3, 0.2]), k=2) == 0.5
    both = topk_recall(np.stack([p, p]), np.stack([ph, p]), k=1)
    np.testing.assert_array_equal(both, [0.0, 1.0])


def test_topk_recall_k_larger_than_tokens():
    r = rng(3)
    p, ph = r.dirichlet(np.ones(3), size=4), r.dirichlet(np.ones(3), size=4)
    np.testing.assert_array_equal(topk_recall(p, ph, k=5), np.ones(4))  # every token is in both top sets
    assert topk_recall(p, ph).shape == (4,)  # default k = 5


def test_topk_recall_ties_break_by_token_index():
    flat = np.full(4, 0.25)
    assert topk_recall(flat, flat, k=2) == 1.0
    assert topk_recall(np.array([0.5, 0.5, 0.0]), np.array([0.5, 0.4, 0.1]), k=1) == 1.0  # token 0 wins the tie
    assert topk_recall(np.array([0.5, 0.5, 0.0]), np.array([0.4, 0.5, 0.1]), k=1) == 0.0


def test_fisher_score_error_hand_cases():
    assert fisher_score_error(np.array([0.5, 0.5]), np.array([1.0, -1.0])) == pytest.approx(1.0)
    assert fisher_score_error(np.array([0.25, 0.75]), np.array([2.0, 0.0])) == pytest.approx(0.75)
    # A constant score shift changes no probability: zero error.
    assert fisher_score_error(np.array([0.2, 0.3, 0.5]), np.full(3, 4.0)) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("seed", range(4))
def test_fisher_score_error_is_the_weighted_variance(seed):
    r = rng(seed)
    p = r.dirichlet(np.ones(20), size=(2, 3))
    ds = r.standard_normal((2, 3, 20))
    got = fisher_score_error(p, ds)
    want = np.array([[np.cov(ds[i, j], aweights=p[i, j], bias=True) for j in range(3)] for i in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-10)
    mean = np.average(ds, weights=p, axis=-1)
    np.testing.assert_allclose(got, np.average((ds - mean[..., None]) ** 2, weights=p, axis=-1), rtol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_fisher_score_error_is_twice_local_kl(seed):
    r = rng(seed)
    s = r.standard_normal((5, 30))
    ds = 1e-3 * r.standard_normal((5, 30))
    fisher = fisher_score_error(softmax(s), ds)
    kl = kl_divergence(s, s + ds)
    np.testing.assert_allclose(fisher / kl, 2.0, rtol=FISHER_KL_RTOL)


def test_a2_distortion_hand_case():
    p = np.array([[0.5, 0.5], [1.0, 0.0]])
    v = np.array([[1.0, 0.0], [0.0, 1.0]])
    vh = np.array([[0.0, 0.0], [0.0, 3.0]])
    # per token errors [1, 4]; query 0: 0.25*1 + 0.25*4; query 1: 1*1 + 0*4
    np.testing.assert_allclose(a2_distortion(p, v, vh), [1.25, 1.0])
    r = rng(4)
    pb = r.dirichlet(np.ones(6), size=(2, 3))
    vb, vhb = r.standard_normal((2, 6, 4)), r.standard_normal((2, 6, 4))
    want = np.array([[np.sum(pb[b, q] ** 2 * np.sum((vb[b] - vhb[b]) ** 2, -1)) for q in range(3)] for b in range(2)])
    np.testing.assert_allclose(a2_distortion(pb, vb, vhb), want, rtol=1e-12)


def test_attention_logits_and_softmax():
    r = rng(5)
    q, k = r.standard_normal((2, 3, 16)), r.standard_normal((2, 7, 16))
    np.testing.assert_allclose(attention_logits(q, k), np.einsum("bqd,btd->bqt", q, k) / 4.0, rtol=1e-12)
    p = softmax(np.array([[1e4, 0.0, -1e4], [0.0, 0.0, 0.0]]))
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p, [[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]], atol=1e-15)


# --------------------------------------------------------------------------------------------
# Statistical comparisons
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_mann_whitney_matches_scipy(seed):
    r = rng(seed)
    a, b = r.standard_normal(30) + 0.3 * seed, r.standard_normal(25)
    got = mann_whitney(a, b)
    ref = scipy.stats.mannwhitneyu(a, b, alternative="two-sided")
    assert got.statistic == ref.statistic
    assert got.pvalue == pytest.approx(ref.pvalue, rel=PVALUE_RTOL)
    # Rank-biserial: P(a > b) - P(a < b) over all pairs (ties count half).
    diff = np.sign(a[:, None] - b[None, :])
    assert got.effect == pytest.approx(diff.mean(), abs=1e-12)
    assert got.effect == pytest.approx(2 * ref.statistic / (30 * 25) - 1, abs=1e-12)


def test_mann_whitney_extremes_and_degenerate():
    a, b = np.arange(10.0) + 100, np.arange(8.0)
    assert mann_whitney(a, b).effect == 1.0
    assert mann_whitney(b, a).effect == -1.0
    same = mann_whitney(np.full(5, 2.0), np.full(7, 2.0))
    assert (same.statistic, same.pvalue, same.effect) == (17.5, 1.0, 0.0)
    x = rng(6).standard_normal(20)
    ident = mann_whitney(x, x.copy())
    assert ident.pvalue == pytest.approx(1.0) and ident.effect == pytest.approx(0.0, abs=1e-12)
    assert mann_whitney([], [1.0, 2.0]) == mann_whitney([1.0], [])
    assert mann_whitney([], [1.0]).pvalue == 1.0
    # NaN / inf entries are dropped, never propagated.
    res = mann_whitney([1.0, np.nan, 2.0, 3.0], [0.0, np.inf, -1.0])
    assert res == mann_whitney([1.0, 2.0, 3.0], [0.0, -1.0])


@given(hnp.arrays(np.float64, st.integers(1, 15), elements=finite), hnp.arrays(np.float64, st.integers(1, 15), elements=finite))
def test_mann_whitney_is_antisymmetric_and_bounded(a, b):
    ab, ba = mann_whitney(a, b), mann_whitney(b, a)
    assert -1.0 <= ab.effect <= 1.0 and 0.0 <= ab.pvalue <= 1.0
    assert ab.effect == pytest.approx(-ba.effect, abs=1e-12)
    assert all(np.isfinite([ab.statistic, ab.pvalue, ab.effect]))


@pytest.mark.parametrize("seed", range(3))
def test_kolmogorov_smirnov_matches_scipy(seed):
    r = rng(seed)
    a, b = r.standard_normal(40), r.standard_normal(35) * (1 + seed)
    got = kolmogorov_smirnov(a, b)
    ref = scipy.stats.ks_2samp(a, b)
    assert got.statistic == ref.statistic and got.effect == ref.statistic
    assert got.pvalue == pytest.approx(ref.pvalue, rel=PVALUE_RTOL)
    assert kolmogorov_smirnov([], a) == kolmogorov_smirnov(a, [])


def direct_energy(x, y):
    """Szekely-Rizzo V-statistic by explicit loops, after the documented pooled standardisation."""
    z = np.concatenate([x, y]).astype(np.float64)
    sd = z.std(axis=0)
    z = (z - z.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    xs, ys = z[: len(x)], z[len(x) :]

    def mean_dist(a, b):
        return sum(math.dist(u, w) for u in a for w in b) / (len(a) * len(b))

    return 2 * mean_dist(xs, ys) - mean_dist(xs, xs) - mean_dist(ys, ys), xs, ys


def test_energy_distance_matches_direct_formula():
    r = rng(7)
    x = r.standard_normal((5, 3)) * [1.0, 10.0, 0.1]
    y = r.standard_normal((7, 3)) * [1.0, 10.0, 0.1] + [0.5, 0.0, 0.0]
    res = energy_distance(x, y, permutations=99, seed=1)
    want, _, _ = direct_energy(x, y)
    assert res.statistic == pytest.approx(want, rel=1e-10)
    assert res.effect == res.statistic
    assert 1 / 100 <= res.pvalue <= 1.0
    assert energy_distance(y, x, permutations=99).statistic == pytest.approx(want, rel=1e-10)  # symmetric


def test_energy_distance_one_dimension_matches_scipy():
    """In 1-D scipy's energy_distance is sqrt(2 E|X-Y| - E|X-X'| - E|Y-Y'|) of the samples."""
    r = rng(8)
    x, y = r.standard_normal((20, 1)), r.standard_normal((15, 1)) + 0.7
    res = energy_distance(x, y, permutations=9)
    _, xs, ys = direct_energy(x, y)
    assert math.sqrt(res.statistic) == pytest.approx(scipy.stats.energy_distance(xs[:, 0], ys[:, 0]), rel=1e-10)


def test_energy_distance_same_distribution_is_small_with_large_p():
    ps, stats = [], []
    for s in range(SAME_DIST_DRAWS):
        r = rng(100 + s)
        res = energy_distance(r.standard_normal((30, 6)), r.standard_normal((30, 6)), permutations=99, seed=s)
        ps.append(res.pvalue)
        stats.append(res.statistic)
    assert np.mean(ps) > SAME_DIST_MEAN_P_MIN, ps
    assert sum(p <= 0.05 for p in ps) <= SAME_DIST_MAX_SMALL_P, ps
    r = rng(99)
    shifted = energy_distance(r.standard_normal((30, 6)), r.standard_normal((30, 6)) + 1.0, permutations=99)
    assert max(stats) < shifted.statistic / 3  # "zero-ish" next to a one-sd shift


def test_energy_distance_shifted_clouds_have_small_p():
    r = rng(9)
    x = r.standard_normal((50, 6))
    y = r.standard_normal((50, 6)) + 1.0
    res = energy_distance(x, y, permutations=199, seed=0)
    assert res.pvalue == 1 / 200  # no permutation reaches the observed distance
    assert res.statistic > 0.5


def test_energy_distance_degenerate_inputs():
    x = rng(10).standard_normal((6, 2))
    same = energy_distance(x, x, permutations=19)
    assert same.statistic == pytest.approx(0.0, abs=1e-12) and same.pvalue == 1.0
    const = energy_distance(np.ones((4, 3)), np.ones((5, 3)), permutations=19)
    assert const.statistic == 0.0 and np.isfinite(const.pvalue)


def test_energy_distance_empty_cloud_is_defined():
    x = rng(10).standard_normal((6, 2))
    assert energy_distance(np.zeros((0, 2)), x, permutations=19) == energy_distance(x, np.zeros((0, 2)), permutations=19)
    assert energy_distance(np.zeros((0, 2)), x, permutations=19).pvalue == 1.0


@pytest.mark.parametrize("seed", range(3))
def test_spearman_matches_scipy(seed):
    r = rng(seed)
    x = r.standard_normal(40)
    y = x * (seed - 1) + r.standard_normal(40)
    got = spearman(x, y)
    ref = scipy.stats.spearmanr(x, y)
    assert got.statistic == pytest.approx(ref.statistic, rel=EXACT_RTOL, abs=1e-15)
    assert got.pvalue == pytest.approx(ref.pvalue, rel=PVALUE_RTOL)


def test_spearman_degenerate_inputs():
    assert spearman(np.ones(10), np.arange(10.0)) == spearman(np.arange(10.0), np.ones(10))
    res = spearman(np.ones(10), np.arange(10.0))
    assert (res.statistic, res.pvalue, res.effect) == (0.0, 1.0, 0.0)
    assert spearman([1.0, 2.0], [2.0, 1.0]).pvalue == 1.0  # fewer than 3 pairs
    assert spearman(np.arange(5.0), np.exp(np.arange(5.0))).statistic == pytest.approx(1.0)
    # Pairs with a non-finite member are dropped together.
    x = np.array([1.0, 2.0, np.nan, 4.0, 5.0, 6.0])
    y = np.array([2.0, 1.0, 3.0, np.inf, 5.0, 7.0])
    assert spearman(x, y) == spearman([1.0, 2.0, 5.0, 6.0], [2.0, 1.0, 5.0, 7.0])


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_mean_ci_matches_scipy_t_interval(confidence):
    x = rng(11).standard_normal(17) * 3 + 1
    m, lo, hi = mean_ci(x, confidence)
    want_lo, want_hi = scipy.stats.t.interval(confidence, len(x) - 1, loc=x.mean(), scale=scipy.stats.sem(x))
    assert m == pytest.approx(x.mean(), rel=EXACT_RTOL)
    assert lo == pytest.approx(want_lo, rel=1e-10) and hi == pytest.approx(want_hi, rel=1e-10)


def test_mean_ci_degenerate_inputs():
    assert mean_ci([]) == (0.0, 0.0, 0.0)
    assert mean_ci([2.5]) == (2.5, 2.5, 2.5)
    assert mean_ci([3.0, 3.0, 3.0]) == (3.0, 3.0, 3.0)
    assert mean_ci([1.0, np.nan, 3.0]) == mean_ci([1.0, 3.0])
    m, lo, hi = mean_ci([1.0, 3.0])
    assert lo < m == 2.0 < hi and np.isfinite([lo, hi]).all()
