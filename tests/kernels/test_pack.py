"""Bit packing (docs/kernels.md section 2): pack_bits / unpack_bits against the oracle,
hand-checked layouts and argument errors. Packing is exact, so every comparison is byte for byte."""

from __future__ import annotations

import re

import kvqrs
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import oracle

from tests.strategies import bits, leading_shapes

CODE_DTYPES = [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64]
counts = st.integers(min_value=0, max_value=40)


@st.composite
def code_arrays(draw, dtypes=CODE_DTYPES):
    """(codes, bits): valid codes of a drawn integer dtype and shape ``(*leading, m)``."""
    b = draw(bits)
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    hi = min(2**b - 1, int(np.iinfo(dtype).max))
    shape = (*draw(leading_shapes), draw(counts))
    codes = draw(hnp.arrays(dtype, shape, elements=st.integers(0, hi)))
    return codes, b


def index_named(message: str, pos: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether an error message names position ``pos`` of an array of ``shape``.

    Accepts the full index ``(i, j, ...)`` or ``row r, position p`` with ``r`` the flattened row.
    """
    full = "(" + ", ".join(str(p) for p in pos) + ("," if len(pos) == 1 else "") + ")"
    row = int(np.ravel_multi_index(pos[:-1], shape[:-1])) if len(pos) > 1 else 0
    return full in message or f"row {row}, position {pos[-1]}" in message


# --------------------------------------------------------------------------------------------
# Against the oracle
# --------------------------------------------------------------------------------------------


@given(code_arrays())
def test_pack_matches_oracle(case):
    codes, b = case
    got = kvqrs.pack_bits(codes, b)
    want = oracle.pack_bits(codes, b)
    assert got.dtype == np.uint8
    assert got.shape == (*codes.shape[:-1], kvqrs.packed_size(codes.shape[-1], b))
    np.testing.assert_array_equal(got, want)


@given(case=code_arrays(), data=st.data())
def test_pack_strided_and_transposed(case, data):
    codes, b = case
    assume(codes.ndim >= 1)
    views = [codes[..., ::2], codes[..., ::-1]]
    if codes.ndim >= 2:
        views.append(np.swapaxes(codes, -1, -2))
        views.append(codes[::-1, ..., 1:])
    view = data.draw(st.sampled_from(views))
    got = kvqrs.pack_bits(view, b)
    np.testing.assert_array_equal(got, oracle.pack_bits(np.ascontiguousarray(view), b))
    np.testing.assert_array_equal(got, kvqrs.pack_bits(np.ascontiguousarray(view), b))


@given(code_arrays())
def test_unpack_inverts_pack(case):
    codes, b = case
    m = codes.shape[-1]
    out = kvqrs.unpack_bits(kvqrs.pack_bits(codes, b), b, m)
    assert out.dtype == np.uint8
    assert out.shape == codes.shape
    np.testing.assert_array_equal(out, codes)


@given(b=bits, m=counts, leading=leading_shapes, data=st.data())
def test_unpack_matches_oracle_on_arbitrary_bytes(b, m, leading, data):
    # Arbitrary bytes, including set bits in the unused high part of the last byte.
    nbytes = kvqrs.packed_size(m, b)
    packed = data.draw(hnp.arrays(np.uint8, (*leading, nbytes)))
    got = kvqrs.unpack_bits(packed, b, m)
    np.testing.assert_array_equal(got, oracle.unpack_bits(packed, b, m))
    assert got.shape == (*leading, m)
    assert np.all(got < 2**b)
    # Re-packing gives the input with the unused high bits cleared.
    repacked = kvqrs.pack_bits(got, b)
    mask = np.full(nbytes, 0xFF, dtype=np.uint8)
    if nbytes and (m * b) % 8:
        mask[-1] = (1 << ((m * b) % 8)) - 1
    np.testing.assert_array_equal(repacked, packed & mask)


@given(b=bits, m=counts, data=st.data())
def test_unpack_strided_input(b, m, data):
    nbytes = kvqrs.packed_size(m, b)
    packed = data.draw(hnp.arrays(np.uint8, (3, 2 * nbytes)))
    view = packed[::-1, ::2]
    np.testing.assert_array_equal(kvqrs.unpack_bits(view, b, m), kvqrs.unpack_bits(np.ascontiguousarray(view), b, m))


@given(code_arrays())
def test_unused_high_bits_are_zero(case):
    codes, b = case
    m = codes.shape[-1]
    packed = kvqrs.pack_bits(codes, b)
    used = (m * b) % 8
    if packed.shape[-1] and used:
        assert np.all(packed[..., -1] >> used == 0)


@given(b=bits, m=st.integers(0, 200))
def test_packed_size(b, m):
    assert kvqrs.packed_size(m, b) == -(-m * b // 8)
    assert kvqrs.pack_bits(np.zeros(m, np.uint8), b).shape == (kvqrs.packed_size(m, b),)


# --------------------------------------------------------------------------------------------
# Hand-checked layouts (little-endian bit stream, bit 0 = LSB of byte 0)
# --------------------------------------------------------------------------------------------

HAND_CASES = [
    # codes, bits, bytes
    ([1, 0, 3, 2], 2, [0b10110001]),
    ([1, 0, 0, 0, 0, 0, 0, 0, 1], 1, [0x01, 0x01]),
    ([1, 1, 0, 1], 1, [0b1011]),
    ([5, 3, 7], 3, [0b11011101, 0b1]),  # 101 | 011<<3 | 111<<6 spills one bit
    ([0x1, 0xA], 4, [0xA1]),
    ([0xF, 0x0, 0x3], 4, [0x0F, 0x03]),
    ([31, 0], 5, [0x1F, 0x00]),
    ([1, 1], 5, [0b00100001, 0b00]),
    ([0x3F, 0x01], 6, [0x7F, 0x00]),
    ([0x7F] * 8, 7, [0xFF] * 7),
    ([0x40, 0x01], 7, [0xC0, 0x00]),
    ([0, 255, 17], 8, [0, 255, 17]),
    ([], 3, []),
]


@pytest.mark.parametrize("codes, b, expected", HAND_CASES)
def test_pack_hand_cases(codes, b, expected):
    got = kvqrs.pack_bits(np.array(codes, dtype=np.uint8), b)
    assert got.tolist() == expected
    assert kvqrs.unpack_bits(np.array(expected, np.uint8), b, len(codes)).tolist() == codes


def test_rows_pack_independently():
    # Each row starts on a byte boundary: row 1 is not shifted by row 0's spare bits.
    codes = np.array([[1, 1, 1], [1, 1, 1]], dtype=np.uint8)
    assert kvqrs.pack_bits(codes, 3).tolist() == [[0b01001001, 0], [0b01001001, 0]]


@pytest.mark.parametrize("b", range(1, 9))
def test_single_code_each_position(b):
    # Code with only its top bit set, at every position: lands at stream bit i*b + b - 1.
    m = 11
    for i in range(m):
        codes = np.zeros(m, np.uint8)
        codes[i] = 1 << (b - 1)
        packed = kvqrs.pack_bits(codes, b)
        p = i * b + b - 1
        want = np.zeros(kvqrs.packed_size(m, b), np.uint8)
        want[p // 8] = 1 << (p % 8)
        np.testing.assert_array_equal(packed, want)


def test_list_input_accepted():
    assert kvqrs.pack_bits([1, 0, 3, 2], 2).tolist() == [0b10110001]


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_kvqrs_error_is_value_error():
    assert issubclass(kvqrs.KvqrsError, ValueError)


@pytest.mark.parametrize("bad", [0, 9, -1, True, False, 2.0, None, "2"])
def test_bad_bits(bad):
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.pack_bits(np.zeros(4, np.uint8), bad)
    msg = str(info.value)
    assert msg.startswith("bits:")
    assert "1..8" in msg and str(bad) in msg
    with pytest.raises(kvqrs.KvqrsError, match="^bits:"):
        kvqrs.unpack_bits(np.zeros(4, np.uint8), bad, 4)


@given(case=code_arrays(), data=st.data())
def test_code_too_large_names_index(case, data):
    codes, b = case
    assume(codes.size > 0 and 2**b <= np.iinfo(codes.dtype).max)
    codes = codes.copy()
    pos = tuple(data.draw(st.integers(0, s - 1)) for s in codes.shape)
    bad = data.draw(st.integers(2**b, min(int(np.iinfo(codes.dtype).max), 2**16)))
    codes[pos] = bad
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.pack_bits(codes, b)
    msg = str(info.value)
    assert msg.startswith("codes:"), msg
    assert str(bad) in msg and str(2**b) in msg, msg  # actual value and the limit
    assert index_named(msg, pos, codes.shape), msg


@given(case=code_arrays(dtypes=[np.int8, np.int16, np.int32, np.int64]), data=st.data())
def test_negative_code_names_index(case, data):
    codes, b = case
    assume(codes.size > 0)
    codes = codes.copy()
    pos = tuple(data.draw(st.integers(0, s - 1)) for s in codes.shape)
    bad = data.draw(st.integers(int(np.iinfo(codes.dtype).min), -1))
    codes[pos] = bad
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.pack_bits(codes, b)
    msg = str(info.value)
    assert msg.startswith("codes:") and str(bad) in msg, msg
    assert index_named(msg, pos, codes.shape), msg


def test_code_256_in_wide_dtype_is_not_wrapped():
    # 256 would wrap to 0 in uint8; it must be rejected, not packed as 0.
    with pytest.raises(kvqrs.KvqrsError, match="256"):
        kvqrs.pack_bits(np.array([0, 256], np.int64), 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.complex64, object])
def test_float_codes_rejected(dtype):
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.pack_bits(np.array([0, 1], dtype=dtype), 2)
    msg = str(info.value)
    assert msg.startswith("codes:") and str(np.dtype(dtype)) in msg, msg


def test_scalar_codes_rejected():
    with pytest.raises(kvqrs.KvqrsError, match="^codes:"):
        kvqrs.pack_bits(np.uint8(1), 2)


@given(b=bits, m=st.integers(0, 40), delta=st.sampled_from([-2, -1, 1, 2]))
def test_unpack_wrong_length(b, m, delta):
    want = kvqrs.packed_size(m, b)
    got_len = want + delta
    assume(got_len >= 0)
    packed = np.zeros((2, got_len), np.uint8)
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.unpack_bits(packed, b, m)
    msg = str(info.value)
    assert msg.startswith("packed:"), msg
    assert re.search(rf"\b{want}\b", msg) and str((2, got_len)) in msg, msg


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int64, np.float32])
def test_unpack_non_uint8_rejected(dtype):
    with pytest.raises(kvqrs.KvqrsError) as info:
        kvqrs.unpack_bits(np.zeros(2, dtype), 4, 4)
    msg = str(info.value)
    assert msg.startswith("packed:") and str(np.dtype(dtype)) in msg, msg


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_unpack_bad_count(bad):
    with pytest.raises(kvqrs.KvqrsError, match="^count:"):
        kvqrs.unpack_bits(np.zeros(2, np.uint8), 4, bad)
