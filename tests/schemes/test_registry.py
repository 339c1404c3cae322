"""The scheme registry (kvqrs.schemes.registry): every registered scheme, on every side it
declares, is built into a KVCodec and checked against what its entry and its coder's layout
declare: the round trip, the stored bits against its declared layout and the file format, each
part's declared token rate, alignment and dtype against what encodes store, ``nbytes(T)``
against the bytes stored, fixed size per token (joined chunks and vLLM's paged slots), the
fused read path, the fewest and most bits, the calibration, the MSE value stage and the HeadQ
base. A new entry is tested here by being registered (tests/schemes/test_added_scheme.py runs
these checks on a scheme registered at run time)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
from fractions import Fraction

import numpy as np
import pytest
from kvqrs import KvqrsError
from kvqrs import format as fmt
from kvqrs.hf import QuantConfig
from kvqrs.kernels import DenseRows
from kvqrs.layout import DTYPES, WIDENED, check_parts
from kvqrs.schemes import KVCodec, registry
from kvqrs.schemes.base import Coder
from kvqrs.schemes.codec import KEY_SCHEMES, VALUE_SCHEMES
from kvqrs.schemes.matched import random_calibration
from kvqrs.schemes.registry import REGISTRY, names
from kvqrs.vllm.layout import SlotLayout, refuse_reason

D = 40  # padded to 64 by the rotation schemes
BITS = 3
SEED = 5
SHAPE = (2, 2, 37, D)  # batch, KV heads, tokens (not a whole group), head_dim
PARTNER = "kv"  # the other side's scheme where a codec needs one
# Relative L2 error of a decode: the 3-bit schemes leave about 0.2, a 1-bit code about 0.6.
MAX_ERROR = 0.75

SIDES = [pytest.param(name, kind, id=f"{name}-{kind}") for name, spec in REGISTRY.items() for kind in ("keys", "values") if spec.side(kind)]


def gaussian(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def codec_for(name: str, kind: str, bits: int | None = None, **kw) -> KVCodec:
    """A codec coding ``kind`` with ``name`` at ``bits`` (default: :data:`BITS` within the
    side's range), the other side with :data:`PARTNER`."""
    spec = REGISTRY[name]
    bits = spec.side(kind).bits(BITS) if bits is None else bits
    kw = {**spec.control_kwargs(D, bits, SEED), **kw}
    if kind == "keys":
        return KVCodec(name, bits, D, seed=SEED, value_scheme=PARTNER, value_bits=BITS, **kw)
    return KVCodec(PARTNER, BITS, D, seed=SEED, value_scheme=name, value_bits=bits, **kw)


def coder_of(codec: KVCodec, kind: str) -> Coder | None:
    return codec._key_coder() if kind == "keys" else codec.values


def encode(codec: KVCodec, kind: str, x: np.ndarray):
    if kind == "keys":
        return codec.encode_keys(x)
    weights = np.abs(gaussian(x.shape[:-1], 9)) if codec.values.takes_weights else None
    return codec.encode_values(x, weights)


def per_token(layout_of, tokens=(1, 2, 5, 8, 33, 64)) -> bool:
    """Whether every part of ``layout_of((T, d))`` holds one entry per token, cut anywhere: the
    same elements per token whatever the number of tokens."""
    one = layout_of((1, D))
    for t in tokens:
        layout = layout_of((t, D))
        for name, p in layout.items():
            if p.align != 1 or p.shape[p.token_axis] != t or math.prod(p.shape) != t * math.prod(one[name].shape):
                return False
    return True


# --------------------------------------------------------------------------------------------
# The entries and the name lists derived from them
# --------------------------------------------------------------------------------------------


def test_entries_are_named_described_and_consistent():
    for name, spec in REGISTRY.items():
        assert spec.name == name and (spec.keys or spec.values), name
        assert spec.description and "\n" not in spec.description and len(spec.description) < 120, name
        for side in (spec.keys, spec.values):
            if side is not None:
                assert side.unpaged is None or side.unpaged.strip(), name
                assert 1 <= side.min_bits <= side.max_bits <= 8
                assert side.coded or (side is spec.values and side.fused and side.unpaged), name
        assert not (spec.mse_values or spec.log_norms) or spec.values, name
        assert not spec.log_norms or spec.mse_values, name
        assert spec.headq_base is None or spec.keys, name


def test_name_lists_follow_the_registry():
    """The lists as read now (module attributes; a ``from`` import keeps those of its time)."""
    import kvqrs.schemes.codec as lists
    import kvqrs.vllm

    for which in ("KEY_SCHEMES", "VALUE_SCHEMES", "MSE_VALUE_SCHEMES", "LOG_NORM_VALUE_SCHEMES", "HEADQ_BASES", "PAGED_SCHEMES"):
        assert names(which) == getattr(registry, which)
    assert lists.KEY_SCHEMES == lists.SCHEMES == tuple(n for n, s in REGISTRY.items() if s.keys)
    assert lists.VALUE_SCHEMES == tuple(n for n, s in REGISTRY.items() if s.values)
    assert lists.MSE_VALUE_SCHEMES == tuple(n for n, s in REGISTRY.items() if s.mse_values)
    assert lists.LOG_NORM_VALUE_SCHEMES == tuple(n for n, s in REGISTRY.items() if s.log_norms)
    assert kvqrs.vllm.PAGED_SCHEMES == tuple(n for n, s in REGISTRY.items() if s.paged)
    ranks = [REGISTRY[n].headq_base for n in lists.HEADQ_BASES]
    assert ranks == list(range(len(ranks))) and set(lists.HEADQ_BASES) == {n for n, s in REGISTRY.items() if s.headq_base is not None}
    # The default base is the first.
    assert inspect.signature(KVCodec).parameters["headq_base"].default == lists.HEADQ_BASES[0]
    assert QuantConfig("kv", 4).headq_base == lists.HEADQ_BASES[0]


def test_unknown_schemes_are_refused_with_the_lists():
    with pytest.raises(KvqrsError, match=r"^scheme: expected one of \('"):
        KVCodec("nope", 3, D)
    with pytest.raises(KvqrsError, match=r"^value_scheme: expected one of \('"):
        KVCodec("kv", 3, D, value_scheme="nope")
    for name, spec in REGISTRY.items():
        if spec.keys is None:
            with pytest.raises(KvqrsError, match="^scheme: expected one of"):
                KVCodec(name, 3, D)
        if spec.values is None:
            with pytest.raises(KvqrsError, match="^value_scheme: expected one of"):
                KVCodec(PARTNER, 3, D, value_scheme=name)


# --------------------------------------------------------------------------------------------
# Every scheme, every side it declares
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kind", SIDES)
def test_coder_declares_the_protocol(name, kind):
    codec = codec_for(name, kind)
    coder = coder_of(codec, kind)
    assert (coder is not None) == REGISTRY[name].side(kind).coded
    if coder is None:  # values kept in full precision
        assert kind == "values" and not codec.needs_weights
        return
    assert Coder in type(coder).__mro__
    assert (coder.scheme, coder.kind, coder.head_dim, coder.k) == (name, kind, D, codec.backend)
    assert isinstance(dict(coder.params), dict)
    for flag in ("fused", "has_layout", "takes_weights", "needs_weights"):
        assert isinstance(getattr(coder, flag), bool), flag
    assert callable(getattr(coder, "attention_rows", None)) >= coder.fused
    assert callable(getattr(coder, "layout", None)) == coder.has_layout
    assert coder.takes_weights >= coder.needs_weights and codec.needs_weights == coder.takes_weights
    if kind == "keys":
        assert callable(coder.scores)


@pytest.mark.parametrize("name,kind", SIDES)
def test_round_trip_bits_and_format(name, kind):
    codec = codec_for(name, kind)
    coder = coder_of(codec, kind)
    x = gaussian(SHAPE, 1)
    if coder is None:
        with pytest.raises(KvqrsError, match="full precision"):
            codec.encode_values(x)
        return
    enc = encode(codec, kind, x)
    assert (enc.scheme, enc.kind, enc.shape, enc.dtype) == (name, kind, SHAPE, np.float32)
    decode = codec.decode_keys if kind == "keys" else codec.decode_values
    back = decode(enc)
    assert back.shape == SHAPE and back.dtype == np.float32
    assert np.linalg.norm(back - x) < MAX_ERROR * np.linalg.norm(x)
    # The stored bits: every part's bytes, and where the coder declares its layout, that layout.
    assert enc.bits_per_element == pytest.approx(8 * sum(np.asarray(p).nbytes for p in enc.parts.values()) / x.size)
    assert 1 < enc.bits_per_element < 16
    if coder.has_layout:  # every part as declared, nothing else
        check_parts(enc.parts, codec.layout(kind, SHAPE), kind)
    # The file format keeps every byte.
    np.testing.assert_array_equal(decode(fmt.loads(fmt.dumps(enc), codec)), back)


TOKENS = (0, 1, 2, 5, 8, 31, 32, 33, 64, 100)


@pytest.mark.parametrize("name,kind", SIDES)
def test_declared_rates_alignment_and_dtypes_are_what_encodes_store(name, kind):
    """Each part's declared token rate, alignment and dtype against actual encodes: the token
    axis holds ceil(T * rate) entries at every T, the other axes stay, the stored dtype is the
    declared one's (float16 scalars, float32 when a value leaves float16's range); a part cuts
    at whole entries at multiples of its align, and the first ``align`` tokens encode to the
    whole tensor's first entries; ``nbytes(T)`` is the bytes an encode of T tokens stores."""
    codec = codec_for(name, kind)
    if not codec.has_layout(kind):
        assert REGISTRY[name].side(kind).unpaged, "a side without a layout is not paged"
        return
    x = gaussian((2, 2, max(TOKENS), D), 13)
    declared = codec.layout(kind, (2, 2, 0, D))
    for t in TOKENS:
        enc = encode(codec, kind, x[..., :t, :])
        assert set(enc.parts) == set(declared), t
        widened = 0  # scalars that left float16's range (a tiny HeadQ residual of one token) store float32
        for part_name, p in declared.items():
            a = np.asarray(enc.parts[part_name])
            ax = a.ndim + p.token_axis
            assert (a.shape[:ax], a.shape[ax + 1 :]) == (p.outer, p.inner), (part_name, t)
            assert a.shape[ax] == math.ceil(t * p.rate), (part_name, t, p.rate)
            if p.dtype == "scalar" and a.dtype == WIDENED:
                widened += a.nbytes - a.size * DTYPES["scalar"].itemsize
            else:
                assert a.dtype == DTYPES[p.dtype], (part_name, a.dtype, p.dtype)
        assert codec.nbytes(kind, enc.shape) + widened == enc.nbytes, t
    # Alignment: every part cuts at whole entries at multiples of its align, and a chunk of
    # the side's alignment (their least common multiple) encodes to a prefix of every part.
    side_align = math.lcm(*(p.align for p in declared.values()))
    assert side_align <= codec.align() and codec.align() % side_align == 0
    whole = encode(codec, kind, x)
    head = encode(codec, kind, x[..., :side_align, :])
    for part_name, p in declared.items():
        assert Fraction(p.rate * p.align).denominator == 1, f"{part_name}: {p.align} tokens end mid-entry"
        a = np.asarray(head.parts[part_name])
        kept = np.take(np.asarray(whole.parts[part_name]), np.arange(a.shape[p.token_axis]), axis=p.token_axis)
        np.testing.assert_array_equal(a, kept, err_msg=f"{part_name}: the first {side_align} tokens")
    # Gaussian tokens store float16 scalars, as declared: nbytes(T) is exact.
    assert codec.nbytes(kind, whole.shape) == whole.nbytes


@pytest.mark.parametrize("name,kind", SIDES)
def test_fixed_size_per_token_as_declared(name, kind):
    side = REGISTRY[name].side(kind)
    codec = codec_for(name, kind)
    if not codec.has_layout(kind):
        assert not codec.fixed_per_token(kind) and side.unpaged
        return
    assert per_token(lambda shape: codec.layout(kind, shape)) == codec.fixed_per_token(kind)
    assert side.unpaged is not None or codec.fixed_per_token(kind), f"{name}: paged sides have a fixed size per token"
    if codec.fixed_per_token(kind):  # chunks cut anywhere join to the bytes of one encode
        x = gaussian(SHAPE, 2)
        whole = encode(codec, kind, x)
        joined = codec.concat([encode(codec, kind, x[..., :5, :]), encode(codec, kind, x[..., 5:, :])])
        assert set(joined.parts) == set(whole.parts)
        for n, p in whole.parts.items():
            np.testing.assert_array_equal(joined.parts[n], p, err_msg=n)
        assert codec.nbytes(kind, (1, D)) * SHAPE[-2] * math.prod(SHAPE[:-2]) == whole.nbytes
    else:  # some part is shared by a group of tokens: cut at its multiples only
        assert codec.align() > 1


@pytest.mark.parametrize("name", list(REGISTRY))
def test_paged_as_declared(name):
    spec = REGISTRY[name]
    for kind in ("keys", "values"):
        side = spec.side(kind)
        if side is None:
            continue
        config = types.SimpleNamespace(
            key_scheme=name if kind == "keys" else PARTNER,
            value_scheme=name if kind == "values" else PARTNER,
            residual_length=0,
            sink_tokens=0,
            value_norms="float",
            calibration=None,  # matched: refused without a calibration that fixes its size per token
        )
        reason = refuse_reason(config)
        assert reason is None if side.unpaged is None else side.unpaged in reason, (kind, reason)
        assert side.paged_with is None or side.unpaged, "a calibration decides only for a side refused without one"
    if spec.paged:  # a slot holds one token's parts of both sides, as declared and as encoded
        slots = SlotLayout(QuantConfig(name, spec.keys.bits(BITS), name, spec.values.bits(BITS)), 0, D)
        x = gaussian((1, D), 12)
        one = [slots.codec.encode_keys(x), slots.codec.encode_values(x)]
        assert slots.slot_bytes == sum(e.nbytes for e in one) == sum(slots.codec.nbytes(k, (1, D)) for k in ("keys", "values"))
        for p in slots.parts:
            stored = np.asarray(one[("keys", "values").index(p.side)].parts[p.name])
            assert (p.dtype, p.row_bytes) == (stored.dtype, stored.nbytes), (p.side, p.name)


@pytest.mark.parametrize("name,kind", SIDES)
def test_fused_path_as_declared(name, kind):
    side = REGISTRY[name].side(kind)
    codec = codec_for(name, kind)
    coder = coder_of(codec, kind)
    assert (coder.fused if coder is not None else True) == side.fused
    assert codec.has_fused_path() == side.fused
    k, v = gaussian(SHAPE, 3), gaussian(SHAPE, 4)
    q = gaussian((2, 6, 3, D), 5)  # 3 query heads per KV head, 3 query tokens
    ck = codec.encode_keys(k)
    cv = DenseRows(v) if codec.values is None else encode(codec, "values", v)
    if not side.fused:
        with pytest.raises(KvqrsError, match="no fused attention"):
            codec.fused_attention(q, ck, cv)
        return
    got = codec.fused_attention(q, ck, cv, probs=True)
    s = codec.scores(q, ck).astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    v_hat = v if codec.values is None else codec.decode_values(cv)
    want = p @ np.repeat(v_hat.astype(np.float64), 3, axis=-3)
    np.testing.assert_allclose(got.probs, p, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(got.out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,kind", SIDES)
def test_bit_range_as_declared(name, kind):
    side = REGISTRY[name].side(kind)
    x = gaussian((3, D), 6)
    for bits in (side.min_bits, side.max_bits):
        codec = codec_for(name, kind, bits=bits)
        if coder_of(codec, kind) is not None:
            encode(codec, kind, x)
    for bits in (side.min_bits - 1, side.max_bits + 1):
        if 1 <= bits <= 8:
            with pytest.raises(KvqrsError, match="bits"):
                codec_for(name, kind, bits=bits)


@pytest.mark.parametrize("name,kind", [p for p in SIDES if REGISTRY[p.values[0]].needs_calibration])
def test_calibration_as_declared(name, kind):
    """Without its control a calibrated scheme does not encode (the others are built and
    encoded without one in every test above)."""
    x = gaussian((3, D), 7)
    with pytest.raises(KvqrsError, match="basis|calibration"):
        codec = KVCodec(name, BITS, D) if kind == "keys" else KVCodec(PARTNER, BITS, D, value_scheme=name)
        encode(codec, kind, x)


@pytest.mark.parametrize("name", VALUE_SCHEMES)
@pytest.mark.parametrize("option,value,flag", [("value_scale", "least_squares", "mse_values"), ("value_norms", "log8", "log_norms")])
def test_value_stage_as_declared(name, option, value, flag):
    x = gaussian((2, 8, D), 8)
    if getattr(REGISTRY[name], flag):
        codec = codec_for(name, "values", group=8, **{option: value})
        assert codec.values.params[{"value_scale": "scale", "value_norms": "norms"}[option]] == value  # the stage took it
        assert np.linalg.norm(codec.decode_values(encode(codec, "values", x)) - x) < MAX_ERROR * np.linalg.norm(x)
    else:
        with pytest.raises(KvqrsError, match=f"^{option}: {value!r} applies to"):
            codec_for(name, "values", group=8, **{option: value})


@pytest.mark.parametrize("name", KEY_SCHEMES)
def test_headq_base_as_declared(name):
    if REGISTRY[name].headq_base is None:
        with pytest.raises(KvqrsError, match="^headq_base: expected one of"):
            KVCodec("headq", BITS, D, headq_base=name, basis="random")
        return
    codec = KVCodec("headq", BITS, D, seed=SEED, headq_base=name, basis="random")
    assert codec._key_coder().base.scheme == name
    ck = codec.encode_keys(gaussian(SHAPE, 10))
    assert ck.params["base"]["scheme"] == name and codec.decode_keys(ck).shape == SHAPE


def test_width_class_values_declare_their_own_capabilities():
    """matched values in width classes (a calibration's choice, not the scheme's default): no
    fused path, weights needed; the codec follows the coder."""
    cal = dataclasses.replace(random_calibration(D, 3, 1), value_bits=2, value_classes=((3, 4), (2, 8), (1, 4)))
    codec = KVCodec("matched", 3, D, seed=SEED, calibration=cal, group=16)
    coder = codec.values
    assert (coder.fused, coder.has_layout, coder.takes_weights, coder.needs_weights) == (False, True, True, True)
    assert codec.needs_weights and not codec.has_fused_path()
    v = gaussian((2, 20, D), 11)
    with pytest.raises(KvqrsError, match="weights"):
        codec.encode_values(v)
    cv = codec.encode_values(v, np.ones(v.shape[:-1]))
    assert codec.decode_values(cv).shape == v.shape
