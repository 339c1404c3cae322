"""Log-coded scalars (docs/kernels.md section 13): the Rust path against the float64 oracle, bit
for bit (codes, exponent bytes and decoded floats), on values spanning every octave with zeros,
subnormals and values near the float32 maximum; both sides of every threshold; the exact
level table; streaming by whole groups; invariants; errors naming the argument; tensors."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import KvqrsError, oracle
from kvqrs.kernels import LogScalars, log_decode, log_encode

from tests.strategies import leading_shapes

BIAS, EXP_MIN, EXP_MAX, ZERO = 127, 16, 254, 255
STEP_RTOL = 2.0 ** (1 / 32) - 1 + 2.0**-22
"""Relative error of a coded value: half a grid step, plus the float32 rounding of the level and
of the threshold."""


# ---------------------------------------------------------------------------------------------
# The grid, computed exactly (rational arithmetic) and independently of the kernel and oracle
# ---------------------------------------------------------------------------------------------


def _f32(v) -> np.float32:
    return np.float32(v)


def _up(t: np.float32) -> np.float32:
    return np.nextafter(t, np.float32(np.inf))


def _down(t: np.float32) -> np.float32:
    return np.nextafter(t, np.float32(0))


def _threshold(k: int) -> np.float32:
    """The smallest float32 t with t >= 2^((k + 0.5) / 16), i.e. t^32 >= 2^(2k + 1), exactly."""
    t, target = _f32(2.0 ** ((k + 0.5) / 16)), Fraction(2) ** (2 * k + 1)
    while Fraction(float(t)) ** 32 < target:
        t = _up(t)
    while Fraction(float(_down(t))) ** 32 >= target:
        t = _down(t)
    return t


def _level(j: int) -> np.float32:
    """The float32 nearest 2^(j / 16): between the midpoints to its neighbours, exactly."""
    t, target = _f32(2.0 ** (j / 16)), Fraction(2) ** j
    for _ in range(4):
        lo = (Fraction(float(_down(t))) + Fraction(float(t))) / 2
        hi = (Fraction(float(t)) + Fraction(float(_up(t)))) / 2
        if lo**16 > target:
            t = _down(t)
        elif hi**16 < target:
            t = _up(t)
        else:
            return t
    raise AssertionError(f"no nearest float32 found for 2^({j}/16)")


THRESHOLDS = [_threshold(k) for k in range(16)]
LEVELS = [_level(j) for j in range(16)]


def exact_decode(codes: np.ndarray, exps: np.ndarray, group: int) -> np.ndarray:
    """``L_(k mod 16) 2^floor(k / 16)``, ``k = 16 (b - 127) + 15 - c`` (code 255: 0), float64."""
    c = np.asarray(codes).astype(np.int64)
    b = np.asarray(exps).astype(np.int64)[..., np.arange(c.shape[-1]) // group]
    k = 16 * (b - BIAS) + 15 - c
    lv = np.array(LEVELS, np.float64)[k % 16]
    return np.where(c == ZERO, 0.0, np.ldexp(lv, k // 16))


def threshold_pairs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``[just below T_k 2^E, T_k 2^E]`` for every octave E in -126..127 and k in 0..15,
    with their E and k."""
    e, k = np.meshgrid(np.arange(-126, 128), np.arange(16), indexing="ij")
    e, k = e.reshape(-1), k.reshape(-1)
    t = np.ldexp(np.array(THRESHOLDS, np.float32)[k], e).astype(np.float32)
    return np.stack([np.nextafter(t, np.float32(0)), t], axis=1), e, k


def all_codes() -> LogScalars:
    """Every code (0..255) under every valid exponent byte (16..254): one row per byte."""
    exps = np.arange(EXP_MIN, EXP_MAX + 1, dtype=np.uint8)
    codes = np.tile(np.arange(256, dtype=np.uint8), (exps.size, 1))
    return LogScalars(codes, exps[:, None], 256)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


