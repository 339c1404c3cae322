"""Symmetric per-row absmax codes (docs/kernels.md section 14): Rust against the float64 oracle,
the levels, zero rows and widths, torch in and out, every error path."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import _native, oracle

from tests.strategies import finite_rows, leading_shapes

# The kernel forms t + 0.5 = ((x / s + 1) * 0.5) * L + 0.5 in float32 (the oracle in float64):
# the division, the + 1, the * L and the + 0.5 each round by at most 2^-24 relative, which is
# below 6e-5 in units of t for L <= 255 (|x / s| <= 1 + 2^-11). A code may therefore differ from
# the oracle's, by one step, only where the oracle's t + 0.5 lies within this distance of an
# integer.
ROUNDING_TOL = 1e-4
# Decoding ((2c - L) / L) * s in float32 rounds twice (the division, the multiply): within
# 2^-23 relative of the float64 level times s, so within this bound times the row's scale.
DECODE_RTOL = 2.0**-22

widths_of = st.integers(1, 70).flatmap(lambda d: st.lists(st.integers(0, 8), min_size=d, max_size=d))


def t_plus_half(x, scales, widths):
    """The oracle's float64 ``t + 0.5`` of every coordinate."""
    s = np.asarray(scales, np.float64)[..., None]
    top = 2.0 ** np.asarray(widths, np.int64) - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(s > 0, np.asarray(x, np.float64) / np.where(s > 0, s, 1), 0.0)
    return ((u + 1) * 0.5) * top + 0.5


def check_against_oracle(x, widths):
    w = np.asarray(widths, np.uint8)
    got = kvqrs.absmax_encode(x, w)
    codes, scales = oracle.absmax_encode(x, w)
    assert got.codes.dtype == np.uint8 and got.codes.shape == x.shape
    assert got.scales.dtype == np.float16 and got.scales.shape == x.shape[:-1]
    assert got.widths.dtype == np.uint8 and got.widths.tobytes() == w.tobytes()
    assert got.scales.tobytes() == scales.tobytes()  # the float16 scale exactly
    diff = got.codes != codes
    if diff.any():
        t = t_plus_half(x, scales, w)
        dist = np.abs(t - np.round(t))[diff]
        assert np.all(dist < ROUNDING_TOL), dist
        assert np.all(np.abs(got.codes[diff].astype(int) - codes[diff].astype(int)) == 1)
    assert not got.codes[..., w == 0].any()
    dec = kvqrs.absmax_decode(got)
    want = oracle.absmax_decode(got.codes, got.scales, w)
    assert dec.dtype == np.float32 and dec.shape == x.shape
    bound = DECODE_RTOL * got.scales.astype(np.float64)[..., None]
    assert np.all(np.abs(dec - want) <= bound)
    assert not dec[..., w == 0].any()
    return got


@given(data=st.data(), widths=widths_of, leading=leading_shapes, scale=st.sampled_from([1e-6, 1e-2, 1.0, 100.0, 6e4]))
def test_matches_oracle(data, widths, leading, scale):
    check_against_oracle(finite_rows(data.draw, leading, len(widths), scale=scale), widths)


@given(data=st.data(), widths=widths_of)
def test_ties_and_grid_points_match_the_oracle(data, widths):
    """Values on the levels and on the midpoints between them (t + 0.5 an integer in exact
    arithmetic): equal to the oracle except within ROUNDING_TOL of the tie."""
    w = np.asarray(widths)
    top = 2 ** w.astype(np.int64) - 1
    j = np.asarray(data.draw(st.lists(st.integers(0, 510), min_size=w.size, max_size=w.size))) % (2 * top + 1)
    v = np.where(top > 0, (j - top) / np.maximum(top, 1), 2.0)  # (j - L) / L: a level or a midpoint; 2 where uncoded
    if (w > 0).any():
        v[np.argmax(w > 0)] = 1.0  # the row's largest coded magnitude: s itself
    s = data.draw(st.sampled_from([1.0, 0.75, 3.0, 1000.0]))
    x = (np.stack([v, -v]) * s).astype(np.float32)
    check_against_oracle(x, w)


