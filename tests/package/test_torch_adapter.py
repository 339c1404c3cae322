"""The torch adapter (``kvqrs.torch``): tensors in, tensors out through the NumPy-facing API.

to_numpy / from_numpy / apply / hadamard / inverse_hadamard / quantize_dequantize on float32,
float16 and bfloat16 (and float64) tensors: values against the float64 oracle and the NumPy API,
strided (transposed) inputs equal to their contiguous copies, zero-copy for contiguous float32
CPU tensors, the caller's dtype and device on the way out, and KvqrsError for non-float tensors
and for objects that are not tensors."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvqrs  # noqa: E402
from kvqrs import oracle  # noqa: E402
from kvqrs import torch as kt  # noqa: E402
from kvqrs.schemes import KVCodec  # noqa: E402

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALL_FLOAT_DTYPES = FLOAT_DTYPES + (torch.float64,)
NON_FLOAT = (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.complex64)

# The Walsh-Hadamard transform computed in float32 vs the float64 oracle, per element relative to
# the row norm: log2(d') butterfly stages round once each (<= ~12 * 2^-24); 2e-6 (as in
# tests/kernels/test_hadamard.py).
F32_TOL = 2e-6
# Results rounded to the caller's half-precision dtype: |y_i| <= ||x||, so rounding moves an
# element by at most half an ulp of the norm (2^-11 float16, 2^-8 bfloat16); twice that. The input
# itself is also rounded to the dtype before the transform, which the oracle sees too (we feed
# the oracle the rounded input), so only the output rounding counts.
HALF_TOL = {torch.float32: F32_TOL, torch.float64: F32_TOL, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
# hadamard then inverse_hadamard in float32: two transforms' rounding relative to the row norm.
ROUND_TRIP_TOL = 1e-6

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rows(shape, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _rel_err(out: torch.Tensor, ref: np.ndarray, x_rows: np.ndarray) -> float:
    """max |out - ref| per element relative to the norm of the input row."""
    norms = np.linalg.norm(x_rows.astype(np.float64), axis=-1, keepdims=True)
    return float(np.max(np.abs(out.detach().cpu().double().numpy() - ref) / np.maximum(norms, 1e-30)))


# --- to_numpy / from_numpy ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
def test_to_numpy_is_float32_with_the_tensor_values(dtype):
    t = _rows((2, 3, 5, 8), dtype)
    a = kt.to_numpy(t)
    assert isinstance(a, np.ndarray)
    assert a.dtype == np.float32
    assert a.shape == tuple(t.shape)
    assert a.flags.c_contiguous
    # float16 / bfloat16 widen to float32 exactly; float64 rounds once, as torch does.
    np.testing.assert_array_equal(a, t.to(torch.float32).numpy())


def test_to_numpy_zero_copy_for_contiguous_float32_cpu():
    t = _rows((4, 16))
    a = kt.to_numpy(t)
    assert np.shares_memory(a, t.numpy())
    # a contiguous slice with a storage offset is still shared, not copied
    s = t[1:3]
    assert s.is_contiguous()
    assert np.shares_memory(kt.to_numpy(s), t.numpy())


def test_to_numpy_requires_grad_tensor_is_detached_and_shared():
    t = _rows((3, 8)).requires_grad_(True)
    with pytest.warns(UserWarning, match="requires grad"):  # detached, and the caller is told
        a = kt.to_numpy(t)
    np.testing.assert_array_equal(a, t.detach().numpy())
    assert np.shares_memory(a, t.detach().numpy())


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
def test_to_numpy_stages_strided_and_other_dtypes(dtype):
    base = _rows((16, 8), dtype)
    view = base.t()  # (8, 16), non-contiguous
    assert not view.is_contiguous()
    a = kt.to_numpy(view)
    assert a.flags.c_contiguous
    np.testing.assert_array_equal(a, view.contiguous().to(torch.float32).numpy())
    # a staging copy: writing into it leaves the caller's tensor alone
    before = base.clone()
    a[...] = 123.0
    assert torch.equal(base, before)


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_from_numpy_takes_dtype_and_device_of_like(dtype, device):
    like = torch.zeros(1, dtype=dtype, device=device)
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    out = kt.from_numpy(a, like)
    assert out.dtype == dtype and out.device == like.device
    assert torch.equal(out.cpu(), torch.from_numpy(a).to(dtype))


def test_from_numpy_keeps_integer_arrays_and_accepts_strided():
    like = torch.zeros(1, dtype=torch.float16)
    codes = np.arange(10, dtype=np.uint8)
    out = kt.from_numpy(codes, like)
    assert out.dtype == torch.uint8  # codes are not floats: only float arrays take like's dtype
    assert torch.equal(out, torch.arange(10, dtype=torch.uint8))
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_array_equal(kt.from_numpy(strided, like).float().numpy(), strided.astype(np.float16).astype(np.float32))


# --- hadamard / inverse_hadamard / apply -------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 48])
def test_hadamard_against_oracle(dtype, device, head_dim):
    x = _rows((2, 3, 7, head_dim), dtype, seed=1, device=device)
    y = kt.hadamard(x, seed=5)
    assert y.dtype == dtype and y.device == x.device
    assert y.shape == (2, 3, 7, kvqrs.padded_dim(head_dim))
    x_rows = x.detach().cpu().double().numpy()
    ref = oracle.hadamard(x_rows, 5)
    assert _rel_err(y, ref, x_rows) <= HALF_TOL[dtype]


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
def test_hadamard_matches_numpy_api_exactly(dtype):
    # The contract: computed in float32 by the NumPy API, then cast to the caller's dtype.
    x = _rows((5, 64), dtype, seed=2)
    expected = torch.from_numpy(kvqrs.hadamard(x.float().numpy(), 9)).to(dtype)
    assert torch.equal(kt.hadamard(x, seed=9), expected)
    assert torch.equal(kt.apply(kvqrs.hadamard, x, 9), expected)
    assert torch.equal(kt.apply(kvqrs.hadamard, x, seed=9), expected)


@pytest.mark.parametrize("seed", [None, 0, 2**64 - 1])
@pytest.mark.parametrize("head_dim", [64, 96])
def test_inverse_hadamard_round_trip(seed, head_dim):
    x = _rows((4, 6, head_dim), seed=3)
    y = kt.hadamard(x, seed=seed)
    back = kt.inverse_hadamard(y, seed=seed, head_dim=head_dim)
    assert back.shape == x.shape and back.dtype == x.dtype
    x_rows = x.double().numpy()
    assert _rel_err(back, x_rows, x_rows) <= ROUND_TRIP_TOL
    ref = oracle.inverse_hadamard(y.double().numpy(), seed, head_dim)
    assert _rel_err(back, ref, x_rows) <= F32_TOL


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_inverse_hadamard_dtype(dtype):
    y = _rows((3, 64), dtype, seed=4)
    out = kt.inverse_hadamard(y, seed=1)
    assert out.dtype == dtype
    expected = torch.from_numpy(kvqrs.inverse_hadamard(y.float().numpy(), 1)).to(dtype)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
@pytest.mark.parametrize(
    "fn",
    [
        lambda t: kt.hadamard(t, seed=3),
        lambda t: kt.inverse_hadamard(t, seed=3),
        lambda t: kt.apply(kvqrs.hadamard, t, 7),
        lambda t: kt.quantize_dequantize(KVCodec("kqv", 3, 64, seed=1), t, "keys"),
        lambda t: kt.quantize_dequantize(KVCodec("kivi", 2, 64), t, "values"),
    ],
    ids=["hadamard", "inverse_hadamard", "apply", "qdq-kqv-keys", "qdq-kivi-values"],
)
def test_transposed_input_equals_contiguous(dtype, fn):
    base = _rows((2, 64, 32), dtype, seed=6)
    view = base.transpose(-1, -2)  # (2, 32, 64), strided
    assert not view.is_contiguous()
    out_view, out_contig = fn(view), fn(view.contiguous())
    assert out_view.dtype == dtype
    assert torch.equal(out_view, out_contig)


# --- quantize_dequantize ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_FLOAT_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme,kind", [("kqv", "keys"), ("kqv", "values"), ("kivi", "keys"), ("qkqv", "keys"), ("block", "values")])
def test_quantize_dequantize_matches_codec(dtype, device, scheme, kind):
    codec = KVCodec(scheme, 4, 64, seed=3)
    x = _rows((2, 3, 32, 64), dtype, seed=7, device=device)
    out = kt.quantize_dequantize(codec, x, kind)
    assert out.dtype == dtype and out.device == x.device and out.shape == x.shape
    a = x.detach().cpu().float().numpy()
    if kind == "keys":
        ref = codec.decode_keys(codec.encode_keys(a))
    else:
        ref = codec.decode_values(codec.encode_values(a))
    assert torch.equal(out.cpu(), torch.from_numpy(ref).to(dtype))


def test_quantize_dequantize_is_lossy_but_close():
    # Guards against an identity implementation: a 2-bit round trip must move the tensor, a
    # 8-bit one must stay close. Relative Frobenius error bounds: 2-bit kqv has MSE ~0.12 per
    # unit-norm vector (error ~0.35); 8-bit is ~1e-4 (error ~1e-2); the bounds sit between.
    x = _rows((4, 64, 64), seed=8)
    err2 = (kt.quantize_dequantize(KVCodec("kqv", 2, 64), x) - x).norm() / x.norm()
    err8 = (kt.quantize_dequantize(KVCodec("kqv", 8, 64), x) - x).norm() / x.norm()
    assert err2 > 0.1
    assert err8 < 0.03


def test_quantize_dequantize_bad_kind():
    with pytest.raises(kvqrs.KvqrsError, match="kind"):
        kt.quantize_dequantize(KVCodec("kqv", 4, 64), _rows((2, 64)), "queries")


# --- errors -----------------------------------------------------------------------------------

ENTRY_POINTS = [
    lambda t: kt.to_numpy(t),
    lambda t: kt.apply(kvqrs.hadamard, t),
    lambda t: kt.hadamard(t),
    lambda t: kt.inverse_hadamard(t),
    lambda t: kt.quantize_dequantize(KVCodec("kqv", 4, 64), t),
]
ENTRY_IDS = ["to_numpy", "apply", "hadamard", "inverse_hadamard", "quantize_dequantize"]


@pytest.mark.parametrize("dtype", NON_FLOAT, ids=str)
@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=ENTRY_IDS)
def test_non_float_tensor_raises(dtype, fn):
    t = torch.ones(2, 64, dtype=dtype)
    with pytest.raises(kvqrs.KvqrsError, match="float"):
        fn(t)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=ENTRY_IDS)
def test_sparse_tensor_raises(layout, fn):
    t = torch.randn(2, 64)
    t = t.to_sparse() if layout == "sparse_coo" else t.to_sparse_csr()
    with pytest.raises(kvqrs.KvqrsError, match="expected a dense \\(strided\\) tensor, got layout torch.sparse"):
        fn(t)


@pytest.mark.parametrize("obj", [np.ones((2, 64), np.float32), [[1.0] * 64], 3.0, None], ids=["ndarray", "list", "float", "None"])
@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=ENTRY_IDS)
def test_non_tensor_raises(obj, fn):
    with pytest.raises(kvqrs.KvqrsError, match="torch.Tensor"):
        fn(obj)


def test_error_names_the_argument():
    with pytest.raises(kvqrs.KvqrsError, match="^keys:"):
        kt.to_numpy(torch.ones(2, 2, dtype=torch.int32), "keys")


def test_result_beyond_float16_raises_instead_of_inf():
    # Rows of 60000: the rotation concentrates them into coordinates beyond float16's 65504.
    big = torch.full((2, 64), 60000.0, dtype=torch.float16)
    with pytest.raises(kvqrs.KvqrsError, match="does not fit torch.float16"):
        kt.hadamard(big, seed=1)
    codec = KVCodec("kqv", 4, 64, seed=0)
    with pytest.raises(kvqrs.KvqrsError, match="does not fit"):
        kt.quantize_dequantize(codec, big, "keys")
