"""Norm-and-direction (MSE) stage: kvqrs.mse_encode / kvqrs.mse_decode (docs/kernels.md section 5; docs/kernels.md
section 5) against the float64 NumPy oracle, plus its statistical and edge-case invariants."""

from __future__ import annotations

import re

import kvqrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import oracle

from tests.strategies import (
    EDGE_DIMS,
    HEAD_DIMS,
    POWER_OF_TWO_DIMS,
    assert_scales_close,
    bits,
    codes_match_except_near_boundaries,
    finite_rows,
    gaussian_rows,
    head_dims,
    leading_shapes,
    seeds,
)

# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------

# Decode vs the float64 oracle, per row, relative to the stored norm: the float32 inverse FWHT
# rounds at most log2(d') <= 8 times at magnitudes <= norm (8 * 2^-24 * a margin of 4 ~ 2e-6).
DECODE_RTOL = 2e-6
# Stored norms vs the oracle: both are one float64 sum rounded to float32 (identical in
# practice); allow one ulp of the storage dtype in case a compute path rounds the float32 once
# differently (which may then round to the adjacent float16).
NORM_RTOL = {np.dtype(np.float16): 2.0**-10, np.dtype(np.float32): 2.0**-23}
# Relative MSE vs Lloyd-Max theory (the 2% the self-check allows), with the sampling standard error required
# to be at most a quarter of it (so a pass is a >= 4-sigma statement, not luck).
THEORY_RTOL = 0.02
THEORY_MAX_SE = THEORY_RTOL / 4
# With padding (d' > d) the decoded vector is the truncation of R^T c, so re-encoding it need
# not reproduce the codes. Measured changed fraction on Gaussian rows: <= 1.2% of codes for
# every head_dim in HEAD_DIMS + EDGE_DIMS and bits 1..8 (2000 rows each); bound at 2%.
PADDED_REENCODE_MAX_CHANGED = 0.02
# Accuracy of rows with norms outside float16's range: the float32 norm is exact to 2^-24, so
# the relative reconstruction error is the quantization error only; at 4 bits the Lloyd-Max
# unit MSE at d' = 128 is ~0.0093, per-row relative squared errors stay below 0.05.
OUT_OF_RANGE_ROW_REL_MSE = 0.05

SEED_OR_NONE = st.one_of(st.none(), seeds)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def code_dim(head_dim: int, seed) -> int:
    return head_dim if seed is None else oracle.padded_dim(head_dim)


def oracle_unit(x, seed) -> np.ndarray:
    """The oracle's float64 rotated unit coordinates: hadamard(x, seed) / float32 norm."""
    x32 = np.asarray(x, dtype=np.float32)
    y = x32.astype(np.float64) if seed is None else oracle.hadamard(x32, seed)
    n = oracle.vector_norm(x32).astype(np.float32).astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n > 0, y / np.where(n > 0, n, 1.0), 0.0)


def assert_norms_match(got, want):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype, f"norm storage {got.dtype} != oracle {want.dtype}"
    assert got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=NORM_RTOL[got.dtype], atol=0)


def assert_decode_close(got, want, norms):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    tol = DECODE_RTOL * np.asarray(norms).astype(np.float64)[..., None]
    err = np.abs(got - want)
    assert np.all(err <= tol), f"decode differs from the oracle by {np.max(err - tol):.3e} over tolerance"


def check_encode_against_oracle(x, nbits, seed):
    head_dim = np.asarray(x).shape[-1]
    codes, norms = kvqrs.mse_encode(x, nbits, seed)
    want_codes, want_norms = oracle.mse_encode(np.asarray(x, dtype=np.float32), nbits, seed)
    lead = np.asarray(x).shape[:-1]
    assert codes.dtype == np.uint8
    assert codes.shape == (*lead, code_dim(head_dim, seed))
    assert norms.shape == lead
    assert_norms_match(norms, want_norms)
    _, boundaries, _ = oracle.lloyd_max_codebook(code_dim(head_dim, seed), nbits)
    codes_match_except_near_boundaries(codes, want_codes, oracle_unit(x, seed), boundaries)
    return codes, norms


def relative_mse(x, xh) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    xh = np.asarray(xh, dtype=np.float64)
    return ((x - xh) ** 2).sum(-1) / (x * x).sum(-1)


# --------------------------------------------------------------------------------------------
# Kernel vs oracle (hypothesis)
# --------------------------------------------------------------------------------------------


@st.composite
def mse_inputs(draw, dims=head_dims, seed_strategy=SEED_OR_NONE, dtype=np.float32):
    d = draw(dims)
    lead = draw(leading_shapes)
    x = finite_rows(draw, lead, d, scale=draw(st.sampled_from([1e-3, 1.0, 100.0])), dtype=dtype)
    return x, draw(bits), draw(seed_strategy)


@given(mse_inputs())
def test_encode_matches_oracle(case):
    x, nbits, seed = case
    check_encode_against_oracle(x, nbits, seed)


@given(mse_inputs())
def test_decode_of_encode_matches_oracle(case):
    x, nbits, seed = case
    d = x.shape[-1]
    codes, norms = kvqrs.mse_encode(x, nbits, seed)
    got = kvqrs.mse_decode(codes, norms, nbits, d, seed)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert_decode_close(got, oracle.mse_decode(codes, norms, nbits, d, seed), norms)


