"""The MSE stage in WGSL (shaders/mse.wgsl composed with hadamard.wgsl and lloyd_max.wgsl)
against the Rust path (docs/kernels.md section 5).

The device's norm is a float32 reduction (the Rust path's is float64), so stored norms agree
within NORM_RTOL / one float16 ulp and codes are equal except for coordinates within
GPU_BOUNDARY_TOL of a Lloyd-Max boundary; decoding the same codes is exact (FLUSH_ATOL)."""

from __future__ import annotations

import kvqrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu

from tests.gpu.gpu_helpers import (
    FLUSH_ATOL,
    GPU_BOUNDARY_TOL,
    assert_stored_close,
    requires_adapter,
    same_error,
)
from tests.strategies import assert_scales_close, bits, codes_match_except_near_boundaries, finite_rows, head_dims, leading_shapes, seeds

pytestmark = requires_adapter

SEED_OR_NONE = st.one_of(st.none(), seeds)


def rust_unit(x, seed, norms32) -> np.ndarray:
    """The Rust path's unit coordinates y / ||x|| in float64 (for boundary distances)."""
    x32 = np.asarray(x, dtype=np.float32)
    y = x32.astype(np.float64) if seed is None else kvqrs.hadamard(x32, seed).astype(np.float64)
    n = np.asarray(norms32, dtype=np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, y / np.where(n > 0, n, 1.0), 0.0)


@st.composite
def mse_inputs(draw):
    d = draw(head_dims)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    dtype = draw(st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16, np.float64]))
    return finite_rows(draw, draw(leading_shapes), d, scale=scale, dtype=dtype), draw(bits), draw(SEED_OR_NONE)


def check_against_rust(x, b, seed):
    got = gpu.mse_encode(x, b, seed)
    want = kvqrs.mse_encode(x, b, seed)
    assert got.codes.shape == want.codes.shape and got.codes.dtype == np.uint8
    assert_stored_close(got.norms, want.norms)
    code_dim = want.codes.shape[-1]
    cb = kvqrs.lloyd_max_codebook(code_dim, b)
    norms32 = kvqrs.oracle.vector_norm(np.asarray(x, dtype=np.float32)).astype(np.float32)
    codes_match_except_near_boundaries(got.codes, want.codes, rust_unit(x, seed, norms32), cb.boundaries, tol=GPU_BOUNDARY_TOL)
    return got, want


@given(mse_inputs())
def test_codes_and_norms_match_rust_path(case):
    check_against_rust(*case)


@given(mse_inputs())
def test_decode_equals_rust_path(case):
    x, b, seed = case
    code = kvqrs.mse_encode(x, b, seed)
    d = np.shape(x)[-1]
    for dtype in (np.float32, np.float64):
        got = gpu.mse_decode(code.codes, code.norms, b, d, seed, dtype=dtype)
        want = kvqrs.mse_decode(code.codes, code.norms, b, d, seed, dtype=dtype)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=0, atol=FLUSH_ATOL)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("seed", [None, 11])
def test_cross_path_decoding_every_width(bits, seed):
    x = np.random.default_rng(bits).standard_normal((4, 33, 96)).astype(np.float32)
    g, c = gpu.mse_encode(x, bits, seed), kvqrs.mse_encode(x, bits, seed)
    # Encoded on the device, decoded by the Rust path (and the reverse): the same as decoding
    # on the encoding path.
    np.testing.assert_allclose(
        kvqrs.mse_decode(g.codes, g.norms, bits, 96, seed), gpu.mse_decode(g.codes, g.norms, bits, 96, seed), rtol=0, atol=FLUSH_ATOL
    )
    np.testing.assert_allclose(
        gpu.mse_decode(c.codes, c.norms, bits, 96, seed), kvqrs.mse_decode(c.codes, c.norms, bits, 96, seed), rtol=0, atol=FLUSH_ATOL
    )
    # Both paths' codes are almost all equal on Gaussian rows.
    assert np.mean(g.codes != c.codes) < 1e-3


