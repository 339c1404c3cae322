"""HeadQ side code: kvqrs.headq_encode / headq_decode / headq_score_correction / headq_basis and
kvqrs.random_orthonormal_basis (docs/kernels.md section 7; docs/kernels.md sections 1 and 7) against the float64
NumPy oracle, plus the score-space identities the read path relies on."""

from __future__ import annotations

import kvqrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import oracle

from tests.strategies import bits, finite_rows, gaussian_rows, head_dims, leading_shapes, seeds

# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------

# A side code may differ from the oracle only where t = p/s + h + 0.5 (float64, from the
# oracle's float32 p and stored s) lies within this many code steps of an integer: p and the
# code formula are specified bit for bit in float32 (kernels.md sections 7, 8), so the only
# slack needed is a few float32 ulps of t (|t| <= 256, ulp 3e-5).
CODE_STEP_TOL = 1e-4
# Decode / score correction vs the float64 oracle, relative to the sum of absolute terms
# (|U| |z| per coordinate; |q|^T |U| |z| per score): float32 fixed-order sums over <= 256 + 256
# terms err by at most ~(2 * 256/8 + 6) * 2^-24 ~ 4e-6.
SUM_RTOL = 1e-5
# Basis from calibration queries vs the oracle: same float64 eigendecomposition of the same
# matrix, rounded to float32 (half an ulp at |entry| <= 1 is 3e-8).
BASIS_ATOL = 1e-6
# random_orthonormal_basis vs the oracle: the float32 Gaussians may differ by one ulp with a
# different libm (kernels.md section 1); Gram-Schmidt in float64 keeps that at ~1e-7.
RANDOM_BASIS_ATOL = 1e-6
# Orthonormality of a float32 basis: U^T U = I up to float32 rounding of d entries per column.
ORTHONORMAL_ATOL = 1e-5


# --------------------------------------------------------------------------------------------
# Strategies and helpers
# --------------------------------------------------------------------------------------------


@st.composite
def bases(draw, dims=head_dims):
    """(head_dim, rank, basis): a seeded random orthonormal basis of any rank 1..head_dim."""
    d = draw(dims)
    rank = draw(st.one_of(st.integers(1, min(d, 8)), st.integers(1, d)))
    return d, rank, kvqrs.random_orthonormal_basis(draw(seeds), d, rank)


@st.composite
def headq_inputs(draw):
    d, rank, u = draw(bases())
    e = finite_rows(draw, draw(leading_shapes), d, scale=draw(st.sampled_from([1e-3, 1.0, 100.0, 1e5])))
    return e, u, draw(bits)


def flat(a, width):
    return np.asarray(a).reshape(-1, width)


def oracle_projection(e, u):
    """p = U^T e in the float32 fixed order (the oracle's own helper), as float64 (rows, r)."""
    return oracle._dot_f32(flat(e, u.shape[0]), np.asarray(u, np.float32).T).astype(np.float64)


def side_values(code) -> np.ndarray:
    h = (2**code.bits - 1) / 2
    return code.scales.astype(np.float64)[..., None] * (code.codes.astype(np.float64) - h)


# --------------------------------------------------------------------------------------------
# Kernel vs oracle (hypothesis)
# --------------------------------------------------------------------------------------------


@given(headq_inputs())
def test_encode_matches_oracle(case):
    e, u, q = case
    d, rank = u.shape
    code = kvqrs.headq_encode(e, u, q)
    want_codes, want_scales = oracle.headq_encode(e, u, q)
    assert code.bits == q
    assert code.codes.dtype == np.uint8 and code.codes.shape == (*e.shape[:-1], rank)
    assert code.scales.shape == e.shape[:-1]
    assert code.scales.dtype == want_scales.dtype, "scale storage (float16/float32) differs"
    np.testing.assert_array_equal(code.scales, want_scales)
    assert code.codes.size == 0 or int(code.codes.max()) < 2**q
    diff = code.codes != want_codes
    if diff.any():
        p = oracle_projection(e, u)
        s = want_scales.astype(np.float64).reshape(-1, 1)
        t = p / np.where(s > 0, s, 1.0) + (2**q - 1) / 2 + 0.5
        dist = np.abs(t - np.round(t)).reshape(diff.shape)
        assert np.all(dist[diff] <= CODE_STEP_TOL), "side codes differ away from a rounding tie"
        assert np.all(np.abs(code.codes.astype(int) - want_codes.astype(int))[diff] == 1)


