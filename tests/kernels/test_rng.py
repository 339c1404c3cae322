"""The seeded generator (docs/kernels.md section 1): Philox4x32-10 and the random objects
derived from it, against the NumPy oracle and known answers."""

from __future__ import annotations

import math

import kvqrs
import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import oracle

from tests.strategies import EDGE_DIMS, HEAD_DIMS, seeds

U32 = st.integers(min_value=0, max_value=2**32 - 1)

# Gaussians are Box-Muller in float64 rounded to float32; a different libm may move the float32
# result by one ulp (kernels.md section 1).
GAUSSIAN_MAX_ULPS = 1
# The basis is orthonormalised in float64 and rounded once to float32; two float64
# implementations of the same Gram-Schmidt order differ far below a float32 ulp (~6e-8).
BASIS_TOL = 1e-6
# U^T U of a float64 orthonormal basis rounded to float32: each entry moves by <= 2^-24
# relative, so the Gram matrix is off the identity by a few 1e-8; 1e-6 leaves headroom.
ORTHONORMAL_TOL = 1e-6
# Two-sided significance of each statistical check: a correct generator fails one of these
# fixed-seed checks with probability ~1e-6 (and, the seeds being fixed, never flakes).
STAT_ALPHA = 1e-6

# Seeds whose two 32-bit key words are at their edges.
EDGE_SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 2, 2**64 - 1]
near_max_seeds = st.integers(min_value=2**64 - 2**16, max_value=2**64 - 1)
any_seeds = st.one_of(seeds, near_max_seeds, st.sampled_from(EDGE_SEEDS))