@st.composite
def decode_inputs(draw):
    d = draw(head_dims)
    nbits = draw(bits)
    seed = draw(SEED_OR_NONE)
    lead = draw(leading_shapes)
    cd = code_dim(d, seed)
    codes = draw(hnp.arrays(np.uint8, (*lead, cd), elements=st.integers(0, 2**nbits - 1)))
    norm_dtype = draw(st.sampled_from([np.float16, np.float32]))
    top = 6e4 if norm_dtype == np.float16 else 2.0**100
    norms = draw(
        hnp.arrays(
            np.float32,
            lead,
            elements=st.floats(0, top, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32),
        )
    ).astype(norm_dtype)
    return codes, norms, nbits, d, seed


@given(decode_inputs())
def test_decode_arbitrary_codes_matches_oracle(case):
    """Decode is checked on its own: any valid codes and stored norms, not only encoder output."""
    codes, norms, nbits, d, seed = case
    got = kvqrs.mse_decode(codes, norms, nbits, d, seed)
    assert got.shape == (*codes.shape[:-1], d)
    assert_decode_close(got, oracle.mse_decode(codes, norms, nbits, d, seed), norms)


@pytest.mark.parametrize("head_dim", EDGE_DIMS + [40, 64, 80])
@pytest.mark.parametrize("seed", [None, 0, 2**64 - 1])
def test_edge_dims_match_oracle(head_dim, seed):
    x = gaussian_rows(head_dim, 64, head_dim)
    for nbits in (1, 2, 5, 8):
        codes, norms = check_encode_against_oracle(x, nbits, seed)
        got = kvqrs.mse_decode(codes, norms, nbits, head_dim, seed)
        assert_decode_close(got, oracle.mse_decode(codes, norms, nbits, head_dim, seed), norms)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
@given(case=mse_inputs())
def test_other_input_dtypes_equal_their_float32_values(dtype, case):
    """float16 / bfloat16 / float64 inputs are computed as their float32 values."""
    x32, nbits, seed = case
    x = x32.astype(dtype)
    codes, norms = check_encode_against_oracle(x, nbits, seed)
    codes32, norms32 = kvqrs.mse_encode(x.astype(np.float32), nbits, seed)
    np.testing.assert_array_equal(codes, codes32)
    np.testing.assert_array_equal(norms, norms32)
    assert norms.dtype == norms32.dtype


def test_float64_input_is_rounded_to_float32_once():
    x64 = gaussian_rows(1, 8, 64).astype(np.float64) + 1e-12  # below float32 resolution at ~1
    np.testing.assert_array_equal(kvqrs.mse_encode(x64, 4, 3).codes, kvqrs.mse_encode(x64.astype(np.float32), 4, 3).codes)


@pytest.mark.parametrize("seed", [None, 77])
def test_strided_input_equals_contiguous(seed):
    base = gaussian_rows(5, 6 * 4, 2 * 80).reshape(6, 4, 160)
    views = {
        "every other column": base[..., ::2],
        "reversed rows and columns": base[::-1, :, ::-2],
        "transposed leading axes": base[..., :80].transpose(1, 0, 2),
        "fortran order": np.asfortranarray(base[..., :80]),
    }
    for name, view in views.items():
        assert not view.flags.c_contiguous, name
        contiguous = np.ascontiguousarray(view)
        got = kvqrs.mse_encode(view, 3, seed)
        want = kvqrs.mse_encode(contiguous, 3, seed)
        np.testing.assert_array_equal(got.codes, want.codes, err_msg=name)
        np.testing.assert_array_equal(got.norms, want.norms, err_msg=name)
        # Decode from strided codes and norms too.
        codes_view = np.asfortranarray(got.codes)
        norms_view = np.asfortranarray(got.norms)
        np.testing.assert_array_equal(
            kvqrs.mse_decode(codes_view, norms_view, 3, 80, seed),
            kvqrs.mse_decode(want.codes, want.norms, 3, 80, seed),
            err_msg=name,
        )


@pytest.mark.parametrize("lead", [(), (0,), (1,), (3, 0, 2), (2, 3, 4)])
@pytest.mark.parametrize("seed", [None, 5])
def test_leading_shapes_including_empty(lead, seed):
    d = 80
    x = gaussian_rows(3, max(1, int(np.prod(lead))), d)[: int(np.prod(lead))].reshape(*lead, d)
    codes, norms = kvqrs.mse_encode(x, 2, seed)
    assert codes.shape == (*lead, code_dim(d, seed))
    assert norms.shape == lead
    out = kvqrs.mse_decode(codes, norms, 2, d, seed)
    assert out.shape == (*lead, d)
    want_codes, want_norms = oracle.mse_encode(x, 2, seed)
    np.testing.assert_array_equal(codes, want_codes)
    assert_norms_match(norms, want_norms)


def test_decode_output_dtype():
    x = gaussian_rows(4, 3, 64)
    codes, norms = kvqrs.mse_encode(x, 4, 1)
    for dtype in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16):
        out = kvqrs.mse_decode(codes, norms, 4, 64, 1, dtype=dtype)
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, kvqrs.mse_decode(codes, norms, 4, 64, 1).astype(dtype))


# --------------------------------------------------------------------------------------------
# Re-encoding the decoded vector (docs section 5)
# --------------------------------------------------------------------------------------------