def test_every_width_mixed_and_split_over_threads():
    # 2 x 300 rows of 128: above the size below which a call stays on one thread.
    rng = np.random.default_rng(1)
    w = np.resize(np.arange(1, 9, dtype=np.uint8), 128)
    x = (rng.standard_normal((2, 300, 128)) * rng.uniform(1e-3, 1e3, (2, 300, 1))).astype(np.float32)
    got = check_against_oracle(x, w)
    one = kvqrs.absmax_encode(x[1, 17:18], w)
    np.testing.assert_array_equal(one.codes, got.codes[1, 17:18])
    assert one.scales.tobytes() == got.scales[1, 17:18].tobytes()


@pytest.mark.parametrize("width", range(1, 9))
def test_levels_are_the_documented_grid(width):
    top = (1 << width) - 1
    codes = np.arange(top + 1, dtype=np.uint8)[:, None]
    for s in (1.0, 0.375, 65504.0):
        code = kvqrs.AbsmaxCode(codes, np.full(top + 1, s, np.float16), np.array([width], np.uint8))
        dec = kvqrs.absmax_decode(code)[:, 0]
        np.testing.assert_array_equal(dec, ((2 * codes[:, 0].astype(np.int64) - top).astype(np.float32) / np.float32(top)) * np.float32(s))
        assert dec[0] == -s and dec[-1] == s  # both ends included
        # Each level encodes to its own code (the ends set the row's scale exactly).
        again = kvqrs.absmax_encode(np.stack([dec, np.full_like(dec, s)], axis=1), np.array([width, width], np.uint8))
        np.testing.assert_array_equal(again.codes[:, 0], codes[:, 0])


def test_width_8_and_the_error_bound():
    x = np.random.default_rng(8).standard_normal((500, 64)).astype(np.float32)
    for w in (np.full(64, 8, np.uint8), np.resize(np.arange(1, 9, dtype=np.uint8), 64)):
        code = check_against_oracle(x, w)
        s = code.scales.astype(np.float64)[:, None]
        step = 2 * s / (2.0**w - 1)
        err = np.abs(kvqrs.absmax_decode(code, np.float64) - x)
        # Half a step, plus where |x| > s (the float16 scale rounded below a) the clamp: 2^-11 s.
        assert np.all(err <= 0.5 * step + 2.0**-11 * s + 1e-7)


def test_zero_rows_empty_batches_and_no_coded_coordinates():
    w = np.array([3, 0, 5], np.uint8)
    for shape in [(0, 3), (2, 0, 3), (3,)]:
        check_against_oracle(np.zeros(shape, np.float32), w)
    code = kvqrs.absmax_encode(np.zeros((2, 3), np.float32), w)
    # s = 0: u = 0 and t = L / 2, so the code is (L + 1) / 2, the level +1/L, decoded as 0.
    np.testing.assert_array_equal(code.codes, [[4, 0, 16]] * 2)
    assert not code.scales.any() and not kvqrs.absmax_decode(code).any()
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32) * 1e4
    none = check_against_oracle(x, np.zeros(6, np.uint8))
    assert not none.codes.any() and not none.scales.any()
    empty = kvqrs.absmax_encode(np.zeros((0, 3)), w)
    assert empty.codes.shape == (0, 3) and empty.scales.shape == (0,)
    assert kvqrs.absmax_decode(empty).shape == (0, 3)


