"""The input-class sweep (robustness): every public entry point that takes float data,
fed float16 / bfloat16 / float32 / float64 NumPy arrays and torch tensors, strided, transposed,
broadcast and reversed views, empty tensors, zero / constant / one-hot rows, bfloat16 values
beyond float16's range, NaN and infinities; every scheme at head_dim 40, 80, 96, 112, 160, 192
and 576; GQA ratios 1, 4, 7, 32 and multi-query, through KVCodec and through QuantizedKVCache in
a real (tiny, random) Llama.

What each class must give:
- a view gives the bytes of its contiguous copy, bit for bit;
- float16 / bfloat16 input gives the bytes of the same values in float32 (the kernels compute in
  float32), in the documented output dtype: transforms and decodes return the caller's dtype,
  ``Encoded.dtype`` records it, estimators, logits and attention are float32;
- empty input gives empty outputs of the right shape (``headq_basis`` with no queries and
  attention over no tokens raise, as documented);
- zero, constant and one-hot rows are finite and equal the oracle (codes except at a boundary);
- a NaN or infinity raises ``KvqrsError`` naming its position: the index in the caller's array
  (``index (1, 2, 3, 7)``) or, from the kernels on flattened rows, ``row R, position C``;
- the head_dims and GQA ratios agree with the oracle and the decode-based reference.
"""

from __future__ import annotations

import math
import re
import warnings

import kvqrs
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import KvqrsError, oracle
from kvqrs import format as fmt
from kvqrs._arrays import torch_to_numpy
from kvqrs.kernels import DenseRows, decode_attention
from kvqrs.schemes import Encoded, KVCodec
from kvqrs.schemes.registry import KEY_SCHEMES

from tests.kernels.test_attention import check as check_attention
from tests.scheme_helpers import scheme_codec
from tests.schemes.test_schemes import (
    assert_uniform_codes_close,
    oracle_derive_seed,
)
from tests.schemes.test_schemes import (
    test_keys_decode_matches_oracle_composition as keys_match_oracle,
)
from tests.schemes.test_schemes import (
    test_values_decode_matches_oracle_composition as values_match_oracle,
)

torch = pytest.importorskip("torch")
from kvqrs import torch as kt  # noqa: E402

# Tensors that require grad are accepted and detached with a warning (tests/package/test_torch_io.py
# checks the warning); here they only have to give the values of their detached copy.
pytestmark = pytest.mark.filterwarnings("ignore:.*requires grad:UserWarning")

BF16 = ml_dtypes.bfloat16
SHAPE = (2, 3, 5, 64)  # (batch, kv heads, tokens, head_dim)
BAD_AT = (1, 2, 3, 7)  # where a NaN / Inf goes
SEED = 7
# Every key scheme (HeadQ on its seeded random basis) but matched: its calibrated transform mixes
# channels, so one outlier coordinate moves the codes of every coordinate of its groups (the
# outlier tests below hold the other channels to the clean error), and its random control takes
# 1..7 bits (tests/schemes/test_matched.py and tests/schemes/test_registry.py cover it).
SCHEMES = [s for s in KEY_SCHEMES if s != "matched"]


