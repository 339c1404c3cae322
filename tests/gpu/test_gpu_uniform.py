"""The KIVI quantizer in WGSL (shaders/uniform.wgsl) against the Rust path (docs/schemes.md;
docs/kernels.md section 9). Zero points are exact (group minima); scales within one float16
ulp; codes equal except where (x - z) / s + 0.5 lies within ROUND_TIE_TOL of an integer;
decoding the same code equal within one rounding where a driver fuses z + s * code."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu

from tests.gpu.gpu_helpers import ROUND_TIE_TOL, assert_stored_close, codes_equal_except_ties, requires_adapter, same_error
from tests.strategies import bits, finite_rows, leading_shapes

pytestmark = requires_adapter


@st.composite
def groups_case(draw):
    n = draw(st.integers(1, 80))
    x = finite_rows(draw, draw(leading_shapes), n, scale=draw(st.sampled_from([1e-2, 1.0, 1e5])))
    return x, draw(bits), draw(st.sampled_from([1, 3, 32, 100]))


def tie_distance(x, code):
    n, g = x.shape[-1], code.group
    idx = np.arange(n) // g
    s = np.asarray(code.scales, np.float64)[..., idx]
    z = np.asarray(code.zeros, np.float64)[..., idx]
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s > 0, (x.astype(np.float64) - z) / np.where(s > 0, s, 1) + 0.5, 0.5)
    return np.abs(t - np.round(t))


@given(groups_case())
def test_encode_matches_rust_path(case):
    x, b, g = case
    got, want = gpu.uniform_encode(x, b, g), kvqrs.uniform_encode(x, b, g)
    assert (got.group, got.bits) == (want.group, want.bits)
    assert got.zeros.dtype == want.zeros.dtype and got.zeros.tobytes() == want.zeros.tobytes()  # a zero's sign too
    assert_stored_close(got.scales, want.scales, rtol32=1e-6)
    codes_equal_except_ties(got.codes, want.codes, tie_distance(x, want), ROUND_TIE_TOL)


@given(groups_case())
def test_decode_matches_rust_path(case):
    x, b, g = case
    code = kvqrs.uniform_encode(x, b, g)
    got, want = gpu.uniform_decode(code), kvqrs.uniform_decode(code)
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2.0**-23, atol=1e-37)


@pytest.mark.parametrize("bits", range(1, 9))
def test_cross_path_every_width(bits):
    x = np.random.default_rng(bits).standard_normal((6, 128, 64)).astype(np.float32)
    g, c = gpu.uniform_encode(x, bits, 32), kvqrs.uniform_encode(x, bits, 32)
    np.testing.assert_array_equal(kvqrs.uniform_decode(g), gpu.uniform_decode(g))
    np.testing.assert_array_equal(gpu.uniform_decode(c), kvqrs.uniform_decode(c))
    assert np.mean(g.codes != c.codes) < 1e-3


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.uniform_encode(np.array([[1.0, np.nan]], np.float32), 2, 2),
        lambda m: m.uniform_encode(np.ones((2, 4), np.float32), 2, 0),
        lambda m: m.uniform_encode(np.array([[-3e38, 3e38]], np.float32), 2, 2),  # range overflow
        lambda m: m.uniform_decode(
            kvqrs.UniformCode(np.zeros((2, 4), np.uint8), np.ones((2, 1), np.float16), np.ones((2, 2), np.float16), 4, 2)
        ),
        lambda m: m.uniform_decode(
            kvqrs.UniformCode(np.full((2, 4), 4, np.uint8), np.ones((2, 1), np.float16), np.ones((2, 1), np.float16), 4, 2)
        ),
        lambda m: m.uniform_decode(
            kvqrs.UniformCode(np.zeros((2, 4), np.uint8), -np.ones((2, 1), np.float32), np.ones((2, 1), np.float16), 4, 2)
        ),
        lambda m: m.uniform_decode(
            kvqrs.UniformCode(np.zeros((2, 4), np.uint8), np.ones((2, 1), np.float32), np.full((2, 1), np.inf, np.float32), 4, 2)
        ),
        lambda m: m.uniform_decode("code"),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kvqrs))
