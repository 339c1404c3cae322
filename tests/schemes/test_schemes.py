"""Schemes of docs/schemes.md (``kvqrs.schemes``): every scheme's decode against the composition of
the kernel oracles (``kvqrs.oracle``) computed here from the codec's derived seeds, the storage
accounting (bits per element, overhead included), the score paths (incl. GQA and per-head HeadQ
bases), HeadQ's controls, the A^2 value allocation and the error handling."""

from __future__ import annotations

import heapq
import itertools
import math

import kvqrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import oracle
from kvqrs.schemes import Encoded, KVCodec, allocate_bits, derive_seed
from kvqrs.schemes.registry import KEY_SCHEMES, REGISTRY, VALUE_SCHEMES

from tests.scheme_helpers import scheme_codec
from tests.strategies import codes_match_except_near_boundaries, finite_rows, head_dims, leading_shapes

# --------------------------------------------------------------------------------------------
# Tolerances (each with its reason)
# --------------------------------------------------------------------------------------------

# The kernels compute in float32 (fast Walsh-Hadamard, fixed-order sums), the oracle in float64.
# A code may therefore differ from the oracle's where the encoded value sits within float32
# round-off of a decision boundary. On Gaussian rows this happens for ~1e-5 of the coordinates;
# we allow at most this fraction of the codes (and sign bits) of a tensor to differ ...
MAX_CODE_MISMATCH_FRAC = 1e-3
# ... and at most this fraction of the rows (tokens) to contain any differing code.
MAX_ROW_MISMATCH_FRAC = 0.03
# HeadQ side codes (r per token) are computed from the residual k - k_base: a token whose base
# code sat on a boundary gets another residual and possibly r other side codes. Measured 0;
# allow about one token in a hundred.
SIDE_CODE_MISMATCH_FRAC = 1e-2
# Codes and unit values within this distance of a Lloyd-Max boundary may differ by one step
# (float32 rotation vs the float64 oracle; the same constant as tests/strategies.BOUNDARY_TOL,
# widened x10 because the scheme-level residual adds one more float32 rounding).
BOUNDARY_TOL = 1e-4
# Decoded rows vs the float64 oracle, per coordinate, relative to the row's stored norm (or to
# the row's max |x| for KIVI): float32 FWHT / QJL sums over <= 128 terms err by ~1e-6 at most.
DECODE_RTOL = 2e-5
# Rows whose codes differ at a boundary decode one centroid step (or one QJL sign, ~2.5/sqrt(m)
# of ||r||) apart; such rows must still agree to this fraction of ||x||.
LOOSE_ROW_RTOL = 0.5
# QJL residual norms and HeadQ / KIVI side scales are stored in float16: a residual that differs by
# float32 round-off may round to the neighbouring float16 (one ulp = 2^-10 relative).
FLOAT16_ULP_RTOL = 2.0**-10 + 1e-7
# Scores from the score path vs q . decode_keys / sqrt(d): float32 sums; measured ~1e-7 of
# ||q|| ||k_hat|| / sqrt(d); 1e-5 leaves 100x margin.
SCORE_RTOL = 1e-5
# Basis from the kernel vs oracle (same float64 eigendecomposition / Gram-Schmidt, rounded to f32).
BASIS_ATOL = 1e-6
# bits per element are exact rationals: compare with a float64 round-off allowance only.
BPE_ATOL = 1e-12

# Sub-seed tags of schemes/codec.py (docs/kernels.md section 1: one seed per codec).
KEY_ROTATION, KEY_QJL, VALUE_ROTATION, VALUE_QJL, RANDOM_BASIS = 1, 2, 3, 4, 5

SEED = 12345
LEAD = (2, 2)  # (batch, kv_heads)
TOKENS = 40


def gaussian(seed, shape, scale=1.0):
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def away_from_zero(x, gap=0.01):
    """Push every value at least ``gap`` from 0, so that no KIVI zero point (a group minimum)
    falls below float16's normal range and every stored scalar is 16-bit (kernels.md 5, 9)."""
    return (x + np.where(x < 0, -gap, gap)).astype(np.float32)


def padded(d):
    return 1 << (d - 1).bit_length()


def oracle_derive_seed(seed: int, tag: int) -> int:
    """Philox4x32-10 at counter (tag, 0, 0xFFFFFFFF, 0), key = seed (schemes.codec.derive_seed)."""
    w = oracle.philox4x32_10(np.array([tag, 0, 0xFFFFFFFF, 0], np.uint32), np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32))
    return int(w[0]) | (int(w[1]) << 32)


# --------------------------------------------------------------------------------------------
# Oracle compositions
# --------------------------------------------------------------------------------------------


def f32(a):
    return np.asarray(a).astype(np.float32).astype(np.float64)


def oracle_mse(x, bits, seed):
    """The MSE stage by the oracle: codes, stored norms, the encoded unit values, the code-domain
    reconstruction ``||x|| c`` and the decode."""
    x32 = np.asarray(x, np.float32)
    d = x32.shape[-1]
    codes, norms = oracle.mse_encode(x32, bits, seed)
    dp = d if seed is None else oracle.padded_dim(d)
    cent, bounds, _ = oracle.lloyd_max_codebook(dp, bits)
    n32 = f32(oracle.vector_norm(x32))
    y = x32.astype(np.float64) if seed is None else oracle.hadamard(x32, seed)
    safe = np.where(n32 > 0, n32, 1.0)[..., None]
    unit = np.where(n32[..., None] > 0, y / safe, 0.0).astype(np.float32)
    rotated = oracle.lloyd_max_decode(codes, cent) * f32(norms)[..., None]
    return {
        "codes": codes,
        "norms": norms,
        "unit": unit,
        "boundaries": bounds,
        "rotated": rotated,
        "decode": oracle.mse_decode(codes, norms, bits, d, seed),
        "y": y,
    }


def oracle_mse_qjl(x, bits, rot, qjl):
    """(bits-1)-bit rotated MSE stage + 1-bit QJL of the rotated residual, by the oracle."""
    x32 = np.asarray(x, np.float32)
    d = x32.shape[-1]
    base = oracle_mse(x32, bits - 1, rot)
    r = (base["y"] - base["rotated"]).astype(np.float32)
    signs, rnorms = oracle.qjl_sketch(r, qjl)
    r_hat = oracle.qjl_vector_estimate(signs, rnorms, qjl, padded(d))
    return {**base, "residual": r, "signs": signs, "rnorms": rnorms, "decode": oracle.inverse_hadamard(base["rotated"] + r_hat, rot, d)}


def oracle_kivi(x, bits, group, per_channel):
    rows = np.swapaxes(np.asarray(x, np.float32), -1, -2) if per_channel else np.asarray(x, np.float32)
    codes, scales, zeros = oracle.uniform_encode(rows, bits, group)
    dec = oracle.uniform_decode(codes, scales, zeros, bits, group)
    return {"codes": codes, "scales": scales, "zeros": zeros, "rows": rows, "decode": np.swapaxes(dec, -1, -2) if per_channel else dec}


def row_norms(x):
    return np.linalg.norm(np.asarray(x, np.float64), axis=-1)