def gaussian(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def codec(scheme, d=64, bits=4, value_scheme=None, **kw):
    return scheme_codec(scheme, bits, d, SEED, value_scheme=value_scheme, **kw)


# --------------------------------------------------------------------------------------------
# The entry points: each maps a float input x of SHAPE (or any dtype / view of it) to a result.
# --------------------------------------------------------------------------------------------

KEYS = gaussian(SHAPE, 1)
VALUES = gaussian(SHAPE, 2)
BASIS = kvqrs.random_orthonormal_basis(3, 64, 4)
SKETCH = kvqrs.qjl_sketch(gaussian((4, 64), 4), seed=5)
SIDE = kvqrs.headq_encode(gaussian((4, 64), 6), BASIS, 2)
CODEBOOK = kvqrs.lloyd_max_codebook(64, 3)
ABSMAX_WIDTHS = np.resize(np.arange(9, dtype=np.uint8), 64)  # every width 0..8


def to_tensor(x):
    """x as a tensor (the torch adapters' entries): NumPy views torch cannot hold (negative
    strides) and bfloat16 (ml_dtypes) go through a copy of their values."""
    if isinstance(x, torch.Tensor):
        return x
    if x.dtype == BF16:
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    with warnings.catch_warnings():  # a broadcast view is read-only; the adapters only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x if all(s >= 0 for s in x.strides) else x.copy())


def cache_update(t):
    """QuantizedKVCache.update of a fresh one-layer cache (two tokens in full precision; the
    rest quantized at once, KIVI keys in groups of 2) with ``t`` as keys and values."""
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    cache = QuantizedKVCache(QuantConfig("kivi", 4, "qkqv", 4, residual_length=2, group=2), 1)
    return (*cache.update(t, t, 0), cache.get_seq_length())


def _scheme_entries():
    out = {}
    for s in SCHEMES:
        c = codec(s)
        ck, cv = c.encode_keys(KEYS), c.encode_values(VALUES)
        out[f"{s}.encode_keys"] = (lambda x, c=c: c.encode_keys(x), "keys")
        out[f"{s}.encode_values"] = (lambda x, c=c: c.encode_values(x), "values")
        out[f"{s}.scores"] = (lambda x, c=c, ck=ck: c.scores(x, ck), "q")
        out[f"{s}.attention"] = (lambda x, c=c, ck=ck, cv=cv: c.attention(x, ck, cv), "q")
        out[f"{s}.attention_reference"] = (lambda x, c=c, ck=ck, cv=cv: c.attention(x, ck, cv, fused=False), "q")
        out[f"{s}.fused_attention"] = (lambda x, c=c, ck=ck, cv=cv: c.fused_attention(x, ck, cv, probs=True), "q")
        out[f"{s}.format_dumps"] = (lambda x, c=c: fmt.dumps(c.encode_keys(x)), "keys")
    hq = codec("headq")
    hq_keys = hq.encode_keys(KEYS)
    out["headq.score_correction"] = (lambda x, ck=hq_keys: hq.score_correction(x, ck), "q")
    out["headq.calibrate"] = (lambda x: KVCodec("headq", 2, 64, seed=SEED).calibrate(x[1]), "queries")
    a2 = codec("kv", value_scheme="a2")
    out["a2.encode_values"] = (lambda x: a2.encode_values(x, np.abs(gaussian(np.shape(x)[:-1], 9))), "values")
    return out


ENTRIES = {
    "hadamard": (lambda x: kvqrs.hadamard(x, seed=SEED), "x"),
    "inverse_hadamard": (lambda x: kvqrs.inverse_hadamard(x, seed=SEED, head_dim=40), "y"),
    "mse_encode": (lambda x: kvqrs.mse_encode(x, 3, seed=SEED), "x"),
    "mse_encode_unrotated": (lambda x: kvqrs.mse_encode(x, 3), "x"),
    "lloyd_max_encode": (lambda x: kvqrs.lloyd_max_encode(x, CODEBOOK), "x"),
    "qjl_sketch": (lambda x: kvqrs.qjl_sketch(x, seed=SEED), "r"),
    "qjl_inner_product": (lambda x: kvqrs.qjl_inner_product(x, SKETCH, seed=5), "y"),
    "headq_encode": (lambda x: kvqrs.headq_encode(x, BASIS, 2), "residual"),
    "headq_score_correction": (lambda x: kvqrs.headq_score_correction(x, SIDE, BASIS), "q"),
    "headq_basis": (lambda x: kvqrs.headq_basis(x[1, 2], 4), "queries"),
    "uniform_encode": (lambda x: kvqrs.uniform_encode(x, 3, 16), "x"),
    "absmax_encode": (lambda x: kvqrs.absmax_encode(x, ABSMAX_WIDTHS)[:2], "x"),  # codes, scales
    "decode_attention.q": (lambda x: decode_attention(x, DenseRows(KEYS), DenseRows(VALUES), probs=True), "q"),
    "decode_attention.values": (lambda x: decode_attention(KEYS, DenseRows(KEYS), DenseRows(x)), "values.values"),
    "torch.hadamard": (lambda x: kt.hadamard(to_tensor(x), seed=SEED), "x"),
    "torch.inverse_hadamard": (lambda x: kt.inverse_hadamard(to_tensor(x), seed=SEED, head_dim=40), "y"),
    "torch.quantize_dequantize": (lambda x: kt.quantize_dequantize(codec("kqv"), to_tensor(x)), "keys"),
    "torch.cache_update": (lambda x: cache_update(to_tensor(x)), "key_states"),
    **_scheme_entries(),
}
NAMES = sorted(ENTRIES)


def call(name, x):
    return ENTRIES[name][0](x)


def leaves(result):
    """The arrays (and bytes) of a result, in a fixed order, for bit-for-bit comparison."""
    if isinstance(result, Encoded):
        return [result.shape, str(result.dtype), *[(k, np.asarray(v)) for k, v in sorted(result.parts.items())]]
    if isinstance(result, tuple):  # NamedTuples of the kernels, (out, probs) pairs
        return [leaf for r in result for leaf in leaves(r)]
    if isinstance(result, torch.Tensor):  # compared with NumPy results: the same values and dtype
        return [torch_to_numpy(result.detach())]
    return [result]


def assert_same(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, tuple):
            assert x[0] == y[0]
            x, y = x[1], y[1]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes()
        else:
            assert x == y


# --------------------------------------------------------------------------------------------
# Views: the result of a view equals that of its contiguous copy, bit for bit
# --------------------------------------------------------------------------------------------


def views(x):
    """Non-contiguous arrays holding x's values: a transposed layout, a stepped slice, reversed
    axes, a broadcast (zero-stride) one, and torch's transpose."""
    yield "transposed", np.ascontiguousarray(np.swapaxes(x, 1, 2)).swapaxes(1, 2)
    wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), x.dtype)
    wide[..., ::2] = x
    yield "stepped", wide[..., ::2]
    yield "reversed", np.ascontiguousarray(x[::-1, :, ::-1])[::-1, :, ::-1]
    yield "broadcast", np.broadcast_to(x[:1, :1], x.shape)
    yield "torch_transposed", torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2))).transpose(1, 2)


