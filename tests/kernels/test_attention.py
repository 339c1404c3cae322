"""Fused decode attention (docs/kernels.md section 11): kvqrs.kernels.decode_attention
and KVCodec.fused_attention against the float64 oracle (oracle.decode_attention, built from the
oracle's own decoders) and against the decode-based reference (KVCodec.attention(fused=False):
decode keys and values, softmax in float64), for every scheme with a fused read path, GQA
ratios 1, 3 and 7, one to four query tokens, padded and unpadded head_dims; plus bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError, oracle, random_orthonormal_basis
from kvqrs.kernels import CentredRows, ChannelRunRows, DenseRows, LogScalars, MSERows, SideRows, UniformRows, decode_attention
from kvqrs.schemes import KVCodec
from kvqrs.schemes.matched import MatchedBasis, MatchedCalibration, MatchedCoder
from kvqrs.schemes.registry import HEADQ_BASES, REGISTRY

from tests.process_helpers import stdout_per_thread_count

# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------

# The kernel evaluates each logit in float32 (dot products of d' terms at most, in the fixed
# 8-lane order) and accumulates the softmax normaliser in float64 and the values in float32
# blocks of 32 tokens carried into float64 (value error below 2e-6 max |v_hat|, well inside the
# bound below; docs/kernels.md section 11). A float32 logit carries an absolute error
# proportional to the sum of its absolute terms,
#     L = scale * max_j sum_i |q_i| |k_hat_ji|
# (per query row; k_hat the oracle's decoded key, QJL residual included), and a logit error e
# moves every probability by a relative e and the log-sum-exp by e. So each comparison allows
# TOL * (1 + L): probabilities relative, the log-sum-exp absolute, outputs relative to the
# largest decoded value |v_hat|. For logits of order one this is 1e-5 relative; measured worst
# error / (1 + L) (outputs: / ((1 + L) |v_hat|)) over 300 drawn problems of every scheme pair:
# 5.4e-7 (probabilities), 4.2e-7 (lse), 1.9e-7 (outputs); at 4096 tokens (5 schemes): 3e-7,
# 6.4e-8, 2e-9. So the bound has an 18x margin and still fails on any wrong code, centroid,
# scale or sign (those move outputs by 1e-3 or more).
TOL = 1e-5
# Probabilities below float32's normal range may flush to zero in the float32 kernel.
PROB_ATOL = 1e-30

# Every scheme with a fused read path that needs no calibration (matched: its own strategy below,
# with drawn bases) and HeadQ over each of its bases; values that are coded ("none" values: the
# DenseRows tests below).
_FUSED = {
    kind: [n for n, s in REGISTRY.items() if s.side(kind) and s.side(kind).fused and not s.needs_calibration] for kind in ("keys", "values")
}
KEY_SCHEMES = _FUSED["keys"] + [f"headq:{base}" for base in HEADQ_BASES]
# "kv:log8": kv values whose norms are 8-bit log codes (docs/kernels.md section 13).
VALUE_SCHEMES = [n for n in _FUSED["values"] if REGISTRY[n].values.coded] + ["kv:log8"]
# 64 and 128 are powers of two; 96 and 40 are padded to 128 and 64 by the rotation schemes.
HEAD_DIMS = [64, 96, 128, 40]
GQA_RATIOS = [1, 3, 7]


def bit_range(scheme: str, kind: str) -> tuple[int, int]:
    """The bits ``scheme`` (``"headq:<base>"``: its base; ``"kv:log8"``: kv) takes for ``kind``:
    2 at the fewest where a QJL residual takes one."""
    side = REGISTRY[scheme.split(":")[-1 if scheme.startswith("headq") else 0]].side(kind)
    return side.min_bits, side.max_bits


# --------------------------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------------------------


@st.composite
def problems(draw, key_scheme=None, value_scheme=None):
    """A codec, encoded keys and values of seeded Gaussians with drawn scales, and queries
    ``(batch?, kv_heads * g, nq, d)``."""
    ks = key_scheme or draw(st.sampled_from(KEY_SCHEMES))
    vs = value_scheme or draw(st.sampled_from(VALUE_SCHEMES))
    d = draw(st.sampled_from(HEAD_DIMS))
    bits = draw(st.integers(*bit_range(ks, "keys")))
    value_bits = draw(st.integers(*bit_range(vs, "values")))
    g = draw(st.sampled_from(GQA_RATIOS))
    kv_heads = draw(st.integers(1, 2))
    batch = draw(st.sampled_from([(), (2,)]))
    nq = draw(st.integers(1, 4))
    tokens = draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**64 - 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    k_scale, v_scale, q_scale = (
        draw(st.sampled_from([0.05, 1.0, 8.0])),
        draw(st.sampled_from([1e-3, 1.0, 100.0])),
        draw(st.sampled_from([0.1, 1.0, 3.0])),
    )
    extra = {}
    if vs == "kv:log8":
        vs = "kv"
        extra = dict(value_norms="log8", group=draw(st.sampled_from([1, 8, 32])))
    scheme = ks
    if ks.startswith("headq"):
        scheme, base = ks.split(":")
        rank = draw(st.integers(1, 8))
        if draw(st.booleans()):
            basis = np.stack([random_orthonormal_basis(int(rng.integers(2**63)), d, rank) for _ in range(kv_heads)])
        else:
            basis = random_orthonormal_basis(int(rng.integers(2**63)), d, rank)
        extra.update(headq_base=base, basis=basis, rank=rank, side_bits=draw(st.integers(1, 8)), sign=draw(st.sampled_from([1, -1])))
    codec = KVCodec(scheme, bits, d, seed=seed, value_scheme=vs, value_bits=value_bits, **extra)
    k = (rng.standard_normal((*batch, kv_heads, tokens, d)) * k_scale).astype(np.float32)
    v = (rng.standard_normal((*batch, kv_heads, tokens, d)) * v_scale).astype(np.float32)
    q = (rng.standard_normal((*batch, kv_heads * g, nq, d)) * q_scale).astype(np.float32)
    return codec, q, codec.encode_keys(k), codec.encode_values(v)


def logit_magnitude(qg: np.ndarray, key_spec: dict, tokens: int, d: int) -> np.ndarray:
    """``L = scale * max_j sum_i |q_i| |k_hat_ji|`` per grouped query row ``(..., rows)``."""
    spec = dict(key_spec, tokens=tokens)
    k_hat = np.abs(oracle.decode_rows(spec, d))
    terms = np.abs(qg.astype(np.float64))[..., :, None, :] * k_hat[..., None, :, :]
    return terms.sum(-1).max(-1) / math.sqrt(d)


def check(codec: KVCodec, q: np.ndarray, ck, cv) -> None:
    d = codec.head_dim
    t = ck.shape[-2]
    kv_lead = ck.shape[:-2]
    got = codec.fused_attention(q, ck, cv, probs=True)
    assert got.out.dtype == np.float32 and got.out.shape == q.shape
    assert got.probs.shape == (*q.shape[:-1], t) and got.lse.shape == q.shape[:-1]

    # Oracle: the stored parts decoded by the oracle's own functions, query heads grouped.
    krows, vrows, side = codec.fused_rows(ck, cv)
    qg = q.reshape(*kv_lead, -1, d)
    o, lse, p = oracle.decode_attention(qg, krows.spec(), vrows.spec(), None if side is None else side.spec())
    o, lse, p = o.reshape(q.shape), lse.reshape(q.shape[:-1]), p.reshape(got.probs.shape)
    bound = 1.0 + logit_magnitude(qg, krows.spec(), t, d).reshape(q.shape[:-1])
    if side is not None:
        # The side correction's absolute terms: |U^T q| . |z| (bounded by ||q|| max|z| sqrt(r)).
        s = side.spec()
        z = np.abs(oracle.unpack_bits(s["codes"], s["bits"], s["rank"]).astype(np.float64) - (2 ** s["bits"] - 1) / 2)
        zmax = (z * np.asarray(s["scales"], np.float64)[..., None]).max(axis=(-1, -2))
        qn = np.linalg.norm(qg.astype(np.float64), axis=-1) * math.sqrt(s["rank"]) / math.sqrt(d)
        bound = bound + (qn * zmax[..., None]).reshape(q.shape[:-1])
    v_max = np.abs(oracle.decode_rows(vrows.spec(), d)).max(axis=(-1, -2))
    v_scale = np.broadcast_to(v_max[..., None], qg.shape[:-1]).reshape(q.shape[:-1])

    np.testing.assert_array_less(np.abs(got.lse - lse), TOL * bound)
    np.testing.assert_array_less(np.abs(got.probs - p), TOL * bound[..., None] * p + PROB_ATOL)
    np.testing.assert_array_less(np.abs(got.out - o).max(-1), TOL * bound * v_scale)

    # The decode-based reference (float32 decodes and scores, float64 softmax).
    ro, rp = codec.attention(q, ck, cv, fused=False)
    np.testing.assert_array_less(np.abs(got.probs - rp), TOL * bound[..., None] * rp + PROB_ATOL)
    np.testing.assert_array_less(np.abs(got.out - ro).max(-1), TOL * bound * v_scale)
    # The default path is the fused one.
    out, probs = codec.attention(q, ck, cv)
    assert np.array_equal(out, got.out) and np.array_equal(probs, got.probs.astype(np.float64))


@pytest.mark.parametrize("key_scheme", KEY_SCHEMES)
@settings(max_examples=25)
@given(data=st.data())
def test_fused_matches_oracle_and_reference_for_every_key_scheme(key_scheme, data):
    check(*data.draw(problems(key_scheme=key_scheme)))


@pytest.mark.parametrize("value_scheme", VALUE_SCHEMES)
@settings(max_examples=25)
@given(data=st.data())
def test_fused_matches_oracle_and_reference_for_every_value_scheme(value_scheme, data):
    check(*data.draw(problems(value_scheme=value_scheme)))


@settings(max_examples=20)
@given(
    lead=st.sampled_from([(), (1,), (2, 3)]),
    rows=st.integers(1, 5),
    tokens=st.integers(1, 40),
    d=st.sampled_from([2, 17, 64]),
    scale=st.sampled_from([None, 0.05, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_dense_rows_give_plain_attention(lead, rows, tokens, d, scale, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*lead, rows, d)).astype(np.float32)
    k = rng.standard_normal((*lead, tokens, d)).astype(np.float32)
    v = rng.standard_normal((*lead, tokens, d)).astype(np.float32)
    got = decode_attention(q, DenseRows(k), DenseRows(v), scale=scale, probs=True)
    sc = 1 / math.sqrt(d) if scale is None else scale
    s = sc * np.einsum("...rd,...td->...rt", q.astype(np.float64), k.astype(np.float64))
    p = np.exp(s - s.max(-1, keepdims=True))
    z = p.sum(-1, keepdims=True)
    p /= z
    bound = 1 + sc * (np.abs(q.astype(np.float64))[..., :, None, :] * np.abs(k)[..., None, :, :]).sum(-1).max(-1)
    np.testing.assert_array_less(np.abs(got.probs - p), TOL * bound[..., None] * p + PROB_ATOL)
    np.testing.assert_array_less(np.abs(got.out - p @ v).max(-1), TOL * bound * np.abs(v).max())
    np.testing.assert_array_less(np.abs(got.lse - (s.max(-1) + np.log(z[..., 0]))), TOL * bound)


def test_lse_merges_two_parts_exactly():
    """Splitting the cache in two and merging the parts by log-sum-exp gives the whole."""
    rng = np.random.default_rng(3)
    codec = KVCodec("kqv", 4, 64, seed=9)
    k = rng.standard_normal((3, 50, 64)).astype(np.float32)
    v = rng.standard_normal((3, 50, 64)).astype(np.float32)
    q = rng.standard_normal((9, 2, 64)).astype(np.float32)
    whole = codec.fused_attention(q, codec.encode_keys(k), codec.encode_values(v))
    a = codec.fused_attention(q, codec.encode_keys(k[:, :30]), codec.encode_values(v[:, :30]))
    b = codec.fused_attention(q, codec.encode_keys(k[:, 30:]), codec.encode_values(v[:, 30:]))
    lse = np.logaddexp(a.lse, b.lse)
    out = np.exp(a.lse - lse)[..., None] * a.out + np.exp(b.lse - lse)[..., None] * b.out
    np.testing.assert_allclose(lse, whole.lse, rtol=0, atol=TOL)
    np.testing.assert_allclose(out, whole.out, rtol=0, atol=TOL * np.abs(v).max())


# --------------------------------------------------------------------------------------------
# The matched scheme: per-channel runs in a calibrated basis, around a mean
# --------------------------------------------------------------------------------------------


def matched_basis(draw, rng, heads: int, d: int, scale: float) -> MatchedBasis:
    """A drawn calibration of one side: per-head random orthonormal bases and means of size
    ``scale``, non-increasing widths in 0..8 with several runs and at least one 0 column."""
    widths = sorted(draw(st.lists(st.integers(0, 8), min_size=d, max_size=d)), reverse=True)
    widths[0] = max(widths[0], 1)
    widths[-1] = 0
    basis = np.stack([random_orthonormal_basis(int(rng.integers(2**63)), d, d) for _ in range(heads)])
    mean = (rng.standard_normal((heads, d)) * scale).astype(np.float32)
    return MatchedBasis(mean, basis, np.array(widths, np.uint8))


@st.composite
def matched_problems(draw):
    """A matched codec (keys; values by the Lloyd-Max stage around a mean, or by per-channel
    runs in their own basis), one calibration per KV head or one shared, token counts not a
    multiple of the group, GQA groups, one to four query tokens."""
    d = draw(st.sampled_from([12, 40, 64, 96]))
    g = draw(st.sampled_from(GQA_RATIOS))
    kv_heads = draw(st.integers(1, 2))
    cal_heads = draw(st.sampled_from([1, kv_heads]))
    batch = draw(st.sampled_from([(), (2,)]))
    nq = draw(st.integers(1, 4))
    group = draw(st.sampled_from([3, 8, 32, 128]))
    tokens = draw(st.integers(1, 300).filter(lambda t: t % group or t == 0))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mu_scale = draw(st.sampled_from([0.0, 1.0, 10.0]))
    keys = matched_basis(draw, rng, cal_heads, d, mu_scale)
    cal = MatchedCalibration(keys, (rng.standard_normal((cal_heads, d)) * mu_scale).astype(np.float32))
    codec = KVCodec(
        "matched", draw(st.integers(1, 8)), d, seed=draw(st.integers(0, 2**64 - 1)), value_scheme="matched", group=group, calibration=cal
    )
    if draw(st.booleans()):  # values coded like the keys, in their own basis
        codec.values = MatchedCoder(d, matched_basis(draw, rng, cal_heads, d, mu_scale), group, "matched", "values")
    k = (rng.standard_normal((*batch, kv_heads, tokens, d)) * draw(st.sampled_from([0.05, 1.0, 8.0]))).astype(np.float32)
    v = (rng.standard_normal((*batch, kv_heads, tokens, d)) * draw(st.sampled_from([1e-3, 1.0, 100.0]))).astype(np.float32)
    q = (rng.standard_normal((*batch, kv_heads * g, nq, d)) * draw(st.sampled_from([0.1, 1.0, 3.0]))).astype(np.float32)
    return codec, q, codec.encode_keys(k + keys.mean[0]), codec.encode_values(v)


@settings(max_examples=60)
@given(problem=matched_problems())
def test_fused_matched_matches_oracle_and_reference(problem):
    """Fused matched attention (keys from the runs in the query's basis, the key mean only in
    the log-sum-exp; either value coding) against the float64 oracle and the decode-based
    reference, within the tolerances above."""
    codec, q, ck, cv = problem
    assert codec.has_fused_path()
    krows, vrows, _ = codec.fused_rows(ck, cv)
    assert isinstance(krows, CentredRows) and isinstance(krows.rows, ChannelRunRows)
    assert isinstance(vrows, CentredRows) and isinstance(vrows.rows, (ChannelRunRows, MSERows))
    check(codec, q, ck, cv)


def test_fused_matched_log_sum_exp_holds_the_key_mean():
    """The key mean is left out of the kernel's logits but not out of its log-sum-exp: the
    lse equals that of the decoded logits (which include q . mu), so a merge with the
    full-precision window is exact; without the mean the probabilities are the same bits and
    the lse moves by exactly scale * q . mu."""
    rng = np.random.default_rng(3)
    d, heads, t = 16, 2, 50
    widths = np.array([4] * 5 + [3] * 6 + [0] * 5, np.uint8)
    basis = np.stack([random_orthonormal_basis(i, d, d) for i in range(heads)])
    mean = (rng.standard_normal((heads, d)) * 5).astype(np.float32)
    cal = MatchedCalibration(MatchedBasis(mean, basis, widths), np.zeros((heads, d), np.float32))
    codec = KVCodec("matched", 4, d, value_scheme="matched", group=8, calibration=cal)
    k = rng.standard_normal((heads, t, d)).astype(np.float32) + mean[:, None]
    q = rng.standard_normal((heads * 3, 1, d)).astype(np.float32)
    ck, cv = codec.encode_keys(k), codec.encode_values(k)
    got = codec.fused_attention(q, ck, cv, probs=True)
    s = codec.scores(q, ck).astype(np.float64)
    lse = s.max(-1) + np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(got.lse, lse, rtol=0, atol=1e-5 * (1 + np.abs(lse).max()))
    krows, vrows, _ = codec.fused_rows(ck, cv)
    qg = q.reshape(heads, 3, d)
    bare = decode_attention(qg, krows.rows, vrows, probs=True)
    centred = decode_attention(qg, krows, vrows, probs=True)
    assert np.array_equal(bare.probs, centred.probs) and np.array_equal(bare.out, centred.out)
    shift = np.einsum("hrd,hd->hr", qg.astype(np.float64), mean.astype(np.float64)) / math.sqrt(d)
    np.testing.assert_allclose(centred.lse - bare.lse, shift, rtol=0, atol=1e-4)
    assert np.abs(shift).max() > 1.0  # the test would see a dropped term


def test_matched_rows_bad_input_names_the_argument():
    rng = np.random.default_rng(4)
    d, t = 8, 10
    cal = MatchedCalibration(
        MatchedBasis(np.zeros((1, d)), random_orthonormal_basis(1, d, d)[None], np.array([3] * 4 + [0] * 4, np.uint8)), np.zeros((1, d))
    )
    codec = KVCodec("matched", 3, d, value_scheme="matched", group=4, calibration=cal)
    ck = codec.encode_keys(rng.standard_normal((2, t, d)).astype(np.float32))
    cv = codec.encode_values(rng.standard_normal((2, t, d)).astype(np.float32))
    krows, vrows, _ = codec.fused_rows(ck, cv)
    q = rng.standard_normal((2, 1, d)).astype(np.float32)
    runs = krows.rows.runs
    with pytest.raises(KvqrsError, match=r"keys.basis: expected shape \(8, 8\)"):
        decode_attention(q, krows._replace(rows=krows.rows._replace(basis=np.eye(4))), vrows)
    with pytest.raises(KvqrsError, match=r"keys.mean: expected shape"):
        decode_attention(q, krows._replace(mean=np.zeros(3)), vrows)
    with pytest.raises(KvqrsError, match=r"keys.mean: expected finite values, got NaN"):
        decode_attention(q, krows._replace(mean=np.full(d, np.nan)), vrows)
    with pytest.raises(KvqrsError, match=r"keys.runs\[0\].codes: expected shape"):
        decode_attention(q, krows._replace(rows=krows.rows._replace(runs=(runs[0]._replace(codes=runs[0].codes[..., 1:]),))), vrows)
    with pytest.raises(KvqrsError, match=r"keys.runs\[0\]: expected columns"):
        decode_attention(q, krows._replace(rows=krows.rows._replace(runs=(runs[0]._replace(stop=d + 1),))), vrows)
    with pytest.raises(KvqrsError, match=r"keys.runs\[0\].bits"):
        decode_attention(q, krows._replace(rows=krows.rows._replace(runs=(runs[0]._replace(bits=0),))), vrows)
    with pytest.raises(KvqrsError, match=r"keys: expected the values' 10 tokens, got 9"):
        decode_attention(q, krows._replace(rows=krows.rows._replace(tokens=9)), vrows)
    with pytest.raises(KvqrsError, match=r"keys.rows: expected rows around one mean"):
        decode_attention(q, CentredRows(krows, np.zeros(d)), vrows)
    with pytest.raises(KvqrsError, match=r"keys.runs\[0\]: expected a ChannelRun"):
        decode_attention(q, krows._replace(rows=krows.rows._replace(runs=(tuple(runs[0]),))), vrows)
    other = KVCodec("matched", 3, d, value_scheme="matched", group=8, calibration=cal)
    with pytest.raises(KvqrsError, match="group"):
        other.fused_rows(ck, cv)


def test_fused_matched_does_not_depend_on_the_thread_count():
    """Matched keys and values from their runs: one rayon thread gives the bytes of four."""
    script = (
        "import numpy as np, sys\n"
        "from kvqrs.schemes import KVCodec\n"
        "from kvqrs.schemes.matched import MatchedCoder, random_calibration\n"
        "rng = np.random.default_rng(5)\n"
        "cal = random_calibration(64, 4, 1)\n"
        "c = KVCodec('matched', 4, 64, value_scheme='matched', group=32, calibration=cal)\n"
        "k, v = (rng.standard_normal((1, 3, 1000, 64)).astype(np.float32) for _ in range(2))\n"
        "q = rng.standard_normal((1, 9, 2, 64)).astype(np.float32)\n"
        "r = c.fused_attention(q, c.encode_keys(k), c.encode_values(v), probs=True)\n"
        "c.values = MatchedCoder(64, random_calibration(64, 3, 2).keys, 32, 'matched', 'values')\n"
        "s = c.fused_attention(q, c.encode_keys(k), c.encode_values(v), probs=True)\n"
        "sys.stdout.buffer.write(b''.join(a.tobytes() for a in (*r, *s)))\n"
    )
    outs = stdout_per_thread_count(script)
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_results_do_not_depend_on_the_thread_count():
    """Heads and chunks of tokens run in parallel (above a minimum of work, here reached) but
    each one's arithmetic is sequential: one thread gives the same bytes as a pool of four."""
    script = (
        "import numpy as np, sys\n"
        "from kvqrs.schemes import KVCodec\n"
        "rng = np.random.default_rng(5)\n"
        "c = KVCodec('qkqv', 4, 96, seed=2, value_scheme='kivi')\n"
        "k, v = (rng.standard_normal((2, 4, 1200, 96)).astype(np.float32) for _ in range(2))\n"
        "q = rng.standard_normal((2, 12, 3, 96)).astype(np.float32)\n"
        "r = c.fused_attention(q, c.encode_keys(k), c.encode_values(v), probs=True)\n"
        "sys.stdout.buffer.write(r.out.tobytes() + r.lse.tobytes() + r.probs.tobytes())\n"
    )
    outs = stdout_per_thread_count(script)
    assert outs[0] == outs[1] and len(outs[0]) > 0


