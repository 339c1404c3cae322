"""Declared layouts (kvqrs.layout): every coder's ``layout(shape)`` is exactly what it stores,
and joining chunks, keeping a prefix and the format's checks follow from it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError, format, layout
from kvqrs.schemes import KVCodec

CONFIGS = [
    ("kv", "kv"),
    ("kqv", "kqv"),
    ("qkqv", "qkqv"),
    ("kivi", "kivi"),
    ("block", "block"),
    ("headq", "kivi"),
    ("kqv", "none"),
]


def _codec(scheme: str, values: str, d: int, bits: int, group: int = 32) -> KVCodec:
    basis = "random" if scheme == "headq" else None
    return KVCodec(scheme, bits, d, seed=3, value_scheme=values, group=group, basis=basis)


def _coders(codec: KVCodec):
    yield "keys", codec.keys, codec.encode_keys
    if codec.values is not None:
        yield "values", codec.values, codec.encode_values


@settings(max_examples=40, deadline=None)
@given(
    cfg=st.sampled_from(CONFIGS),
    d=st.sampled_from([8, 40, 64]),
    bits=st.integers(2, 8),
    lead=st.lists(st.integers(0, 3), max_size=2),
    t=st.integers(0, 70),
)
def test_each_coder_stores_exactly_its_declared_layout(cfg, d, bits, lead, t):
    codec = _codec(*cfg, d, bits)
    shape = (*lead, t, d)
    x = np.random.default_rng(t).standard_normal(shape).astype(np.float32)
    for kind, coder, encode in _coders(codec):
        enc = encode(x)
        layout.check_parts(enc.parts, coder.layout(shape), kind)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_chunks_join_and_cut_as_one_encoding(cfg):
    codec = _codec(*cfg, 40, 4)
    x = np.random.default_rng(1).standard_normal((2, 3, 96, 40)).astype(np.float32)
    for kind, _, encode in _coders(codec):
        whole = encode(x)
        cuts = [0, 32, 64, 96] if cfg[0] in ("kivi", "headq") and kind == "keys" else [0, 1, 33, 64, 96]
        chunks = [encode(x[..., a:b, :]) for a, b in zip(cuts, cuts[1:])]
        joined = codec.concat(chunks)
        assert joined.shape == whole.shape
        for name, part in whole.parts.items():
            np.testing.assert_array_equal(joined.parts[name], part, err_msg=f"{kind} {name}")
        kept = codec.slice_tokens(whole, 64)
        first = encode(x[..., :64, :])
        for name, part in first.parts.items():
            np.testing.assert_array_equal(kept.parts[name], part, err_msg=f"{kind} {name}")


def test_kivi_keys_join_and_cut_only_at_whole_groups_and_bytes():
    codec = _codec("kivi", "kivi", 16, 3, group=8)
    x = np.random.default_rng(2).standard_normal((1, 40, 16)).astype(np.float32)
    part = codec.keys.layout(x.shape)
    assert part["codes"].align == 8 and part["scales"].align == 8
    ck = codec.encode_keys(x)
    with pytest.raises(KvqrsError, match="n: cannot cut after 12 tokens"):
        codec.slice_tokens(ck, 12)
    with pytest.raises(KvqrsError, match="start: cannot cut after 4 tokens"):
        codec.slice_tokens(ck, 40, 4)
    # A window's oldest whole groups dropped: the same bytes as encoding the rest alone.
    tail = codec.slice_tokens(ck, 40, 8)
    for name, part in codec.encode_keys(x[:, 8:]).parts.items():
        np.testing.assert_array_equal(tail.parts[name], part, err_msg=name)
    with pytest.raises(KvqrsError, match="cannot be joined"):
        codec.concat([codec.encode_keys(x[:, :12]), codec.encode_keys(x[:, 12:])])
    kept = codec.slice_tokens(ck, 16)
    np.testing.assert_array_equal(kept.parts["codes"], codec.encode_keys(x[:, :16]).parts["codes"])


def test_the_format_checks_a_loaded_tensor_against_the_layout():
    codec = _codec("headq", "kivi", 40, 4)
    x = np.random.default_rng(3).standard_normal((2, 9, 40)).astype(np.float32)
    ck = codec.encode_keys(x)
    assert format.loads(format.dumps(ck), codec).shape == ck.shape
    bad = dict(ck.parts)
    bad["side_scales"] = bad["side_scales"].astype(np.uint8)
    with pytest.raises(KvqrsError, match="part 'side_scales' should be"):
        format.check_belongs(type(ck)(ck.scheme, ck.kind, ck.shape, ck.dtype, bad, ck.params), codec)
    extra = dict(ck.parts, stray=np.zeros(1, np.uint8))
    with pytest.raises(KvqrsError, match="parts"):
        format.check_belongs(type(ck)(ck.scheme, ck.kind, ck.shape, ck.dtype, extra, ck.params), codec)


def test_attention_rows_are_checked_against_the_same_layout():
    codec = _codec("qkqv", "kqv", 40, 4)
    x = np.random.default_rng(4).standard_normal((2, 9, 40)).astype(np.float32)
    ck = codec.encode_keys(x)
    rows = codec.keys.attention_rows(ck)
    declared = codec.keys.layout(ck.shape)
    from_rows = rows.layout((2,), 9, 40)
    assert from_rows["codes"] == declared["codes"]
    assert from_rows["qjl.signs"] == declared["qjl_signs"]
    assert from_rows["qjl.norms"] == declared["qjl_norms"]