@pytest.mark.parametrize("name", NAMES)
def test_views_equal_their_contiguous_copy(name):
    for label, v in views(gaussian(SHAPE, 11)):
        contiguous = v.contiguous() if isinstance(v, torch.Tensor) else np.ascontiguousarray(v)
        assert not (v.is_contiguous() if isinstance(v, torch.Tensor) else v.flags.c_contiguous), label
        assert_same(call(name, v), call(name, contiguous))


# --------------------------------------------------------------------------------------------
# Dtypes: float16 / bfloat16 / float64 NumPy and torch tensors
# --------------------------------------------------------------------------------------------

NP_DTYPES = [np.float16, BF16, np.float64]
TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def as_float32(result):
    """The result with floating arrays cast to float32 (for comparing outputs whose dtype
    follows the input's); Encoded keeps its parts (they are what was stored)."""
    if isinstance(result, np.ndarray) and (result.dtype.kind == "f" or result.dtype == BF16) and result.dtype != np.float16:
        return result.astype(np.float32) if result.dtype != np.float32 else result
    return result


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_dtypes_give_the_float32_result_of_their_values(name, dtype):
    x = gaussian(SHAPE, 12).astype(dtype)
    got, want = call(name, x), call(name, x.astype(np.float32))
    if name.startswith("torch."):
        pairs = zip(got[:2], want[:2]) if isinstance(got, tuple) else [(got, want)]
        for g, w in pairs:
            assert g.dtype == to_tensor(x).dtype  # the tensor's dtype back
            assert torch.equal(g, w.to(g.dtype))
        return
    if name.endswith("format_dumps"):  # the container records the dtype: compare what it holds
        c = codec(name.split(".")[0])
        got, want = fmt.loads(got, c), fmt.loads(want, c)
    if isinstance(got, Encoded):
        assert got.dtype == np.dtype(dtype)  # recorded: decoding returns it
        assert got.parts.keys() == want.parts.keys()
        for k in got.parts:
            assert np.asarray(got.parts[k]).tobytes() == np.asarray(want.parts[k]).tobytes(), k
        return
    if name in ("hadamard", "inverse_hadamard"):
        assert got.dtype == np.dtype(dtype)  # transforms return the caller's dtype
        np.testing.assert_array_equal(got, want.astype(dtype))
        return
    assert_same(got, want)  # codes, estimators, logits and attention: float32 of the values


@pytest.mark.parametrize("scheme", SCHEMES + ["a2"])
@pytest.mark.parametrize("dtype", NP_DTYPES + TORCH_DTYPES, ids=str)
def test_decode_returns_the_encoded_dtype(scheme, dtype):
    c = codec("kv", value_scheme="a2") if scheme == "a2" else codec(scheme)
    x = torch.from_numpy(KEYS).to(dtype) if isinstance(dtype, torch.dtype) else KEYS.astype(dtype)
    want = (
        BF16
        if dtype == torch.bfloat16
        else (np.float16 if dtype == torch.float16 else np.float32)
        if isinstance(dtype, torch.dtype)
        else dtype
    )
    out = c.decode_values(c.encode_values(x))
    # A tensor's codes decode to a tensor of its dtype; an array's to an array of its dtype.
    same = (lambda o: o.dtype == dtype) if isinstance(dtype, torch.dtype) else (lambda o: o.dtype == np.dtype(want))
    assert same(out) and tuple(out.shape) == SHAPE
    if scheme != "a2":
        assert same(c.decode_keys(c.encode_keys(x)))


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("torch.")])
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_tensors_equal_numpy_arrays_of_their_values(name, dtype):
    t = torch.from_numpy(gaussian(SHAPE, 13)).to(dtype)
    a = t.float().numpy().astype(BF16 if dtype == torch.bfloat16 else np.float16 if dtype == torch.float16 else np.float32)
    assert_same(call(name, t), call(name, a))
    # A tensor that requires grad is read through detach (with a warning), not refused.
    assert_same(call(name, t.clone().requires_grad_(True)), call(name, a))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("fn", ["hadamard", "quantize_dequantize"])
