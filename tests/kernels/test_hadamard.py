"""Randomized Walsh-Hadamard rotation (docs/kernels.md section 3): hadamard and
inverse_hadamard against the float64 oracle (explicit Sylvester matrix), orthogonality,
padding, dtypes, strided inputs and argument errors."""

from __future__ import annotations

import math

import kvqrs
import ml_dtypes
import numpy as np
import pytest
import scipy.linalg
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import oracle

from tests.strategies import EDGE_DIMS, HEAD_DIMS, float_rows, gaussian_rows, leading_shapes, seeds

ALL_DIMS = HEAD_DIMS + EDGE_DIMS
optional_seeds = st.one_of(st.none(), seeds, st.just(2**64 - 1))

# float32 fast transform vs the float64 oracle, per element relative to the row norm: log2(d')
# butterfly stages plus the sign and scale steps each round once (<= ~12 * 2^-24 ~ 7e-7).
F32_TOL = 2e-6
# Output rounded to the caller's half-precision dtype: |y_i| <= ||x||, so the rounding error is
# at most half an ulp of the norm (2^-11 for float16, 2^-8 for bfloat16); allow twice that.
F16_TOL = 2.0**-10
BF16_TOL = 2.0**-7
# Absolute floor for rows of subnormal values, where relative precision is lost: float32
# subnormal granularity is ~1.4e-45, float16's is 2^-24.
F32_ATOL = 1e-37
F16_ATOL = 2.0**-24
# hadamard followed by inverse_hadamard in float32: two transforms' rounding (~2 x 7e-7 worst
# case, ~1e-7 typical), relative to the row norm.
INVERSE_TOL = 1e-6
# ||R x|| vs ||x||: the transform is orthogonal, so only float32 rounding moves the norm.
NORM_TOL = 1e-6

DTYPE_TOLS = {
    np.dtype(np.float32): (F32_TOL, F32_ATOL),
    np.dtype(np.float64): (F32_TOL, F32_ATOL),  # still computed in float32
    np.dtype(np.float16): (F16_TOL, F16_ATOL),
    np.dtype(ml_dtypes.bfloat16): (BF16_TOL, F32_ATOL),
}


@st.composite
def rows_case(draw, dims=ALL_DIMS, dtypes=(np.float32,)):
    d = draw(st.sampled_from(dims))
    leading = draw(leading_shapes)
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    x = float_rows(draw, leading, d).astype(dtype)
    return x, draw(optional_seeds)


def row_norms(x) -> np.ndarray:
    x64 = np.asarray(x).astype(np.float64)
    return np.linalg.norm(x64, axis=-1, keepdims=True)


def assert_rows_close(got, want, ref, rtol, atol):
    """|got - want| <= rtol * ||ref row|| + atol, elementwise."""
    got64 = np.asarray(got).astype(np.float64)
    err = np.abs(got64 - want)
    bound = rtol * row_norms(ref) + atol
    assert got64.shape == want.shape
    assert np.all(err <= bound), f"max excess {np.max(err - bound)}, max rel err {np.max(err / (bound - atol + 1e-300))}"


# --------------------------------------------------------------------------------------------
# Against the oracle
# --------------------------------------------------------------------------------------------


@given(rows_case(dtypes=(np.float32, np.float64, np.float16, ml_dtypes.bfloat16)))
def test_hadamard_matches_oracle(case):
    x, seed = case
    d = x.shape[-1]
    got = kvqrs.hadamard(x, seed)
    assert got.dtype == x.dtype
    assert got.shape == (*x.shape[:-1], kvqrs.padded_dim(d))
    # The kernel computes in float32 from the caller's values (float64 rounded to float32).
    want = oracle.hadamard(x.astype(np.float32).astype(np.float64), seed)
    rtol, atol = DTYPE_TOLS[x.dtype]
    assert_rows_close(got, want, x.astype(np.float32), rtol, atol)


@given(case=rows_case(dtypes=(np.float32, np.float64, np.float16, ml_dtypes.bfloat16)), data=st.data())
def test_inverse_hadamard_matches_oracle(case, data):
    # Arbitrary rows of length d' (not only images of padded vectors).
    x, seed = case
    d = x.shape[-1]
    dp = kvqrs.padded_dim(d)
    y = float_rows(data.draw, x.shape[:-1], dp).astype(x.dtype)
    got = kvqrs.inverse_hadamard(y, seed, d)
    assert got.dtype == y.dtype
    assert got.shape == (*y.shape[:-1], d)
    want = oracle.inverse_hadamard(y.astype(np.float32).astype(np.float64), seed, d)
    rtol, atol = DTYPE_TOLS[y.dtype]
    assert_rows_close(got, want, y.astype(np.float32), rtol, atol)


