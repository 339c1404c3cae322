"""The HeadQ side code in WGSL (shaders/headq.wgsl) against the Rust path (docs/kernels.md section 7). Side codes are equal except where p / s + h + 0.5 lies within
ROUND_TIE_TOL of an integer (WGSL division is within 2.5 ulp); scales within one float16 ulp;
decode and score corrections within SUM_RTOL of their absolute terms."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu

from tests.gpu.gpu_helpers import ROUND_TIE_TOL, SUM_RTOL, assert_stored_close, codes_equal_except_ties, requires_adapter, same_error
from tests.strategies import bits, finite_rows, leading_shapes, seeds

pytestmark = requires_adapter


@st.composite
def side_inputs(draw):
    d = draw(st.sampled_from([2, 5, 40, 64, 128]))
    rank = draw(st.integers(1, min(d, 8)))
    basis = kvqrs.random_orthonormal_basis(draw(seeds), d, rank)
    e = finite_rows(draw, draw(leading_shapes), d, scale=draw(st.sampled_from([1e-2, 1.0, 100.0])))
    return e, basis, draw(bits)


def tie_distance(e, basis, scales, q):
    p = e.reshape(-1, basis.shape[0]).astype(np.float64) @ basis.astype(np.float64)
    s = scales.astype(np.float64).reshape(-1, 1)
    h = ((1 << q) - 1) / 2
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s > 0, p / np.where(s > 0, s, 1) + h + 0.5, 0.5)
    return np.abs(t - np.round(t))


@given(side_inputs())
def test_codes_and_scales_match_rust_path(case):
    e, basis, q = case
    got, want = gpu.headq_encode(e, basis, q), kvqrs.headq_encode(e, basis, q)
    assert got.codes.shape == want.codes.shape and got.bits == want.bits
    assert_stored_close(got.scales, want.scales, rtol32=1e-6)
    dist = tie_distance(e, basis, want.scales, q).reshape(want.codes.shape)
    codes_equal_except_ties(got.codes, want.codes, dist, ROUND_TIE_TOL)


@given(side_inputs(), st.integers(0, 4))
def test_decode_and_correction_match_rust_path(case, nq):
    e, basis, q = case
    code = kvqrs.headq_encode(e, basis, q)
    d, rank = basis.shape
    h = ((1 << q) - 1) / 2
    z = np.abs(code.scales.astype(np.float64).reshape(-1, 1) * (code.codes.reshape(-1, rank) - h))
    got, want = gpu.headq_decode(code, basis), kvqrs.headq_decode(code, basis)
    terms = z @ np.abs(basis.T.astype(np.float64))
    np.testing.assert_array_less(np.abs(got - want).reshape(terms.shape), SUM_RTOL * terms + 1e-30)
    qs = np.random.default_rng(nq).standard_normal((nq, d)).astype(np.float32)
    got, want = gpu.headq_score_correction(qs, code, basis), kvqrs.headq_score_correction(qs, code, basis)
    assert got.shape == want.shape == (nq, *e.shape[:-1])
    uq = np.abs(qs.astype(np.float64) @ basis.astype(np.float64))
    terms = uq @ z.T
    np.testing.assert_array_less(np.abs(got - want).reshape(terms.shape), SUM_RTOL * terms + 1e-12 * (terms.max(initial=0) + 1))


@pytest.mark.parametrize("q", range(1, 9))
def test_cross_path_every_width(q):
    rng = np.random.default_rng(q)
    basis = kvqrs.headq_basis(rng.standard_normal((200, 64)), 4)
    e = rng.standard_normal((30, 64)).astype(np.float32)
    g, c = gpu.headq_encode(e, basis, q), kvqrs.headq_encode(e, basis, q)
    np.testing.assert_allclose(kvqrs.headq_decode(g, basis), gpu.headq_decode(g, basis), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gpu.headq_decode(c, basis), kvqrs.headq_decode(c, basis), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(g.codes, c.codes)


@pytest.mark.parametrize(
    "call",
    [
        lambda m, u: m.headq_encode(np.ones((2, 5), np.float32), u, 2),
        lambda m, u: m.headq_encode(np.array([[np.nan] * 8]), u, 2),
        lambda m, u: m.headq_encode(np.ones((2, 8), np.float32), u, 0),
        lambda m, u: m.headq_encode(np.ones((2, 8), np.float32), np.full((8, 2), np.nan, np.float32), 2),
        lambda m, u: m.headq_encode(np.ones((2, 8), np.float32), np.ones(8, np.float32), 2),
        lambda m, u: m.headq_decode(kvqrs.HeadQCode(np.zeros((2, 3), np.uint8), np.ones(2, np.float16), 2), u),
        lambda m, u: m.headq_decode(kvqrs.HeadQCode(np.full((2, 2), 4, np.uint8), np.ones(2, np.float16), 2), u),
        lambda m, u: m.headq_score_correction(
            np.ones((1, 7), np.float32), kvqrs.HeadQCode(np.zeros((2, 2), np.uint8), np.ones(2, np.float16), 2), u
        ),
        lambda m, u: m.headq_score_correction(
            np.ones((1, 8), np.float32), kvqrs.HeadQCode(np.zeros((2, 2), np.uint8), np.array([1, -1], np.float32), 2), u
        ),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    u = kvqrs.random_orthonormal_basis(1, 8, 2)
    same_error(lambda: call(gpu, u), lambda: call(kvqrs, u))
