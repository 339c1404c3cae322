"""The compressed-cache format (docs/format.md): round trips of every scheme, identity checks against a
codec, and every kind of broken input (truncated, altered, hostile, well-formed but wrong meta)
raising KvqrsError; the fuzz corpus from benches/fuzz_format.py as a regression test."""

from __future__ import annotations

import json
import pathlib

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import _native
from kvqrs import format as fmt
from kvqrs.schemes import KVCodec
from kvqrs.schemes.registry import KEY_SCHEMES

from tests.scheme_helpers import scheme_codec

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "corpus" / "format"
SCHEMES = KEY_SCHEMES  # each with its seeded control where it needs a calibration


def codec(scheme, bits=3, d=40, seed=1, **kw):
    return scheme_codec(scheme, bits, d, seed, **kw)


def tensor(shape=(1, 2, 33, 40), seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(1, 2, 33, 40), (5, 40), (3, 0, 40)])
def test_round_trip_every_scheme(scheme, shape, tmp_path):
    c = codec(scheme)
    x = tensor(shape)
    for enc, decode in ((c.encode_keys(x), c.decode_keys), (c.encode_values(x), c.decode_values)):
        back = fmt.loads(fmt.dumps(enc), c)
        assert (back.scheme, back.kind, back.shape, back.dtype, dict(back.params)) == (
            enc.scheme,
            enc.kind,
            enc.shape,
            enc.dtype,
            dict(enc.params),
        )
        assert all(
            np.array_equal(back.parts[k], np.asarray(v)) and back.parts[k].dtype == np.asarray(v).dtype for k, v in enc.parts.items()
        )
        np.testing.assert_array_equal(decode(back), decode(enc))
        fmt.save(tmp_path / "t.kvq", enc)
        np.testing.assert_array_equal(decode(fmt.load(tmp_path / "t.kvq", c)), decode(enc))


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_original_dtype_survives(dtype):
    import ml_dtypes  # noqa: F401 (bfloat16)

    c = codec("kqv")
    x = tensor().astype(dtype)
    back = fmt.loads(fmt.dumps(c.encode_keys(x)), c)
    assert back.dtype == x.dtype and c.decode_keys(back).dtype == x.dtype


def test_a2_values_round_trip():
    c = KVCodec("kqv", 2, 40, seed=3, value_scheme="a2")
    v = tensor((20, 40))
    enc = c.encode_values(v, np.linspace(0, 1, 20))
    np.testing.assert_array_equal(c.decode_values(fmt.loads(fmt.dumps(enc), c)), c.decode_values(enc))


@pytest.mark.parametrize(
    "other",
    [
        dict(scheme="kqv", seed=2),
        dict(scheme="kqv", bits=4),
        dict(scheme="qkqv"),
        dict(scheme="kv"),
        dict(scheme="kivi"),
        dict(scheme="kqv", d=48),
    ],
)
def test_loading_under_other_settings_raises(other):
    enc = codec("kqv").encode_keys(tensor())
    with pytest.raises(kvqrs.KvqrsError, match="compressed cache|encoded"):
        fmt.loads(fmt.dumps(enc), codec(**other))


def test_headq_other_basis_raises():
    enc = codec("headq").encode_keys(tensor())
    other = KVCodec("headq", 3, 40, seed=1, basis=np.linalg.qr(np.random.default_rng(5).standard_normal((40, 4)))[0])
    with pytest.raises(kvqrs.KvqrsError, match="basis_sha256"):
        fmt.loads(fmt.dumps(enc), other)


def test_values_loaded_as_keys_and_codec_without_values_raise():
    c = codec("kqv")
    enc = c.encode_values(tensor())
    with pytest.raises(kvqrs.KvqrsError, match="no values"):
        fmt.loads(fmt.dumps(enc), KVCodec("kqv", 3, 40, seed=1, value_scheme="none"))
    keys = c.encode_keys(tensor())
    bad = keys.__class__(keys.scheme, "values", keys.shape, keys.dtype, keys.parts, keys.params)
    with pytest.raises(kvqrs.KvqrsError, match="encoded"):
        fmt.loads(fmt.dumps(bad), c)