@given(headq_inputs())
def test_decode_matches_oracle(case):
    e, u, q = case
    d, rank = u.shape
    code = kvqrs.headq_encode(e, u, q)
    got = kvqrs.headq_decode(code, u)
    assert got.dtype == np.float32 and got.shape == e.shape
    want = oracle.headq_decode(code.codes, code.scales, u, q)
    scale = np.abs(side_values(code)) @ np.abs(u.astype(np.float64)).T
    assert np.all(np.abs(got - want) <= SUM_RTOL * scale)


@st.composite
def correction_inputs(draw):
    e, u, q = draw(headq_inputs())
    queries = finite_rows(draw, draw(leading_shapes), u.shape[0], scale=draw(st.sampled_from([1e-2, 1.0, 100.0])))
    return queries, e, u, q


def correction(queries, code, u):
    """Score correction, working around the 0-d reshape bug when both inputs are single rows
    (see test_score_correction_of_single_vectors)."""
    if np.ndim(queries) == 1 and code.codes.ndim == 1:
        one = code._replace(codes=code.codes[None], scales=code.scales[None])
        return kvqrs.headq_score_correction(np.asarray(queries)[None], one, u)[0, 0]
    return kvqrs.headq_score_correction(queries, code, u)


@given(correction_inputs())
def test_score_correction_matches_oracle_and_decode(case):
    queries, e, u, q = case
    d, rank = u.shape
    code = kvqrs.headq_encode(e, u, q)
    got = correction(queries, code, u)
    assert got.dtype == np.float32 and got.shape == (*queries.shape[:-1], *e.shape[:-1])
    qf = flat(queries, d).astype(np.float64)
    want = oracle.headq_score_correction(qf, u, flat(code.codes, rank), code.scales.reshape(-1), q)
    abs_terms = (np.abs(qf) @ np.abs(u.astype(np.float64))) @ np.abs(flat(side_values(code), rank)).T
    got2 = np.asarray(got, np.float64).reshape(want.shape)
    assert np.all(np.abs(got2 - want) <= SUM_RTOL * abs_terms)
    # The correction is (U^T q) . z = q . (U z) = q . headq_decode(...).
    via_decode = qf @ flat(kvqrs.headq_decode(code, u), d).astype(np.float64).T
    assert np.all(np.abs(got2 - via_decode) <= 2 * SUM_RTOL * abs_terms)


@given(correction_inputs().map(lambda c: (c[0], c[1], c[2], 8)))
def test_eight_bit_correction_approximates_projected_residual(case):
    """At q = 8 bits, (U^T q).z approximates q^T U U^T e: |z_i - p_i| <= s/2 from rounding
    (s the stored scale) plus, where float16 storage rounded s down and p_i/s overshoots the top
    code, max|p| * 2^-11 from the clamp; summed with weights |(U^T q)_i|."""
    queries, e, u, q = case
    d, rank = u.shape
    code = kvqrs.headq_encode(e, u, q)
    nq, nk = flat(queries, d).shape[0], flat(e, d).shape[0]
    got = np.asarray(correction(queries, code, u), np.float64).reshape(nq, nk)
    p = oracle_projection(e, u)  # (rows, r)
    uq = flat(queries, d).astype(np.float64) @ u.astype(np.float64)  # (nq, r)
    exact = uq @ p.T
    s = code.scales.astype(np.float64).reshape(-1)
    pmax = np.abs(p).max(axis=1) if p.size else np.zeros(0)
    per_coord = s / 2 + pmax * 2.0**-11
    bound = np.abs(uq).sum(1)[:, None] * per_coord[None, :]
    slack = SUM_RTOL * np.abs(uq).sum(1)[:, None] * pmax[None, :] * 2 + 1e-30
    assert np.all(np.abs(got - exact) <= bound + slack)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_other_input_dtypes_equal_their_float32_values(dtype):
    u = kvqrs.random_orthonormal_basis(4, 64, 6)
    e = gaussian_rows(1, 5, 64).astype(dtype)
    qs = gaussian_rows(2, 3, 64).astype(dtype)
    code = kvqrs.headq_encode(e, u.astype(dtype), 4)
    ref = kvqrs.headq_encode(e.astype(np.float32), u.astype(dtype).astype(np.float32), 4)
    np.testing.assert_array_equal(code.codes, ref.codes)
    np.testing.assert_array_equal(code.scales, ref.scales)
    np.testing.assert_array_equal(kvqrs.headq_score_correction(qs, code, u), kvqrs.headq_score_correction(qs.astype(np.float32), code, u))
    out = kvqrs.headq_decode(code, u, dtype=dtype)
    assert out.dtype == np.dtype(dtype)