def assert_rows_close(got, want, scale, same_rows, what):
    """Rows with identical codes agree to float32 round-off; the few rows whose codes differ at a
    decision boundary are bounded in number and still close."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = np.asarray(scale, np.float64)[..., None]
    err = np.abs(got - want)
    tight = err <= DECODE_RTOL * scale + 1e-30
    assert np.all(tight[same_rows]), f"{what}: decode differs from the oracle by {np.max(err[same_rows]):.3e} on rows with equal codes"
    assert np.mean(~same_rows) <= MAX_ROW_MISMATCH_FRAC, f"{what}: {np.mean(~same_rows):.3%} rows differ from the oracle"
    if (~same_rows).any():
        row_err = np.linalg.norm(got - want, axis=-1)[~same_rows]
        assert np.all(row_err <= LOOSE_ROW_RTOL * scale[..., 0][~same_rows]), f"{what}: rows far from the oracle"


def assert_codes_close(got, want, unit, boundaries, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    frac = float(np.mean(got != want))
    assert frac <= MAX_CODE_MISMATCH_FRAC, f"{what}: {frac:.3%} of the codes differ from the oracle"
    codes_match_except_near_boundaries(got, want, unit, boundaries, tol=BOUNDARY_TOL)
    return (got == want).all(axis=-1)


def assert_uniform_codes_close(got, want, what):
    got, want = np.asarray(got).astype(int), np.asarray(want).astype(int)
    diff = got != want
    assert np.mean(diff) <= MAX_CODE_MISMATCH_FRAC, f"{what}: {np.mean(diff):.3%} codes differ"
    assert np.all(np.abs(got - want)[diff] == 1), f"{what}: codes differ by more than one step"
    return ~diff


def assert_stored_equal(got, want, what, rtol=0.0):
    assert got.dtype == want.dtype, f"{what}: stored as {got.dtype}, oracle {want.dtype}"
    assert got.shape == want.shape, (what, got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=0, err_msg=what)


def check_mse_parts(parts, x, bits, seed, what):
    """Compare an MSE-stage Encoded part set with the oracle; returns (oracle dict, codec codes,
    equal-row mask)."""
    d = x.shape[-1]
    dp = d if seed is None else padded(d)
    o = oracle_mse(x, bits, seed)
    codes = oracle.unpack_bits(parts["codes"], bits, dp)
    same = assert_codes_close(codes, o["codes"], o["unit"], o["boundaries"], what)
    assert_stored_equal(parts["norms"], o["norms"], f"{what} norms")
    # Where the codes agree the stored bytes are the oracle's packing of the oracle's codes.
    np.testing.assert_array_equal(parts["codes"][same], oracle.pack_bits(o["codes"], bits)[same])
    return o, codes, same


def check_mse_qjl_parts(parts, x, bits, rot, qjl, what):
    d = x.shape[-1]
    dp = padded(d)
    o = oracle_mse_qjl(x, bits, rot, qjl)
    codes = oracle.unpack_bits(parts["codes"], bits - 1, dp)
    same_codes = assert_codes_close(codes, o["codes"], o["unit"], o["boundaries"], what)
    assert_stored_equal(parts["norms"], o["norms"], f"{what} norms")
    signs = oracle.unpack_bits(parts["qjl_signs"], 1, dp)
    # Sign bits are only comparable on rows whose MSE codes (hence residuals) agree.
    sdiff = (signs != o["signs"]) & same_codes[..., None]
    assert np.mean(sdiff) <= MAX_CODE_MISMATCH_FRAC, f"{what}: {np.mean(sdiff):.3%} QJL signs differ"
    if sdiff.any():
        s = oracle.qjl_matrix(qjl, dp, dp).astype(np.float64)
        t = o["residual"].astype(np.float64) @ s.T
        tol = BOUNDARY_TOL * np.linalg.norm(s, axis=1) * row_norms(o["residual"])[..., None]
        assert np.all(np.abs(t)[sdiff] <= tol[sdiff]), f"{what}: QJL signs differ where |S r| is not tiny"
    rn = parts["qjl_norms"]
    assert rn.dtype == o["rnorms"].dtype
    np.testing.assert_allclose(f32(rn)[same_codes], f32(o["rnorms"])[same_codes], rtol=FLOAT16_ULP_RTOL)
    same = same_codes & ~(signs != o["signs"]).any(axis=-1)
    return o, codes, signs, same


# --------------------------------------------------------------------------------------------
# Derived seeds
# --------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**64 - 1), tag=st.integers(1, 5))
def test_derive_seed_is_philox_at_the_documented_counter(seed, tag):
    assert derive_seed(seed, tag) == oracle_derive_seed(seed, tag)


def test_derived_seeds_are_distinct_per_tag():
    assert len({derive_seed(SEED, t) for t in range(1, 6)}) == 5


# --------------------------------------------------------------------------------------------
# Keys: decode against the oracle composition
# --------------------------------------------------------------------------------------------


KEY_CASES = [(s, d, b) for s in ("kv", "kqv", "qkqv", "kivi") for d in (64, 96, 128) for b in (1, 2, 4) if not (s == "qkqv" and b == 1)]


@pytest.mark.parametrize("scheme,d,bits", KEY_CASES)
def test_keys_decode_matches_oracle_composition(scheme, d, bits):
    k = gaussian(d * 10 + bits, (*LEAD, TOKENS, d), scale=2.0)
    codec = KVCodec(scheme, bits, d, seed=SEED, value_bits=max(bits, 2))
    ck = codec.encode_keys(k)
    got = codec.decode_keys(ck)
    assert got.shape == k.shape and got.dtype == np.float32
    assert ck.scheme == scheme and ck.kind == "keys" and tuple(ck.shape) == k.shape
    rot, qjl = oracle_derive_seed(SEED, KEY_ROTATION), oracle_derive_seed(SEED, KEY_QJL)
    if scheme in ("kv", "kqv"):
        seed = None if scheme == "kv" else rot
        o, codes, same = check_mse_parts(ck.parts, k, bits, seed, scheme)
        assert_rows_close(got, o["decode"], f32(o["norms"]), same, scheme)
        # The decode of the codec's own parts, by the oracle, on every row.
        own = oracle.mse_decode(codes, ck.parts["norms"], bits, d, seed)
        assert_rows_close(got, own, f32(o["norms"]), np.ones(same.shape, bool), f"{scheme} own codes")
    elif scheme == "qkqv":
        o, codes, signs, same = check_mse_qjl_parts(ck.parts, k, bits, rot, qjl, scheme)
        assert_rows_close(got, o["decode"], f32(o["norms"]), same, scheme)
        cent = oracle.lloyd_max_codebook(padded(d), bits - 1)[0]
        own_rot = oracle.lloyd_max_decode(codes, cent) * f32(ck.parts["norms"])[..., None]
        own = oracle.inverse_hadamard(own_rot + oracle.qjl_vector_estimate(signs, ck.parts["qjl_norms"], qjl, padded(d)), rot, d)
        assert_rows_close(got, own, f32(o["norms"]), np.ones(same.shape, bool), "qkqv own codes")
    else:
        o = oracle_kivi(k, bits, 32, per_channel=True)
        assert_stored_equal(ck.parts["scales"], o["scales"], "kivi scales")
        assert_stored_equal(ck.parts["zeros"], o["zeros"], "kivi zeros")
        codes = oracle.unpack_bits(ck.parts["codes"], bits, TOKENS)
        same_el = np.swapaxes(assert_uniform_codes_close(codes, o["codes"], "kivi"), -1, -2)
        # KIVI codes are per element: compare element-wise (a differing code moves one element one step).
        err = np.abs(got.astype(np.float64) - o["decode"])
        assert np.all(err[same_el] <= DECODE_RTOL * float(np.abs(k).max()))
        own = np.swapaxes(oracle.uniform_decode(codes, ck.parts["scales"], ck.parts["zeros"], bits, 32), -1, -2)
        np.testing.assert_allclose(got, own, rtol=0, atol=DECODE_RTOL * float(np.abs(k).max()))


# --------------------------------------------------------------------------------------------
# Values: decode against the oracle composition
# --------------------------------------------------------------------------------------------

VALUE_CASES = [(s, d, b) for s in ("kv", "kqv", "qkqv", "kivi", "a2") for d in (64, 96, 128) for b in (2, 3)]


def a2_weights(seed, lead, tokens):
    """Skewed importances ``sum_q p_qj^2`` of a few peaked attention rows."""
    rng = np.random.default_rng(seed)
    logits = 3.0 * rng.standard_normal((*lead, 4, tokens))
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p**2).sum(-2)


def oracle_unit_distortions(dp):
    return np.array([oracle.lloyd_max_codebook(dp, b)[2] for b in range(1, 9)])


def greedy_allocation(w, sq, bits, dp):
    """Independent allocation: a priority queue of marginal gains ``w ||v||^2 (D_b - D_{b+1})``
    (optimal for a separable convex objective)."""
    dist = oracle_unit_distortions(dp)
    t = len(w)
    widths = np.ones(t, int)
    heap = [(-(w[j] * sq[j]) * (dist[0] - dist[1]), j) for j in range(t)]
    heapq.heapify(heap)
    for _ in range((bits - 1) * t):
        _, j = heapq.heappop(heap)
        widths[j] += 1
        if widths[j] < 8:
            b = widths[j]
            heapq.heappush(heap, (-(w[j] * sq[j]) * (dist[b - 1] - dist[b]), j))
    return widths


def allocation_objective(widths, w, sq, dp):
    dist = oracle_unit_distortions(dp)
    return float(np.sum(np.asarray(w) * np.asarray(sq) * dist[np.asarray(widths, int) - 1]))


@pytest.mark.parametrize("scheme,d,bits", VALUE_CASES)
def test_values_decode_matches_oracle_composition(scheme, d, bits):
    v = gaussian(d * 7 + bits, (*LEAD, TOKENS, d), scale=1.5)
    codec = KVCodec("kv", 2, d, seed=SEED, value_scheme=scheme, value_bits=bits)
    weights = a2_weights(d + bits, LEAD, TOKENS) if scheme == "a2" else None
    cv = codec.encode_values(v, weights)
    got = codec.decode_values(cv)
    assert got.shape == v.shape and got.dtype == np.float32
    assert cv.scheme == scheme and cv.kind == "values"
    rot, qjl = oracle_derive_seed(SEED, VALUE_ROTATION), oracle_derive_seed(SEED, VALUE_QJL)
    if scheme == "kv":
        o, _, same = check_mse_parts(cv.parts, v, bits, None, scheme)
        assert_rows_close(got, o["decode"], f32(o["norms"]), same, scheme)
    elif scheme in ("kqv", "qkqv"):
        o, _, _, same = check_mse_qjl_parts(cv.parts, v, bits, rot, qjl, scheme)
        assert_rows_close(got, o["decode"], f32(o["norms"]), same, scheme)
    elif scheme == "kivi":
        o = oracle_kivi(v, bits, 32, per_channel=False)
        assert_stored_equal(cv.parts["scales"], o["scales"], "kivi scales")
        assert_stored_equal(cv.parts["zeros"], o["zeros"], "kivi zeros")
        codes = oracle.unpack_bits(cv.parts["codes"], bits, d)
        same_el = assert_uniform_codes_close(codes, o["codes"], "kivi values")
        err = np.abs(got.astype(np.float64) - o["decode"])
        assert np.all(err[same_el] <= DECODE_RTOL * float(np.abs(v).max()))
    else:  # a2
        n_tok = math.prod(v.shape[:-1])
        widths = (oracle.unpack_bits(cv.parts["widths"], 3, n_tok) + 1).reshape(v.shape[:-1])
        np.testing.assert_array_equal(widths, codec.values.widths(cv))
        sq = np.sum(v.astype(np.float64) ** 2, -1)
        # The stored allocation is optimal: its objective equals an independent greedy's.
        for i in np.ndindex(*LEAD):
            ref = greedy_allocation(weights[i], sq[i], bits, padded(d))
            assert widths[i].mean() == bits
            np.testing.assert_allclose(
                allocation_objective(widths[i], weights[i], sq[i], padded(d)),
                allocation_objective(ref, weights[i], sq[i], padded(d)),
                rtol=1e-6,
            )
        want = np.zeros(v.shape)
        same = np.ones(v.shape[:-1], bool)
        for b in np.unique(widths):
            sel = widths == b
            parts = {"codes": cv.parts[f"codes_{b}"], "norms": cv.parts[f"norms_{b}"]}
            o, _, same_b = check_mse_parts(parts, v[sel], int(b), rot, f"a2 width {b}")
            want[sel] = o["decode"]
            same[sel] = same_b
        assert_rows_close(got, want, row_norms(v), same, "a2")


# --------------------------------------------------------------------------------------------
# HeadQ against the oracle composition
# --------------------------------------------------------------------------------------------


def lowrank_queries(seed, n, d, rank=4, noise=0.1, lead=()):
    """Queries in a rank-``rank`` subspace (plus small noise), ||q||^2 ~ d: post-RoPE queries
    concentrate in a few directions, which is what HeadQ's calibrated basis exploits."""
    rng = np.random.default_rng(seed)
    w, _ = np.linalg.qr(rng.standard_normal((d, rank)))
    z = rng.standard_normal((*lead, n, rank)) * math.sqrt(d / rank)
    return (z @ w.T + noise * rng.standard_normal((*lead, n, d))).astype(np.float32)