@given(d=st.sampled_from(ALL_DIMS), seed=optional_seeds, n=st.integers(1, 8), rseed=st.integers(0, 2**32))
def test_hadamard_gaussian_rows_match_oracle(d, seed, n, rseed):
    # Same comparison on well-scaled Gaussian rows (no subnormals, no cancellation to zero).
    x = gaussian_rows(rseed, n, d)
    assert_rows_close(kvqrs.hadamard(x, seed), oracle.hadamard(x, seed), x, F32_TOL, 0.0)


def test_hadamard_explicit_matrix_small():
    # d = 4, no signs: H_4 / 2 with Sylvester ordering.
    h4 = np.array([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], np.float64) / 2
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    np.testing.assert_allclose(kvqrs.hadamard(x, None), x @ h4, rtol=0, atol=F32_TOL * 6)
    # With a seed: H diag(s) / 2.
    s = oracle.rotation_signs(77, 4)
    np.testing.assert_allclose(kvqrs.hadamard(x, 77), (x * s) @ h4, rtol=0, atol=F32_TOL * 6)


@pytest.mark.parametrize("d", [2, 3, 64, 100])
def test_hadamard_rows_of_matrix_are_orthonormal(d):
    # Rotating the identity gives R^T (rows e_i -> R e_i); its rows are orthonormal.
    eye = np.eye(d, dtype=np.float32)
    r = kvqrs.hadamard(eye, 5).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(d), rtol=0, atol=NORM_TOL * 4)


# --------------------------------------------------------------------------------------------
# Strided inputs
# --------------------------------------------------------------------------------------------


@given(d=st.sampled_from(ALL_DIMS), seed=optional_seeds, data=st.data())
def test_strided_views_match_contiguous(d, seed, data):
    base = float_rows(data.draw, (4, 3), 2 * d)
    views = [
        base[:, :, ::2],  # strided last axis
        base[::-1, 1:, d:],  # reversed, offset
        np.swapaxes(base[..., :d], 0, 1),  # transposed leading axes
    ]
    if d <= 4:
        views.append(np.swapaxes(base[:, :d, :d], -1, -2))  # transposed rows and columns
    for v in views:
        np.testing.assert_array_equal(kvqrs.hadamard(v, seed), kvqrs.hadamard(np.ascontiguousarray(v), seed))
        dp = kvqrs.padded_dim(v.shape[-1])
        y = float_rows(data.draw, (3, 2), 2 * dp)[:, :, ::2]
        np.testing.assert_array_equal(
            kvqrs.inverse_hadamard(y, seed, v.shape[-1]),
            kvqrs.inverse_hadamard(np.ascontiguousarray(y), seed, v.shape[-1]),
        )


def test_fortran_order_input():
    x = np.asfortranarray(gaussian_rows(1, 16, 64))
    np.testing.assert_array_equal(kvqrs.hadamard(x, 3), kvqrs.hadamard(np.ascontiguousarray(x), 3))


# --------------------------------------------------------------------------------------------
# Orthogonality, inverse, special rows
# --------------------------------------------------------------------------------------------


@given(rows_case())
def test_norm_preserved(case):
    x, seed = case
    y = kvqrs.hadamard(x, seed)
    n_x = row_norms(x)[..., 0]
    n_y = row_norms(y)[..., 0]
    assert np.all(np.abs(n_y - n_x) <= NORM_TOL * n_x + F32_ATOL)


@given(rows_case())
def test_inverse_undoes_hadamard(case):
    x, seed = case
    d = x.shape[-1]
    back = kvqrs.inverse_hadamard(kvqrs.hadamard(x, seed), seed, d)
    assert back.shape == x.shape and back.dtype == x.dtype
    assert_rows_close(back, x.astype(np.float64), x, INVERSE_TOL, F32_ATOL)