def test_torch_adapters_return_the_tensor_dtype(dtype, fn):
    t = torch.from_numpy(KEYS).to(dtype)
    out = kt.hadamard(t, seed=SEED) if fn == "hadamard" else kt.quantize_dequantize(codec("kqv"), t)
    assert out.dtype == dtype and out.shape == t.shape and bool(torch.isfinite(out).all())


# --------------------------------------------------------------------------------------------
# NaN and infinities: KvqrsError naming the position
# --------------------------------------------------------------------------------------------


def position_named(message, name):
    """Whether ``message`` names BAD_AT: as an index of the caller's array, or as a flattened
    row and position (the kernels' rows: leading axes flattened)."""
    if name == "headq_basis":  # reads x[1, 2]: rows are its tokens
        return f"row {BAD_AT[2]}, position {BAD_AT[3]}" in message
    if name == "headq.calibrate":  # reads x[1]: (kv_heads, n, d)
        return f"index {BAD_AT[1:]}" in message
    row = int(np.ravel_multi_index(BAD_AT[:-1], SHAPE[:-1]))
    return f"index {BAD_AT}" in message or f"row {row}, position {BAD_AT[3]}" in message


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_nonfinite_input_raises_naming_its_position(name, bad, dtype):
    x = gaussian(SHAPE, 14).astype(dtype)
    x[BAD_AT] = bad
    with pytest.raises(KvqrsError) as e:
        call(name, x)
    assert position_named(str(e.value), name), str(e.value)
    assert str(e.value).startswith(ENTRIES[name][1] + ":"), str(e.value)  # the argument named


@pytest.mark.parametrize("scheme", ["kqv", "kivi", "qkqv"])
@pytest.mark.parametrize("side", ["key_states", "value_states"])
@pytest.mark.parametrize("token", [0, 4])  # one that is quantized at once, one that stays in the window
def test_cache_refuses_nonfinite_states_before_storing_them(scheme, side, token):
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    cache = QuantizedKVCache(QuantConfig(scheme, 4, scheme, 4, residual_length=2, group=2), 1)
    k, v = torch.from_numpy(KEYS), torch.from_numpy(VALUES)
    cache.update(k, v, 0)
    bad = (k if side == "key_states" else v).clone()
    bad[1, 2, token, 7] = float("nan")
    with pytest.raises(KvqrsError, match=rf"{side}: expected finite values, got nan at index \(1, 2, {token}, 7\)"):
        cache.update(bad, v, 0) if side == "key_states" else cache.update(k, bad, 0)
    assert cache.get_seq_length() == SHAPE[2]  # nothing appended
    keys, _ = cache.update(k[..., :1, :], v[..., :1, :], 0)
    assert bool(torch.isfinite(keys).all())


@pytest.mark.parametrize("fused", [True, False])
def test_cache_attention_refuses_a_nonfinite_query(fused):
    from kvqrs.hf import QuantConfig, QuantizedKVCache

    class Module:  # what the attention function reads from a transformers attention module
        num_key_value_groups, layer_idx = 2, 0

    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=2, fused=fused), 1)
    k, v = torch.from_numpy(KEYS), torch.from_numpy(VALUES)
    q = torch.from_numpy(gaussian((2, 6, 1, 64), 15))
    cache.attend(Module, q, *cache.update(k, v, 0), None, 0.125)  # prefill, served by the cache
    rk, rv = cache.update(k[..., :1, :], v[..., :1, :], 0)
    assert cache.layers[0]._fused == fused
    q[1, 4, 0, 9] = float("inf")
    with pytest.raises(KvqrsError, match=r"query: expected finite values, got inf at index \(1, 4, 0, 9\)"):
        cache.attend(Module, q, rk, rv, None, 0.125)


# --------------------------------------------------------------------------------------------
# Empty tensors
# --------------------------------------------------------------------------------------------

EMPTY_SHAPES = [(0, 3, 5, 64), (2, 0, 5, 64), (2, 3, 0, 64)]
# Documented errors: a basis needs queries; attention needs at least one token to weigh.
EMPTY_RAISES = {
    "headq_basis": "queries: expected at least one calibration query",
    "headq.calibrate": "queries: expected .* n >= rank",
    "decode_attention.values": "values: expected at least one token",
}


def empty_applies(name, shape):
    """Entries whose input is paired with fixed keys, a sketch or a side code of SHAPE can
    only be empty along the token axis (0 query tokens); headq_basis reads x[1, 2]."""
    paired = ENTRIES[name][1] in ("q", "y", "values.values", "queries")
    return not paired or shape == (2, 3, 0, 64)


def all_empty(result):
    arrays = [leaf for leaf in leaves(result) if isinstance(leaf, np.ndarray)]
    arrays += [leaf[1] for leaf in leaves(result) if isinstance(leaf, tuple)]
    return bool(arrays) and all(a.size == 0 for a in arrays)