@st.composite
def unpadded_inputs(draw):
    """(x, bits, seed) whose codes live in R^head_dim without padding: a power-of-two head_dim
    with a rotation, or any head_dim without one."""
    seed = draw(SEED_OR_NONE)
    dims = head_dims if seed is None else st.sampled_from(POWER_OF_TWO_DIMS)
    x, nbits, _ = draw(mse_inputs(dims=dims, seed_strategy=st.just(seed)))
    return x, nbits, seed


@given(unpadded_inputs())
def test_reencoding_gives_the_codes_of_the_renormalised_centroids(case):
    """Without padding decode(codes) = norm * R^T c exactly in real arithmetic, so re-encoding it
    gives encode(c / ||c||) (docs section 5: its norm is ||x|| * ||c||). That equals the original
    codes whenever every c_i / ||c|| stays in its cell, which is the usual case but not always
    (see test_docs_claim_reencoding_reproduces_codes)."""
    x, nbits, seed = case
    d = x.shape[-1]
    codes, norms = kvqrs.mse_encode(x, nbits, seed)
    xh = kvqrs.mse_decode(codes, norms, nbits, d, seed)
    codes2, _ = kvqrs.mse_encode(xh, nbits, seed)
    cd = code_dim(d, seed)
    centroids, boundaries, _ = oracle.lloyd_max_codebook(cd, nbits)
    c = oracle.lloyd_max_decode(codes, centroids)
    cn = np.linalg.norm(c, axis=-1, keepdims=True)
    # Rows that decode to exact zeros (zero rows, or float16 norms that flush) re-encode as a
    # zero row: all codes 2^(b-1) (0.0 sits on the middle boundary and goes up).
    zero = (np.abs(np.asarray(xh, np.float64)).sum(-1) == 0)[..., None]
    u2 = np.where(zero, 0.0, c / np.where(cn > 0, cn, 1.0))
    want = np.where(zero, 2 ** (nbits - 1), oracle.lloyd_max_encode(u2, boundaries))
    codes_match_except_near_boundaries(codes2, want, u2, boundaries)


@given(unpadded_inputs())
def test_one_bit_reencoding_reproduces_codes_exactly(case):
    """At 1 bit the cells are the two half-lines, so rescaling by 1/||c|| cannot move a code."""
    x, _, seed = case
    nbits, d = 1, x.shape[-1]
    codes, norms = kvqrs.mse_encode(x, nbits, seed)
    codes2, _ = kvqrs.mse_encode(kvqrs.mse_decode(codes, norms, nbits, d, seed), nbits, seed)
    live = norms.astype(np.float64) > 0
    np.testing.assert_array_equal(codes2[live], codes[live])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_reencoding_reproduces_codes_for_typical_rows(head_dim):
    """Power-of-two head_dim, Gaussian rows: re-encoding reproduces the codes of all but a tiny
    fraction of rows. Measured (8000 rows): zero changes for bits <= 3 at every power of two >= 8,
    and at most 0.2% of rows / 0.04% of codes changed at head_dim 64 (fewer at 128, none at 256).
    Bounded at 1% of rows and 0.1% of codes."""
    x = gaussian_rows(head_dim + 1, 4000, head_dim)
    for nbits in range(1, 9):
        codes, norms = kvqrs.mse_encode(x, nbits, 11)
        codes2, _ = kvqrs.mse_encode(kvqrs.mse_decode(codes, norms, nbits, head_dim, 11), nbits, 11)
        changed = codes2 != codes
        if nbits <= 3:
            assert not changed.any(), f"bits={nbits}: {changed.sum()} codes changed"
        assert changed.any(axis=-1).mean() <= 0.01, f"bits={nbits}"
        assert changed.mean() <= 0.001, f"bits={nbits}"


@pytest.mark.parametrize("head_dim", [h for h in HEAD_DIMS + EDGE_DIMS if h & (h - 1)])
def test_padded_reencoding_changes_few_codes(head_dim):
    """With padding (d' > d) decode truncates R^T c to the first d coordinates, so re-encoding
    need not reproduce the codes; we measure and bound the changed fraction instead."""
    x = gaussian_rows(head_dim, 500, head_dim)
    for nbits in range(1, 9):
        codes, norms = kvqrs.mse_encode(x, nbits, 9)
        codes2, _ = kvqrs.mse_encode(kvqrs.mse_decode(codes, norms, nbits, head_dim, 9), nbits, 9)
        frac = float((codes2 != codes).mean())
        assert frac <= PADDED_REENCODE_MAX_CHANGED, f"bits={nbits}: {frac:.4f} of codes changed"


# --------------------------------------------------------------------------------------------
# Distortion vs Lloyd-Max theory
# --------------------------------------------------------------------------------------------

# (head_dim, seed): rotated power-of-two dims (the rotated unit vector of a Gaussian row is
# uniform on S^(d'-1)) and an unrotated non-power-of-two dim (x/||x|| is uniform on S^(d-1)).
THEORY_CASES = [(128, 2024), (256, 7), (80, None)]
# Rows per case. Per-row relative errors are heavy-tailed at high bits (rare coordinates beyond
# the outermost centroid), so the standard error is ~0.4% at 8 bits even with 40000 rows.
THEORY_ROWS = 40000