@st.composite
def log_values(draw, leading=None, n=None):
    """Non-negative finite float32 ``(*leading, n)`` built from their bits: biased exponents
    around a drawn octave (0 = subnormal, 254 = up to the float32 maximum) with a drawn spread,
    any mantissa, and some exact zeros; by hypothesis' arrays or a seeded generator."""
    leading = draw(leading_shapes) if leading is None else leading
    n = draw(st.integers(1, 70)) if n is None else n
    shape = (*leading, n)
    center = draw(st.integers(0, 254))
    spread = draw(st.sampled_from([0, 1, 4, 16, 40, 254]))
    if draw(st.booleans()):
        offs = draw(hnp.arrays(np.int64, shape, elements=st.integers(-spread, spread)))
        mant = draw(hnp.arrays(np.uint32, shape, elements=st.integers(0, 2**23 - 1)))
        zeros = draw(hnp.arrays(np.bool_, shape))
    else:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        offs = rng.integers(-spread, spread + 1, shape)
        mant = rng.integers(0, 2**23, shape, dtype=np.uint32)
        zeros = rng.random(shape) < draw(st.sampled_from([0.0, 0.1, 0.9]))
    bits = (np.clip(center + offs, 0, 254).astype(np.uint32) << 23) | mant
    bits[zeros] = 0
    return bits.view(np.float32)


groups = st.sampled_from([1, 2, 3, 7, 16, 32, 64, 128])