def oracle_base_decode(base, k, bits, seed):
    if base == "kivi":
        return oracle_kivi(k, bits, 32, per_channel=True)["decode"]
    return oracle_mse(k, bits, oracle_derive_seed(seed, KEY_ROTATION) if base == "kqv" else None)["decode"]


def oracle_base_decode_parts(base, parts, bits, d, tokens, seed):
    if base == "kivi":
        codes = oracle.unpack_bits(parts["base_codes"], bits, tokens)
        return np.swapaxes(oracle.uniform_decode(codes, parts["base_scales"], parts["base_zeros"], bits, 32), -1, -2)
    s = oracle_derive_seed(seed, KEY_ROTATION) if base == "kqv" else None
    codes = oracle.unpack_bits(parts["base_codes"], bits, d if s is None else padded(d))
    return oracle.mse_decode(codes, parts["base_norms"], bits, d, s)


@pytest.mark.parametrize("base", ["kivi", "kqv"])
@pytest.mark.parametrize("basis_kind", ["calibrated", "random"])
@pytest.mark.parametrize("sign", [1, -1])
def test_headq_decode_matches_oracle_composition(base, basis_kind, sign):
    d, bits, rank, side_bits, heads = 64, 2, 4, 4, 2
    k = gaussian(5, (1, heads, TOKENS, d))
    if basis_kind == "calibrated":
        codec = KVCodec("headq", bits, d, seed=SEED, headq_base=base, rank=rank, side_bits=side_bits, sign=sign)
        calib = lowrank_queries(9, 256, d, lead=(heads,))
        basis = codec.calibrate(calib)
        assert basis.shape == (heads, d, rank)
        want_basis = np.stack([oracle.headq_basis(calib[h], rank) for h in range(heads)])
        np.testing.assert_allclose(basis, want_basis, atol=BASIS_ATOL)
        bases = [want_basis[h] for h in range(heads)]
    else:
        codec = KVCodec("headq", bits, d, seed=SEED, headq_base=base, rank=rank, side_bits=side_bits, sign=sign, basis="random")
        want_basis = oracle.random_orthonormal_basis(oracle_derive_seed(SEED, RANDOM_BASIS), d, rank)
        np.testing.assert_allclose(codec.keys.basis, want_basis, atol=BASIS_ATOL)
        bases = [want_basis] * heads
    ck = codec.encode_keys(k)
    got = codec.decode_keys(ck)
    k_base = oracle_base_decode(base, k, bits, SEED)
    e = (k.astype(np.float64) - f32(k_base)).astype(np.float32)
    side_codes = oracle.unpack_bits(ck.parts["side_codes"], side_bits, rank)
    side_scales = ck.parts["side_scales"]
    want = np.zeros(k.shape)
    own = np.zeros(k.shape)
    own_base = oracle_base_decode_parts(base, ck.parts, bits, d, TOKENS, SEED)
    same = np.ones(k.shape[:-1], bool)
    for h in range(heads):
        codes_o, scales_o = oracle.headq_encode(e[0, h], bases[h], side_bits)
        assert side_scales.dtype == scales_o.dtype
        np.testing.assert_allclose(f32(side_scales[0, h]), f32(scales_o), rtol=FLOAT16_ULP_RTOL)
        diff = side_codes[0, h] != codes_o
        assert np.mean(diff) <= SIDE_CODE_MISMATCH_FRAC, f"{np.mean(diff):.3%} side codes differ"
        assert np.all(np.abs(side_codes[0, h].astype(int) - codes_o)[diff] == 1)
        same[0, h] = ~diff.any(-1) & (f32(side_scales[0, h]) == f32(scales_o))
        want[0, h] = k_base[0, h] + sign * oracle.headq_decode(codes_o, scales_o, bases[h], side_bits)
        own[0, h] = own_base[0, h] + sign * oracle.headq_decode(side_codes[0, h], side_scales[0, h], bases[h], side_bits)
    scale = np.abs(k).max() * np.ones(k.shape[:-1])
    assert_rows_close(got, own, scale, np.ones(same.shape, bool), "headq own parts")
    # Independent composition: the base codes may differ at a boundary (one element, one step),
    # which also moves the residual; compare rows whose side codes agree.
    base_same = np.abs(own_base - k_base).max(-1) <= DECODE_RTOL * scale
    assert_rows_close(got, want, scale, same & base_same, "headq")