@pytest.fixture(scope="module")
def measured_mse():
    """{(head_dim, seed): [(mean relative MSE, standard error, theory) for bits 1..8]}."""
    out = {}
    for d, seed in THEORY_CASES:
        x = gaussian_rows(1000 + d, THEORY_ROWS, d)
        n2 = (x.astype(np.float64) ** 2).sum(-1)
        per_bits = []
        for nbits in range(1, 9):
            codes, norms = kvqrs.mse_encode(x, nbits, seed)
            xh = kvqrs.mse_decode(codes, norms, nbits, d, seed)
            rel = ((x - xh).astype(np.float64) ** 2).sum(-1) / n2
            theory = kvqrs.lloyd_max_codebook(code_dim(d, seed), nbits).unit_mse
            per_bits.append((rel.mean(), rel.std(ddof=1) / np.sqrt(rel.size), theory))
        out[(d, seed)] = per_bits
    return out


@pytest.mark.parametrize("case", THEORY_CASES, ids=lambda c: f"d{c[0]}-seed{c[1]}")
def test_relative_mse_matches_lloyd_max_theory(measured_mse, case):
    for nbits, (mean, se, theory) in enumerate(measured_mse[case], start=1):
        assert se / theory <= THEORY_MAX_SE, f"bits={nbits}: too few rows (se {se / theory:.4f})"
        assert abs(mean / theory - 1) <= THEORY_RTOL, f"bits={nbits}: {mean:.4e} vs theory {theory:.4e}"


@pytest.mark.parametrize("case", THEORY_CASES, ids=lambda c: f"d{c[0]}-seed{c[1]}")
def test_mse_strictly_falls_as_bits_rise(measured_mse, case):
    means = [m for m, _, _ in measured_mse[case]]
    assert all(b < a for a, b in zip(means, means[1:])), means


@pytest.mark.parametrize("head_dim", [40, 80, 160])
def test_padded_relative_mse_is_below_the_padded_theory(head_dim):
    """With padding the rotated unit vector lies in a d-dimensional subspace of R^d' and decode
    drops the padded coordinates, so the d' theory is an upper bound rather than the value
    (measured ratio 0.61-0.78 for bits 1..8); bounded at 0.85 x theory."""
    x = gaussian_rows(head_dim, 4000, head_dim)
    for nbits in range(1, 9):
        codes, norms = kvqrs.mse_encode(x, nbits, 3)
        rel = relative_mse(x, kvqrs.mse_decode(codes, norms, nbits, head_dim, 3)).mean()
        theory = kvqrs.lloyd_max_codebook(oracle.padded_dim(head_dim), nbits).unit_mse
        assert 0.5 * theory <= rel <= 0.85 * theory, f"bits={nbits}: ratio {rel / theory:.3f}"


# --------------------------------------------------------------------------------------------
# Special rows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [2, 3, 40, 64, 80])
@pytest.mark.parametrize("seed", [None, 13])
def test_zero_rows_decode_to_exact_zeros(head_dim, seed):
    x = gaussian_rows(1, 4, head_dim)
    x[1] = 0.0
    x[3] = -0.0
    for nbits in range(1, 9):
        codes, norms = kvqrs.mse_encode(x, nbits, seed)
        assert norms[1] == 0 and norms[3] == 0
        assert np.all(codes[[1, 3]] == 2 ** (nbits - 1))  # u = 0 sits on the middle boundary
        out = kvqrs.mse_decode(codes, norms, nbits, head_dim, seed)
        assert np.all(np.isfinite(out))
        assert np.all(out[[1, 3]] == 0.0)
        # A batch of only zero rows (norms stored as float16 zeros).
        z_codes, z_norms = kvqrs.mse_encode(np.zeros((2, head_dim), np.float32), nbits, seed)
        assert z_norms.dtype == np.float16 and np.all(z_norms == 0)
        z_out = kvqrs.mse_decode(z_codes, z_norms, nbits, head_dim, seed)
        np.testing.assert_array_equal(z_out, np.zeros((2, head_dim), np.float32))


@pytest.mark.parametrize("head_dim", [2, 5, 64, 80, 256])
@pytest.mark.parametrize("seed", [None, 99])
def test_constant_and_one_hot_rows(head_dim, seed):
    const = np.full((3, head_dim), 1.0, np.float32) * np.array([[0.5], [-3.0], [1e3]], np.float32)
    one_hot = np.zeros((head_dim, head_dim), np.float32)
    one_hot[np.arange(head_dim), np.arange(head_dim)] = np.linspace(-5, 5, head_dim, dtype=np.float32) + 0.01
    for x in (const, one_hot):
        for nbits in (1, 3, 8):
            codes, norms = check_encode_against_oracle(x, nbits, seed)
            out = kvqrs.mse_decode(codes, norms, nbits, head_dim, seed)
            assert_decode_close(out, oracle.mse_decode(codes, norms, nbits, head_dim, seed), norms)
            # Direction kept: every reconstruction points into the half-space of its row.
            assert np.all((out.astype(np.float64) * x).sum(-1) > 0)
    if seed is None:
        # No rotation: a one-hot row uses the top/bottom code at its position and the code of
        # 0.0 (2^(b-1)) everywhere else.
        codes, _ = kvqrs.mse_encode(one_hot, 3, None)
        expected = np.full((head_dim, head_dim), 4)
        expected[np.arange(head_dim), np.arange(head_dim)] = np.where(np.diag(one_hot) > 0, 7, 0)
        np.testing.assert_array_equal(codes, expected)