def test_strided_inputs_equal_contiguous():
    u_full = kvqrs.random_orthonormal_basis(5, 128, 16)
    u = u_full[::2, ::2]  # (64, 8), strided; orthonormality is irrelevant for this check
    e = gaussian_rows(6, 10, 128)[::2, ::2]
    qs = np.asfortranarray(gaussian_rows(7, 3, 64))
    assert not (u.flags.c_contiguous or e.flags.c_contiguous or qs.flags.c_contiguous)
    uc, ec, qc = map(np.ascontiguousarray, (u, e, qs))
    code, ref = kvqrs.headq_encode(e, u, 5), kvqrs.headq_encode(ec, uc, 5)
    np.testing.assert_array_equal(code.codes, ref.codes)
    np.testing.assert_array_equal(code.scales, ref.scales)
    strided = code._replace(codes=np.asfortranarray(code.codes))
    np.testing.assert_array_equal(kvqrs.headq_decode(strided, u), kvqrs.headq_decode(ref, uc))
    np.testing.assert_array_equal(kvqrs.headq_score_correction(qs, strided, u), kvqrs.headq_score_correction(qc, ref, uc))


@pytest.mark.parametrize(("lead_q", "lead_k"), [((3,), (0,)), ((0,), (2, 2)), ((2, 3), (4,)), ((), (5,)), ((2,), ())])
def test_leading_shapes(lead_q, lead_k):
    u = kvqrs.random_orthonormal_basis(1, 32, 4)
    code = kvqrs.headq_encode(np.ones((*lead_k, 32), np.float32), u, 3)
    assert code.codes.shape == (*lead_k, 4) and code.scales.shape == lead_k
    assert kvqrs.headq_decode(code, u).shape == (*lead_k, 32)
    assert kvqrs.headq_score_correction(np.ones((*lead_q, 32), np.float32), code, u).shape == (*lead_q, *lead_k)


def test_score_correction_of_single_vectors():
    u = kvqrs.random_orthonormal_basis(1, 32, 4)
    code = kvqrs.headq_encode(gaussian_rows(0, 1, 32)[0], u, 4)
    q = gaussian_rows(1, 1, 32)[0]
    got = kvqrs.headq_score_correction(q, code, u)
    assert got.shape == ()
    assert got == correction(q, code, u)


# --------------------------------------------------------------------------------------------
# Exact special cases and semantics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", range(1, 9))
def test_zero_residual_gives_exact_zero_correction(q):
    u = kvqrs.random_orthonormal_basis(8, 48, 6)
    e = gaussian_rows(9, 4, 48)
    e[2] = 0.0
    code = kvqrs.headq_encode(e, u, q)
    assert code.scales[2] == 0
    assert np.all(code.codes[2] == 2 ** (q - 1))  # all codes 2^(q-1) when s = 0
    queries = gaussian_rows(10, 3, 48) * 1e3
    corr = kvqrs.headq_score_correction(queries, code, u)
    assert np.all(corr[:, 2] == 0.0) and np.all(np.isfinite(corr))
    dec = kvqrs.headq_decode(code, u)
    assert np.all(dec[2] == 0.0)
    only_zero = kvqrs.headq_encode(np.zeros((2, 48), np.float32), u, q)
    assert only_zero.scales.dtype == np.float16 and np.all(only_zero.scales == 0)
    np.testing.assert_array_equal(kvqrs.headq_score_correction(queries, only_zero, u), 0.0)


def test_one_bit_side_code_is_plus_minus_max():
    """q = 1: h = 1/2, s = 2 max|p|, codes are the signs (p >= 0 -> 1) and z_i = +-max|p|."""
    u = kvqrs.random_orthonormal_basis(2, 32, 5)
    e = gaussian_rows(3, 6, 32)
    code = kvqrs.headq_encode(e, u, 1)
    p = oracle_projection(e, u)
    np.testing.assert_array_equal(code.codes, (p >= 0).astype(np.uint8))
    z = side_values(code)
    np.testing.assert_allclose(np.abs(z), np.repeat(np.abs(p).max(1, keepdims=True), 5, 1), rtol=2.0**-10)


