"""Log-coded scalars in WGSL (shaders/log_scalars.wgsl) against the Rust path and the oracle
(docs/kernels.md section 13): codes, exponent bytes and decoded floats equal bit for bit (the
grid index is read from the float32 bits with integer and comparison operations, the decode is
a table read and an exponent shift), so nothing here has a tolerance."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import KvqrsError, gpu, kernels, oracle
from kvqrs.gpu._host import MAX_LOOP_ROW
from kvqrs.kernels import LogScalars

from tests.gpu.gpu_helpers import requires_adapter, same_error
from tests.kernels.test_log_scalars import EXP_MAX, EXP_MIN, ZERO, all_codes, assert_bits_equal, exact_decode, log_values, threshold_pairs
from tests.strategies import leading_shapes

pytestmark = requires_adapter

groups = st.sampled_from([1, 2, 3, 7, 16, 32, 64, 128])


def assert_same_code(got: LogScalars, want: LogScalars) -> None:
    assert got.group == want.group
    for a, b in ((got.codes, want.codes), (got.exps, want.exps)):
        assert a.dtype == np.uint8 and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@given(x=log_values(), group=groups)
def test_encode_matches_rust_path_and_oracle(x, group):
    got = gpu.log_encode(x, group)
    assert_same_code(got, kernels.log_encode(x, group))
    codes, exps = oracle.log_encode(x, group)
    np.testing.assert_array_equal(got.codes, codes)
    np.testing.assert_array_equal(got.exps, exps)
    assert_bits_equal(gpu.log_decode(got), oracle.log_decode(codes, exps, group))


@st.composite
def stored_codes(draw):
    leading = draw(leading_shapes)
    n = draw(st.integers(1, 70))
    group = draw(groups)
    codes = draw(hnp.arrays(np.uint8, (*leading, n), elements=st.integers(0, 255)))
    exps = draw(hnp.arrays(np.uint8, (*leading, -(-n // group)), elements=st.integers(EXP_MIN, EXP_MAX)))
    return LogScalars(codes, exps, group)


@given(code=stored_codes())
def test_decode_matches_rust_path_bit_for_bit(code):
    got = gpu.log_decode(code)
    assert_bits_equal(got, kernels.log_decode(code))
    np.testing.assert_array_equal(got, exact_decode(code.codes, code.exps, code.group))
    np.testing.assert_array_equal(gpu.log_decode(code, np.float64), kernels.log_decode(code, np.float64))


def test_every_code_under_every_exponent_byte():
    code = all_codes()
    got = gpu.log_decode(code)
    assert_bits_equal(got, kernels.log_decode(code))
    np.testing.assert_array_equal(got, exact_decode(code.codes, code.exps, code.group))
    assert np.all(got[:, ZERO] == 0) and np.all(got[:, :ZERO] >= np.finfo(np.float32).tiny)


@pytest.mark.parametrize("group", [1, 2, 5])
def test_both_sides_of_every_threshold(group):
    pairs, _, _ = threshold_pairs()
    x = pairs.reshape(-1, 16) if group == 5 else pairs
    got = gpu.log_encode(x, group)
    assert_same_code(got, kernels.log_encode(x, group))
    np.testing.assert_array_equal(got.codes, oracle.log_encode(x, group)[0])
    assert_bits_equal(gpu.log_decode(got), kernels.log_decode(got))


def test_zero_subnormal_extreme_and_negative_zero():
    tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    x = np.array([[0.0, 1e-45, np.nextafter(tiny, np.float32(0)), tiny, 1.0, 3e38, big]], np.float32)
    for g in (1, 3, 7):
        assert_same_code(gpu.log_encode(x, g), kernels.log_encode(x, g))
    # -0.0 is zero (section 13, the oracle); the Rust path differs here (test_log_scalars'
    # test_negative_zero_codes_as_zero).
    z = np.array([[1.0, -0.0, 0.0, 2.0], [-0.0, -0.0, 0.0, 0.0]], np.float32)
    got = gpu.log_encode(z, 4)
    codes, exps = oracle.log_encode(z, 4)
    np.testing.assert_array_equal(got.codes, codes)
    np.testing.assert_array_equal(got.exps, exps)
    assert got.codes[0, 1] == ZERO and got.exps[1, 0] == 127


@given(data=st.data(), group=st.sampled_from([1, 3, 16, 32]), chunks=st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_encoding_whole_groups_in_chunks_equals_one_call(data, group, chunks):
    sizes = [c * group for c in chunks] + [data.draw(st.integers(0, group - 1))]
    sizes = [s for s in sizes if s]
    x = data.draw(log_values(leading=(2,), n=sum(sizes)))
    one = gpu.log_encode(x, group)
    bounds = np.cumsum([0, *sizes])
    parts = [gpu.log_encode(x[..., a:b], group) for a, b in zip(bounds[:-1], bounds[1:])]
    np.testing.assert_array_equal(np.concatenate([p.codes for p in parts], axis=-1), one.codes)
    np.testing.assert_array_equal(np.concatenate([p.exps for p in parts], axis=-1), one.exps)
    assert_same_code(one, kernels.log_encode(x, group))


def test_long_groups_rows_and_batches():
    rng = np.random.default_rng(5)
    # The longest group an invocation loops over, and rows longer than that in short groups.
    x = np.ldexp(rng.random((2, MAX_LOOP_ROW + 5)), rng.integers(-60, 60, (2, MAX_LOOP_ROW + 5))).astype(np.float32)
    for g in (MAX_LOOP_ROW, 16):
        got = gpu.log_encode(x, g)
        assert_same_code(got, kernels.log_encode(x, g))
        assert_bits_equal(gpu.log_decode(got), kernels.log_decode(got))
    with pytest.raises(KvqrsError, match=f"group: the WGSL path loops over at most {MAX_LOOP_ROW} values"):
        gpu.log_encode(x, MAX_LOOP_ROW + 1)
    # More values than one row of 65535 workgroups of 64 (common.wgsl's second grid dimension).
    code = LogScalars(rng.integers(0, 256, (65, 65536), dtype=np.uint8), rng.integers(EXP_MIN, EXP_MAX + 1, (65, 2048), dtype=np.uint8), 32)
    assert_bits_equal(gpu.log_decode(code), kernels.log_decode(code))


def test_empty_batches_and_float_dtypes():
    for leading in [(0,), (3, 0)]:
        x = np.zeros((*leading, 5), np.float32)
        assert_same_code(gpu.log_encode(x, 2), kernels.log_encode(x, 2))
        code = kernels.log_encode(x, 2)
        out = gpu.log_decode(code, np.float16)
        assert out.dtype == np.float16 and out.shape == x.shape
    x = np.abs(np.random.default_rng(1).standard_normal((4, 33)))
    for dtype in (np.float64, np.float16, ml_dtypes.bfloat16):
        assert_same_code(gpu.log_encode(x.astype(dtype), 8), kernels.log_encode(x.astype(dtype), 8))
        code = kernels.log_encode(x, 8)
        np.testing.assert_array_equal(gpu.log_decode(code, dtype), kernels.log_decode(code, dtype))


def test_explicit_device():
    x = np.abs(np.random.default_rng(2).standard_normal((3, 40))).astype(np.float32)
    adapter = next(iter(gpu.iter_adapters()))
    for dev in (gpu.device(), adapter):
        got = gpu.log_encode(x, 8, device=dev)
        assert_same_code(got, kernels.log_encode(x, 8))
        assert_bits_equal(gpu.log_decode(got, device=dev), kernels.log_decode(got))


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    x = torch.rand(3, 5, 40) * 100
    code = gpu.log_encode(x, 8)
    assert isinstance(code.codes, torch.Tensor) and code.codes.dtype == torch.uint8 and code.codes.shape == (3, 5, 40)
    assert isinstance(code.exps, torch.Tensor) and code.exps.dtype == torch.uint8 and code.exps.shape == (3, 5, 5)
    want = kernels.log_encode(x.numpy(), 8)
    np.testing.assert_array_equal(code.codes.numpy(), want.codes)
    np.testing.assert_array_equal(code.exps.numpy(), want.exps)
    out = gpu.log_decode(code, torch.float64)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    np.testing.assert_array_equal(out.numpy(), kernels.log_decode(want, np.float64))


def _code() -> LogScalars:
    return kernels.log_encode(np.array([[1.0, 2.0, 3.0], [4.0, 0.0, 5.0]], np.float32), 2)


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.log_encode(np.array([[1.0, 2.0], [3.0, -1.0]], np.float32), 1),
        lambda m: m.log_encode(np.array([[1.0, np.nan]], np.float32), 1),
        lambda m: m.log_encode(np.array([[np.inf, 1.0]], np.float32), 2),
        lambda m: m.log_encode(np.array([[1.0, -np.inf]], np.float32), 2),
        lambda m: m.log_encode(np.ones((2, 2, 3), np.float32) - 2 * (np.arange(12).reshape(2, 2, 3) == 8), 2),
        lambda m: m.log_encode(np.ones((2, 3), np.float32), 0),
        lambda m: m.log_encode(np.ones((2, 3), np.float32), True),
        lambda m: m.log_encode(np.ones((2, 3), np.float32), 2**21),
        lambda m: m.log_encode(np.zeros((0, 3), np.float32), 2**21),
        lambda m: m.log_encode(np.ones((2, 3), np.int32), 1),
        lambda m: m.log_encode(np.ones((2, 0), np.float32), 1),
        lambda m: m.log_decode(_code()._replace(exps=_code().exps.astype(np.int16))),
        lambda m: m.log_decode(_code()._replace(exps=_code().exps[:, :1])),
        lambda m: m.log_decode(_code()._replace(exps=np.array([[16, 15], [20, 20]], np.uint8))),
        lambda m: m.log_decode(_code()._replace(exps=np.array([[16, 16], [255, 20]], np.uint8))),
        lambda m: m.log_decode(_code()._replace(codes=_code().codes.astype(np.int64) + 250)),
        lambda m: m.log_decode(_code()._replace(group=0)),
        lambda m: m.log_decode(_code()._replace(group=2**21)),
        lambda m: m.log_decode(LogScalars(np.zeros((2, 0), np.uint8), np.zeros((2, 0), np.uint8), 2)),
        lambda m: m.log_decode(_code()[:2]),
        lambda m: m.log_decode(_code(), np.int32),
        lambda m: m.log_decode(_code()._replace(exps=np.full((2, 2), 15, np.uint8)), np.int32),
        lambda m: m.log_decode(kernels.log_encode(np.array([[1e5, 1.0]], np.float32), 2), np.float16),
    ],
)
def test_bad_input_raises_like_rust_path(call):
    same_error(lambda: call(gpu), lambda: call(kernels))
