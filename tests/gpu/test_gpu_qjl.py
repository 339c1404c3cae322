"""The QJL sketch in WGSL (shaders/qjl.wgsl with mse.wgsl and pack.wgsl) against the Rust path
(docs/kernels.md section 6). S is the host's (float64 Box-Muller) and uploaded once.
Sign bits are equal except where |(S r)_i| is at rounding level (SIGN_TOL of test_qjl); norms
within NORM_RTOL / one float16 ulp; estimators within SUM_RTOL of their absolute terms."""

from __future__ import annotations

import math

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu

from tests.gpu.gpu_helpers import SUM_RTOL, assert_stored_close, requires_adapter, same_error
from tests.kernels.test_qjl import SIGN_TOL
from tests.strategies import finite_rows, head_dims, leading_shapes, seeds

pytestmark = requires_adapter

K_QJL = math.sqrt(math.pi / 2)


@st.composite
def sketch_inputs(draw):
    d = draw(st.one_of(head_dims, st.integers(1, 9)))
    r = finite_rows(draw, draw(leading_shapes), d, scale=draw(st.sampled_from([1e-3, 1.0, 100.0])))
    return r, draw(seeds), draw(st.one_of(st.none(), st.integers(1, 200)))


@given(sketch_inputs())
def test_sketch_matches_rust_path(case):
    r, seed, m = case
    got, want = gpu.qjl_sketch(r, seed, m), kvqrs.qjl_sketch(r, seed, m)
    assert (got.m, got.dim) == (want.m, want.dim) and got.signs.shape == want.signs.shape
    assert_stored_close(got.norms, want.norms)
    gb = kvqrs.unpack_bits(got.signs, 1, want.m).reshape(-1, want.m)
    wb = kvqrs.unpack_bits(want.signs, 1, want.m).reshape(-1, want.m)
    diff = gb != wb
    if diff.any():
        s = kvqrs.rng.qjl_matrix(seed, want.m, r.shape[-1]).astype(np.float64)
        rows = r.reshape(-1, r.shape[-1]).astype(np.float64)
        t = np.abs(rows @ s.T)
        bound = SIGN_TOL * np.linalg.norm(s, axis=1)[None, :] * np.linalg.norm(rows, axis=1)[:, None]
        assert np.all(t[diff] <= bound[diff]), "sign bits differ away from rounding level"


@given(sketch_inputs(), st.integers(0, 4))
def test_estimators_match_rust_path(case, ny):
    r, seed, m = case
    sk = kvqrs.qjl_sketch(r, seed, m)
    d = r.shape[-1]
    y = np.random.default_rng(ny).standard_normal((ny, d)).astype(np.float32)
    s = np.abs(kvqrs.rng.qjl_matrix(seed, sk.m, d).astype(np.float64))
    norms = sk.norms.astype(np.float64).reshape(-1)
    k = K_QJL / sk.m
    got, want = gpu.qjl_inner_product(y, sk, seed), kvqrs.qjl_inner_product(y, sk, seed)
    assert got.shape == want.shape and got.dtype == np.float32
    terms = k * (s @ np.abs(y.astype(np.float64)).T).sum(0)[:, None] * norms[None, :]
    np.testing.assert_array_less(np.abs(got - want).reshape(terms.shape), SUM_RTOL * terms + 1e-30)
    got, want = gpu.qjl_vector_estimate(sk, seed), kvqrs.qjl_vector_estimate(sk, seed)
    assert got.shape == want.shape
    terms = k * s.sum(0)[None, :] * norms[:, None]
    np.testing.assert_array_less(np.abs(got - want).reshape(terms.shape), SUM_RTOL * terms + 1e-30)


def test_cross_path_estimates():
    rng = np.random.default_rng(1)
    r = rng.standard_normal((3, 20, 128)).astype(np.float32)
    y = rng.standard_normal((5, 128)).astype(np.float32)
    g, c = gpu.qjl_sketch(r, 4), kvqrs.qjl_sketch(r, 4)
    np.testing.assert_allclose(kvqrs.qjl_inner_product(y, g, 4), gpu.qjl_inner_product(y, g, 4), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gpu.qjl_vector_estimate(c, 4), kvqrs.qjl_vector_estimate(c, 4), rtol=1e-5, atol=1e-6)
    assert np.mean(g.signs != c.signs) < 1e-3


def test_matrix_is_uploaded_once():
    dev = gpu.device()
    r = np.ones((2, 48), np.float32)
    gpu.qjl_sketch(r, 123456)
    before = dict(dev._constants)
    gpu.qjl_sketch(r, 123456)
    assert dev._constants[("qjl", 123456, 48, 48)] is before[("qjl", 123456, 48, 48)]


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.qjl_sketch(np.array([[1.0, np.nan]], np.float32), 1),
        lambda m: m.qjl_sketch(np.ones((2, 4), np.float32), None),
        lambda m: m.qjl_sketch(np.ones((2, 4), np.float32), 1, 0),
        lambda m: m.qjl_sketch(np.full((1, 4), 3e38, np.float32), 1),
        lambda m: m.qjl_inner_product(np.ones((2, 5), np.float32), kvqrs.qjl_sketch(np.ones((2, 4), np.float32), 1), 1),
        lambda m: m.qjl_vector_estimate(kvqrs.QJLSketch(np.zeros((2, 3), np.uint8), np.ones(2, np.float16), 4, 4), 1),
        lambda m: m.qjl_vector_estimate(kvqrs.QJLSketch(np.zeros((2, 1), np.uint8), np.array([1, -2], np.float32), 4, 4), 1),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kvqrs))


def test_a_non_sketch_is_named():
    with pytest.raises(kvqrs.KvqrsError, match="sketch: expected a QJLSketch from qjl_sketch, got str"):
        gpu.qjl_inner_product(np.ones((2, 4), np.float32), "sketch", 1)
    with pytest.raises(kvqrs.KvqrsError, match="sketch: expected a QJLSketch from qjl_sketch, got str"):
        gpu.qjl_vector_estimate("sketch", 1)