def test_largest_coordinate_gets_an_extreme_code():
    """scale = max|p| / h, so the coordinate attaining max|p| maps to code 0 or 2^q - 1."""
    u = kvqrs.random_orthonormal_basis(11, 64, 8)
    e = gaussian_rows(12, 50, 64)
    p = oracle_projection(e, u)
    for q in range(2, 9):
        code = kvqrs.headq_encode(e, u, q)
        top = code.codes[np.arange(50), np.abs(p).argmax(1)]
        assert np.all((top == 0) | (top == 2**q - 1)), q


@pytest.mark.parametrize("scale", [1e7, 1e-7])
def test_scales_beyond_float16_are_float32(scale):
    """p ~ scale, so the 8-bit scale max|p|/127.5 is ~1e5 or ~1e-9: outside float16's range."""
    u = kvqrs.random_orthonormal_basis(13, 64, 8)
    e = gaussian_rows(14, 6, 64) * np.float32(scale)
    code = kvqrs.headq_encode(e, u, 8)
    assert code.scales.dtype == np.float32
    want_codes, want_scales = oracle.headq_encode(e, u, 8)
    np.testing.assert_array_equal(code.scales, want_scales)
    np.testing.assert_array_equal(code.codes, want_codes)
    p = oracle_projection(e, u)
    z = side_values(code)
    assert np.all(np.abs(z - p) <= code.scales.astype(np.float64)[:, None] / 2 * (1 + 1e-5))


def test_queries_in_the_basis_span_recover_the_score_error():
    """When the live queries lie in span(U) (as HeadQ intends: U comes from the queries), the
    8-bit correction recovers q . e itself, the error of the base scores."""
    d, r = 64, 6
    rng = np.random.default_rng(21)
    w = np.linalg.qr(rng.standard_normal((d, r)))[0]
    calib = (rng.standard_normal((500, r)) * np.linspace(3, 1, r)) @ w.T
    u = kvqrs.headq_basis(calib.astype(np.float32), r)
    queries = (rng.standard_normal((20, r)) @ w.T).astype(np.float32)
    keys = gaussian_rows(22, 30, d)
    codes, norms = kvqrs.mse_encode(keys, 2, 5)
    base = kvqrs.mse_decode(codes, norms, 2, d, 5)
    code = kvqrs.headq_encode(keys - base, u, 8)
    true_err = queries.astype(np.float64) @ (keys - base).astype(np.float64).T
    left = true_err - kvqrs.headq_score_correction(queries, code, u)
    # Residual error after correction is under 3% of the base error (8-bit side code, basis
    # recovered to ~1e-6 from noiseless calibration data).
    assert np.linalg.norm(left) <= 0.03 * np.linalg.norm(true_err)


# --------------------------------------------------------------------------------------------
# Bases
# --------------------------------------------------------------------------------------------


@given(st.data())
def test_headq_basis_matches_oracle(data):
    d = data.draw(head_dims)
    n = data.draw(st.integers(1, 40))
    rank = data.draw(st.integers(1, d))
    queries = finite_rows(data.draw, (n,), d, scale=data.draw(st.sampled_from([1e-2, 1.0, 100.0])))
    got = kvqrs.headq_basis(queries, rank)
    assert got.dtype == np.float32 and got.shape == (d, rank)
    want = oracle.headq_basis(queries, rank)
    np.testing.assert_allclose(got, want, atol=BASIS_ATOL, rtol=0)
    np.testing.assert_allclose(got.T.astype(np.float64) @ got, np.eye(rank), atol=ORTHONORMAL_ATOL)
    # Sign convention: the largest-magnitude entry of every column is positive (the choice is
    # made in float64, so among entries tied in float32 at least one must be positive).
    top = np.abs(got).max(0)
    assert np.all((got >= top - BASIS_ATOL).any(0))


@pytest.mark.parametrize(("d", "k"), [(64, 4), (128, 16), (80, 1), (5, 2)])
def test_headq_basis_recovers_planted_subspace(d, k):
    rng = np.random.default_rng(d * 100 + k)
    w = np.linalg.qr(rng.standard_normal((d, k)))[0]
    z = rng.standard_normal((4 * d, k)) * np.linspace(4, 2, k)
    queries = (z @ w.T + 1e-3 * rng.standard_normal((4 * d, d))).astype(np.float32)
    u = kvqrs.headq_basis(queries.reshape(4, d, d), k).astype(np.float64)  # leading axes pooled
    # Distance between the projectors: sin of the largest principal angle (noise 1e-3 vs
    # signal >= 2 gives ~1e-3).
    assert np.linalg.norm(u @ u.T - w @ w.T, 2) < 1e-2
    if k < d:
        extra = kvqrs.headq_basis(queries, k + 1).astype(np.float64)
        np.testing.assert_allclose(extra[:, :k], u, atol=BASIS_ATOL)  # nested
        assert np.linalg.norm(w.T @ extra[:, k]) < 1e-2  # the next column is noise, outside W


