"""The randomized Walsh-Hadamard rotation in WGSL (shaders/hadamard.wgsl) against the Rust
path (docs/kernels.md section 3). Both evaluate the same float32 operations in the same
order with no multiply-add to fuse, so results are equal; the only tolerance is FLUSH_ATOL for
drivers that flush subnormals to zero."""

from __future__ import annotations

import kvqrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu

from tests.gpu.gpu_helpers import FLUSH_ATOL, requires_adapter, same_error
from tests.strategies import EDGE_DIMS, HEAD_DIMS, float_rows, leading_shapes, seeds

pytestmark = requires_adapter

SEED_OR_NONE = st.one_of(st.none(), seeds)
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64]


def assert_same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0, atol=FLUSH_ATOL)


@st.composite
def rows(draw):
    d = draw(st.sampled_from(HEAD_DIMS + EDGE_DIMS))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([2.0**-10, 1.0, 2.0**13]))
    x = float_rows(draw, draw(leading_shapes), d, scale=scale).astype(dtype)
    return x, draw(SEED_OR_NONE)


@given(rows())
def test_forward_equals_rust_path(case):
    x, seed = case
    assert_same(gpu.hadamard(x, seed), kvqrs.hadamard(x, seed))


@given(rows())
def test_inverse_equals_rust_path_and_inverts(case):
    x, seed = case
    d = x.shape[-1]
    y = kvqrs.hadamard(x.astype(np.float32), seed)
    got = gpu.inverse_hadamard(y, seed, d)
    assert_same(got, kvqrs.inverse_hadamard(y, seed, d))
    np.testing.assert_allclose(got, x.astype(np.float32), rtol=0, atol=2e-6 * (np.abs(y).max(initial=0) * np.sqrt(y.shape[-1]) + 1e-30))


def test_large_batch_and_large_dim():
    x = np.random.default_rng(3).standard_normal((3000, 160)).astype(np.float32)
    assert_same(gpu.hadamard(x, 9), kvqrs.hadamard(x, 9))
    big = np.random.default_rng(4).standard_normal((3, 5000)).astype(np.float32)
    assert_same(gpu.hadamard(big, 2**64 - 1), kvqrs.hadamard(big, 2**64 - 1))


def test_strided_input_equals_contiguous():
    x = np.random.default_rng(5).standard_normal((8, 2 * 96)).astype(np.float32)[::2, ::2]
    assert_same(gpu.hadamard(x, 1), gpu.hadamard(np.ascontiguousarray(x), 1))


def test_large_rows_do_not_overflow():
    x = np.full((2, 128), 1e37, np.float32)
    assert_same(gpu.hadamard(x, 1), kvqrs.hadamard(x, 1))


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.hadamard(np.array([[1.0, np.nan, 2.0]], np.float32), 1),
        lambda m: m.hadamard(np.array([[1.0], [2.0]], np.float32), 1),
        lambda m: m.hadamard(np.ones((2, 4), np.int32), 1),
        lambda m: m.hadamard(np.ones((2, 4), np.float32), -1),
        lambda m: m.hadamard(np.float32(1.0), 1),
        lambda m: m.hadamard(np.full((1, 2), 3e38, np.float32), None),  # result beyond float32
        lambda m: m.inverse_hadamard(np.ones((2, 6), np.float32), 1),
        lambda m: m.inverse_hadamard(np.ones((2, 8), np.float32), 1, 3),
        lambda m: m.inverse_hadamard(np.array([[np.inf, 0.0]], np.float32), 1),
        lambda m: m.hadamard(np.full((1, 4), 1e39, np.float64), 1),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kvqrs))


def test_float16_result_beyond_range_raises():
    x = np.full((1, 2), 60000, np.float16)
    same_error(lambda: gpu.hadamard(x, None), lambda: kvqrs.hadamard(x, None))