@pytest.mark.parametrize("name,shape", [(n, s) for n in NAMES for s in EMPTY_SHAPES if empty_applies(n, s)], ids=str)
def test_empty_input_gives_empty_output(name, shape):
    x = np.zeros(shape, np.float32)
    if name in EMPTY_RAISES:
        with pytest.raises(KvqrsError, match=EMPTY_RAISES[name]):
            call(name, x)
        return
    result = call(name, x)
    if name.endswith("format_dumps"):
        scheme = name.split(".")[0]
        back = fmt.loads(result, codec(scheme))
        assert back.shape == shape and codec(scheme).decode_keys(back).shape == shape
        return
    if isinstance(result, Encoded):
        scheme = name.split(".")[0]
        c = codec("kv", value_scheme="a2") if scheme == "a2" else codec(scheme)
        dec = c.decode_keys(result) if result.kind == "keys" else c.decode_values(result)
        assert result.shape == shape and dec.shape == shape
        return
    assert all_empty(result), leaves(result)


def test_empty_results_have_the_documented_shapes():
    c = codec("qkqv")
    ck = c.encode_keys(np.zeros((0, 3, 5, 64), np.float32))
    assert c.scores(np.zeros((0, 3, 2, 64), np.float32), ck).shape == (0, 3, 2, 5)
    ck = c.encode_keys(KEYS)
    out, p = c.attention(np.zeros((2, 3, 0, 64), np.float32), ck, c.encode_values(VALUES))
    assert out.shape == (2, 3, 0, 64) and p.shape == (2, 3, 0, 5)
    res = decode_attention(np.zeros((3, 0, 64), np.float32), DenseRows(KEYS[0]), DenseRows(VALUES[0]), probs=True)
    assert res.out.shape == (3, 0, 64) and res.lse.shape == (3, 0) and res.probs.shape == (3, 0, 5)
    h = codec("headq")
    ck = h.encode_keys(np.zeros((0, 3, 5, 64), np.float32))
    assert ck.parts["side_codes"].shape == (0, 3, 5, 2) and h.decode_keys(ck).shape == (0, 3, 5, 64)
    assert h.scores(np.zeros((0, 6, 1, 64), np.float32), ck).shape == (0, 6, 1, 5)
    with pytest.raises(KvqrsError, match="at least one token"):
        c.attention(KEYS[..., :1, :], c.encode_keys(KEYS[..., :0, :]), c.encode_values(VALUES[..., :0, :]))


# --------------------------------------------------------------------------------------------
# Zero, constant and one-hot rows; every scheme at unusual head_dims: against the oracle
# --------------------------------------------------------------------------------------------


