"""Absmax codes in WGSL (shaders/absmax.wgsl) against the Rust path (docs/kernels.md section 14).
The float16 scales are equal (exact row maxima, rounded on the host); codes equal except where
t + 0.5 lies within ROUND_TIE_TOL of an integer (WGSL's division is within 2.5 ulp); decoding
the same code equal bit for bit (the host's float32 level table times the scale)."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu

from tests.gpu.gpu_helpers import ROUND_TIE_TOL, codes_equal_except_ties, requires_adapter, same_error
from tests.kernels.test_absmax import t_plus_half
from tests.strategies import finite_rows, leading_shapes

pytestmark = requires_adapter


@st.composite
def rows_case(draw):
    widths = np.asarray(draw(st.lists(st.integers(0, 8), min_size=1, max_size=80)), np.uint8)
    x = finite_rows(draw, draw(leading_shapes), widths.size, scale=draw(st.sampled_from([1e-6, 1e-2, 1.0, 6e4])))
    return x, widths


def tie_distance(x, code):
    t = t_plus_half(x, code.scales, code.widths)
    return np.where(np.asarray(code.widths) > 0, np.abs(t - np.round(t)), 1.0)


@given(rows_case())
def test_encode_matches_rust_path(case):
    x, w = case
    got, want = gpu.absmax_encode(x, w), kvqrs.absmax_encode(x, w)
    assert got.scales.dtype == np.float16 and got.scales.tobytes() == want.scales.tobytes()
    assert got.widths.tobytes() == want.widths.tobytes()
    assert got.codes.dtype == np.uint8 and got.codes.shape == want.codes.shape
    codes_equal_except_ties(got.codes, want.codes, tie_distance(x, want), ROUND_TIE_TOL)


@given(rows_case())
def test_decode_matches_rust_path_bit_for_bit(case):
    x, w = case
    code = kvqrs.absmax_encode(x, w)
    got, want = gpu.absmax_decode(code), kvqrs.absmax_decode(code)
    assert got.dtype == want.dtype == np.float32
    assert got.tobytes() == want.tobytes()


def test_every_code_of_every_width_decodes_alike():
    w = np.arange(9, dtype=np.uint8)
    codes = np.arange(256)[:, None] % (1 << w.astype(int))[None, :]  # every code of every width
    scales = np.array([0.0, 1.0, 0.375, 65504.0, 6e-8] * 52, np.float16)[:256]
    code = kvqrs.AbsmaxCode(codes.astype(np.uint8), scales, w)
    assert gpu.absmax_decode(code).tobytes() == kvqrs.absmax_decode(code).tobytes()


@pytest.mark.parametrize("bits", range(1, 9))
def test_cross_path_every_width(bits):
    x = np.random.default_rng(bits).standard_normal((6, 128, 64)).astype(np.float32)
    w = np.full(64, bits, np.uint8)
    w[::7] = 0
    g, c = gpu.absmax_encode(x, w), kvqrs.absmax_encode(x, w)
    np.testing.assert_array_equal(kvqrs.absmax_decode(g), gpu.absmax_decode(g))
    np.testing.assert_array_equal(gpu.absmax_decode(c), kvqrs.absmax_decode(c))
    assert g.scales.tobytes() == c.scales.tobytes()
    assert np.mean(g.codes != c.codes) < 1e-3


def test_empty_batches_and_torch():
    w = np.array([3, 0, 5], np.uint8)
    e = gpu.absmax_encode(np.zeros((0, 3), np.float32), w)
    assert e.codes.shape == (0, 3) and e.scales.shape == (0,) and e.scales.dtype == np.float16
    assert gpu.absmax_decode(e).shape == (0, 3)
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3)
    code = gpu.absmax_encode(x, torch.tensor(w))
    assert isinstance(code.codes, torch.Tensor) and code.scales.dtype == torch.float16
    assert torch.equal(gpu.absmax_decode(code), kvqrs.absmax_decode(code))


W = np.array([2, 0, 3], np.uint8)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.absmax_encode(np.ones((2, 3), np.float32), np.array([2, 9, 3])),
        lambda m: m.absmax_encode(np.ones((2, 4), np.float32), W),
        lambda m: m.absmax_encode(np.array([[1.0, 1.0, 1.0], [1.0, np.nan, 1.0]], np.float32), W),
        lambda m: m.absmax_encode(np.array([[1.0, 1e30, 1.0], [-65520.0, 0.0, 1.0], [7e4, 0.0, 1.0]], np.float32), W),
        lambda m: m.absmax_decode("code"),
        lambda m: m.absmax_decode(kvqrs.AbsmaxCode(np.array([[3, 0, 7], [4, 0, 0]], np.uint8), np.ones(2, np.float16), W)),
        lambda m: m.absmax_decode(kvqrs.AbsmaxCode(np.array([[0, 1, 0], [0, 0, 0]], np.uint8), np.ones(2, np.float16), W)),
        lambda m: m.absmax_decode(kvqrs.AbsmaxCode(np.zeros((2, 3), np.uint8), np.ones(2, np.float32), W)),
        lambda m: m.absmax_decode(kvqrs.AbsmaxCode(np.zeros((2, 3), np.uint8), np.array([1, -1], np.float16), W)),
        lambda m: m.absmax_decode(kvqrs.AbsmaxCode(np.full((2, 3), 9, np.uint8), np.array([1, np.inf], np.float16), W)),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kvqrs))