def test_headq_basis_full_rank_and_ordering():
    d = 16
    rng = np.random.default_rng(3)
    w = np.linalg.qr(rng.standard_normal((d, d)))[0]
    queries = (rng.standard_normal((400, d)) * np.geomspace(8, 0.5, d)) @ w.T
    u = kvqrs.headq_basis(queries.astype(np.float32), d).astype(np.float64)
    np.testing.assert_allclose(u.T @ u, np.eye(d), atol=ORTHONORMAL_ATOL)
    moment = queries.T @ queries / 400
    energies = np.einsum("ij,ik,kj->j", u, moment, u)  # Rayleigh quotients, descending
    assert np.all(np.diff(energies) < 0)


@pytest.mark.parametrize("rank", [0, -1, 17, True, 2.5])
def test_headq_basis_rank_bounds(rank):
    with pytest.raises(kvqrs.KvqrsError, match="rank"):
        kvqrs.headq_basis(gaussian_rows(0, 10, 16), rank)


def test_headq_basis_bad_queries():
    with pytest.raises(kvqrs.KvqrsError, match="0 rows"):
        kvqrs.headq_basis(np.zeros((0, 16), np.float32), 2)
    q = gaussian_rows(0, 10, 16).reshape(2, 5, 16)
    q[1, 3, 7] = np.nan
    with pytest.raises(kvqrs.KvqrsError, match=r"queries: .*finite.*row 8, position 7"):
        kvqrs.headq_basis(q, 2)


@given(st.data())
def test_random_orthonormal_basis_matches_oracle(data):
    d = data.draw(st.sampled_from([1, 2, 3, 17, 40, 64, 128, 256]))
    rank = data.draw(st.integers(1, min(d, 24)))
    seed = data.draw(seeds)
    u = kvqrs.random_orthonormal_basis(seed, d, rank)
    assert u.dtype == np.float32 and u.shape == (d, rank)
    np.testing.assert_allclose(u, oracle.random_orthonormal_basis(seed, d, rank), atol=RANDOM_BASIS_ATOL, rtol=0)
    np.testing.assert_allclose(u.T.astype(np.float64) @ u, np.eye(rank), atol=ORTHONORMAL_ATOL)


@pytest.mark.parametrize(("seed", "d", "rank"), [(0, 64, 4), (2**64 - 1, 17, 17), (12345, 128, 1), (7, 2, 2)])
def test_random_orthonormal_basis_equals_oracle(seed, d, rank):
    u = kvqrs.random_orthonormal_basis(seed, d, rank)
    np.testing.assert_allclose(u, oracle.random_orthonormal_basis(seed, d, rank), atol=RANDOM_BASIS_ATOL, rtol=0)
    np.testing.assert_array_equal(u, kvqrs.random_orthonormal_basis(seed, d, rank))  # deterministic
    other = kvqrs.random_orthonormal_basis(seed ^ 1, d, rank)
    assert not np.allclose(u, other)