@pytest.mark.parametrize(
    ("row", "dtype"),
    [
        ([65504.0, 0.0], np.float32),  # norm 65504 is outside [2^-14, 65504)
        ([65500.0, 0.0], np.float16),  # inside (it rounds to 65504 as float16, still finite)
        ([2.0**-14, 0.0], np.float16),  # the smallest normal float16 is inside
        ([2.0**-15, 0.0], np.float32),  # below it
        ([3.0e4, 4.0e4], np.float16),  # norm 5e4
        ([4.0e4, 6.0e4], np.float32),  # norm 7.2e4, although every value fits float16
    ],
)
def test_norm_storage_thresholds(row, dtype):
    x = np.array([row, [1.0, 1.0]], dtype=np.float32)
    _, norms = kvqrs.mse_encode(x, 2, None)
    assert norms.dtype == dtype
    assert oracle.store_scalars(oracle.vector_norm(x).astype(np.float32)).dtype == dtype


@pytest.mark.parametrize("scale", [1e5, 1e-7])
@pytest.mark.parametrize("seed", [None, 21])
def test_norms_beyond_float16_switch_to_float32_and_decode_accurately(scale, seed):
    d, nbits = 128, 4
    x = gaussian_rows(8, 200, d) * np.float32(scale)
    codes, norms = check_encode_against_oracle(x, nbits, seed)
    assert norms.dtype == np.float32
    np.testing.assert_array_equal(norms, oracle.vector_norm(x).astype(np.float32))
    out = kvqrs.mse_decode(codes, norms, nbits, d, seed)
    assert np.all(np.isfinite(out))
    assert_decode_close(out, oracle.mse_decode(codes, norms, nbits, d, seed), norms)
    rel = relative_mse(x, out)
    assert rel.max() <= OUT_OF_RANGE_ROW_REL_MSE
    # Scale invariance: same codes as the unscaled rows up to boundary ties.
    unit_codes, _ = kvqrs.mse_encode(gaussian_rows(8, 200, d), nbits, seed)
    _, boundaries, _ = oracle.lloyd_max_codebook(d, nbits)
    codes_match_except_near_boundaries(codes, unit_codes, oracle_unit(x, seed), boundaries)


def test_one_large_row_widens_the_batch_not_the_others_rounding():
    x = gaussian_rows(2, 6, 64)
    x[4] *= 1e5
    codes, norms = kvqrs.mse_encode(x, 3, 1)
    assert norms.dtype == np.float32
    exact = oracle.vector_norm(x).astype(np.float32)
    assert norms[4] == exact[4]  # the large row keeps its float32 norm
    # The ordinary rows are rounded to float16 as if encoded without the large row (rounding is
    # per value, so a row's stored norm never depends on the rest of the batch).
    _, small_norms = kvqrs.mse_encode(np.delete(x, 4, axis=0), 3, 1)
    assert small_norms.dtype == np.float16
    np.testing.assert_array_equal(np.delete(norms, 4), small_norms.astype(np.float32))
    assert not np.array_equal(np.delete(norms, 4), np.delete(exact, 4))


@pytest.mark.parametrize("seed", [None, 4])
def test_bfloat16_input_beyond_float16_range(seed):
    d, nbits = 64, 4
    x = (gaussian_rows(6, 50, d) * np.float32(1e6)).astype(ml_dtypes.bfloat16)
    codes, norms = check_encode_against_oracle(x, nbits, seed)
    assert norms.dtype == np.float32 and np.all(np.isfinite(norms))
    x32 = x.astype(np.float32)
    for dtype in (np.float32, ml_dtypes.bfloat16):
        out = kvqrs.mse_decode(codes, norms, nbits, d, seed, dtype=dtype)
        assert out.dtype == np.dtype(dtype)
        assert np.all(np.isfinite(out.astype(np.float32)))
        assert relative_mse(x32, out.astype(np.float32)).max() <= OUT_OF_RANGE_ROW_REL_MSE


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("seed", [None, 3])
def test_non_finite_input_names_row_and_position(bad, seed):
    x = gaussian_rows(0, 2 * 3, 40).reshape(2, 3, 40)
    x[1, 0, 7] = bad  # flattened row 1 * 3 + 0 = 3
    with pytest.raises(kvqrs.KvqrsError, match=r"x: .*finite.*row 3, position 7"):
        kvqrs.mse_encode(x, 3, seed)
    with pytest.raises(ValueError):  # KvqrsError is a ValueError
        kvqrs.mse_encode(x.astype(np.float16), 3, seed)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float64_beyond_float32_is_rejected_not_saturated():
    x = np.ones((2, 8))
    x[1, 2] = 1e39  # becomes inf in float32
    with pytest.raises(kvqrs.KvqrsError, match=r"x: .*(row 1, position 2|index \(1, 2\))"):
        kvqrs.mse_encode(x, 2, None)


def test_norm_overflowing_float32_is_rejected():
    x = np.full((1, 64), 3e38, np.float32)
    with pytest.raises(kvqrs.KvqrsError, match=r"overflow"):
        kvqrs.mse_encode(x, 2, 1)