def test_headq_score_correction_uses_the_sign():
    d = 64
    k = gaussian(1, (TOKENS, d))
    q = gaussian(2, (6, d))
    calib = lowrank_queries(3, 128, d)
    plus = KVCodec("headq", 2, d, seed=SEED)
    minus = KVCodec("headq", 2, d, seed=SEED, sign=-1)
    plus.calibrate(calib), minus.calibrate(calib)
    ckp, ckm = plus.encode_keys(k), minus.encode_keys(k)
    base = KVCodec("kivi", 2, d, seed=SEED)
    sb = base.scores(q, base.encode_keys(k)).astype(np.float64)
    sp, sm = plus.scores(q, ckp).astype(np.float64), minus.scores(q, ckm).astype(np.float64)
    # base + c and base - c: symmetric around the base scores.
    np.testing.assert_allclose(sp - sb, -(sm - sb), atol=SCORE_RTOL * np.abs(sb).max())
    assert np.abs(sp - sb).max() > 1e-3


# --------------------------------------------------------------------------------------------
# Bits per element: stored bytes and the hand-computed formula
# --------------------------------------------------------------------------------------------


def stored_bpe(enc: Encoded) -> float:
    total = sum(np.asarray(p).size * np.asarray(p).dtype.itemsize for p in enc.parts.values())
    return 8.0 * total / math.prod(enc.shape)