# --------------------------------------------------------------------------------------------
# What falls back, and bad input
# --------------------------------------------------------------------------------------------


def test_schemes_without_a_fused_path_fall_back_to_the_reference():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 20, 64)).astype(np.float32)
    q = rng.standard_normal((3, 1, 64)).astype(np.float32)
    codec = KVCodec("kqv", 4, 64, value_scheme="a2")
    ck, cv = codec.encode_keys(k), codec.encode_values(k)
    assert codec.fused_rows(ck, cv) is None
    out, p = codec.attention(q, ck, cv)
    ref_out, ref_p = codec.attention(q, ck, cv, fused=False)
    assert np.array_equal(out, ref_out) and np.array_equal(p, ref_p)
    with pytest.raises(KvqrsError, match="fused: no fused attention for kqv keys with a2 values"):
        codec.attention(q, ck, cv, fused=True)


def _mse(rng, lead, t, d, bits=4, seed=None):
    codec = KVCodec("kv" if seed is None else "kqv", bits, d, seed=0)
    enc = codec.encode_keys(rng.standard_normal((*lead, t, d)).astype(np.float32))
    return MSERows(enc.parts["codes"], enc.parts["norms"], bits, codec.keys.seed)


def test_bad_inputs_raise_kvqrs_errors_naming_the_argument():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 64)).astype(np.float32)
    keys = _mse(rng, (2,), 10, 64)
    values = DenseRows(rng.standard_normal((2, 10, 64)).astype(np.float32))
    decode_attention(q, keys, values)
    with pytest.raises(KvqrsError, match=r"keys.codes: expected shape \(2, 10, 32\)"):
        decode_attention(q, keys._replace(codes=keys.codes[..., :-1]), values)
    with pytest.raises(KvqrsError, match="keys.norms: expected float16 or float32"):
        decode_attention(q, keys._replace(norms=keys.norms.astype(np.float64)), values)
    with pytest.raises(KvqrsError, match="keys: expected the values' 10 tokens, got 9"):
        decode_attention(q, keys._replace(codes=keys.codes[:, :9], norms=keys.norms[:, :9]), values)
    with pytest.raises(KvqrsError, match=r"values: expected leading shape \(2,\)"):
        decode_attention(q, keys, DenseRows(values.values[None]))
    with pytest.raises(KvqrsError, match="keys.bits"):
        decode_attention(q, keys._replace(bits=9), values)
    with pytest.raises(KvqrsError, match="keys.norms"):
        bad = keys.norms.copy()
        bad[1, 3] = -1
        decode_attention(q, keys._replace(norms=bad), values)
    with pytest.raises(KvqrsError, match="q: expected finite"):
        decode_attention(np.full_like(q, np.inf), keys, values)
    with pytest.raises(KvqrsError, match="values: expected at least one token"):
        decode_attention(q, keys._replace(codes=keys.codes[:, :0], norms=keys.norms[:, :0]), DenseRows(values.values[:, :0]))
    with pytest.raises(KvqrsError, match="values: expected per-token values"):
        decode_attention(q, keys, UniformRows(keys.codes, keys.norms, keys.norms, 4, 32, per_channel=True))
    with pytest.raises(KvqrsError, match="scale"):
        decode_attention(q, keys, values, scale=-1.0)
    with pytest.raises(KvqrsError, match="keys: expected MSERows, UniformRows, DenseRows, ChannelRunRows, TokenRunRows or CentredRows"):
        decode_attention(q, {"codes": keys.codes}, values)
    side = SideRows(np.zeros((2, 10, 2), np.uint8), np.ones((2, 10), np.float16), np.ones((3, 64, 4), np.float32), 4)
    with pytest.raises(KvqrsError, match="side.basis"):
        decode_attention(q, keys, values, side=side)
    with pytest.raises(KvqrsError, match=r"side.codes: expected shape \(2, 10, 2\)"):
        decode_attention(q, keys, values, side=side._replace(basis=np.ones((64, 4), np.float32), codes=side.codes[..., :1]))