@pytest.mark.parametrize(
    ("seed", "d", "rank", "pattern"),
    [
        (1, 8, 0, "rank"),
        (1, 8, 9, "rank"),
        (-1, 8, 2, "seed"),
        (2**64, 8, 2, "seed"),
        (None, 8, 2, "seed"),
        (1, 0, 1, "head_dim"),
    ],
)
def test_random_orthonormal_basis_errors(seed, d, rank, pattern):
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.random_orthonormal_basis(seed, d, rank)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_basis_shape_errors():
    e = gaussian_rows(0, 3, 16)
    with pytest.raises(kvqrs.KvqrsError, match=r"basis: expected a \(head_dim, rank\) array"):
        kvqrs.headq_encode(e, np.ones(16, np.float32), 2)
    with pytest.raises(kvqrs.KvqrsError, match=r"basis: expected a \(head_dim, rank\) array"):
        kvqrs.headq_encode(e, np.ones((1, 16, 2), np.float32), 2)
    with pytest.raises(kvqrs.KvqrsError, match=r"basis: .*length >= 1"):
        kvqrs.headq_encode(e, np.ones((16, 0), np.float32), 2)
    with pytest.raises(kvqrs.KvqrsError, match="rank <= head_dim"):  # rank > head_dim
        kvqrs.headq_encode(np.ones((3, 4), np.float32), np.ones((4, 8), np.float32), 2)
    with pytest.raises(kvqrs.KvqrsError, match=r"residual: expected a last axis of 16.*got 15"):
        kvqrs.headq_encode(gaussian_rows(0, 3, 15), kvqrs.random_orthonormal_basis(1, 16, 2), 2)
    with pytest.raises(kvqrs.KvqrsError, match="dtype"):
        kvqrs.headq_encode(e, np.ones((16, 2), np.int32), 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_inputs(bad):
    u = kvqrs.random_orthonormal_basis(1, 16, 3)
    e = gaussian_rows(0, 6, 16).reshape(3, 2, 16)
    e[2, 1, 4] = bad
    with pytest.raises(kvqrs.KvqrsError, match=r"residual: .*finite.*row 5, position 4"):
        kvqrs.headq_encode(e, u, 3)
    ub = u.copy()
    ub[3, 1] = bad
    with pytest.raises(kvqrs.KvqrsError, match=r"basis: .*finite"):
        kvqrs.headq_encode(gaussian_rows(0, 2, 16), ub, 3)
    code = kvqrs.headq_encode(gaussian_rows(0, 2, 16), u, 3)
    with pytest.raises(kvqrs.KvqrsError, match=r"basis: .*finite"):
        kvqrs.headq_decode(code, ub)
    qs = gaussian_rows(2, 4, 16)
    qs[3, 15] = bad
    with pytest.raises(kvqrs.KvqrsError, match=r"q: .*finite.*row 3, position 15"):
        kvqrs.headq_score_correction(qs, code, u)


def test_projection_overflow_rejected():
    u = np.zeros((8, 1), np.float32)
    u[:, 0] = 1 / np.sqrt(8)
    with pytest.raises(kvqrs.KvqrsError, match="overflow"):
        kvqrs.headq_encode(np.full((1, 8), 3e38, np.float32), u, 4)


def test_mismatched_query_dims():
    u = kvqrs.random_orthonormal_basis(1, 16, 3)
    code = kvqrs.headq_encode(gaussian_rows(0, 2, 16), u, 3)
    with pytest.raises(kvqrs.KvqrsError, match=r"q: expected a last axis of 16.*got 17"):
        kvqrs.headq_score_correction(np.ones((2, 17), np.float32), code, u)
    with pytest.raises(kvqrs.KvqrsError, match=r"codes: expected a last axis of 4"):
        kvqrs.headq_decode(code, kvqrs.random_orthonormal_basis(1, 16, 4))


@pytest.mark.parametrize("dtype", [np.uint8, np.int64])
@pytest.mark.parametrize("q", [1, 4, 7])
def test_codes_out_of_range(dtype, q):
    u = kvqrs.random_orthonormal_basis(1, 16, 3)
    code = kvqrs.headq_encode(gaussian_rows(0, 4, 16), u, q)
    codes = code.codes.astype(dtype)
    codes[3, 2] = 2**q
    bad = code._replace(codes=codes)
    pattern = rf"code {2**q} .*(row 3, position 2|index \(3, 2\))"
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.headq_decode(bad, u)
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.headq_score_correction(np.ones((1, 16), np.float32), bad, u)


@pytest.mark.parametrize("bad_bits", [0, 9, None, True])
def test_bad_bits(bad_bits):
    u = kvqrs.random_orthonormal_basis(1, 16, 3)
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        kvqrs.headq_encode(gaussian_rows(0, 2, 16), u, bad_bits)
    code = kvqrs.headq_encode(gaussian_rows(0, 2, 16), u, 2)._replace(bits=bad_bits)
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        kvqrs.headq_decode(code, u)


@pytest.mark.parametrize(
    ("scales", "pattern"),
    [
        (np.ones(3, np.float16), r"scales: expected shape \(2,\)"),
        (np.ones(2, np.float64), r"scales: .*float16 or float32"),
        (np.array([0.5, -0.5], np.float32), r"scales: .*non-negative.*row 1"),
        (np.array([np.nan, 0.5], np.float16), r"scales: .*row 0"),
    ],
)
def test_bad_scales(scales, pattern):
    u = kvqrs.random_orthonormal_basis(1, 16, 3)
    code = kvqrs.headq_encode(gaussian_rows(0, 2, 16), u, 3)._replace(scales=scales)
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.headq_decode(code, u)
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.headq_score_correction(np.ones((1, 16), np.float32), code, u)