@pytest.mark.parametrize("nbits", [0, 9, -1, True, 2.0, None])
def test_bad_bits(nbits):
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        kvqrs.mse_encode(np.ones((1, 8), np.float32), nbits, 1)
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        kvqrs.mse_decode(np.zeros((1, 8), np.uint8), np.ones(1, np.float16), nbits, 8, 1)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "1"])
def test_bad_seed(seed):
    with pytest.raises(kvqrs.KvqrsError, match="seed"):
        kvqrs.mse_encode(np.ones((1, 8), np.float32), 2, seed)
    with pytest.raises(kvqrs.KvqrsError, match="seed"):
        kvqrs.mse_decode(np.zeros((1, 8), np.uint8), np.ones(1, np.float16), 2, 8, seed)


def test_bad_input_shapes_and_dtypes():
    with pytest.raises(kvqrs.KvqrsError, match="head_dim|length >= 2"):
        kvqrs.mse_encode(np.ones((3, 1), np.float32), 2, 1)
    with pytest.raises(kvqrs.KvqrsError, match="scalar"):
        kvqrs.mse_encode(np.float32(1.0), 2, 1)
    with pytest.raises(kvqrs.KvqrsError, match="dtype"):
        kvqrs.mse_encode(np.ones((3, 8), np.int32), 2, 1)
    with pytest.raises(kvqrs.KvqrsError, match="head_dim"):
        kvqrs.mse_decode(np.zeros((1, 1), np.uint8), np.ones(1, np.float16), 2, 1, None)


@pytest.mark.parametrize(("head_dim", "seed", "width"), [(80, 1, 80), (80, None, 128), (64, 1, 63), (64, None, 65)])
def test_wrong_code_width(head_dim, seed, width):
    codes = np.zeros((2, width), np.uint8)
    with pytest.raises(kvqrs.KvqrsError, match=rf"codes: .*{code_dim(head_dim, seed)}.*got {width}"):
        kvqrs.mse_decode(codes, np.ones(2, np.float16), 3, head_dim, seed)


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, np.uint16, np.int8])
@pytest.mark.parametrize("nbits", [1, 3, 6])
def test_codes_out_of_range(dtype, nbits):
    codes = np.zeros((3, 64), dtype)
    codes[2, 5] = 2**nbits
    with pytest.raises(kvqrs.KvqrsError, match=rf"code {2**nbits} .*(row 2, position 5|index \(2, 5\))"):
        kvqrs.mse_decode(codes, np.ones(3, np.float16), nbits, 64, 1)
    if np.issubdtype(dtype, np.signedinteger):
        codes[2, 5] = -1
        with pytest.raises(kvqrs.KvqrsError, match="code -1"):
            kvqrs.mse_decode(codes, np.ones(3, np.float16), nbits, 64, 1)
    codes[2, 5] = 2**nbits - 1  # the largest valid code decodes
    assert np.all(np.isfinite(kvqrs.mse_decode(codes, np.ones(3, np.float16), nbits, 64, 1)))


def test_code_256_rejected_at_8_bits():
    codes = np.zeros((1, 64), np.int64)
    codes[0, 63] = 256
    with pytest.raises(kvqrs.KvqrsError, match=r"code 256 at index \(0, 63\)"):
        kvqrs.mse_decode(codes, np.ones(1, np.float16), 8, 64, 1)


def test_non_integer_codes_rejected():
    with pytest.raises(kvqrs.KvqrsError, match="integer"):
        kvqrs.mse_decode(np.zeros((1, 64), np.float32), np.ones(1, np.float16), 2, 64, 1)


@pytest.mark.parametrize(
    ("norms", "pattern"),
    [
        (np.ones(3, np.float16), r"norms: expected shape \(2,\)"),
        (np.ones((2, 1), np.float32), r"norms: expected shape \(2,\)"),
        (np.ones((), np.float32), r"norms: expected shape \(2,\)"),
        (np.ones(2, np.float64), r"norms: .*float16 or float32"),
        (np.ones(2, np.int32), r"norms: .*float16 or float32"),
        (np.ones(2, ml_dtypes.bfloat16), r"norms: .*float16 or float32"),
        (np.array([1.0, -1.0], np.float32), r"norms: .*non-negative.*row 1"),
        (np.array([-0.5, 1.0], np.float16), r"norms: .*non-negative.*row 0"),
        (np.array([1.0, np.nan], np.float32), r"norms: .*finite.*row 1"),
        (np.array([np.inf, 1.0], np.float16), r"norms: .*finite.*row 0"),
    ],
)
def test_bad_norms(norms, pattern):
    codes, _ = kvqrs.mse_encode(gaussian_rows(0, 2, 64), 2, 1)
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        kvqrs.mse_decode(codes, norms, 2, 64, 1)


def test_error_messages_are_kvqrs_errors_and_value_errors():
    assert issubclass(kvqrs.KvqrsError, ValueError)
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.mse_encode(np.array([[1.0, np.nan]], np.float32), 2, None)
    assert re.search(r"row 0, position 1", str(info.value))


# --------------------------------------------------------------------------------------------
# Fused packed encode / decode (what the schemes store)
# --------------------------------------------------------------------------------------------