@given(d=st.sampled_from([2, 4, 8, 64, 128, 256]), seed=optional_seeds, rseed=st.integers(0, 2**32))
def test_hadamard_undoes_inverse_for_powers_of_two(d, seed, rseed):
    # When d = d' the rotation is square, so R (R^T y) = y too.
    y = gaussian_rows(rseed, 5, d)
    back = kvqrs.hadamard(kvqrs.inverse_hadamard(y, seed, d), seed)
    assert_rows_close(back, y.astype(np.float64), y, INVERSE_TOL, 0.0)


def test_inverse_default_head_dim_is_padded_dim():
    y = gaussian_rows(0, 3, 64)
    np.testing.assert_array_equal(kvqrs.inverse_hadamard(y, 9), kvqrs.inverse_hadamard(y, 9, 64))


@pytest.mark.parametrize("d", ALL_DIMS)
@pytest.mark.parametrize("seed", [None, 0, 2**64 - 1])
def test_zero_rows(d, seed):
    x = np.zeros((2, d), np.float32)
    y = kvqrs.hadamard(x, seed)
    assert y.shape == (2, kvqrs.padded_dim(d))
    assert np.all(y == 0)
    assert np.all(kvqrs.inverse_hadamard(y, seed, d) == 0)


@pytest.mark.parametrize("d", [2, 4, 64, 128, 256])
def test_constant_row_without_signs_concentrates(d):
    # Without signs, a constant row c * 1 maps to (c sqrt(d), 0, ..., 0) (d a power of two).
    c = 1.5
    y = kvqrs.hadamard(np.full((1, d), c, np.float32), None)[0].astype(np.float64)
    assert abs(y[0] - c * math.sqrt(d)) <= F32_TOL * c * math.sqrt(d)
    assert np.all(np.abs(y[1:]) <= F32_TOL * c * math.sqrt(d))


@pytest.mark.parametrize("d", [3, 40, 64, 100, 160])
def test_constant_row_with_signs_spreads(d):
    x = np.full((1, d), -2.0, np.float32)
    y = kvqrs.hadamard(x, 1234)
    assert_rows_close(y, oracle.hadamard(x, 1234), x, F32_TOL, 0.0)


@pytest.mark.parametrize("d", [2, 5, 33, 64, 160])
@pytest.mark.parametrize("seed", [None, 42])
def test_one_hot_rows(d, seed):
    # e_i maps to the i-th column of R = H diag(s) / sqrt(d'): entries s_i H[i, j] / sqrt(d').
    dp = kvqrs.padded_dim(d)
    h = scipy.linalg.hadamard(dp).astype(np.float64)
    signs = np.ones(dp) if seed is None else oracle.rotation_signs(seed, dp)
    eye = np.eye(d, dtype=np.float32)
    y = kvqrs.hadamard(eye, seed).astype(np.float64)
    # Every entry has magnitude exactly 1/sqrt(d') up to float32 rounding.
    np.testing.assert_allclose(np.abs(y), 1 / math.sqrt(dp), rtol=F32_TOL, atol=0)
    want = (signs[:d, None] * h[:d, :]) / math.sqrt(dp)
    np.testing.assert_allclose(y, want, rtol=F32_TOL, atol=0)


@pytest.mark.parametrize("d", ALL_DIMS + [1024])
def test_padding_shape(d):
    dp = kvqrs.padded_dim(d)
    assert dp >= d and dp & (dp - 1) == 0 and dp < 2 * d
    assert kvqrs.hadamard(np.ones((3, 2, d), np.float32), 1).shape == (3, 2, dp)
    assert kvqrs.inverse_hadamard(np.ones((3, 2, dp), np.float32), 1, d).shape == (3, 2, d)


@pytest.mark.parametrize("d", [3, 5, 33, 40, 100])
def test_padding_is_zero_padding(d):
    # hadamard(x) equals hadamard of x explicitly zero-padded to d'.
    x = gaussian_rows(3, 4, d)
    dp = kvqrs.padded_dim(d)
    padded = np.zeros((4, dp), np.float32)
    padded[:, :d] = x
    np.testing.assert_array_equal(kvqrs.hadamard(x, 8), kvqrs.hadamard(padded, 8))


def test_empty_leading_shape():
    assert kvqrs.hadamard(np.zeros((0, 40), np.float32), 1).shape == (0, 64)
    assert kvqrs.inverse_hadamard(np.zeros((2, 0, 64), np.float32), 1, 40).shape == (2, 0, 40)


def test_one_dimensional_input():
    x = gaussian_rows(4, 1, 40)[0]
    y = kvqrs.hadamard(x, 6)
    assert y.shape == (64,)
    np.testing.assert_array_equal(y, kvqrs.hadamard(x[None], 6)[0])