def ulp_distance_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of float32 values between ``a`` and ``b`` (both finite float32)."""
    ia = np.asarray(a, dtype=np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, dtype=np.float32).view(np.int32).astype(np.int64)
    # Map the sign-magnitude encoding to a monotone integer line.
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


# --------------------------------------------------------------------------------------------
# Philox4x32-10 known answers
# --------------------------------------------------------------------------------------------

# (counter, key, expected output). The first two are in docs/kernels.md; the third is the
# Random123 kat_vectors entry for philox4x32 with 10 rounds (pi digits).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers_kernel(counter, key, expected):
    got = kvqrs.rng.philox4x32_10(counter, key)
    assert tuple(int(v) for v in got) == expected


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers_oracle(counter, key, expected):
    got = oracle.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert tuple(int(v) for v in got) == expected


@given(counter=st.tuples(U32, U32, U32, U32), key=st.tuples(U32, U32))
def test_philox_matches_oracle(counter, key):
    got = kvqrs.rng.philox4x32_10(counter, key)
    want = oracle.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert len(got) == 4
    assert all(isinstance(v, int) for v in got)
    assert tuple(int(v) for v in got) == tuple(int(v) for v in want)


@pytest.mark.parametrize(
    "counter, key",
    [
        ((0, 0, 0), (0, 0)),
        ((0, 0, 0, 0, 0), (0, 0)),
        ((0, 0, 0, 0), (0,)),
        ((0, 0, 0, 2**32), (0, 0)),
        ((0, 0, 0, 0), (-1, 0)),
    ],
)
def test_philox_rejects_bad_words(counter, key):
    with pytest.raises(kvqrs.KvqrsError, match="counter/key"):
        kvqrs.rng.philox4x32_10(counter, key)


def test_philox_rejects_float_words():
    with pytest.raises(kvqrs.KvqrsError):
        kvqrs.rng.philox4x32_10((0, 0, 0, 1.7), (0, 0))


# --------------------------------------------------------------------------------------------
# Rotation signs
# --------------------------------------------------------------------------------------------


@given(seed=any_seeds, dim=st.sampled_from(HEAD_DIMS + EDGE_DIMS + [1, 512, 1024, 4096]))
def test_rotation_signs_match_oracle(seed, dim):
    got = kvqrs.rng.rotation_signs(seed, dim)
    want = oracle.rotation_signs(seed, dim)
    assert got.shape == (dim,)
    assert got.dtype == np.float32
    assert np.all((got == 1.0) | (got == -1.0))
    np.testing.assert_array_equal(got, want)


@given(seed=any_seeds)
def test_rotation_signs_are_top_bits_of_stream_1(seed):
    # Independent of the oracle's stream helper: words built from the Philox block directly.
    dim = 8
    words = []
    for block in range(dim // 4):
        words += kvqrs.rng.philox4x32_10((block, 0, 1, 0), (seed & 0xFFFFFFFF, seed >> 32))
    want = np.array([1.0 if w >> 31 == 0 else -1.0 for w in words], dtype=np.float32)
    np.testing.assert_array_equal(kvqrs.rng.rotation_signs(seed, dim), want)


@given(seed=any_seeds, short=st.integers(1, 64), extra=st.integers(0, 64))
def test_rotation_signs_prefix_stable(seed, short, extra):
    # Sign i depends only on (seed, i): a longer vector extends a shorter one.
    np.testing.assert_array_equal(kvqrs.rng.rotation_signs(seed, short + extra)[:short], kvqrs.rng.rotation_signs(seed, short))


def test_rotation_signs_balanced():
    # Number of +1 among n signs is Binomial(n, 1/2).
    n = 1 << 16
    for seed in (0, 12345, 2**64 - 1):
        plus = int(np.sum(kvqrs.rng.rotation_signs(seed, n) > 0))
        p = scipy.stats.binomtest(plus, n, 0.5).pvalue
        assert p > STAT_ALPHA, (seed, plus, p)


def test_rotation_signs_depend_on_seed():
    a = kvqrs.rng.rotation_signs(1, 256)
    b = kvqrs.rng.rotation_signs(2, 256)
    c = kvqrs.rng.rotation_signs(1 + 2**32, 256)  # differs only in the high key word
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, c)


# --------------------------------------------------------------------------------------------
# Gaussians, QJL matrix
# --------------------------------------------------------------------------------------------


def assert_within_ulps(got, want, max_ulps=GAUSSIAN_MAX_ULPS):
    assert got.dtype == np.float32
    assert np.all(np.isfinite(got))
    dist = ulp_distance_f32(got, want)
    assert dist.max(initial=0) <= max_ulps, f"max ulp distance {dist.max()} at {np.argmax(dist)}"


@given(seed=any_seeds, stream=st.one_of(st.sampled_from([1, 2, 3]), U32), count=st.integers(0, 300))
def test_gaussians_match_oracle(seed, stream, count):
    got = kvqrs.rng.gaussians(seed, stream, count)
    want = oracle.gaussians(seed, stream, count)
    assert got.shape == (count,)
    assert_within_ulps(got, want)


@given(seed=any_seeds, short=st.integers(0, 50), extra=st.integers(0, 50))
def test_gaussians_prefix_stable(seed, short, extra):
    np.testing.assert_array_equal(kvqrs.rng.gaussians(seed, 2, short + extra)[:short], kvqrs.rng.gaussians(seed, 2, short))


def test_gaussians_streams_differ():
    a = kvqrs.rng.gaussians(7, 1, 64)
    b = kvqrs.rng.gaussians(7, 2, 64)
    c = kvqrs.rng.gaussians(7, 3, 64)
    assert not np.array_equal(a, b) and not np.array_equal(b, c) and not np.array_equal(a, c)


@given(seed=any_seeds, m=st.integers(1, 40), dim=st.sampled_from(HEAD_DIMS + EDGE_DIMS + [1]))
def test_qjl_matrix_matches_oracle(seed, m, dim):
    got = kvqrs.rng.qjl_matrix(seed, m, dim)
    want = oracle.qjl_matrix(seed, m, dim)
    assert got.shape == (m, dim)
    assert_within_ulps(got, want)


@given(seed=any_seeds, m=st.integers(1, 8), dim=st.integers(1, 40))
def test_qjl_matrix_is_stream_2_row_major(seed, m, dim):
    np.testing.assert_array_equal(kvqrs.rng.qjl_matrix(seed, m, dim).reshape(-1), kvqrs.rng.gaussians(seed, 2, m * dim))


@pytest.mark.parametrize("seed", [0, 99, 2**64 - 1])
def test_gaussians_statistics(seed):
    """Mean, variance and shape of 2^16 draws are consistent with N(0, 1) at level STAT_ALPHA."""
    n = 1 << 16
    g = kvqrs.rng.gaussians(seed, 2, n).astype(np.float64)
    # Mean ~ N(0, 1/n).
    z = scipy.stats.norm.isf(STAT_ALPHA / 2)
    assert abs(g.mean()) < z / math.sqrt(n), g.mean()
    # (n - 1) s^2 ~ chi2(n - 1).
    stat = (n - 1) * g.var(ddof=1)
    lo, hi = scipy.stats.chi2.ppf([STAT_ALPHA / 2, 1 - STAT_ALPHA / 2], n - 1)
    assert lo < stat < hi, g.var(ddof=1)
    # Distribution shape (Kolmogorov-Smirnov against the standard normal).
    assert scipy.stats.kstest(g, "norm").pvalue > STAT_ALPHA
    # Tails are present but bounded: with u1 >= 2^-25, |g| <= sqrt(2 * 25 ln 2) ~ 5.9.
    assert np.abs(g).max() <= math.sqrt(-2 * math.log(2.0**-25)) + 1e-6


def test_gaussians_pairs_uncorrelated():
    # Consecutive entries (from adjacent Philox words) are independent: correlation ~ N(0, 1/n).
    n = 1 << 16
    g = kvqrs.rng.gaussians(3, 3, n).astype(np.float64)
    r = np.corrcoef(g[:-1], g[1:])[0, 1]
    assert abs(r) < scipy.stats.norm.isf(STAT_ALPHA / 2) / math.sqrt(n), r


# --------------------------------------------------------------------------------------------
# Random orthonormal basis (HeadQ control)
# --------------------------------------------------------------------------------------------


@st.composite
def basis_shapes(draw):
    d = draw(st.sampled_from(HEAD_DIMS + EDGE_DIMS + [1]))
    r = draw(st.integers(1, min(d, 64)))
    return d, r


@given(seed=any_seeds, shape=basis_shapes())
def test_random_orthonormal_basis_matches_oracle(seed, shape):
    d, r = shape
    got = kvqrs.random_orthonormal_basis(seed, d, r)
    want = oracle.random_orthonormal_basis(seed, d, r)
    assert got.shape == (d, r)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=BASIS_TOL)


@given(seed=any_seeds, shape=basis_shapes())
def test_random_orthonormal_basis_is_orthonormal(seed, shape):
    d, r = shape
    u = kvqrs.random_orthonormal_basis(seed, d, r).astype(np.float64)
    np.testing.assert_allclose(u.T @ u, np.eye(r), rtol=0, atol=ORTHONORMAL_TOL)


@pytest.mark.parametrize("d, r", [(64, 64), (128, 16), (3, 3)])
def test_random_orthonormal_basis_full_and_partial(d, r):
    u = kvqrs.random_orthonormal_basis(5, d, r).astype(np.float64)
    np.testing.assert_allclose(u.T @ u, np.eye(r), rtol=0, atol=ORTHONORMAL_TOL)
    if r == d:  # square: also U U^T = I
        np.testing.assert_allclose(u @ u.T, np.eye(d), rtol=0, atol=ORTHONORMAL_TOL)


def test_random_orthonormal_basis_first_column_is_normalised_gaussians():
    # Modified Gram-Schmidt leaves the direction of column 0 alone.
    d, r = 40, 8
    a = kvqrs.rng.gaussians(11, 3, d * r).reshape(d, r).astype(np.float64)
    col = a[:, 0] / np.linalg.norm(a[:, 0])
    np.testing.assert_allclose(kvqrs.random_orthonormal_basis(11, d, r)[:, 0], col, rtol=0, atol=BASIS_TOL)


@pytest.mark.parametrize(
    "d, r, pattern",
    [(4, 5, "rank"), (4, 0, "rank"), (0, 1, "head_dim")],
)
def test_random_orthonormal_basis_errors(d, r, pattern):
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.random_orthonormal_basis(1, d, r)


# --------------------------------------------------------------------------------------------
# Seeds, determinism, argument errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", EDGE_SEEDS)
def test_edge_seeds_work_and_match_oracle(seed):
    np.testing.assert_array_equal(kvqrs.rng.rotation_signs(seed, 64), oracle.rotation_signs(seed, 64))
    assert_within_ulps(kvqrs.rng.gaussians(seed, 2, 64), oracle.gaussians(seed, 2, 64))
    np.testing.assert_allclose(
        kvqrs.random_orthonormal_basis(seed, 16, 4),
        oracle.random_orthonormal_basis(seed, 16, 4),
        rtol=0,
        atol=BASIS_TOL,
    )


def test_numpy_integer_seeds_accepted():
    s = np.uint64(2**64 - 1)
    np.testing.assert_array_equal(kvqrs.rng.rotation_signs(s, 32), kvqrs.rng.rotation_signs(2**64 - 1, 32))


@given(seed=any_seeds)
def test_determinism_across_calls(seed):
    for fn in (
        lambda: kvqrs.rng.rotation_signs(seed, 128),
        lambda: kvqrs.rng.gaussians(seed, 2, 100),
        lambda: kvqrs.rng.qjl_matrix(seed, 4, 32),
        lambda: kvqrs.random_orthonormal_basis(seed, 32, 4),
    ):
        a, b = fn(), fn()
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [-1, 2**64, True, None, 1.0, "3"])
@pytest.mark.parametrize(
    "call",
    [
        lambda s: kvqrs.rng.rotation_signs(s, 8),
        lambda s: kvqrs.rng.gaussians(s, 2, 8),
        lambda s: kvqrs.rng.qjl_matrix(s, 2, 8),
        lambda s: kvqrs.random_orthonormal_basis(s, 8, 2),
    ],
    ids=["rotation_signs", "gaussians", "qjl_matrix", "random_orthonormal_basis"],
)
def test_bad_seeds_rejected(call, bad):
    with pytest.raises(kvqrs.KvqrsError, match="seed") as info:
        call(bad)
    assert isinstance(info.value, ValueError)
    assert "2**64" in str(info.value)


@pytest.mark.parametrize("stream", [-1, 2**32])
def test_bad_stream_rejected(stream):
    with pytest.raises(kvqrs.KvqrsError, match=f"stream.*{stream}"):
        kvqrs.rng.gaussians(1, stream, 4)


@pytest.mark.parametrize("stream", [2.5, True])
def test_non_integer_stream_rejected(stream):
    with pytest.raises(kvqrs.KvqrsError, match="stream"):
        kvqrs.rng.gaussians(1, stream, 4)


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: kvqrs.rng.gaussians(1, 2, -1), "count"),
        (lambda: kvqrs.rng.qjl_matrix(1, 0, 8), "m"),
        (lambda: kvqrs.rng.qjl_matrix(1, 4, 0), "dim"),
        (lambda: kvqrs.rng.rotation_signs(1, 0), "dim"),
    ],
)
def test_bad_sizes_rejected(call, arg):
    with pytest.raises(kvqrs.KvqrsError, match=f"^{arg}:"):
        call()