@given(mse_inputs())
def test_packed_encode_equals_pack_of_codes(case):
    """mse_encode_packed = pack_bits(mse_encode) byte for byte, the oracle's codes packed
    except near a boundary; mse_decode_packed = mse_decode(unpack_bits) bit for bit."""
    x, nbits, seed = case
    d = x.shape[-1]
    code = kvqrs.mse_encode(x, nbits, seed)
    packed = kvqrs.mse_encode_packed(x, nbits, seed)
    assert packed.codes.dtype == np.uint8
    assert packed.codes.shape == (*x.shape[:-1], kvqrs.packed_size(code_dim(d, seed), nbits))
    np.testing.assert_array_equal(packed.codes, kvqrs.pack_bits(code.codes, nbits))
    np.testing.assert_array_equal(packed.norms, code.norms)
    assert packed.norms.dtype == code.norms.dtype
    unpacked = kvqrs.unpack_bits(packed.codes, nbits, code_dim(d, seed))
    want_codes, _ = oracle.mse_encode(np.asarray(x, dtype=np.float32), nbits, seed)
    _, boundaries, _ = oracle.lloyd_max_codebook(code_dim(d, seed), nbits)
    codes_match_except_near_boundaries(unpacked, want_codes, oracle_unit(x, seed), boundaries)
    for dtype in (np.float32, np.float64):
        got = kvqrs.mse_decode_packed(packed.codes, packed.norms, nbits, d, seed, dtype=dtype)
        ref = kvqrs.mse_decode(code.codes, code.norms, nbits, d, seed, dtype=dtype)
        assert got.dtype == ref.dtype and got.shape == x.shape
        np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))


def test_packed_decode_rejects_bad_input():
    x = np.random.default_rng(3).standard_normal((4, 40)).astype(np.float32)
    c = kvqrs.mse_encode_packed(x, 3, 5)  # code_dim 64 -> 24 bytes per row
    with pytest.raises(kvqrs.KvqrsError, match="packed: expected a last axis of 24 bytes"):
        kvqrs.mse_decode_packed(c.codes[:, :-1], c.norms, 3, 40, 5)
    with pytest.raises(kvqrs.KvqrsError, match="packed: expected a uint8 array"):
        kvqrs.mse_decode_packed(c.codes.astype(np.int16), c.norms, 3, 40, 5)
    with pytest.raises(kvqrs.KvqrsError, match="norms: expected shape"):
        kvqrs.mse_decode_packed(c.codes, c.norms[:-1], 3, 40, 5)
    with pytest.raises(kvqrs.KvqrsError, match="norms"):
        kvqrs.mse_decode_packed(c.codes, -np.abs(c.norms) - 1, 3, 40, 5)
    with pytest.raises(kvqrs.KvqrsError, match="x: .*NaN"):
        kvqrs.mse_encode_packed(np.full((2, 40), np.nan, np.float32), 3, 5)


@pytest.mark.parametrize("decode", ["mse_decode", "mse_decode_packed"])
def test_decode_beyond_float32_is_an_error_naming_the_row(decode):
    """The kernel checks each decoded row (the Python layer no longer scans float32 outputs): a
    stored norm near float32's top times a rotated centroid above 1 raises, naming the row."""
    codes = np.array([[0, 0], [255, 255]], np.uint8)  # d' = 2, 8 bits: ||c|| ~ 1.41
    norms = np.array([1.0, 3.0e38], np.float32)
    with pytest.raises(kvqrs.KvqrsError, match=r"norms: row 1 overflows float32"):
        getattr(kvqrs, decode)(codes, norms, 8, 2, 1)
    ok = getattr(kvqrs, decode)(codes[:1], norms[:1], 8, 2, 1)
    assert np.isfinite(ok).all()


# --------------------------------------------------------------------------------------------
# The least-squares row scale (scale="least_squares")
# --------------------------------------------------------------------------------------------

# Per-row squared error of the least-squares decode over the norm decode: the minimiser cannot be
# worse in exact arithmetic; the float16 rounding of either stored value adds at most
# ~(2^-11)^2 ||x||^2 (and float32 rounding far less): allowed 1e-6 ||x||^2.
LS_ERROR_SLACK = 1e-6


@pytest.mark.parametrize("scale", ["least_squares", "preserve_norm"])
@given(case=mse_inputs())
def test_stored_scale_matches_oracle_with_the_norm_modes_codes(scale, case):
    x, nbits, seed = case
    norm_mode = kvqrs.mse_encode(x, nbits, seed)
    ls = kvqrs.mse_encode(x, nbits, seed, scale=scale)
    np.testing.assert_array_equal(ls.codes, norm_mode.codes)
    assert_scales_close(ls.norms, np.asarray(x, np.float32), ls.codes, nbits, seed, scale=scale)
    packed = kvqrs.mse_encode_packed(x, nbits, seed, scale=scale)
    np.testing.assert_array_equal(packed.codes, kvqrs.pack_bits(ls.codes, nbits))
    assert packed.norms.dtype == ls.norms.dtype
    np.testing.assert_array_equal(packed.norms, ls.norms)


@given(mse_inputs())
def test_least_squares_scale_never_raises_a_rows_error(case):
    """The stored scale minimises ||x - s r||^2, so the decode is no further from x than the
    norm's for every row (a wrong formula, e.g. ||x|| (u . c) or a missing 1 / ||r||^2, fails)."""
    x, nbits, seed = case
    x = np.asarray(x, np.float32)
    d = x.shape[-1]
    errors = []
    for mode in ("norm", "least_squares"):
        code = kvqrs.mse_encode(x, nbits, seed, scale=mode)
        xh = kvqrs.mse_decode(code.codes, code.norms, nbits, d, seed).astype(np.float64)
        errors.append(((x.astype(np.float64) - xh) ** 2).sum(-1))
    n2 = (x.astype(np.float64) ** 2).sum(-1)
    assert np.all(errors[1] <= errors[0] + LS_ERROR_SLACK * n2)