def test_uncoded_coordinates_set_no_scale_and_float16_edges():
    w = np.array([8, 0], np.uint8)
    code = kvqrs.absmax_encode(np.array([[2.0, 1e30], [65519.0, 0.0]], np.float32), w)
    np.testing.assert_array_equal(code.scales, np.array([2.0, 65504.0], np.float16))
    assert code.codes[1, 0] == 255  # 65519 / 65504 > 1: clamped to the top
    tiny = np.array([[1e-7, -3e-8, 1e-8]], np.float32)  # a subnormal float16 scale
    check_against_oracle(tiny, np.array([4, 4, 4], np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_dtypes_code_their_float32_values(dtype):
    x = np.random.default_rng(2).standard_normal((3, 4, 16)).astype(dtype)
    w = np.resize(np.arange(9, dtype=np.uint8), 16)
    got, want = kvqrs.absmax_encode(x, w), kvqrs.absmax_encode(x.astype(np.float32), w)
    assert got.codes.tobytes() == want.codes.tobytes() and got.scales.tobytes() == want.scales.tobytes()
    assert kvqrs.absmax_decode(got, dtype).dtype == dtype


def test_torch_tensors_in_and_out():
    x = torch.randn(2, 5, 16)
    w = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8)
    code = kvqrs.absmax_encode(x, w)
    assert isinstance(code.codes, torch.Tensor) and code.codes.dtype == torch.uint8 and code.codes.shape == (2, 5, 16)
    assert code.scales.dtype == torch.float16 and code.scales.shape == (2, 5)
    want = kvqrs.absmax_encode(x.numpy(), w.numpy())
    np.testing.assert_array_equal(code.codes.numpy(), want.codes)
    assert code.scales.numpy().tobytes() == want.scales.tobytes()
    dec = kvqrs.absmax_decode(code, torch.float32)
    assert isinstance(dec, torch.Tensor) and dec.dtype == torch.float32
    np.testing.assert_array_equal(dec.numpy(), kvqrs.absmax_decode(want))
    assert kvqrs.absmax_decode(code, torch.bfloat16).dtype == torch.bfloat16


W = np.array([2, 0, 3], np.uint8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: kvqrs.absmax_encode(np.ones((2, 3)), np.array([2, 9, 3])), r"^widths: expected bit widths in 0..8, got 9 at position 1$"),
        (
            lambda: kvqrs.absmax_encode(np.ones((2, 3)), np.array([2, -1, 3])),
            r"^widths: expected bit widths in 0..8, got -1 at position 1$",
        ),
        (
            lambda: kvqrs.absmax_encode(np.ones((2, 3)), np.array([2.0, 0, 3])),
            r"^widths: expected an integer array of bit widths \(uint8\), got dtype float64$",
        ),
        (lambda: kvqrs.absmax_encode(np.ones((2, 3)), W[None]), r"^widths: expected shape \(d,\) with d >= 1 .*, got \(1, 3\)$"),
        (lambda: kvqrs.absmax_encode(np.ones((2, 0)), W[:0]), r"^widths: expected shape \(d,\) with d >= 1"),
        (
            lambda: kvqrs.absmax_encode(np.ones((2, 4)), W),
            r"^x: expected a last axis of length 3 \(one value per width\), got shape \(2, 4\)$",
        ),
        (lambda: kvqrs.absmax_encode(np.ones((2, 3), np.int32), W), r"^x: expected a float16, bfloat16, float32 or float64 array"),
        (
            lambda: kvqrs.absmax_encode(np.array([[1.0, 1.0, 1.0], [1.0, np.nan, 1.0]]), W),
            r"^x: expected finite values, got NaN at row 1, position 1$",
        ),
        (lambda: kvqrs.absmax_encode(np.array([[1.0, 1.0, -np.inf]]), W), r"^x: expected finite values, got -inf at row 0, position 2$"),
        (
            lambda: kvqrs.absmax_encode(np.array([[1.0, 1e30, 1.0], [-65520.0, 0.0, 1.0]]), W),
            r"^x: absmax scale overflows float16 at row 1 \(its largest coded magnitude is 65520; expected below 65520",
        ),
        (lambda: kvqrs.absmax_decode(("codes", "scales", "widths")), r"^code: expected an AbsmaxCode from absmax_encode, got tuple$"),
        (
            lambda: kvqrs.absmax_decode(_code(codes=np.array([[3, 0, 7], [4, 0, 0]]))),
            r"^codes: code 4 at row 1, position 0 does not fit in 2 bits \(expected < 4\)$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(codes=np.array([[0, 1, 0], [0, 0, 0]], np.uint8))),
            r"^codes: code 1 at row 0, position 1 does not fit in 0 bits \(expected < 1\)$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(codes=np.array([[0, 0, -1], [0, 0, 0]]))),
            r"^code.codes: code -1 at index \(0, 2\) does not fit",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(codes=np.zeros((2, 4), np.uint8))),
            r"^code.codes: expected a last axis of length 3 \(one code per width\), got shape \(2, 4\)$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(scales=np.ones(2, np.float32))),
            r"^code.scales: expected float16 shape \(2,\) \(one per row\), got float32 \(2,\)$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(scales=np.ones(3, np.float16))),
            r"^code.scales: expected float16 shape \(2,\) \(one per row\), got float16 \(3,\)$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(scales=np.array([1, -1], np.float16))),
            r"^scales: expected finite stored scalars .*, got -1 at row 1$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(scales=np.array([np.inf, 1], np.float16))),
            r"^scales: expected finite stored scalars .*, got inf at row 0$",
        ),
        (
            lambda: kvqrs.absmax_decode(_code(widths=np.array([2, 0, 10]))),
            r"^code.widths: expected bit widths in 0..8, got 10 at position 2$",
        ),
        (lambda: kvqrs.absmax_decode(_code(), dtype=np.int32), r"^dtype: expected float16, bfloat16, float32 or float64"),
        # The native functions check what the Python layer checks first.
        (
            lambda: _native.absmax_encode(np.ones(4, np.float32), np.array([9, 1], np.uint8)),
            r"^widths: expected a bit width in 0..8, got 9$",
        ),
        (
            lambda: _native.absmax_encode(np.ones(3, np.float32), np.array([1, 1], np.uint8)),
            r"^x: expected rows of 2 values, got 3 values$",
        ),
        (lambda: _native.absmax_encode(np.ones(0, np.float32), np.zeros(0, np.uint8)), r"^widths: expected 1 <= widths <= 1048576, got 0$"),
        (
            lambda: _native.absmax_decode(np.zeros(4, np.uint8), np.ones(3, np.float16), np.array([1, 1], np.uint8)),
            r"^scales: expected 2 values \(one float16 scale per row\), got 3 values$",
        ),
        (
            lambda: _native.absmax_decode(np.zeros(3, np.uint8), np.ones(1, np.float16), np.array([1, 1], np.uint8)),
            r"^codes: expected rows of 2 values, got 3 values$",
        ),
        (
            lambda: _native.absmax_decode(np.zeros(2, np.uint8), np.ones(1, np.float16), np.array([1, 9], np.uint8)),
            r"^widths: expected a bit width in 0..8, got 9$",
        ),
    ],
)
def test_errors_name_the_problem(call, message):
    with pytest.raises(kvqrs.KvqrsError, match=message):
        call()