def ceil_div(a, b):
    return -(-a // b)


def key_bpe_formula(scheme, n, d, t, base="kivi", rank=4, side_bits=4):
    dp = padded(d)
    if scheme == "kv":
        return n + 16 / d
    if scheme == "kqv":
        return n * dp / d + 16 / d
    if scheme == "qkqv":
        return (n - 1) * dp / d + dp / d + 32 / d
    if scheme == "kivi":
        return 8 * ceil_div(t * n, 8) / t + 32 * ceil_div(t, 32) / t
    assert scheme == "headq"
    return key_bpe_formula(base, n, d, t) + 8 * ceil_div(rank * side_bits, 8) / d + 16 / d


def value_bpe_formula(scheme, n, d, n_tokens):
    dp = padded(d)
    if scheme == "kv":
        return n + 16 / d
    if scheme in ("kqv", "qkqv"):
        return (n - 1) * dp / d + dp / d + 32 / d
    if scheme == "kivi":
        return 8 * ceil_div(d * n, 8) / d + 32 * ceil_div(d, 32) / d
    assert scheme == "a2"
    return n * dp / d + 16 / d + 8 * ceil_div(3 * n_tokens, 8) / (n_tokens * d)


def test_bpe_formula_examples():
    """The formulas themselves, on numbers worked by hand."""
    assert key_bpe_formula("kv", 4, 128, 40) == 4.125
    assert key_bpe_formula("kqv", 3, 96, 40) == 3 * 128 / 96 + 16 / 96 == 4 + 1 / 6
    assert key_bpe_formula("qkqv", 3, 128, 40) == 3 + 0.25
    assert key_bpe_formula("kivi", 2, 64, 64) == 2 + 1.0
    assert key_bpe_formula("headq", 2, 64, 64) == 3.0 + 0.25 + 0.25


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("t", [37, 40, 64])
@pytest.mark.parametrize("scheme", ["kv", "kqv", "qkqv", "kivi", "headq"])
@pytest.mark.parametrize("n", [2, 3])
def test_key_bits_per_element(scheme, n, d, t):
    k = away_from_zero(gaussian(d + t, (*LEAD, t, d)))
    kw = {"basis": "random", "rank": 3, "side_bits": 3} if scheme == "headq" else {}
    codec = KVCodec(scheme, n, d, seed=SEED, **kw)
    ck = codec.encode_keys(k)
    want = key_bpe_formula(scheme, n, d, t, rank=3, side_bits=3)
    assert ck.bits_per_element == pytest.approx(stored_bpe(ck), abs=BPE_ATOL)
    assert ck.bits_per_element == pytest.approx(want, abs=BPE_ATOL), ck.breakdown()
    assert sum(ck.breakdown().values()) == pytest.approx(ck.bits_per_element, abs=BPE_ATOL)
    assert set(ck.breakdown()) == set(ck.parts)


@pytest.mark.parametrize("base", ["kivi", "kqv", "kv"])
def test_headq_bits_per_element_on_each_base(base):
    d, t, n = 96, 40, 2
    k = away_from_zero(gaussian(3, (*LEAD, t, d)))
    codec = KVCodec("headq", n, d, seed=SEED, headq_base=base, basis="random")
    ck = codec.encode_keys(k)
    want = key_bpe_formula(base, n, d, t) + 8 * ceil_div(4 * 4, 8) / d + 16 / d
    assert ck.bits_per_element == pytest.approx(want, abs=BPE_ATOL)
    assert ck.bits_per_element == pytest.approx(stored_bpe(ck), abs=BPE_ATOL)


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("scheme", ["kv", "kqv", "qkqv", "kivi", "a2"])
@pytest.mark.parametrize("n", [2, 3])
def test_value_bits_per_element(scheme, n, d):
    t = 37
    v = away_from_zero(gaussian(d + n, (*LEAD, t, d)))
    codec = KVCodec("kv", 2, d, seed=SEED, value_scheme=scheme, value_bits=n)
    weights = a2_weights(1, LEAD, t) if scheme == "a2" else None
    cv = codec.encode_values(v, weights)
    want = value_bpe_formula(scheme, n, d, math.prod((*LEAD, t)))
    assert cv.bits_per_element == pytest.approx(stored_bpe(cv), abs=BPE_ATOL)
    assert cv.bits_per_element == pytest.approx(want, abs=BPE_ATOL), cv.breakdown()
    assert sum(cv.breakdown().values()) == pytest.approx(cv.bits_per_element, abs=BPE_ATOL)


def test_a2_uniform_and_weighted_allocations_cost_the_same():
    d, t = 64, 48
    v = gaussian(4, (t, d))
    codec = KVCodec("kv", 2, d, seed=SEED, value_scheme="a2", value_bits=3)
    w = a2_weights(2, (), t)
    assert codec.encode_values(v, w).bits_per_element == pytest.approx(codec.encode_values(v).bits_per_element, abs=BPE_ATOL)


def test_wide_norms_are_stored_and_counted_as_32_bits():
    """docs/kernels.md section 5: stored scalars outside float16's range are float32 and cost 32 bits."""
    d, n = 64, 3
    k = gaussian(6, (TOKENS, d), scale=1e5)  # norms ~ 8e5 > 65504
    ck = KVCodec("kv", n, d, seed=SEED).encode_keys(k)
    assert ck.parts["norms"].dtype == np.float32
    assert ck.bits_per_element == pytest.approx(n + 32 / d, abs=BPE_ATOL)
    ckk = KVCodec("kivi", n, d, seed=SEED).encode_keys(k)
    assert ckk.parts["zeros"].dtype == np.float32
    assert ckk.bits_per_element == pytest.approx(stored_bpe(ckk), abs=BPE_ATOL)
    assert np.all(np.isfinite(KVCodec("kv", n, d, seed=SEED).decode_keys(ck)))


def test_one_tiny_kivi_zero_point_widens_every_zero_point():
    """The float16 rule is tensor-wide (kernels.md 5 step 5, 9): a single group minimum below
    2^-14 stores all zero points as float32, and the bits per element count it."""
    d, t, n = 64, 64, 2
    k = away_from_zero(gaussian(7, (t, d)))
    k[:, 5] = np.abs(k[:, 5])
    k[3, 5] = 1e-6  # the minimum of channel 5's first group
    ck = KVCodec("kivi", n, d).encode_keys(k)
    assert ck.parts["zeros"].dtype == np.float32 and ck.parts["scales"].dtype == np.float16
    assert ck.bits_per_element == pytest.approx(n + (16 + 32) * 2 / t, abs=BPE_ATOL)


# --------------------------------------------------------------------------------------------
# Score paths
# --------------------------------------------------------------------------------------------

SCORE_SCHEMES = [
    ("kv", {}),
    ("kqv", {}),
    ("qkqv", {}),
    ("kivi", {}),
    ("headq", {"headq_base": "kivi"}),
    ("headq", {"headq_base": "kqv"}),
    ("headq", {"headq_base": "kivi", "sign": -1}),
]


def make_codec(scheme, bits, d, kw, kv_heads=None, seed=SEED):
    codec = KVCodec(scheme, bits, d, seed=seed, **kw)
    if scheme == "headq":
        lead = (kv_heads,) if kv_heads else ()
        codec.calibrate(lowrank_queries(seed % 1000 + 17, 64, d, lead=lead))
    return codec


def expected_scores(q, k_hat, g=1):
    """q . k_hat / sqrt(d) in float64, query head h reading KV head h // g (axis -3)."""
    k = np.repeat(np.asarray(k_hat, np.float64), g, axis=-3) if g > 1 else np.asarray(k_hat, np.float64)
    q = np.asarray(q, np.float64)
    want = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    scale = row_norms(q)[..., :, None] * row_norms(k)[..., None, :] / math.sqrt(q.shape[-1])
    return want, scale


@pytest.mark.parametrize("scheme,kw", SCORE_SCHEMES)
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("bits", [2, 3])
def test_scores_equal_decoded_keys(scheme, kw, d, bits):
    k = gaussian(bits * d, (*LEAD, TOKENS, d))
    q = gaussian(bits * d + 1, (*LEAD, 5, d))
    codec = make_codec(scheme, bits, d, kw, kv_heads=LEAD[-1])
    ck = codec.encode_keys(k)
    s = codec.scores(q, ck)
    assert s.shape == (*LEAD, 5, TOKENS) and s.dtype == np.float32
    want, scale = expected_scores(q, codec.decode_keys(ck))
    assert np.all(np.abs(s - want) <= SCORE_RTOL * scale), np.max(np.abs(s - want) / scale)


@pytest.mark.parametrize("scheme,kw", SCORE_SCHEMES)
def test_gqa_scores(scheme, kw):
    d, g, kv_heads, nq = 64, 3, 2, 4
    k = gaussian(31, (2, kv_heads, TOKENS, d))
    q = gaussian(32, (2, g * kv_heads, nq, d))
    codec = make_codec(scheme, 2, d, kw, kv_heads=kv_heads)
    ck = codec.encode_keys(k)
    s = codec.scores(q, ck)
    assert s.shape == (2, g * kv_heads, nq, TOKENS)
    k_hat = codec.decode_keys(ck)
    want, scale = expected_scores(q, k_hat, g)
    assert np.all(np.abs(s - want) <= SCORE_RTOL * scale)
    # Query head h reads KV head h // g: per-head scores of the group equal the grouped call.
    for h in range(g * kv_heads):
        one_codec, one_ck = _head_slice(codec, k, h // g)
        one = one_codec.scores(q[:, h // g * g : h // g * g + g], one_ck)
        np.testing.assert_allclose(s[:, h], one[:, h % g], rtol=0, atol=SCORE_RTOL * scale[:, h].max())


def _head_slice(codec, k, kv_head):
    """(codec, encoded) for one KV head alone with the same settings (its own basis selected)."""
    if codec.scheme == "headq" and codec.keys.basis.ndim == 3:
        codec = KVCodec(
            "headq",
            codec.bits,
            codec.head_dim,
            seed=codec.seed,
            headq_base=codec.headq_base,
            rank=codec.rank,
            side_bits=codec.side_bits,
            sign=codec.sign,
            basis=codec.keys.basis[kv_head],
        )
    return codec, codec.encode_keys(k[:, kv_head : kv_head + 1])


def test_gqa_attention_output_shapes_and_values():
    d, g, kv_heads = 64, 2, 2
    k = gaussian(41, (1, kv_heads, TOKENS, d))
    v = gaussian(42, (1, kv_heads, TOKENS, d))
    q = gaussian(43, (1, g * kv_heads, 3, d))
    codec = KVCodec("kqv", 3, d, seed=SEED)
    ck, cv = codec.encode_keys(k), codec.encode_values(v)
    out, p = codec.attention(q, ck, cv)
    assert out.shape == (1, g * kv_heads, 3, d) and p.shape == (1, g * kv_heads, 3, TOKENS)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-12)
    s = codec.scores(q, ck).astype(np.float64)
    want_p = np.exp(s - s.max(-1, keepdims=True))
    want_p /= want_p.sum(-1, keepdims=True)
    want = want_p @ np.repeat(codec.decode_values(cv).astype(np.float64), g, axis=-3)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@given(
    scheme=st.sampled_from(["kv", "kqv", "qkqv", "kivi"]),
    bits=st.integers(2, 5),
    d=st.sampled_from([16, 48, 64]),
    t=st.integers(1, 70),
    nq=st.integers(1, 4),
    seed=st.integers(0, 2**64 - 1),
)
def test_scores_equal_decoded_keys_property(scheme, bits, d, t, nq, seed):
    k = gaussian(t, (2, t, d))
    q = gaussian(t + 1, (2, nq, d))
    codec = KVCodec(scheme, bits, d, seed=seed)
    ck = codec.encode_keys(k)
    want, scale = expected_scores(q, codec.decode_keys(ck))
    s = codec.scores(q, ck)
    assert s.shape == (2, nq, t)
    assert np.all(np.abs(s - want) <= SCORE_RTOL * scale + 1e-30)


# --------------------------------------------------------------------------------------------
# HeadQ controls and benefit
# --------------------------------------------------------------------------------------------

# Seeds averaged over in the statistical HeadQ comparisons (deterministic data).
HEADQ_TRIALS = 6


def score_mse(codec, q, k):
    ck = codec.encode_keys(k)
    s = codec.scores(q, ck).astype(np.float64)
    ref = q.astype(np.float64) @ k.astype(np.float64).T / math.sqrt(k.shape[-1])
    return float(np.mean((s - ref) ** 2))


def headq_trial(seed, d=64, tokens=128, **kw):
    k = gaussian(100 + seed, (tokens, d))
    calib = lowrank_queries(200 + seed, 256, d)
    q = lowrank_queries(200 + seed, 512, d)[256:]  # same subspace, held-out queries
    codec = KVCodec("headq", 2, d, seed=seed, **kw)
    if kw.get("basis") is None:
        codec.calibrate(calib)
    return codec, q, k


def test_headq_wrong_sign_is_worse():
    plus = [score_mse(*headq_trial(s)) for s in range(HEADQ_TRIALS)]
    minus = [score_mse(*headq_trial(s, sign=-1)) for s in range(HEADQ_TRIALS)]
    assert np.mean(minus) > 1.5 * np.mean(plus), (np.mean(minus), np.mean(plus))
    assert sum(m > p for m, p in zip(minus, plus)) >= HEADQ_TRIALS - 1


def test_headq_calibrated_basis_beats_random_basis():
    cal = [score_mse(*headq_trial(s)) for s in range(HEADQ_TRIALS)]
    rnd = [score_mse(*headq_trial(s, basis="random")) for s in range(HEADQ_TRIALS)]
    assert np.mean(cal) < 0.5 * np.mean(rnd), (np.mean(cal), np.mean(rnd))


def test_headq_reduces_attention_kl_against_plain_kivi():
    from kvqrs.metrics import kl_divergence

    kl_h, kl_k = [], []
    for s in range(HEADQ_TRIALS):
        codec, q, k = headq_trial(s)
        kivi = KVCodec("kivi", 2, k.shape[-1], seed=s)
        ref = q.astype(np.float64) @ k.astype(np.float64).T / math.sqrt(k.shape[-1])
        kl_h.append(kl_divergence(ref, codec.scores(q, codec.encode_keys(k))).mean())
        kl_k.append(kl_divergence(ref, kivi.scores(q, kivi.encode_keys(k))).mean())
    assert np.mean(kl_h) < 0.7 * np.mean(kl_k), (np.mean(kl_h), np.mean(kl_k))


# --------------------------------------------------------------------------------------------
# A^2 allocation
# --------------------------------------------------------------------------------------------


@given(
    w=hnp.arrays(np.float64, st.tuples(st.integers(1, 3), st.integers(1, 40)), elements=st.floats(0, 1e3)),
    bits=st.integers(1, 8),
    d=st.sampled_from([64, 96, 128]),
)
def test_allocate_bits_budget_and_range(w, bits, d):
    sq = np.ones_like(w)
    widths = allocate_bits(w, sq, bits, d)
    assert widths.dtype == np.uint8 and widths.shape == w.shape
    assert np.all((widths >= 1) & (widths <= 8))
    np.testing.assert_array_equal(widths.astype(int).sum(-1), bits * w.shape[-1])  # mean exactly bits
    # Heavier-weighted tokens (equal norms) never get fewer bits. (Weights within float
    # round-off of each other may tie in w * gain and are then ordered by token index.)
    for row, wr in zip(widths.astype(int), w):
        heavier = wr[:, None] > wr[None, :] * (1 + 1e-9)
        assert np.all((row[:, None] >= row[None, :])[heavier])


def test_allocate_bits_is_optimal_against_exhaustive_search():
    d = 64
    dist = oracle_unit_distortions(d)
    rng = np.random.default_rng(0)
    for trial in range(6):
        t, bits = 4, 1 + trial % 4
        w = rng.exponential(size=t) ** 2
        sq = rng.uniform(0.5, 2.0, size=t)
        best = min(float(np.sum(w * sq * dist[np.array(c) - 1])) for c in itertools.product(range(1, 9), repeat=t) if sum(c) == bits * t)
        got = allocate_bits(w, sq, bits, d)
        assert allocation_objective(got, w, sq, d) == pytest.approx(best, rel=1e-6)


def test_allocate_bits_gives_more_bits_to_heavier_tokens():
    w = np.array([1e-4, 1e-2, 1.0, 100.0])
    widths = allocate_bits(w, np.ones(4), 3, 64)
    assert list(widths) == sorted(widths) and widths[-1] > widths[0]
    np.testing.assert_array_equal(allocate_bits(np.ones(4), np.ones(4), 3, 64), [3, 3, 3, 3])


def test_a2_weights_none_is_uniform_allocation():
    d = 64
    v = gaussian(8, (*LEAD, TOKENS, d))
    codec = KVCodec("kv", 2, d, seed=SEED, value_scheme="a2", value_bits=3)
    cv = codec.encode_values(v)
    assert np.all(codec.values.widths(cv) == 3)
    # ... and equals the rotated 3-bit MSE stage of the value rotation seed.
    o = oracle_mse(v, 3, oracle_derive_seed(SEED, VALUE_ROTATION))
    codes = oracle.unpack_bits(cv.parts["codes_3"], 3, d).reshape(o["codes"].shape)
    same = ~(codes != o["codes"]).any(-1)
    assert_rows_close(codec.decode_values(cv), o["decode"], f32(o["norms"]), same, "a2 uniform")


def test_a2_lowers_attention_squared_distortion_at_the_same_budget():
    from kvqrs.metrics import a2_distortion

    d, t = 64, 256
    ratios = []
    for s in range(4):
        rng = np.random.default_rng(s)
        k = rng.standard_normal((t, d))
        v = gaussian(50 + s, (t, d))
        q = 6.0 * k[rng.choice(t, 8)] / math.sqrt(d) + rng.standard_normal((8, d))  # focused queries
        logits = q @ k.T / math.sqrt(d)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        w = (p**2).sum(0)
        codec = KVCodec("kv", 2, d, seed=s, value_scheme="a2", value_bits=2)
        cw, cu = codec.encode_values(v, w), codec.encode_values(v)
        assert cw.bits_per_element == cu.bits_per_element
        dw = a2_distortion(p, v, codec.decode_values(cw)).sum()
        du = a2_distortion(p, v, codec.decode_values(cu)).sum()
        ratios.append(dw / du)
    assert max(ratios) < 0.5, ratios  # measured ~0.01: peaked attention, skewed weights


# --------------------------------------------------------------------------------------------
# More bits, lower error; breakdown
# --------------------------------------------------------------------------------------------


def relative_error(x, x_hat):
    x = np.asarray(x, np.float64)
    return float(np.sum((x - x_hat) ** 2) / np.sum(x**2))


@pytest.mark.parametrize("scheme", KEY_SCHEMES)
def test_more_key_bits_lower_error(scheme):
    d = 64
    k = gaussian(60, (256, d))
    errs = []
    side = REGISTRY[scheme].keys
    for n in range(side.min_bits, min(side.max_bits, 5) + 1):
        codec = scheme_codec(scheme, n, d, SEED, value_scheme="kv")
        errs.append(relative_error(k, codec.decode_keys(codec.encode_keys(k))))
    assert all(b < a for a, b in zip(errs, errs[1:])), errs


@pytest.mark.parametrize("scheme", [n for n in VALUE_SCHEMES if REGISTRY[n].values.coded])
def test_more_value_bits_lower_error(scheme):
    d = 64
    v = gaussian(61, (256, d))
    errs = []
    side = REGISTRY[scheme].values
    for n in range(side.min_bits, min(side.max_bits, 5) + 1):
        kw = REGISTRY[scheme].control_kwargs(d, n, SEED)
        codec = KVCodec("kv", 2, d, seed=SEED, value_scheme=scheme, value_bits=n, **kw)
        w = a2_weights(3, (), 256) if scheme == "a2" else None
        errs.append(relative_error(v, codec.decode_values(codec.encode_values(v, w))))
    assert all(b < a for a, b in zip(errs, errs[1:])), errs


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_unknown_scheme_raises():
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        KVCodec("turbo", 2, 64)
    with pytest.raises(kvqrs.KvqrsError, match="value_scheme"):
        KVCodec("kv", 2, 64, value_scheme="turbo")
    with pytest.raises(kvqrs.KvqrsError, match="value_scheme"):
        KVCodec("kv", 2, 64, value_scheme="headq")  # headq is a key scheme only
    with pytest.raises(kvqrs.KvqrsError, match="headq_base"):
        KVCodec("headq", 2, 64, headq_base="qkqv")


@pytest.mark.parametrize("scheme", ["kqv", "qkqv"])
def test_qjl_schemes_need_two_bits(scheme):
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        KVCodec(scheme, 1, 64)
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        KVCodec("kv", 2, 64, value_scheme=scheme, value_bits=1)


@pytest.mark.parametrize("kw", [{"bits": 0}, {"bits": 9}, {"head_dim": 1}, {"seed": -1}, {"seed": 2**64}, {"group": 0}])
def test_bad_codec_parameters_raise(kw):
    args = {"scheme": "kv", "bits": 2, "head_dim": 64, "seed": 0, **kw}
    with pytest.raises(kvqrs.KvqrsError):
        KVCodec(args.pop("scheme"), args.pop("bits"), args.pop("head_dim"), **args)


def test_headq_without_basis_raises():
    codec = KVCodec("headq", 2, 64)
    k = gaussian(0, (TOKENS, 64))
    with pytest.raises(kvqrs.KvqrsError, match="basis"):
        codec.encode_keys(k)
    with pytest.raises(kvqrs.KvqrsError, match="basis"):
        codec.scores(gaussian(1, (2, 64)), Encoded("headq", "keys", k.shape, k.dtype, {}))
    with pytest.raises(kvqrs.KvqrsError, match="sign"):
        KVCodec("headq", 2, 64, sign=0, basis="random")
    with pytest.raises(kvqrs.KvqrsError, match="basis"):
        KVCodec("headq", 2, 64, basis=np.zeros((32, 4)))
    with pytest.raises(kvqrs.KvqrsError, match="calibrate"):
        KVCodec("kv", 2, 64).calibrate(gaussian(2, (8, 64)))


def test_per_head_basis_needs_matching_heads():
    codec = KVCodec("headq", 2, 64, basis=np.stack([oracle.random_orthonormal_basis(i, 64, 4) for i in range(3)]))
    with pytest.raises(kvqrs.KvqrsError, match="kv_heads"):
        codec.encode_keys(gaussian(0, (1, 2, TOKENS, 64)))


def test_decoding_another_schemes_encoded_raises():
    d = 64
    k = gaussian(0, (TOKENS, d))
    kv, kqv, qkqv = (KVCodec(s, 2, d, seed=SEED) for s in ("kv", "kqv", "qkqv"))
    kivi = KVCodec("kivi", 2, d, seed=SEED)
    headq = KVCodec("headq", 2, d, seed=SEED, basis="random")
    a2 = KVCodec("kv", 2, d, seed=SEED, value_scheme="a2")
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        kv.decode_keys(kqv.encode_keys(k))
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        qkqv.decode_keys(kqv.encode_keys(k))
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        qkqv.decode_values(kqv.encode_values(k))  # same coder class, other scheme label
    with pytest.raises(kvqrs.KvqrsError, match="values"):
        kv.decode_values(kv.encode_keys(k))  # keys decoded as values
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        headq.decode_keys(kivi.encode_keys(k))
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        kivi.decode_keys(headq.encode_keys(k))
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        a2.decode_values(kv.encode_values(k))
    with pytest.raises(kvqrs.KvqrsError, match="scheme"):
        kqv.scores(gaussian(1, (3, d)), kv.encode_keys(k))
    with pytest.raises(kvqrs.KvqrsError):
        kv.decode_keys(np.zeros((TOKENS, d)))


def test_weights_for_non_a2_values_raise():
    d = 64
    v = gaussian(0, (TOKENS, d))
    for scheme in ("kv", "kqv", "qkqv", "kivi"):
        with pytest.raises(kvqrs.KvqrsError, match="weights"):
            KVCodec(scheme, 2, d).encode_values(v, np.ones(TOKENS))


@pytest.mark.parametrize("weights", [np.ones(TOKENS + 1), -np.ones(TOKENS), np.full(TOKENS, np.nan)])
def test_bad_a2_weights_raise(weights):
    codec = KVCodec("kv", 2, 64, value_scheme="a2")
    with pytest.raises(kvqrs.KvqrsError, match="weights"):
        codec.encode_values(gaussian(0, (TOKENS, 64)), weights)


@pytest.mark.parametrize("scheme", ["kv", "qkqv", "kivi", "headq"])
def test_bad_query_shape_raises(scheme):
    d = 64
    codec = KVCodec(scheme, 2, d, basis="random" if scheme == "headq" else None)
    ck = codec.encode_keys(gaussian(0, (1, 2, TOKENS, d)))
    for q in (gaussian(1, (1, 2, 3, d + 1)), gaussian(1, (d,)), gaussian(1, (1, 3, 3, d)), gaussian(1, (2, 2, 3, d))):
        with pytest.raises(kvqrs.KvqrsError, match="q"):
            codec.scores(q, ck)


def test_bad_key_shape_and_dtype_raise():
    codec = KVCodec("kqv", 2, 64)
    with pytest.raises(kvqrs.KvqrsError):
        codec.encode_keys(gaussian(0, (TOKENS, 63)))
    with pytest.raises(kvqrs.KvqrsError):
        codec.encode_keys(np.ones((TOKENS, 64), dtype=np.int32))
    with pytest.raises(kvqrs.KvqrsError):
        codec.encode_values(gaussian(0, (64,)))


@pytest.mark.parametrize("scheme", KEY_SCHEMES)
def test_empty_token_axis(scheme):
    # A cache with no tokens yet: encode, decode and score without errors, shapes kept.
    c = scheme_codec(scheme, 3, 40, seed=1)
    x = np.zeros((2, 0, 40), np.float32)
    ck, cv = c.encode_keys(x), c.encode_values(x)
    assert ck.nbytes == cv.nbytes == 0
    assert c.decode_keys(ck).shape == c.decode_values(cv).shape == (2, 0, 40)
    assert c.scores(np.ones((2, 3, 40), np.float32), ck).shape == (2, 3, 0)


# --------------------------------------------------------------------------------------------
# The one-token append path: MSECoder on the cpu backend calls the native kernels directly
# --------------------------------------------------------------------------------------------


@given(
    leading=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),
    d=st.sampled_from([2, 5, 40, 64, 128]),
    bits=st.integers(1, 8),
    rotate=st.booleans(),
    layout=st.sampled_from(["float32", "float16", "float64", "strided"]),
    seed=st.integers(0, 2**64 - 1),
)
def test_mse_coder_native_path_equals_the_kernel_composition(leading, d, bits, rotate, layout, seed):
    # Same bytes, dtypes and shapes as kvqrs.mse_encode + kvqrs.pack_bits (the general path
    # that every other backend takes), for contiguous float32 and for every staged input.
    from kvqrs.schemes.mse import MSECoder

    x = np.random.default_rng(seed % 2**32).standard_normal((*leading, 2 * d)).astype(np.float32)
    x = x[..., ::2] if layout == "strided" else x[..., :d].astype(layout)
    coder = MSECoder(d, bits, seed if rotate else None, "kqv", "keys")
    enc = coder.encode(x)
    code = kvqrs.mse_encode(x, bits, coder.seed)
    want = kvqrs.pack_bits(code.codes, bits)
    assert enc.parts["codes"].dtype == want.dtype and np.array_equal(enc.parts["codes"], want)
    assert enc.parts["norms"].dtype == code.norms.dtype and np.array_equal(enc.parts["norms"], code.norms)
    assert enc.shape == x.shape and enc.dtype == x.dtype


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_mse_coder_native_path_raises_what_the_kernel_raises(bad):
    from kvqrs.schemes.mse import MSECoder

    x = np.ones((1, 3, 64), np.float32)
    x[0, 2, 7] = bad
    with pytest.raises(kvqrs.KvqrsError) as general:
        kvqrs.mse_encode(x, 4, 1)
    with pytest.raises(kvqrs.KvqrsError) as lean:
        MSECoder(64, 4, 1, "kqv", "keys").encode(x)
    assert str(lean.value) == str(general.value)


@pytest.mark.parametrize("scale", [0.0, 2.0])
def test_headq_refuses_a_basis_without_orthonormal_columns(scale):
    """A zero or scaled basis used to be accepted (the correction then is not q^T U U^T e)."""
    q = np.linalg.qr(np.random.default_rng(0).standard_normal((64, 4)))[0]
    with pytest.raises(kvqrs.KvqrsError, match="basis: expected orthonormal columns"):
        KVCodec("headq", 2, 64, basis=q * scale)
    KVCodec("headq", 2, 64, basis=q)  # the same columns, orthonormal: accepted
    per_head = np.stack([q, q * scale])  # head 0 orthonormal, head 1 not
    with pytest.raises(kvqrs.KvqrsError, match="of KV head 1"):
        KVCodec("headq", 2, 64, basis=per_head)


# --------------------------------------------------------------------------------------------
# value_scale="least_squares": the MSE value stage stores the least-squares scale
# --------------------------------------------------------------------------------------------


def _value_error(codec: KVCodec, v: np.ndarray) -> tuple[Encoded, float]:
    enc = codec.encode_values(v)
    return enc, float(((codec.decode_values(enc).astype(np.float64) - v) ** 2).sum() / (v.astype(np.float64) ** 2).sum())


@pytest.mark.parametrize("scheme", ["kv", "matched"])
def test_preserve_norm_value_scale_keeps_codes_and_each_values_norm(scheme):
    """value_scale="preserve_norm": the norm setting's codes and bits, stored scales that make
    every decoded value as long as its input, recorded in the parameters (QJL values add a
    residual estimate to the MSE stage's decode, so only the stage itself keeps the norm)."""
    v = np.random.default_rng(6).standard_normal((2, 64, 64)).astype(np.float32)
    from kvqrs.schemes.matched import random_calibration

    kw = {"calibration": random_calibration(64, 3, 1), "group": 16, "value_norms": "log8"} if scheme == "matched" else {"seed": 5}
    a = KVCodec(scheme, 3, 64, **kw).encode_values(v)
    codec = KVCodec(scheme, 3, 64, **kw, value_scale="preserve_norm")
    b = codec.encode_values(v)
    np.testing.assert_array_equal(b.parts["codes"], a.parts["codes"])
    assert b.bits_per_element == a.bits_per_element and b.params == {**a.params, "scale": "preserve_norm"}
    # (the random matched control's value mean is zero: the decoded values are the MSE stage's)
    ratio = np.linalg.norm(codec.decode_values(b), axis=-1) / np.linalg.norm(v, axis=-1)
    tol = 2.0**-10 if scheme != "matched" else 2.0**-4  # log8 norms: 1/16-octave grid, <= 2.2% error
    assert np.all(np.abs(ratio - 1) < tol), ratio.min()


@pytest.mark.parametrize("scheme", ["kv", "kqv", "qkqv"])
def test_least_squares_value_scale_keeps_codes_and_lowers_the_error(scheme):
    from kvqrs import format as fmt

    v = np.random.default_rng(4).standard_normal((2, 400, 64)).astype(np.float32)
    norm_codec = KVCodec(scheme, 3, 64, seed=5)
    ls_codec = KVCodec(scheme, 3, 64, seed=5, value_scale="least_squares")
    a, err_norm = _value_error(norm_codec, v)
    b, err_ls = _value_error(ls_codec, v)
    np.testing.assert_array_equal(b.parts["codes"], a.parts["codes"])
    assert not np.array_equal(b.parts["norms"], a.parts["norms"])
    assert b.parts["norms"].dtype == a.parts["norms"].dtype and b.bits_per_element == a.bits_per_element
    assert b.params == {**a.params, "scale": "least_squares"} and "scale" not in a.params
    assert err_ls < err_norm
    # The stored format is unchanged but records the setting: it loads and decodes identically
    # under its codec, and refuses a codec of the other setting.
    back = fmt.loads(fmt.dumps(b), ls_codec)
    np.testing.assert_array_equal(ls_codec.decode_values(back), ls_codec.decode_values(b))
    with pytest.raises(kvqrs.KvqrsError, match="differs in scale"):
        fmt.loads(fmt.dumps(b), norm_codec)
    # The fused read path reads the stored scale as it read the norm.
    q = np.random.default_rng(6).standard_normal((2, 3, 64)).astype(np.float32)
    ck = ls_codec.encode_keys(v)
    fused, _ = ls_codec.attention(q, ck, b, fused=True)
    ref, _ = ls_codec.attention(q, ck, b, fused=False)
    np.testing.assert_allclose(fused, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"value_scale": "ls"}, r"value_scale: expected one of \('norm', 'least_squares', 'preserve_norm'\)"),
        ({"value_scale": None}, "value_scale: expected one of"),
        ({"value_scheme": "kivi", "value_scale": "least_squares"}, "applies to the MSE value stage .* not to 'kivi' values"),
        ({"value_scheme": "block", "value_scale": "least_squares"}, "not to 'block' values"),
        ({"value_scheme": "a2", "value_scale": "least_squares"}, "not to 'a2' values"),
    ],
)
def test_value_scale_is_validated(kwargs, pattern):
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        KVCodec("kqv", 3, 64, **kwargs)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"value_norms": "log4"}, r"norms: expected one of \('float', 'log8'\)"),
        ({"value_scheme": "kqv", "value_norms": "log8"}, "applies to the MSE value stage without a QJL residual .* not to 'kqv' values"),
        ({"value_scheme": "kivi", "value_norms": "log8"}, "not to 'kivi' values"),
        ({"value_scheme": "kv", "value_norms": "log8", "group": 0}, "group: expected an integer >= 1"),
    ],
)
def test_value_norms_are_validated(kwargs, pattern):
    with pytest.raises(kvqrs.KvqrsError, match=pattern):
        KVCodec("kivi", 2, 64, **kwargs)