def assert_bits_equal(got, want) -> None:
    """Same float32 values, bit for bit (so +0.0 and -0.0 differ)."""
    got, want = np.asarray(got), np.asarray(want, np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ---------------------------------------------------------------------------------------------
# Against the oracle
# ---------------------------------------------------------------------------------------------


@given(x=log_values(), group=groups)
def test_matches_oracle_bit_for_bit(x, group):
    got = log_encode(x, group)
    codes, exps = oracle.log_encode(x, group)
    assert got.group == group
    assert got.codes.dtype == np.uint8 and got.codes.shape == x.shape
    assert got.exps.dtype == np.uint8 and got.exps.shape == (*x.shape[:-1], -(-x.shape[-1] // group))
    np.testing.assert_array_equal(got.exps, exps)
    np.testing.assert_array_equal(got.codes, codes)
    dec = log_decode(got)
    want = oracle.log_decode(codes, exps, group)
    assert_bits_equal(dec, want)
    np.testing.assert_array_equal(want, exact_decode(codes, exps, group))
    np.testing.assert_array_equal(log_decode(got, np.float64), want)
    assert np.all((dec == 0) | (dec >= np.finfo(np.float32).tiny)), "a level below the normal float32 range"


@given(x=log_values(), group=groups)
def test_other_float_dtypes_are_coded_as_float32(x, group):
    want = log_encode(x, group)
    got = log_encode(x.astype(np.float64), group)
    np.testing.assert_array_equal(got.codes, want.codes)
    np.testing.assert_array_equal(got.exps, want.exps)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            y = x.astype(dtype)
        y = np.where(np.isfinite(y.astype(np.float32)), y, dtype(0))
        got, want = log_encode(y, group), oracle.log_encode(y.astype(np.float32), group)
        np.testing.assert_array_equal(got.codes, want[0])
        np.testing.assert_array_equal(got.exps, want[1])


def test_both_sides_of_every_threshold():
    pairs, e, k = threshold_pairs()
    code = log_encode(pairs, 2)
    codes, exps = oracle.log_encode(pairs, 2)
    np.testing.assert_array_equal(code.codes, codes)
    np.testing.assert_array_equal(code.exps, exps)
    c = code.codes.astype(np.int64)
    top = 16 * (code.exps[:, 0].astype(np.int64) - BIAS) + 15
    # The float32 at the threshold has grid index 16 E + k + 1, the one below 16 E + k: one
    # code apart under their shared exponent, except where the exponent byte clamps.
    clamped_top = (e == 127) & (k == 15)  # index 2048: the top level is 2047
    clamped_low = (e == -126) & (k == 0)  # index -2016: 255 codes below the lowest top, stored 254
    ok = ~(clamped_top | clamped_low)
    np.testing.assert_array_equal(c[ok, 0], c[ok, 1] + 1)
    unclamped = ok & (e >= -111)
    np.testing.assert_array_equal((top - c[:, 1])[unclamped], (16 * e + k + 1)[unclamped])
    np.testing.assert_array_equal(c[clamped_top], [[0, 0]])
    np.testing.assert_array_equal(c[clamped_low], [[254, 254]])
    assert np.all(code.exps[e < -111] == EXP_MIN)


def levels_below_top(octave: int, steps: np.ndarray) -> np.ndarray:
    """float32 levels at grid index ``16 octave + 15 - step`` (``step`` steps below the top level
    of ``octave``), each exactly on its grid point."""
    r = 16 * octave + 15 - np.asarray(steps, np.int64)
    return np.ldexp(np.array(LEVELS, np.float32)[r % 16], r // 16).astype(np.float32)


@given(octave=st.integers(-110, 127), steps=st.lists(st.integers(0, 300), min_size=1, max_size=40))
def test_codes_below_the_lowest_level(octave, steps):
    # A group whose largest value is the top level of `octave`, then values `step` grid steps
    # below it: code `step` down to 254, 254 within an octave below that (steps 255..270), 255
    # beyond; no value of the group changes the exponent byte.
    steps = np.array([0, *steps], np.int64)
    x = levels_below_top(octave, steps)[None, :]
    code = log_encode(x, steps.size)
    assert code.exps.tolist() == [[octave + BIAS]]
    want = np.where(steps <= 254, steps, np.where(steps <= 270, 254, ZERO))
    np.testing.assert_array_equal(code.codes[0], want)
    dec = log_decode(code)[0]
    np.testing.assert_array_equal(dec, np.where(steps <= 254, x[0], np.where(steps <= 270, levels_below_top(octave, [254])[0], 0)))
    np.testing.assert_array_equal(code.codes, oracle.log_encode(x, steps.size)[0])


def test_level_table_is_the_nearest_float32():
    code = all_codes()
    dec = log_decode(code)
    np.testing.assert_array_equal(dec, exact_decode(code.codes, code.exps, code.group))
    np.testing.assert_array_equal(dec, oracle.log_decode(code.codes, code.exps, code.group))
    assert np.all(dec[:, 255] == 0)
    assert np.all(dec[:, :255] >= np.finfo(np.float32).tiny) and np.all(np.isfinite(dec))
    # Exponent byte 127 holds octave 0: codes 15..0 are the levels L_0..L_15 themselves.
    np.testing.assert_array_equal(dec[127 - EXP_MIN, 15::-1], np.array(LEVELS, np.float32))
    assert dec.max() == np.ldexp(np.float32(LEVELS[15]), 127) and dec[:, :255].min() == np.ldexp(np.float32(LEVELS[1]), -126)


def test_zero_subnormal_and_extreme_values():
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    x = np.array([0.0, 1e-45, _down(tiny), tiny, 1.0, 3e38, big], np.float32)
    code = log_encode(x[None, :], 1)
    np.testing.assert_array_equal(code.codes[0], [255, 255, 255, 254, 15, 2, 0])
    np.testing.assert_array_equal(code.exps[0], [127, 127, 127, 16, 127, 254, 254])
    dec = log_decode(code)[0]
    assert list(dec[:3]) == [0.0, 0.0, 0.0]
    assert dec[3] == np.ldexp(np.float32(LEVELS[1]), -126)  # the lowest level, 2^-125.94
    assert dec[4] == 1.0 and dec[6] == np.ldexp(np.float32(LEVELS[15]), 127) < big


# ---------------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------------


@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 3, 7, 16, 32]),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    leading=st.sampled_from([(), (2,), (3, 1)]),
)
def test_encoding_whole_groups_in_chunks_equals_one_call(data, group, chunks, leading):
    # Whole groups per chunk; the last chunk may end in the row's shorter last group.
    tail = data.draw(st.integers(0, group - 1))
    sizes = [c * group for c in chunks] + ([tail] if tail else [])
    x = data.draw(log_values(leading=leading, n=sum(sizes)))
    one = log_encode(x, group)
    bounds = np.cumsum([0, *sizes])
    parts = [log_encode(x[..., a:b], group) for a, b in zip(bounds[:-1], bounds[1:])]
    np.testing.assert_array_equal(np.concatenate([p.codes for p in parts], axis=-1), one.codes)
    np.testing.assert_array_equal(np.concatenate([p.exps for p in parts], axis=-1), one.exps)
    dec = np.concatenate([log_decode(p) for p in parts], axis=-1)
    assert_bits_equal(dec, log_decode(one))


@given(x=log_values(), group=groups)
def test_round_trip_error_and_reencoding(x, group):
    code = log_encode(x, group)
    y = log_decode(code, np.float64)
    n = x.shape[-1]
    b = code.exps.astype(np.int64)[..., np.arange(n) // group]
    smallest = exact_decode(np.full(b.shape, 254), b, 1)
    largest = exact_decode(np.zeros(b.shape, np.int64), b, 1)
    v = x.astype(np.float64)
    inside = (v >= smallest) & (v <= largest)
    assert np.all(np.abs(y[inside] / v[inside] - 1) <= STEP_RTOL), "a coded value off by more than half a grid step"
    above = v > largest  # clamped top octave: within one step of the top level
    assert np.all(np.abs(y[above] / v[above] - 1) <= 2 * STEP_RTOL)
    below = v < smallest
    assert np.all((y[below] == 0) | (y[below] == smallest[below]))
    assert np.all(y[v == 0] == 0)
    again = log_encode(log_decode(code), group)
    np.testing.assert_array_equal(again.codes, code.codes)
    np.testing.assert_array_equal(again.exps, code.exps)


@given(x=log_values(), group=groups, scale=st.integers(-40, 40))
def test_scaling_by_a_whole_octave_moves_only_the_exponent(x, group, scale):
    # Away from the clamps and subnormals, x 2^s codes the same with exponent bytes shifted by s.
    x = np.where(x == 0, 0, np.clip(x, 2.0**-60, 2.0**60)).astype(np.float32)
    code, moved = log_encode(x, group), log_encode(np.ldexp(x, scale).astype(np.float32), group)
    np.testing.assert_array_equal(moved.codes, code.codes)
    has = x != 0
    shifted = code.exps.astype(np.int64) + scale
    any_index = np.stack([np.any(has[..., i : i + group], axis=-1) for i in range(0, x.shape[-1], group)], axis=-1)
    np.testing.assert_array_equal(moved.exps, np.where(any_index, shifted, BIAS))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _code() -> LogScalars:
    return log_encode(np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 5.0]], np.float32), 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # A bad value is named by its row (over the flattened leading axes) and its position in
        # the row, as mse_encode names a non-finite value.
        (
            lambda: log_encode(np.array([[1.0, 2.0], [3.0, -1.0]], np.float32), 1),
            r"^values: expected finite non-negative values, got -1 at row 1, position 1$",
        ),
        (lambda: log_encode(np.array([[1.0, np.nan]], np.float32), 1), r"^values: expected finite .*got NaN at row 0, position 1$"),
        (lambda: log_encode(np.array([[np.inf, 1.0]], np.float32), 1), r"^values: expected finite .*got inf at row 0, position 0$"),
        (lambda: log_encode(np.array([[1.0, -np.inf]], np.float32), 2), r"^values: expected finite .*got -inf at row 0, position 1$"),
        (
            lambda: log_encode(np.ones((2, 2, 3), np.float32) - 2 * (np.arange(12).reshape(2, 2, 3) == 8), 2),
            r"^values: expected finite non-negative values, got -1 at row 2, position 2$",
        ),
        (lambda: log_encode(np.ones((2, 3), np.float32), 0), r"^group: expected an integer >= 1, got 0"),
        (lambda: log_encode(np.ones((2, 3), np.float32), True), r"^group: expected an integer >= 1, got bool"),
        (lambda: log_encode(np.ones((2, 3), np.float32), 1.5), r"^group: expected an integer >= 1"),
        (lambda: log_encode(np.ones((2, 3), np.float32), 2**21), r"^group: expected 1 <= group <= 1048576"),
        (lambda: log_encode(np.ones((2, 3), np.int32), 1), r"^values: expected a float16, bfloat16, float32 or float64 array"),
        (lambda: log_encode(np.ones((2, 0), np.float32), 1), r"^values: expected a last axis of length >= 1"),
        (lambda: log_encode(np.float32(1.0), 1), r"^values: expected an array"),
        (lambda: log_decode(_code()._replace(exps=_code().exps.astype(np.int16))), r"^code\.exps: expected uint8 shape \(2, 2\)"),
        (lambda: log_decode(_code()._replace(exps=_code().exps[:, :1])), r"^code\.exps: expected uint8 shape \(2, 2\).*\(2, 1\)"),
        (lambda: log_decode(_code()._replace(exps=np.array([[16, 15], [20, 20]], np.uint8))), r"^exps: .*16\.\.=254, got 15 at group 1"),
        (lambda: log_decode(_code()._replace(exps=np.array([[16, 16], [255, 20]], np.uint8))), r"^exps: .*16\.\.=254, got 255 at group 2"),
        (lambda: log_decode(_code()._replace(exps=np.zeros((2, 2), np.uint8))), r"^exps: .*got 0 at group 0"),
        (
            lambda: log_decode(_code()._replace(codes=_code().codes.astype(np.int64) + 250)),
            r"^code\.codes: code \d+ at index \(\d, \d\) does not fit",
        ),
        (lambda: log_decode(_code()._replace(codes=_code().codes.astype(np.float32))), r"^code\.codes: expected an integer array"),
        (lambda: log_decode(_code()._replace(group=0)), r"^code\.group: expected an integer >= 1, got 0"),
        (lambda: log_decode(_code()[:2]), r"^code: expected a LogScalars from log_encode, got tuple"),
        (lambda: log_decode(_code(), np.int32), r"^dtype: expected float16, bfloat16, float32 or float64"),
        (lambda: log_decode(log_encode(np.array([[1e5, 1.0]], np.float32), 2), np.float16), r"^result: expected values that fit"),
    ],
)
def test_errors_name_the_argument(call, message):
    with pytest.raises(KvqrsError, match=message):
        call()