def _code(codes=None, scales=None, widths=None):
    return kvqrs.AbsmaxCode(
        np.zeros((2, 3), np.uint8) if codes is None else codes,
        np.ones(2, np.float16) if scales is None else scales,
        W if widths is None else widths,
    )


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.uint16, np.int32])
def test_integer_codes_of_any_dtype_decode_by_value(dtype):
    """Codes of another integer dtype decode as the same uint8 codes (the rule of every kvqrs
    kernel reading codes); a value that does not fit a byte is refused by index, never wrapped."""
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    code = kvqrs.absmax_encode(x, W)
    want = kvqrs.absmax_decode(code)
    np.testing.assert_array_equal(kvqrs.absmax_decode(code._replace(codes=code.codes.astype(dtype))), want)
    if np.iinfo(dtype).max > 255:
        wide = code.codes.astype(dtype)
        wide[2, 1] = 256 + int(code.codes[2, 1])  # would wrap to the original code as uint8
        with pytest.raises(kvqrs.KvqrsError, match=r"^code.codes: code \d+ at index \(2, 1\) does not fit \(expected 0 <= code < 256\)$"):
            kvqrs.absmax_decode(code._replace(codes=wide))
    if np.iinfo(dtype).min < 0:
        neg = code.codes.astype(dtype)
        neg[3, 0] = -1
        with pytest.raises(kvqrs.KvqrsError, match=r"^code.codes: code -1 at index \(3, 0\) does not fit"):
            kvqrs.absmax_decode(code._replace(codes=neg))
    for bad in (code.codes.astype(np.float32), code.codes.astype(bool)):
        with pytest.raises(kvqrs.KvqrsError, match=rf"^code.codes: expected an integer array \(uint8 codes\), got dtype {bad.dtype}$"):
            kvqrs.absmax_decode(code._replace(codes=bad))
