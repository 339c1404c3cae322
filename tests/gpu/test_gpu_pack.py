"""Bit packing in WGSL (shaders/pack.wgsl) against the Rust path: packed bytes and unpacked
codes byte for byte, cross-path round trips at every width, errors like the Rust path's
(docs/kernels.md section 2). Packing is exact: no tolerance anywhere."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from kvqrs import gpu

from tests.gpu.gpu_helpers import requires_adapter, same_error
from tests.kernels.test_pack import code_arrays

pytestmark = requires_adapter


@given(code_arrays())
def test_packed_bytes_equal_rust_path(case):
    codes, b = case
    got = gpu.pack_bits(codes, b)
    want = kvqrs.pack_bits(codes, b)
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@given(code_arrays(dtypes=[np.uint8]))
def test_unpack_equals_rust_path_and_inverts(case):
    codes, b = case
    packed = kvqrs.pack_bits(codes, b)
    got = gpu.unpack_bits(packed, b, codes.shape[-1])
    np.testing.assert_array_equal(got, kvqrs.unpack_bits(packed, b, codes.shape[-1]))
    np.testing.assert_array_equal(got, codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_cross_path_round_trip_every_width(bits):
    # Rows whose byte lengths are not multiples of 4 make rows straddle the shader's words.
    codes = np.random.default_rng(bits).integers(0, 2**bits, (7, 5, 37), dtype=np.uint8)
    np.testing.assert_array_equal(kvqrs.unpack_bits(gpu.pack_bits(codes, bits), bits, 37), codes)
    np.testing.assert_array_equal(gpu.unpack_bits(kvqrs.pack_bits(codes, bits), bits, 37), codes)


def test_strided_and_wide_dtypes():
    base = np.random.default_rng(0).integers(0, 8, (6, 40), dtype=np.int64)
    view = base[::2, ::3]
    np.testing.assert_array_equal(gpu.pack_bits(view, 3), kvqrs.pack_bits(view, 3))


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.pack_bits(np.array([[1, 2, 8]], np.uint8), 3),  # uint8 code out of range
        lambda m: m.pack_bits(np.array([[1, 2, 8]], np.int32), 3),  # wide code out of range
        lambda m: m.pack_bits(np.array([[-1]], np.int8), 3),
        lambda m: m.pack_bits(np.zeros((2, 2), np.float32), 3),
        lambda m: m.pack_bits(np.zeros((2, 2), np.uint8), 0),
        lambda m: m.pack_bits(np.zeros((2, 2), np.uint8), 9),
        lambda m: m.pack_bits(np.uint8(1), 3),
        lambda m: m.unpack_bits(np.zeros((2, 3), np.uint8), 3, 9),
        lambda m: m.unpack_bits(np.zeros((2, 4), np.int8), 3, 9),
        lambda m: m.unpack_bits(np.zeros((2, 4), np.uint8), 3, -1),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kvqrs))


def test_empty_inputs():
    assert gpu.pack_bits(np.zeros((3, 0), np.uint8), 5).shape == (3, 0)
    assert gpu.unpack_bits(np.zeros((0, 2), np.uint8), 4, 4).shape == (0, 4)