def test_norm_storage_switch_and_extremes():
    rng = np.random.default_rng(0)
    for scale in (1e-9, 1.0, 1e6, 1e30):  # float16 storage only for the middle two
        x = (rng.standard_normal((50, 64)) * scale).astype(np.float32)
        check_against_rust(x, 3, 5)
    zero = np.zeros((2, 40), np.float32)
    got = gpu.mse_encode(zero, 4, 1)
    np.testing.assert_array_equal(got.norms, np.zeros(2, np.float16))
    np.testing.assert_array_equal(gpu.mse_decode(got.codes, got.norms, 4, 40, 1), zero)


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 10, 64, dtype=torch.bfloat16)
    code = gpu.mse_encode(x, 4, 3)
    assert isinstance(code.codes, torch.Tensor) and code.codes.dtype == torch.uint8
    want = kvqrs.mse_encode(x.float().numpy(), 4, 3)
    assert np.mean(code.codes.numpy() != want.codes) < 1e-2
    out = gpu.mse_decode(code.codes, code.norms, 4, 64, 3)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 10, 64)
    np.testing.assert_allclose(out.numpy(), kvqrs.mse_decode(code.codes.numpy(), code.norms.numpy(), 4, 64, 3), atol=FLUSH_ATOL)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.mse_encode(np.array([[1.0, np.inf]], np.float32), 2, 1),
        lambda m: m.mse_encode(np.ones((2, 1), np.float32), 2, 1),
        lambda m: m.mse_encode(np.ones((2, 4), np.float32), 9, 1),
        lambda m: m.mse_encode(np.ones((2, 4), np.float32), 2, 2**64),
        lambda m: m.mse_encode(np.full((1, 4), 3e38, np.float32), 2, 1),  # norm overflow
        lambda m: m.mse_decode(np.zeros((2, 8), np.uint8), np.ones(2, np.float16), 2, 3, 1),
        lambda m: m.mse_decode(np.full((2, 8), 4, np.uint8), np.ones(2, np.float16), 2, 8, 1),
        lambda m: m.mse_decode(np.zeros((2, 8), np.uint8), np.array([1, -1], np.float32), 2, 8, 1),
        lambda m: m.mse_decode(np.zeros((2, 8), np.uint8), np.ones(3, np.float16), 2, 8, 1),
        lambda m: m.mse_decode(np.zeros((2, 8), np.uint8), np.ones(2, np.float64), 2, 8, 1),
        lambda m: m.mse_decode(np.zeros((2, 8), np.uint8), np.ones(2, np.float16), 2, 8, 1, dtype=np.int32),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kvqrs))


def test_rows_beyond_the_loop_limit_raise():
    with pytest.raises(kvqrs.KvqrsError, match="the WGSL path loops over at most 8192 values per row"):
        gpu.mse_encode(np.ones((1, 9000), np.float32), 2, None)


@given(mse_inputs())
def test_least_squares_scale_matches_oracle(case):
    """scale="least_squares" on the device: the norm mode's codes, and scales equal to the
    oracle's from the device's codes (the same float32 dot products as the Rust path, one WGSL
    division) within tests/kernels/test_mse.py's tolerance; zero rows store 0."""
    x, b, seed = case
    got = gpu.mse_encode(x, b, seed, scale="least_squares")
    np.testing.assert_array_equal(got.codes, gpu.mse_encode(x, b, seed).codes)
    assert_scales_close(got.norms, np.asarray(x, np.float32), got.codes, b, seed)


@given(mse_inputs())
def test_preserve_norm_scale_matches_oracle(case):
    """scale="preserve_norm" on the device: the norm mode's codes, and scales equal to the
    oracle's from the device's codes (the device's norm, the Rust path's float32 dot, one WGSL
    square root and division) within tests/kernels/test_mse.py's tolerance; zero rows store 0."""
    x, b, seed = case
    got = gpu.mse_encode(x, b, seed, scale="preserve_norm")
    np.testing.assert_array_equal(got.codes, gpu.mse_encode(x, b, seed).codes)
    assert_scales_close(got.norms, x, got.codes, b, seed, scale="preserve_norm")


def test_least_squares_zero_row_and_bad_scale():
    x = np.zeros((2, 40), np.float32)
    x[1] = np.arange(40)
    code = gpu.mse_encode(x, 3, 7, scale="least_squares")
    assert code.norms[0] == 0 and code.norms[1] > 0
    with pytest.raises(kvqrs.KvqrsError, match="scale: expected one of"):
        gpu.mse_encode(x, 3, 7, scale="lsq")
