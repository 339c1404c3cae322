"""Seeded synthetic attention heads (docs/evaluation.md, ``kvqrs.synthetic``): shapes, dtypes, determinism,
and the property that defines each family (heavy tails and outlier channels, low rank, focused
attention), plus the error on bad names and parameters."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from kvqrs.metrics import attention_logits, softmax
from kvqrs.synthetic import DISTRIBUTIONS, generate, parse

NAMES = ["gaussian", "heavy-8", "heavy-3", "heavy-1.05", "lowrank-4", "focused-1", "focused-2"]

# Excess kurtosis of N(0,1) samples has standard error sqrt(24/n) ~ 0.014 at n = 131072; a
# Student-t(8) has excess kurtosis 6/(8-4) = 1.5 (measured 1.63). Thresholds sit well between.
GAUSSIAN_KURTOSIS_MAX = 0.1
HEAVY8_KURTOSIS_MIN = 0.8
# Outlier channels are scaled by 8 (the default outlier_scale): their median |k| is ~8x the
# typical channel's; ordinary channels stay within this factor of the median channel.
OUTLIER_RATIO_MIN = 5.0
ORDINARY_RATIO_MAX = 1.5
# Low rank: singular values beyond r are noise (noise 0.05 vs O(1) signal: measured ratio
# s_{r+1}/s_r ~ 0.015); a gap of 10x is unambiguous.
RANK_GAP = 10.0
# Focused attention: mean entropy (nats) at 256 tokens, measured gaussian 5.05, focused 3.0-3.4.
ENTROPY_DROP_MIN = 1.0


def draw(name, seed=0, tokens=64, n_queries=8, head_dim=64, **kw):
    return generate(name, tokens=tokens, n_queries=n_queries, head_dim=head_dim, seed=seed, **kw)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("head_dim,tokens,n_queries", [(64, 100, 7), (128, 33, 1), (4, 5, 3)])
def test_shapes_and_dtypes(name, head_dim, tokens, n_queries):
    h = draw(name, tokens=tokens, n_queries=n_queries, head_dim=head_dim)
    assert h.queries.shape == (n_queries, head_dim)
    assert h.keys.shape == (tokens, head_dim) and h.values.shape == (tokens, head_dim)
    for a in (h.queries, h.keys, h.values):
        assert a.dtype == np.float32 and np.all(np.isfinite(a))
    assert h.distribution == name


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_per_seed_and_different_across_seeds(name):
    a, b, c = draw(name, seed=3), draw(name, seed=3), draw(name, seed=4)
    for x, y, z in zip((a.queries, a.keys, a.values), (b.queries, b.keys, b.values), (c.queries, c.keys, c.values)):
        np.testing.assert_array_equal(x, y)
        assert not np.array_equal(x, z)


@given(seed=st.integers(0, 2**64 - 1), name=st.sampled_from(NAMES))
def test_any_seed_is_reproducible(seed, name):
    a, b = draw(name, seed=seed, tokens=16, n_queries=2, head_dim=8), draw(name, seed=seed, tokens=16, n_queries=2, head_dim=8)
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.queries, b.queries)


def test_default_parameters():
    assert parse("heavy") == ("heavy", 3.0) and parse("lowrank") == ("lowrank", 4.0)
    assert parse("focused") == ("focused", 1.0) and parse("gaussian") == ("gaussian", None)
    assert parse("heavy-1.05") == ("heavy", 1.05)
    for short, full in (("heavy", "heavy-3"), ("lowrank", "lowrank-4"), ("focused", "focused-1")):
        np.testing.assert_array_equal(draw(short).keys, draw(full).keys)
    assert set(DISTRIBUTIONS) == {"gaussian", "heavy", "lowrank", "focused"}


def test_gaussian_is_standard_normal():
    h = draw("gaussian", tokens=2048, head_dim=64, n_queries=256)
    for a in (h.queries, h.keys, h.values):
        assert abs(a.mean()) < 0.02 and abs(a.std() - 1.0) < 0.02
    assert abs(scipy.stats.kurtosis(h.values.ravel())) < GAUSSIAN_KURTOSIS_MAX


def test_heavy_tails_increase_as_nu_falls():
    kurt = {n: scipy.stats.kurtosis(draw(n, tokens=2048).values.ravel()) for n in ("gaussian", "heavy-8", "heavy-3", "heavy-1.05")}
    assert abs(kurt["gaussian"]) < GAUSSIAN_KURTOSIS_MAX
    assert kurt["heavy-8"] > HEAVY8_KURTOSIS_MIN
    assert kurt["gaussian"] < kurt["heavy-8"] < kurt["heavy-3"] < kurt["heavy-1.05"], kurt
    # Unit variance where it exists (nu > 2): Student-t(8) rescaled by sqrt((nu-2)/nu).
    assert abs(draw("heavy-8", tokens=4096).values.std() - 1.0) < 0.05


@pytest.mark.parametrize("name", ["heavy-8", "heavy-3", "heavy-1.05"])
def test_heavy_keys_have_outlier_channels(name):
    h = draw(name, tokens=2048, head_dim=64)
    med = np.median(np.abs(h.keys), axis=0)
    typical = np.median(med)
    ranked = np.sort(med)[::-1] / typical
    assert np.all(ranked[:4] > OUTLIER_RATIO_MIN), ranked[:6]  # the default 4 outlier channels
    assert ranked[4] < ORDINARY_RATIO_MAX, ranked[:6]
    vmed = np.median(np.abs(h.values), axis=0)
    assert vmed.max() / np.median(vmed) < ORDINARY_RATIO_MAX  # values have none
    two = draw(name, tokens=2048, head_dim=64, outlier_channels=2)
    r2 = np.sort(np.median(np.abs(two.keys), axis=0))[::-1]
    assert r2[1] / np.median(r2) > OUTLIER_RATIO_MIN > r2[2] / np.median(r2)


def test_smallest_head_dim():
    h = draw("focused-2", head_dim=2, tokens=3, n_queries=2)
    assert h.keys.shape == (3, 2) and h.queries.shape == (2, 2)


def test_gaussian_keys_have_no_outlier_channels():
    med = np.median(np.abs(draw("gaussian", tokens=2048).keys), axis=0)
    assert med.max() / np.median(med) < ORDINARY_RATIO_MAX


@pytest.mark.parametrize("rank", [1, 4, 8])
def test_lowrank_keys_and_values_have_numerical_rank_r(rank):
    h = draw(f"lowrank-{rank}", tokens=512, head_dim=64)
    for a in (h.keys, h.values):
        s = np.linalg.svd(a.astype(np.float64), compute_uv=False)
        assert s[rank - 1] / s[rank] > RANK_GAP, s[: rank + 2]
        assert np.sum(s > s[0] / RANK_GAP**2) >= rank
    g = np.linalg.svd(draw("gaussian", tokens=512, head_dim=64).keys.astype(np.float64), compute_uv=False)
    assert g[rank - 1] / g[rank] < 2.0  # the full-rank control has no gap


def attention_entropy(name, seed=1, tokens=256):
    h = draw(name, seed=seed, tokens=tokens, n_queries=64)
    p = softmax(attention_logits(h.queries, h.keys))
    return float(np.mean(-np.sum(p * np.log(np.maximum(p, 1e-300)), axis=-1)))


@pytest.mark.parametrize("name", ["focused-1", "focused-2"])
def test_focused_attention_has_low_entropy(name):
    assert attention_entropy(name) < attention_entropy("gaussian") - ENTROPY_DROP_MIN
    assert attention_entropy(name, seed=2) < attention_entropy("gaussian", seed=2) - ENTROPY_DROP_MIN


def test_focused_queries_point_at_their_keys():
    h = draw("focused-1", tokens=64, n_queries=64, head_dim=64)
    p = softmax(attention_logits(h.queries, h.keys))
    assert np.mean(p.max(-1)) > 0.5  # one key takes most of the mass
    gauss = draw("gaussian", tokens=64, n_queries=64, head_dim=64)
    assert np.mean(softmax(attention_logits(gauss.queries, gauss.keys)).max(-1)) < 0.3


@pytest.mark.parametrize(
    "name,kw",
    [
        ("uniform", {}),
        ("Gaussian", {}),
        ("gaussian-3", {}),
        ("heavy-1", {}),
        ("heavy-0.5", {}),
        ("heavy--2", {}),
        ("heavy-x", {}),
        ("lowrank-0", {}),
        ("lowrank-65", {}),
        ("focused-0", {}),
        ("focused-65", {}),  # more keys per query than tokens
        ("gaussian", {"tokens": 0}),
        ("gaussian", {"n_queries": 0}),
        ("gaussian", {"head_dim": 1}),
        ("gaussian", {"tokens": 2.5}),
    ],
)
def test_bad_names_and_parameters_raise(name, kw):
    with pytest.raises(kvqrs.KvqrsError):
        draw(name, **{"tokens": 64, **kw})


@pytest.mark.parametrize("name", ["heavy-nan", "heavy-inf", "lowrank-inf", "lowrank-nan", "focused-inf"])
def test_non_finite_parameters_raise(name):
    with pytest.raises(kvqrs.KvqrsError):
        draw(name)


@pytest.mark.parametrize("seed", [None, -1, 1.5])
def test_bad_seed_raises(seed):
    with pytest.raises(kvqrs.KvqrsError):
        draw("gaussian", seed=seed)
