"""Uniform asymmetric (KIVI) quantizer: Rust against the oracle, invariants, errors."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import oracle

from tests.strategies import bits, finite_rows, leading_shapes

# A value whose scaled position (x - z) / s + 0.5 lies this close to an integer may round either
# way between the float32 kernel and the float32 oracle (division rounding is identical, but
# this keeps the test honest about where equality is promised).
ROUNDING_TOL = 1e-4


@given(data=st.data(), b=bits, n=st.integers(1, 70), group=st.integers(1, 40), leading=leading_shapes)
def test_matches_oracle(data, b, n, group, leading):
    _check_against_oracle(finite_rows(data.draw, leading, n, scale=100.0), b, group)


@pytest.mark.parametrize("b, group", [(1, 32), (2, 128), (4, 100), (8, 7)])
def test_inputs_split_over_threads_match_the_oracle(b, group):
    # 3 x 64 rows of 700 values: far above the size below which a call stays on one thread.
    rng = np.random.default_rng(b)
    x = (rng.standard_normal((3, 64, 700)) * rng.uniform(0.01, 100.0, (3, 64, 1))).astype(np.float32)
    x[1, 7, 3] = 3e5  # one zero point or scale past float16: that plane is stored in float32
    _check_against_oracle(x, b, group)


@pytest.mark.parametrize("group", [1, 3, 700])
def test_a_negative_zero_minimum_is_stored_as_positive_zero(group):
    """`min` leaves the sign of a zero minimum unspecified (-0.0 and +0.0 compare equal): the
    kernel stores +0.0, as the oracle does, so the bytes are the same on every platform."""
    x = np.abs(np.random.default_rng(group).standard_normal((2, 64, 700))).astype(np.float32)
    x[..., ::3] = -0.0
    x[0, :, :7] = 0.0  # +0.0 and -0.0 mixed in one group
    _check_against_oracle(x, 4, group)
    assert not np.signbit(kvqrs.uniform_encode(x, 4, group).zeros).any()


def test_the_lowest_overflowing_row_is_named_whatever_the_threads():
    x = np.zeros((96, 800), np.float32)
    x[70, :2] = x[5, :2] = (-3e38, 3e38)  # a range past float32
    with pytest.raises(kvqrs.KvqrsError, match="row 5"):
        kvqrs.uniform_encode(x, 4, 32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_transposed_views_encode_as_their_copies(dtype):
    # Per-channel groups read tokens as rows: a (tokens, channels) array's transpose.
    x = np.random.default_rng(3).standard_normal((2, 1000, 48)).astype(dtype)
    view = np.swapaxes(x, -1, -2)
    got, want = kvqrs.uniform_encode(view, 3, 128), kvqrs.uniform_encode(np.ascontiguousarray(view), 3, 128)
    for a, b in zip(got[:3], want[:3]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def _check_against_oracle(x, b, group):
    n = x.shape[-1]
    got = kvqrs.uniform_encode(x, b, group)
    codes, scales, zeros = oracle.uniform_encode(x, b, group)
    assert got.scales.dtype == scales.dtype and got.zeros.dtype == zeros.dtype
    np.testing.assert_array_equal(got.scales, scales)
    assert got.zeros.tobytes() == zeros.tobytes()  # the stored bytes, the sign of a zero included
    diff = got.codes != codes
    if diff.any():
        idx = np.arange(n) // group
        s = scales.astype(np.float64)[..., idx]
        z = zeros.astype(np.float64)[..., idx]
        t = (x.astype(np.float64) - z) / np.where(s > 0, s, 1) + 0.5
        frac = np.abs(t - np.round(t))[diff]
        assert np.all(frac < ROUNDING_TOL), frac
    dec = kvqrs.uniform_decode(got)
    np.testing.assert_allclose(
        dec, oracle.uniform_decode(codes, scales, zeros, b, group), rtol=1e-6, atol=1e-5 * (1 + np.abs(x).max(initial=0))
    )


@given(data=st.data(), b=bits, n=st.integers(1, 64), group=st.integers(1, 32))
def test_error_is_at_most_half_a_step_plus_storage_rounding(data, b, n, group):
    x = finite_rows(data.draw, (3,), n, scale=10.0)
    code = kvqrs.uniform_encode(x, b, group)
    err = np.abs(kvqrs.uniform_decode(code, np.float64) - x)
    idx = np.arange(n) // group
    step = code.scales.astype(np.float64)[..., idx]
    # float16 rounding of the zero point and the scale can shift the grid by up to
    # 2^-11 relative of the zero point and of the range covered by the top code.
    slack = (np.abs(code.zeros.astype(np.float64))[..., idx] + (2**b) * step) * 2**-10
    assert np.all(err <= 0.5 * step + slack + 1e-6)


def test_group_endpoints_are_reproduced():
    x = np.array([[-1.0, 2.0, 0.5, 0.5, 3.0]], dtype=np.float32)
    code = kvqrs.uniform_encode(x, 2, 2)
    np.testing.assert_array_equal(code.codes, [[0, 3, 0, 0, 0]])
    np.testing.assert_array_equal(kvqrs.uniform_decode(code), x)


def test_more_bits_less_error():
    x = np.random.default_rng(0).standard_normal((200, 128)).astype(np.float32)
    errs = [float(np.mean((kvqrs.uniform_decode(kvqrs.uniform_encode(x, b, 32)) - x) ** 2)) for b in range(1, 9)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs


def test_large_values_switch_to_float32_storage():
    x = np.array([[-2e5, 1e5, 3.0, 4.0]], dtype=np.float32)
    code = kvqrs.uniform_encode(x, 8, 4)
    # The zero point -2e5 is beyond float16; the scale 3e5 / 255 still fits it.
    assert code.zeros.dtype == np.float32 and code.scales.dtype == np.float16
    np.testing.assert_allclose(kvqrs.uniform_decode(code), x, atol=3e5 / 255)


def test_errors_name_the_argument():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(kvqrs.KvqrsError, match="bits: expected a bit width in 1..8, got 9"):
        kvqrs.uniform_encode(x, 9, 4)
    with pytest.raises(kvqrs.KvqrsError, match="group: expected an integer >= 1, got 0"):
        kvqrs.uniform_encode(x, 2, 0)
    bad = x.copy()
    bad[1, 3] = np.inf
    with pytest.raises(kvqrs.KvqrsError, match="row 1, position 3"):
        kvqrs.uniform_encode(bad, 2, 4)
    code = kvqrs.uniform_encode(x, 2, 4)
    with pytest.raises(kvqrs.KvqrsError, match="code.scales/zeros: expected shape"):
        kvqrs.uniform_decode(code._replace(scales=code.scales[:, :1]))
    with pytest.raises(kvqrs.KvqrsError, match="does not fit"):
        kvqrs.uniform_decode(code._replace(codes=code.codes.astype(np.int64) + 4))
    with pytest.raises(kvqrs.KvqrsError, match="scales"):
        kvqrs.uniform_decode(code._replace(scales=-np.ones_like(code.scales)))