@settings(max_examples=30, deadline=None)
@given(
    group=st.sampled_from([1, 8, 32]),
    tokens=st.integers(0, 70),
    spread=st.sampled_from([0.0, 1.0, 8.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_log8_value_norms_are_the_float_norms_log_coded(group, tokens, spread, seed):
    """``value_norms="log8"``: the same codes as the float-norm coder, its stored norms coded by
    the log kernel (the oracle's), and every decoded row the float decode times its log-coded
    norm's ratio (within 2.2% where the norm is not below its group's smallest level)."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((2, tokens, 40)) * np.exp(spread * rng.standard_normal((2, tokens, 1)))
    v = v.astype(np.float32)
    plain = KVCodec("kivi", 2, 40, value_scheme="kv", value_bits=3, group=group)
    log8 = KVCodec("kivi", 2, 40, value_scheme="kv", value_bits=3, group=group, value_norms="log8")
    a, b = plain.encode_values(v), log8.encode_values(v)
    np.testing.assert_array_equal(a.parts["codes"], b.parts["codes"])
    assert b.parts["norms"].dtype == np.uint8 and b.parts["norm_exps"].shape == (2, -(-tokens // group))
    if tokens:
        codes, exps = oracle.log_encode(a.parts["norms"], group)
        np.testing.assert_array_equal(b.parts["norms"], codes)
        np.testing.assert_array_equal(b.parts["norm_exps"], exps)
        n_hat = oracle.log_decode(codes, exps, group)
        ratio = np.divide(n_hat, a.parts["norms"].astype(np.float64), out=np.zeros_like(n_hat), where=a.parts["norms"] > 0)
        np.testing.assert_allclose(
            log8.decode_values(b), plain.decode_values(a) * ratio[..., None].astype(np.float32), rtol=1e-5, atol=1e-30
        )
        inside = a.parts["norms"] >= oracle.log_decode(np.full_like(codes, 254), exps, group)
        assert inside.all() or spread > 1  # 2^11.5 at 4 sigma: inside 14.9 octaves
        assert np.all(np.abs(ratio[inside] - 1) <= 2 ** (1 / 32) - 1 + 1e-6)
    # 8 bits per norm and 8 per group instead of 16 (float16 norms) or 32.
    saved = 8 * a.parts["norms"].itemsize * a.parts["norms"].size - 8 * (b.parts["norms"].size + b.parts["norm_exps"].size)
    assert (a.nbytes - b.nbytes) * 8 == saved


def test_log8_value_norms_travel_in_the_format_with_their_group():
    from kvqrs import format as fmt

    v = np.random.default_rng(3).standard_normal((2, 24, 16)).astype(np.float32)
    codec = KVCodec("kivi", 2, 16, value_scheme="kv", group=8, value_norms="log8")
    enc = codec.encode_values(v)
    back = fmt.loads(fmt.dumps(enc), codec)
    np.testing.assert_array_equal(codec.decode_values(back), codec.decode_values(enc))
    for other in (
        KVCodec("kivi", 2, 16, value_scheme="kv", group=16, value_norms="log8"),
        KVCodec("kivi", 2, 16, value_scheme="kv", group=8),
    ):
        with pytest.raises(kvqrs.KvqrsError, match="differs in norm"):
            fmt.loads(fmt.dumps(enc), other)


# --------------------------------------------------------------------------------------------
# The one-call MSE + QJL encoder (kqv / qkqv values, qkqv keys) against its kernels in sequence
# --------------------------------------------------------------------------------------------


@st.composite
def mse_qjl_cases(draw):
    d = draw(head_dims)
    lead = (*draw(leading_shapes), draw(st.integers(0, 4)))  # (..., tokens)
    dtype = draw(st.sampled_from([np.float32, np.float16, np.float64]))
    x = finite_rows(draw, lead, d, scale=draw(st.sampled_from([1e-3, 10.0, 1e4])), dtype=dtype)
    if draw(st.booleans()):
        x = x[..., ::-1, :]  # a strided input takes the staging copy
    return x, draw(st.integers(2, 8)), draw(st.integers(0, 2**64 - 1))


@given(mse_qjl_cases())
def test_native_mse_qjl_encode_equals_the_kernels_in_sequence(case):
    """``MSEQJLCoder.encode`` (one native call) gives the bytes of ``encode_composed`` (the
    Python composition of mse_encode_packed, hadamard, lloyd_max_decode and qjl_sketch that
    every other backend runs): every part, dtype and shape."""
    x, bits, seed = case
    for scheme, kind in (("kqv", "values"), ("qkqv", "keys")):
        codec = KVCodec(scheme, bits, x.shape[-1], seed=seed)
        coder = codec.values if kind == "values" else codec.keys
        got, want = coder.encode(x), coder.encode_composed(x)
        assert (got.shape, got.dtype, list(got.parts)) == (want.shape, want.dtype, list(want.parts))
        for name, part in want.parts.items():
            assert got.parts[name].dtype == part.dtype and got.parts[name].shape == part.shape, name
            np.testing.assert_array_equal(got.parts[name].view(np.uint8), part.view(np.uint8), err_msg=name)


def test_native_mse_qjl_encode_reports_errors_as_the_composition():
    codec = KVCodec("kqv", 4, 40, seed=3)
    x = np.ones((2, 3, 40), np.float32)
    x[1, 2, 7] = np.nan
    with pytest.raises(kvqrs.KvqrsError, match=r"values: .*\(1, 2, 7\)"):
        codec.encode_values(x)
    with pytest.raises(kvqrs.KvqrsError, match=r"values: expected shape \(\.\.\., tokens, 40\)"):
        codec.encode_values(np.ones((2, 41), np.float32))