def _sections(enc):
    return [(n, code, list(shape), payload) for n, code, shape, payload in _native.container_read(fmt.dumps(enc))]


def _rebuild(sections):
    return _native.container_write(sections)


def test_part_of_the_wrong_shape_is_caught_with_a_valid_checksum():
    c = codec("kqv")
    sections = _sections(c.encode_keys(tensor()))
    name, code, shape, payload = sections[1]  # packed codes (1, 2, 33, 24)
    sections[1] = (name, code, [shape[0], shape[1], shape[3], shape[2]], payload)  # same bytes, transposed shape
    data = _rebuild(sections)
    fmt.loads(data)  # a well-formed container ...
    with pytest.raises(kvqrs.KvqrsError, match="part 'codes' should be"):
        fmt.loads(data, c)  # ... that this codec did not write


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(format="kvqrs-encoded-v9"), "format"),
        (lambda m: m.pop("params"), "meta must hold"),
        (lambda m: m.update(shape="12"), "meta must hold"),
        (lambda m: m.update(shape=[-1, 40]), "non-negative"),
        (lambda m: m.update(shape=[True, 40]), "non-negative"),
        (lambda m: m.update(shape=[]), "non-empty"),
        (lambda m: m.update(kind="queries"), "kind"),
        (lambda m: m.update(dtype="int8"), "dtype"),
        (lambda m: m.update(parts=["norms", "codes"]), "lists parts"),
    ],
)
def test_well_formed_container_with_a_bad_meta(edit, match):
    sections = _sections(codec("kqv").encode_keys(tensor()))
    meta = json.loads(sections[0][3])
    edit(meta)
    text = json.dumps(meta).encode()
    sections[0] = ("meta", 5, [len(text)], text)
    with pytest.raises(kvqrs.KvqrsError, match=match):
        fmt.loads(_rebuild(sections))


@pytest.mark.parametrize(
    "first", [("meta", 0, [2], b"{}"), ("codes", 5, [2], b"{}"), ("meta", 5, [3], b"\xff\xfe{"), ("meta", 5, [2], b"[]")]
)
def test_bad_meta_section(first):
    with pytest.raises(kvqrs.KvqrsError, match="compressed cache"):
        fmt.loads(_native.container_write([first]))


def test_empty_container_and_non_bytes():
    with pytest.raises(kvqrs.KvqrsError, match="no sections"):
        fmt.loads(_native.container_write([]))
    with pytest.raises(kvqrs.KvqrsError, match="data: expected bytes"):
        fmt.loads("not bytes")
    with pytest.raises(kvqrs.KvqrsError, match="enc: expected"):
        fmt.dumps({"codes": 1})


def test_every_truncation_raises():
    data = fmt.dumps(codec("qkqv").encode_keys(tensor((3, 40))))
    for n in range(len(data)):
        with pytest.raises(kvqrs.KvqrsError, match="compressed cache"):
            fmt.loads(data[:n])
    with pytest.raises(kvqrs.KvqrsError, match="trailing"):
        fmt.loads(data + b"\0")


@given(st.data())
def test_any_altered_byte_raises(data):
    blob = bytearray(fmt.dumps(codec("kivi").encode_keys(tensor((2, 33, 40)))))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(kvqrs.KvqrsError, match="compressed cache"):
        fmt.loads(bytes(blob))


@given(st.binary(max_size=200))
def test_random_bytes_raise(blob):
    with pytest.raises(kvqrs.KvqrsError):
        fmt.loads(blob)


def test_writer_rejects_bad_sections():
    with pytest.raises(kvqrs.KvqrsError, match="payload"):
        _native.container_write([("x", 2, [3], b"\0" * 11)])
    with pytest.raises(kvqrs.KvqrsError, match="unique names"):
        _native.container_write([("x", 0, [1], b"a"), ("x", 0, [1], b"b")])
    with pytest.raises(kvqrs.KvqrsError, match="dtype code"):
        _native.container_write([("x", 9, [1], b"a")])


def test_fuzz_corpus():
    files = sorted(CORPUS.glob("*.bin"))
    assert len(files) >= 10, "the corpus from benches/fuzz_format.py is missing"
    for p in files:
        with pytest.raises(kvqrs.KvqrsError):
            fmt.loads(p.read_bytes())