def special_rows(d, seed=0):
    """(1, 2, 8, d): zero, constant, negative constant, one-hot (first, last, middle), a
    scaled one-hot and a Gaussian row, per head."""
    rows = np.zeros((8, d), np.float32)
    rows[1], rows[2] = 2.5, -0.75
    rows[3, 0], rows[4, d - 1], rows[5, d // 2], rows[6, 3] = 1.0, -1.0, 3.0, 1e-3
    rows[7] = gaussian((d,), seed)
    return np.stack([rows, rows[::-1]])[None]


def block_matches_oracle(c, x, enc, kind):
    """Rotation + uniform blocks: codes, scales and zero points against the oracle."""
    rot = oracle_derive_seed(SEED, 1 if kind == "keys" else 3)
    y = oracle.hadamard(x, rot).astype(np.float32)
    codes, scales, zeros = oracle.uniform_encode(y, c.bits, 32)
    got = oracle.unpack_bits(enc.parts["codes"], c.bits, y.shape[-1])
    assert enc.parts["scales"].dtype == scales.dtype
    np.testing.assert_allclose(enc.parts["scales"].astype(np.float64), scales.astype(np.float64), rtol=1e-3)
    np.testing.assert_allclose(enc.parts["zeros"].astype(np.float64), zeros.astype(np.float64), rtol=1e-3, atol=1e-30)
    assert_uniform_codes_close(got, codes, f"block {kind}")


def decode_matches_stored_codes(c, enc, kind):
    """The scheme's decode equals the oracle's decode of the stored codes (tight)."""
    coder = c.keys if kind == "keys" else c.values
    rows = getattr(coder, "base", coder).attention_rows if c.scheme != "headq" or kind == "values" else None
    if rows is None:  # HeadQ: base rows plus the oracle's side decode
        base, side = c.keys.attention_rows(enc)
        spec = dict(base.spec(), tokens=enc.shape[-2])
        want = oracle.decode_rows(spec, c.head_dim)
        s = side.spec()
        z = oracle.headq_decode(oracle.unpack_bits(s["codes"], s["bits"], s["rank"]), s["scales"], s["basis"], s["bits"])
        want = want + c.sign * z
        got = c.decode_keys(enc)
    else:
        spec = dict(rows(enc).spec(), tokens=enc.shape[-2])
        want = oracle.decode_rows(spec, c.head_dim)
        got = c.decode_keys(enc) if kind == "keys" else c.decode_values(enc)
    assert np.isfinite(got).all()
    scale = np.abs(want).max() + 1e-30
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("d", [64, 40])
def test_zero_constant_one_hot_rows_match_the_oracle(scheme, d):
    x = special_rows(d)
    c = codec(scheme, d, bits=3, value_scheme="block" if scheme == "headq" else None)
    ck, cv = c.encode_keys(x), c.encode_values(x)
    decode_matches_stored_codes(c, ck, "keys")
    decode_matches_stored_codes(c, cv, "values")
    k_hat, v_hat = c.decode_keys(ck), c.decode_values(cv)
    assert np.all(v_hat[0, 0, 0] == 0) and np.all(v_hat[0, 1, -1] == 0)  # a zero row decodes to zero
    assert np.all(k_hat[0, 0, 0] == 0) or scheme in ("kivi", "headq")  # (KIVI keys: per-channel groups)
    if scheme == "block":
        block_matches_oracle(c, x, ck, "keys")
        block_matches_oracle(c, x, cv, "values")
    for q in (gaussian((1, 2, 2, d), 3), np.zeros((1, 2, 1, d), np.float32), x[:, :, 3:5]):
        check_attention(c, q, ck, cv)


HEAD_DIMS = [40, 80, 96, 112, 160, 192, 576]


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("scheme", ["kv", "kqv", "qkqv", "kivi"])
def test_keys_at_unusual_head_dims_match_the_oracle(scheme, d):
    keys_match_oracle(scheme, d, 2 if scheme == "qkqv" else 3)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("scheme", ["kv", "kqv", "qkqv", "kivi", "a2"])
def test_values_at_unusual_head_dims_match_the_oracle(scheme, d):
    values_match_oracle(scheme, d, 3)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("scheme", ["block", "headq"])
def test_block_and_headq_at_unusual_head_dims_match_the_oracle(scheme, d):
    x = gaussian((2, 2, 12, d), d, scale=2.0)
    c = codec(scheme, d, bits=3, value_scheme="block", headq_base="kqv")
    ck, cv = c.encode_keys(x), c.encode_values(x)
    block_matches_oracle(c, x, cv, "values")
    if scheme == "block":
        block_matches_oracle(c, x, ck, "keys")
    decode_matches_stored_codes(c, ck, "keys")
    decode_matches_stored_codes(c, cv, "values")


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_attention_at_unusual_head_dims_matches_the_oracle(scheme, d):
    c = codec(scheme, d, bits=3, value_scheme="kqv")
    k, v, q = gaussian((2, 2, 9, d), 1), gaussian((2, 2, 9, d), 2), gaussian((2, 4, 2, d), 3)
    check_attention(c, q, c.encode_keys(k), c.encode_values(v))


# --------------------------------------------------------------------------------------------
# GQA: 1, 4, 7, 32 query heads per KV head, and multi-query (one KV head)
# --------------------------------------------------------------------------------------------

GQA = [(g, kv) for g in (1, 4, 7, 32) for kv in (1, 2)]


@pytest.mark.parametrize("g,kv_heads", GQA, ids=lambda v: str(v))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gqa_ratios_through_kvcodec(scheme, g, kv_heads):
    d = 48
    c = codec(scheme, d, bits=3, value_scheme="kivi")
    k, v = gaussian((1, kv_heads, 11, d), g), gaussian((1, kv_heads, 11, d), g + 1)
    q = gaussian((1, kv_heads * g, 2, d), g + 2)
    ck, cv = c.encode_keys(k), c.encode_values(v)
    check_attention(c, q, ck, cv)
    s = c.scores(q, ck)
    k_hat = np.repeat(c.decode_keys(ck, base_only=True).astype(np.float64), g, axis=1)
    want = q.astype(np.float64) @ np.swapaxes(k_hat, -1, -2) / math.sqrt(d)
    corr = c.score_correction(q, ck)
    want = want + (0 if corr is None else corr)
    np.testing.assert_allclose(s, want, rtol=0, atol=1e-4 * np.abs(want).max())


def tiny_llama(kv_heads, g, d):
    from tests.cache_helpers import tiny_llama as llama

    return llama(kv_heads, g, d, vocab=64, hidden=8 * kv_heads * g, intermediate=32, positions=64)


def decode_logits(model, cache, ids, steps=3):
    """Prefill then ``steps`` single-token decode steps; the last logits of each."""
    with torch.no_grad():
        out = [model(ids[:, :-steps], past_key_values=cache, use_cache=True).logits[:, -1]]
        for i in range(steps):
            out.append(model(ids[:, ids.shape[1] - steps + i :][:, :1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out)


# Fused decode steps against the decoded cache in float32: logits agree to float32 rounding
# (measured at most 3.5e-7 of the largest |logit| over these cases); a wrong head mapping moves them
# by 1e-2 or more.
CACHE_ATOL = 1e-4
# Nothing quantized, the full-precision window read natively against the dense cache's eager
# attention: measured at most 4.6e-7 of the largest |logit| over these cases.
FP_WINDOW_ATOL = 1e-5


# Each GQA case runs another key scheme (HeadQ with KIVI values), so every scheme's fused read
# meets a GQA group of more than one head.
CACHE_CASES = [(g, kv, 40 if kv == 1 else 96, s) for (g, kv), s in zip(GQA, ["kqv", "kivi", "qkqv", "headq", "block", "kv", "kqv", "kivi"])]


@pytest.mark.parametrize("g,kv_heads,d,scheme", CACHE_CASES)
def test_gqa_ratios_through_the_quantized_cache(g, kv_heads, d, scheme):
    from kvqrs.hf import QuantConfig, QuantizedKVCache, register
    from transformers import DynamicCache

    register()
    model = tiny_llama(kv_heads, g, d)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(g))
    kw = dict(residual_length=3, group=8, bases="random" if scheme == "headq" else None)
    values = "kivi" if scheme == "headq" else scheme
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = decode_logits(model, DynamicCache(), ids)
        # Nothing quantized: the dense cache's logits to float32 rounding (its decode steps
        # attend natively over the full-precision window, the dense cache by eager attention).
        off = decode_logits(model, QuantizedKVCache(QuantConfig(scheme, 3, values, 3, **dict(kw, residual_length=64)), 2), ids)
        assert torch.allclose(off, dense, rtol=0, atol=FP_WINDOW_ATOL * dense.abs().max().item())
        fused_cache = QuantizedKVCache(QuantConfig(scheme, 3, values, 3, **kw), 2)
        fused = decode_logits(model, fused_cache, ids)
        assert all(layer._fused for layer in fused_cache.layers)  # the steps read the codes
        ref = decode_logits(model, QuantizedKVCache(QuantConfig(scheme, 3, values, 3, fused=False, **kw), 2), ids)
    assert fused_cache.get_seq_length() == ids.shape[1]
    assert torch.allclose(fused, ref, rtol=0, atol=CACHE_ATOL * ref.abs().max().item())
    assert not torch.equal(fused, dense)  # really quantized


# --------------------------------------------------------------------------------------------
# bfloat16 values beyond float16's range
# --------------------------------------------------------------------------------------------

# One coordinate (token 3, channel 5 of head (0, 1)) is set to a value float16 cannot hold. Every
# other token keeps its accuracy: its largest error stays within that of the same tensor without
# the outlier plus one bfloat16 rounding of the output (2^-8 of the largest |x|): the outlier can
# widen the tensor's stored norms or scales to float32, which moves each decode by less than
# that. KIVI keys share a scale per channel over a group of 32 tokens, so that channel of the
# outlier's group is given up; every other channel counts.
BIG = [1e6, 3e38]


def other_mask(scheme, kind, shape):
    m = np.ones(shape, bool)
    m[0, 1, 3] = False
    if kind == "keys" and scheme in ("kivi", "headq"):
        m[0, 1, :, 5] = False
    return m


@pytest.mark.parametrize("big", BIG, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES + ["a2"])
def test_bfloat16_beyond_float16_range_stays_finite_and_accurate(scheme, big):
    c = codec("kv", bits=8, value_scheme="a2") if scheme == "a2" else codec(scheme, bits=8, value_scheme=None)
    x = gaussian((1, 2, 40, 64), 21).astype(BF16)
    xb = x.copy()
    xb[0, 1, 3, 5] = big
    for kind in ("values",) if scheme == "a2" else ("keys", "values"):
        enc = c.encode_keys if kind == "keys" else c.encode_values
        # HeadQ keys: the base keys (the side code is a low-rank correction of the base error,
        # which the outlier's channel dominates; it enters scores, checked below, not keys).
        dec = (lambda e: c.decode_keys(e, base_only=True)) if kind == "keys" else c.decode_values
        out, clean = dec(enc(xb)), dec(enc(x))
        assert out.dtype == BF16 and np.isfinite(out.astype(np.float32)).all()
        ref = x.astype(np.float32)
        m = other_mask(scheme, kind, x.shape)
        err, err_clean = np.abs(out.astype(np.float32) - ref)[m], np.abs(clean.astype(np.float32) - ref)[m]
        assert err.max() <= err_clean.max() + 2.0**-8 * np.abs(ref).max(), (kind, err.max(), err_clean.max())
        # The outlier itself: within its row's quantization error (8 bits, norm of the row ~ big).
        assert abs(float(out[0, 1, 3, 5]) - big) <= 0.5 * big


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bfloat16_1e6_keys_attend_like_the_oracle(scheme):
    c = codec(scheme, bits=4, value_scheme="kivi")
    k = gaussian((1, 2, 40, 64), 22).astype(BF16)
    k[0, 1, 3, 5] = 1e6
    v = gaussian((1, 2, 40, 64), 23).astype(BF16)
    v[0, 0, 7, 9] = -1e6
    q = gaussian((1, 4, 1, 64), 24) * np.float32(1e-6)
    check_attention(c, q, c.encode_keys(k), c.encode_values(v))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_beyond_float32_raise_on_every_attention_path(scheme):
    c = codec(scheme, bits=8)
    k = gaussian((1, 1, 6, 64), 25).astype(BF16)
    k[0, 0, 3, 5] = 3e38  # near the bfloat16 limit: 64 * 3e38 / sqrt(64) overflows float32
    ck, cv = c.encode_keys(k), c.encode_values(gaussian((1, 1, 6, 64), 26))
    q = np.zeros((1, 1, 1, 64), np.float32)
    q[..., 5] = 64.0
    for f in (lambda: c.scores(q, ck), lambda: c.attention(q, ck, cv, fused=False), lambda: c.attention(q, ck, cv)):
        with pytest.raises(KvqrsError, match=r"logits: .*(index \(0, 0, 0, 3\)|row 0, position 3)"):
            f()


def test_float64_queries_beyond_float32_raise_naming_their_index():
    c = codec("kqv")
    q = KEYS[..., :1, :].astype(np.float64)
    q[1, 2, 0, 7] = 1e39
    with pytest.raises(KvqrsError, match=r"q: expected values within the float32 range .* at index \(1, 2, 0, 7\)"):
        c.scores(q, c.encode_keys(KEYS))


@settings(max_examples=30)
@given(
    name=st.sampled_from([n for n in NAMES if ENTRIES[n][1] not in ("q", "y", "values.values", "queries")]),
    lead=hnp.array_shapes(min_dims=3, max_dims=3, min_side=0, max_side=4),
    perm=st.permutations([0, 1, 2]),
    step=st.integers(1, 3),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_layout_equals_its_contiguous_copy(name, lead, perm, step, scale, seed):
    """Any leading shape (empty axes included), axis order and step: the bytes of the copy."""
    base = gaussian((*[lead[p] for p in perm], 64 * step), seed, scale)
    x = base.transpose(*np.argsort(perm), 3)[..., ::step]
    assert x.shape == (*lead, 64)
    assert_same(call(name, x), call(name, np.ascontiguousarray(x)))


def test_headq_basis_of_any_float_input_and_nonfinite_refused_at_once():
    basis = kvqrs.random_orthonormal_basis(8, 64, 4)
    want = KVCodec("headq", 2, 64, basis=basis)
    for b in (torch.from_numpy(basis), torch.from_numpy(basis).requires_grad_(True), basis.astype(np.float64), np.asfortranarray(basis)):
        assert KVCodec("headq", 2, 64, basis=b).keys.params == want.keys.params
    bad = basis.copy()
    bad[5, 1] = np.inf
    with pytest.raises(KvqrsError, match=r"basis: expected finite values, got inf at index \(5, 1\)"):
        KVCodec("headq", 2, 64, basis=bad)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype,top", [(np.float16, 65504.0), (BF16, 3.38e38)], ids=["float16", "bfloat16"])
def test_decode_beyond_the_encoded_dtype_raises_instead_of_inf(scheme, dtype, top):
    """Rows at the dtype's largest value decode a little past it (quantization error); the cast
    back to the encoded dtype must not turn that into inf."""
    c = codec(scheme, bits=2)
    x = np.full((1, 3, 4, 64), top, np.float32)
    if dtype == BF16:  # whole rows of 3.4e38 have no float32 norm: one such coordinate per row
        x[..., 1:] = gaussian((1, 3, 4, 63), 5)
    x[0, 1] = -x[0, 1]
    x[0, 2, :, ::2] = 0
    x = x.astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        for kind, enc, dec in (("keys", c.encode_keys, c.decode_keys), ("values", c.encode_values, c.decode_values)):
            try:
                out = dec(enc(x))
            except KvqrsError as e:
                # float16: the cast back; bfloat16 at 3.4e38: the float32 decode itself (kernel).
                ours = re.match(rf"{kind}: decoded value \S+ at index \(\d+, \d+, \d+, \d+\) does not fit the encoded dtype", str(e))
                assert ours or (dtype == BF16 and re.search(r"float32.*(at index \(|row \d+)|row \d+ overflows float32", str(e))), str(e)
            else:
                assert np.isfinite(out.astype(np.float32)).all()