def test_seed_changes_rotation():
    x = gaussian_rows(5, 2, 64)
    assert not np.array_equal(kvqrs.hadamard(x, 1), kvqrs.hadamard(x, 2))
    assert not np.array_equal(kvqrs.hadamard(x, None), kvqrs.hadamard(x, 0))


def test_deterministic():
    x = gaussian_rows(6, 8, 96)
    np.testing.assert_array_equal(kvqrs.hadamard(x, 2**64 - 1), kvqrs.hadamard(x, 2**64 - 1))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@given(
    d=st.sampled_from(ALL_DIMS),
    leading=hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4),
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    dtype=st.sampled_from([np.float32, np.float64, np.float16]),
    data=st.data(),
)
def test_non_finite_names_position(d, leading, bad, dtype, data):
    x = np.ones((*leading, d), dtype)
    pos = tuple(data.draw(st.integers(0, s - 1)) for s in x.shape)
    x[pos] = bad
    row = int(np.ravel_multi_index(pos[:-1], x.shape[:-1]))
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.hadamard(x, 1)
    msg = str(info.value)
    assert msg.startswith("x:"), msg
    assert ("NaN" if np.isnan(bad) else "inf") in msg, msg
    assert f"row {row}" in msg and f"position {pos[-1]}" in msg, msg
    y = np.ones((*leading, kvqrs.padded_dim(d)), dtype)
    y[(*pos[:-1], 0)] = bad
    with pytest.raises(kvqrs.KvqrsError, match=rf"^y:.*row {row}\b.*position 0\b"):
        kvqrs.inverse_hadamard(y, 1, d)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64])
def test_non_float_dtype_rejected(dtype):
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.hadamard(np.ones((2, 8), dtype), 1)
    msg = str(info.value)
    assert msg.startswith("x:") and str(np.dtype(dtype)) in msg, msg
    with pytest.raises(kvqrs.KvqrsError, match="^y:"):
        kvqrs.inverse_hadamard(np.ones((2, 8), dtype), 1)


def test_head_dim_one_rejected():
    with pytest.raises(kvqrs.KvqrsError, match=r"^x: expected a last axis of length >= 2, got shape \(3, 1\)"):
        kvqrs.hadamard(np.ones((3, 1), np.float32), 1)
    with pytest.raises(kvqrs.KvqrsError, match="head_dim"):
        kvqrs.inverse_hadamard(np.ones((3, 1), np.float32), 1, 1)


def test_scalar_and_empty_row_rejected():
    with pytest.raises(kvqrs.KvqrsError, match="^x:"):
        kvqrs.hadamard(np.float32(1.0), 1)
    with pytest.raises(kvqrs.KvqrsError):
        kvqrs.hadamard(np.ones((3, 0), np.float32), 1)


@pytest.mark.parametrize("d, dp", [(40, 32), (40, 128), (64, 32), (3, 8), (5, 4)])
def test_inverse_head_dim_mismatch(d, dp):
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.inverse_hadamard(np.ones((2, dp), np.float32), 1, d)
    msg = str(info.value)
    assert msg.startswith("y:"), msg
    assert str(kvqrs.padded_dim(d)) in msg and str((2, dp)) in msg, msg


def test_inverse_non_power_of_two_without_head_dim():
    # With head_dim defaulting to d', a last axis of 40 is not padded_dim(40) = 64.
    with pytest.raises(kvqrs.KvqrsError, match="^y:.*64"):
        kvqrs.inverse_hadamard(np.ones((2, 40), np.float32), 1)


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, True, 1.5, "1"])
def test_bad_seed_rejected(bad):
    with pytest.raises(kvqrs.KvqrsError, match=r"^seed:.*2\*\*64"):
        kvqrs.hadamard(np.ones((2, 8), np.float32), bad)
    with pytest.raises(kvqrs.KvqrsError, match="^seed:"):
        kvqrs.inverse_hadamard(np.ones((2, 8), np.float32), bad)


def test_float64_out_of_float32_range_rejected():
    # Finite in float64 but not representable in float32: must not be silently turned into inf.
    with pytest.raises(kvqrs.KvqrsError, match=r"^x: expected values within the float32 range.*1e\+300 at index \(0, 0\)"):
        kvqrs.hadamard(np.array([[1e300, 1.0]]), 1)