def test_least_squares_scale_lowers_the_error_on_gaussian_rows():
    """On average strictly lower (measured -0.7% / -1.3% / -1.8% relative MSE at 2 / 3 / 4 bits,
    d = 128): the exact ``u . c / ||c||^2`` correction is not a no-op."""
    x = gaussian_rows(3, 4000, 128)
    for nbits in (2, 3, 4):
        err = []
        for mode in ("norm", "least_squares"):
            code = kvqrs.mse_encode(x, nbits, 5, scale=mode)
            err.append(relative_mse(x, kvqrs.mse_decode(code.codes, code.norms, nbits, 128, 5)).mean())
        assert err[1] < err[0] * (1 - 0.004), (nbits, err)


@pytest.mark.parametrize("head_dim", [2, 40, 128])
@pytest.mark.parametrize("seed", [None, 4])
def test_least_squares_zero_rows_store_zero(head_dim, seed):
    x = np.zeros((3, head_dim), np.float32)
    x[1] = 1.0
    code = kvqrs.mse_encode(x, 3, seed, scale="least_squares")
    assert code.norms[0] == 0 and code.norms[2] == 0 and not np.signbit(code.norms[0])
    assert np.all(np.isfinite(code.norms)) and code.norms[1] > 0
    np.testing.assert_array_equal(kvqrs.mse_decode(code.codes, code.norms, 3, head_dim, seed)[[0, 2]], 0.0)


@pytest.mark.parametrize("scale", ["Norm", "ls", "", None, 1])
def test_bad_scale_is_a_clear_error(scale):
    x = gaussian_rows(0, 2, 64)
    for fn in (kvqrs.mse_encode, kvqrs.mse_encode_packed):
        with pytest.raises(kvqrs.KvqrsError, match=r"scale: expected one of \('norm', 'least_squares', 'preserve_norm'\)"):
            fn(x, 2, 1, scale=scale)
    with pytest.raises(kvqrs.KvqrsError, match="scale: expected 'norm', 'least_squares' or 'preserve_norm'"):
        kvqrs._native.mse_encode(x.reshape(-1), 64, 2, 1, "ls")


def test_least_squares_scale_beyond_float32_is_rejected():
    """This row's least-squares scale is 1.6% above its norm at 1 bit: a norm of 3.38e38 fits
    float32, the scale does not, and the row is named as for a norm overflow."""
    x = gaussian_rows(2, 2, 64).astype(np.float64)
    x[1] *= 3.38e38 / np.linalg.norm(x[1])
    x = x.astype(np.float32)
    kvqrs.mse_encode(x, 1, 1)
    for fn in (kvqrs.mse_encode, kvqrs.mse_encode_packed):
        with pytest.raises(kvqrs.KvqrsError, match="row 1 overflows float32"):
            fn(x, 1, 1, scale="least_squares")


# --------------------------------------------------------------------------------------------
# The norm-preserving row scale (scale="preserve_norm")
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbits", [1, 2, 3, 4])
@pytest.mark.parametrize("head_dim,seed", [(128, 5), (96, 5), (64, None)])
def test_preserve_norm_decode_keeps_each_rows_norm(nbits, head_dim, seed):
    """Every decoded row has its input's norm (up to the float16 rounding of the stored scale,
    2^-11 relative), where the plain norm's decode is shorter on average by about sqrt(1 - D)
    (measured 0.941 / 0.982 / 0.995 at 2 / 3 / 4 bits, d = 64): a scale that forgot the 1 / ||r||
    or used ||r||^2 fails."""
    x = gaussian_rows(7, 500, head_dim)
    n = np.linalg.norm(x.astype(np.float64), axis=-1)
    ratios = []
    for mode in ("norm", "preserve_norm"):
        code = kvqrs.mse_encode(x, nbits, seed, scale=mode)
        ratios.append(np.linalg.norm(kvqrs.mse_decode(code.codes, code.norms, nbits, head_dim, seed).astype(np.float64), axis=-1) / n)
    assert np.all(np.abs(ratios[1] - 1) < 2.0**-10)
    assert ratios[0].mean() < 1 - 0.002


def test_preserve_norm_zero_rows_store_zero_and_overflow_is_named():
    x = gaussian_rows(2, 3, 64)
    x[0] = 0.0
    code = kvqrs.mse_encode(x, 2, 3, scale="preserve_norm")
    assert code.norms[0] == 0 and not np.signbit(code.norms[0]) and np.all(code.norms[1:] > 0)
    # At 1 bit ||r||^2 = 2 / pi on average: a norm of 3e38 fits float32, its scale does not.
    big = x.astype(np.float64)
    big[2] *= 3.0e38 / np.linalg.norm(big[2])
    for fn in (kvqrs.mse_encode, kvqrs.mse_encode_packed):
        with pytest.raises(kvqrs.KvqrsError, match="row 2 overflows float32"):
            fn(big.astype(np.float32), 1, 1, scale="preserve_norm")