def test_bad_log_norm_exponent_names_the_exponent_part():
    """An exponent byte of log-coded value norms outside 16..254 is named as ``values.norm_exps``
    (the part that holds it), with its group's flat index in that array."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 64)).astype(np.float32)
    keys = _mse(rng, (2,), 10, 64)
    codec = KVCodec("kv", 4, 64, seed=0, value_norms="log8", group=4)
    enc = codec.encode_values(rng.standard_normal((2, 10, 64)).astype(np.float32))
    exps = enc.parts["norm_exps"]
    assert exps.shape == (2, 3)
    values = MSERows(enc.parts["codes"], LogScalars(enc.parts["norms"], exps, 4), 4, None)
    decode_attention(q, keys, values)
    bad = exps.copy()
    bad[1, 2] = 3
    with pytest.raises(KvqrsError, match=r"^values\.norm_exps: expected log-code exponent bytes in 16\.\.=254, got 3 at group 5$"):
        decode_attention(q, keys, values._replace(norms=LogScalars(enc.parts["norms"], bad, 4)))


def test_native_rows_are_typed_objects_and_errors_name_the_part():
    from kvqrs import _native

    q = np.zeros(64, np.float32)
    dense = DenseRows(q)
    # A dict is not a row object (the binding reads typed rows by attribute).
    with pytest.raises(TypeError, match="argument 'keys': expected a row object .* got a dict"):
        _native.decode_attention(q, {"kind": "mse", "bits": 4}, dense, None, 1, 1, 1, 64, 1.0, False)
    with pytest.raises(KvqrsError, match="keys.values"):
        _native.decode_attention(q, DenseRows(q[:3]), dense, None, 1, 1, 1, 64, 1.0, False)
    mse = MSERows(np.zeros(32, np.uint8), np.ones(1, np.float16), 9, None)
    with pytest.raises(KvqrsError, match="keys.bits"):
        _native.decode_attention(q, mse, dense, None, 1, 1, 1, 64, 1.0, False)
    uni = UniformRows(np.zeros(32, np.uint8), np.ones(2, np.float16), np.zeros(1, np.float16), 4, 32)
    with pytest.raises(KvqrsError, match="values.zeros"):
        _native.decode_attention(q, dense, uni, None, 1, 1, 1, 64, 1.0, False)


@pytest.mark.parametrize("scheme", ["kivi", "block"])
def test_values_near_the_float32_limit_give_finite_output_or_a_named_error(scheme):
    """Uniform-coded values whose float32 block sums overflow (64 equal weights of 1e38): the
    fused read returns finite output where its float64 zero-point sums hold the total (KIVI's
    constant values sit in the zero point) and otherwise raises naming the values, never an
    infinite or NaN output."""
    d, t = 20, 64
    codec = KVCodec(scheme, 4, head_dim=d, seed=1)
    k = np.zeros((1, t, d), np.float32)  # equal logits
    q = np.random.default_rng(0).standard_normal((1, 1, d)).astype(np.float32)
    for v in (np.full((1, t, d), 1e38, np.float32), np.linspace(-1e38, 1e38, t * d, dtype=np.float32).reshape(1, t, d)):
        ck, cv = codec.encode_keys(k), codec.encode_values(v)
        try:
            out = codec.fused_attention(q, ck, cv).out
        except KvqrsError as e:
            assert "values: row 0 overflows float32" in str(e)
            continue
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, codec.attention(q, ck, cv, fused=False)[0], rtol=1e-5, atol=0)
    # KIVI's constant values are its zero points: summed in float64, the read stays finite.
    if scheme == "kivi":
        cv = codec.encode_values(np.full((1, t, d), 1e38, np.float32))
        assert np.isfinite(codec.fused_attention(q, codec.encode_keys(k), cv).out).all()
