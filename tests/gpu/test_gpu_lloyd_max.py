"""Lloyd-Max encode/decode in WGSL (shaders/lloyd_max.wgsl) against the Rust path (docs/kernels.md section 4). Comparisons with the float32 boundaries are exact, so codes and
centroids are equal with no tolerance."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import gpu

from tests.gpu.gpu_helpers import requires_adapter, same_error
from tests.strategies import bits, head_dims, leading_shapes

pytestmark = requires_adapter


@st.composite
def unit_values(draw):
    cb = kvqrs.lloyd_max_codebook(draw(head_dims), draw(bits))
    shape = (*draw(leading_shapes), draw(st.integers(0, 40)))
    x = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1, 1, width=32)))
    # Values exactly on the float32 boundaries and their neighbours: a value equal to a
    # boundary goes up on both paths.
    b = cb.boundaries.astype(np.float32)
    edge = np.concatenate([b, np.nextafter(b, np.float32(-2)), np.nextafter(b, np.float32(2))])
    return x, edge, cb


@given(unit_values())
def test_codes_equal_rust_path(case):
    x, edge, cb = case
    np.testing.assert_array_equal(gpu.lloyd_max_encode(x, cb), kvqrs.lloyd_max_encode(x, cb))
    np.testing.assert_array_equal(gpu.lloyd_max_encode(edge, cb), kvqrs.lloyd_max_encode(edge, cb))


@given(unit_values())
def test_decode_equals_rust_path(case):
    x, _, cb = case
    codes = kvqrs.lloyd_max_encode(x, cb)
    got = gpu.lloyd_max_decode(codes, cb)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, kvqrs.lloyd_max_decode(codes, cb))


@pytest.mark.parametrize("bits", range(1, 9))
def test_cross_path_every_width(bits):
    cb = kvqrs.lloyd_max_codebook(128, bits)
    x = np.random.default_rng(bits).uniform(-0.4, 0.4, (9, 128)).astype(np.float32)
    np.testing.assert_array_equal(
        kvqrs.lloyd_max_decode(gpu.lloyd_max_encode(x, cb), cb), gpu.lloyd_max_decode(kvqrs.lloyd_max_encode(x, cb), cb)
    )


def test_scalar_and_codebook_methods_shape():
    cb = kvqrs.lloyd_max_codebook(64, 3)
    assert gpu.lloyd_max_encode(np.float32(0.01), cb).shape == ()
    assert gpu.lloyd_max_encode(np.float32(0.01), cb) == kvqrs.lloyd_max_encode(np.float32(0.01), cb)
    assert gpu.lloyd_max_codebook is kvqrs.lloyd_max_codebook  # the codebook is the host's


@pytest.mark.parametrize(
    "call",
    [
        lambda m, cb: m.lloyd_max_encode(np.array([0.1, np.nan], np.float32), cb),
        lambda m, cb: m.lloyd_max_encode(np.array([1, 2], np.int64), cb),
        lambda m, cb: m.lloyd_max_encode(np.zeros(3, np.float32), "codebook"),
        lambda m, cb: m.lloyd_max_decode(np.array([[0, 8]], np.uint8), cb),
        lambda m, cb: m.lloyd_max_decode(np.array([[0, 1.0]]), cb),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    cb = kvqrs.lloyd_max_codebook(64, 3)
    same_error(lambda: call(gpu, cb), lambda: call(kvqrs, cb))