# ---------------------------------------------------------------------------------------------
# The sign of zero
# ---------------------------------------------------------------------------------------------


def test_negative_zero_codes_as_zero():
    """-0.0 passes the ``>= 0`` check and codes as zero, not by its sign bit's pattern."""
    x = np.array([[1.0, -0.0, 0.0, 2.0]], np.float32)
    code = log_encode(x, 4)
    codes, exps = oracle.log_encode(x, 4)
    np.testing.assert_array_equal(code.exps, exps)
    np.testing.assert_array_equal(code.codes, codes)
    np.testing.assert_array_equal(code.codes[0, 1], ZERO)


# ---------------------------------------------------------------------------------------------
# Tensors in, tensors out
# ---------------------------------------------------------------------------------------------


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    x = np.abs(np.random.default_rng(3).standard_normal((3, 5, 40))).astype(np.float32)
    code = log_encode(torch.from_numpy(x), 8)
    assert isinstance(code.codes, torch.Tensor) and code.codes.dtype == torch.uint8 and code.codes.shape == (3, 5, 40)
    assert isinstance(code.exps, torch.Tensor) and code.exps.dtype == torch.uint8 and code.exps.shape == (3, 5, 5)
    want = log_encode(x, 8)
    np.testing.assert_array_equal(code.codes.numpy(), want.codes)
    np.testing.assert_array_equal(code.exps.numpy(), want.exps)
    out = log_decode(code)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), log_decode(want))
    half = log_decode(code, torch.bfloat16)
    assert isinstance(half, torch.Tensor) and half.dtype == torch.bfloat16
    np.testing.assert_array_equal(half.float().numpy(), log_decode(want).astype(ml_dtypes.bfloat16).astype(np.float32))
    bf = log_encode(torch.from_numpy(x).to(torch.bfloat16), 8)
    np.testing.assert_array_equal(bf.codes.numpy(), log_encode(x.astype(ml_dtypes.bfloat16), 8).codes)
