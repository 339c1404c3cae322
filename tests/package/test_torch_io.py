"""Torch tensors through the NumPy-facing API: a tensor in gives a tensor out.

The kernel functions (``kvqrs.hadamard``, ``mse_encode``/``mse_decode``, ...) and every
``KVCodec`` method return tensors on the caller's device when given tensors, with the values and
dtypes the NumPy path returns (bit for bit: the same kernels run on the staged copy); codes
encoded from a tensor decode back to a tensor of its dtype. A tensor that requires grad is
detached with a UserWarning that points at the caller's line. NumPy inputs still give NumPy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import kvqrs  # noqa: E402
from kvqrs.schemes import KVCodec  # noqa: E402

D = 64
TORCH_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _np(t):
    """The NumPy array holding ``t``'s values in its own dtype (bfloat16 as ml_dtypes')."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _rows(shape, dtype=torch.float32, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).to(dtype)


def _same(t, a):
    """``t`` is a tensor holding exactly the NumPy result ``a`` (values and dtype)."""
    assert isinstance(t, torch.Tensor), type(t)
    got = _np(t)
    assert got.dtype == a.dtype and got.shape == a.shape
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(a).view(np.uint8))


@pytest.mark.parametrize("dtype", TORCH_FLOATS)
def test_transforms_return_tensors_in_the_callers_dtype(dtype):
    x = _rows((3, 5, D), dtype)
    y = kvqrs.hadamard(x, seed=7)
    assert y.dtype == dtype and y.device == x.device
    _same(y, kvqrs.hadamard(_np(x), seed=7))
    back = kvqrs.inverse_hadamard(y, seed=7)
    _same(back, kvqrs.inverse_hadamard(_np(y), seed=7))


@pytest.mark.parametrize("dtype", TORCH_FLOATS)
def test_mse_encode_decode_tensors(dtype):
    x = _rows((4, D), dtype, seed=1)
    code = kvqrs.mse_encode(x, bits=3, seed=5)
    ref = kvqrs.mse_encode(_np(x), bits=3, seed=5)
    _same(code.codes, ref.codes)
    _same(code.norms, ref.norms)
    out = kvqrs.mse_decode(code.codes, code.norms, bits=3, head_dim=D, seed=5)
    _same(out, kvqrs.mse_decode(ref.codes, ref.norms, bits=3, head_dim=D, seed=5))
    half = kvqrs.mse_decode(code.codes, code.norms, bits=3, head_dim=D, seed=5, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    _same(half, kvqrs.mse_decode(ref.codes, ref.norms, bits=3, head_dim=D, seed=5, dtype=ml_dtypes.bfloat16))
    packed = kvqrs.mse_encode_packed(x, bits=3, seed=5)
    _same(packed.codes, kvqrs.pack_bits(ref.codes, 3))
    _same(kvqrs.unpack_bits(packed.codes, 3, D), ref.codes)


def test_numpy_in_gives_numpy_out():
    x = _rows((2, D)).numpy()
    assert isinstance(kvqrs.hadamard(x, seed=1), np.ndarray)
    code = kvqrs.mse_encode(x, 4, seed=1)
    assert isinstance(code.codes, np.ndarray)
    assert isinstance(kvqrs.mse_decode(code.codes, code.norms, 4, D, seed=1), np.ndarray)


@pytest.mark.parametrize("scheme", ["kqv", "kivi", "qkqv", "headq"])
@pytest.mark.parametrize("dtype", TORCH_FLOATS)
def test_codec_methods_return_tensors(scheme, dtype):
    codec = KVCodec(scheme, 4, D, seed=3, basis="random" if scheme == "headq" else None)
    k, v, q = _rows((2, 40, D), dtype, 1), _rows((2, 40, D), dtype, 2), _rows((4, 1, D), dtype, 3)
    ck, cv = codec.encode_keys(k), codec.encode_values(v)
    assert ck.device == "cpu" and cv.device == "cpu"
    nk, nv = codec.encode_keys(_np(k)), codec.encode_values(_np(v))
    assert nk.device is None
    _same(codec.decode_keys(ck), codec.decode_keys(nk))
    _same(codec.decode_values(cv), codec.decode_values(nv))
    assert codec.decode_keys(ck).dtype == dtype
    _same(codec.scores(q, ck), codec.scores(_np(q), nk))
    out, p = codec.attention(q, ck, cv)
    ref_out, ref_p = codec.attention(_np(q), nk, nv)
    _same(out, ref_out)
    _same(p, ref_p)
    out, p = codec.attention(q, ck, cv, fused=False)
    ref_out, ref_p = codec.attention(_np(q), nk, nv, fused=False)
    _same(out, ref_out)
    _same(p, ref_p)
    res = codec.fused_attention(q, ck, cv, probs=True)
    ref = codec.fused_attention(_np(q), nk, nv, probs=True)
    for got, want in zip(res, ref):
        _same(got, want)
    # Cropping and joining keep the source: decodes are still tensors.
    assert isinstance(codec.decode_keys(codec.slice_tokens(ck, 32)), torch.Tensor)
    assert isinstance(codec.decode_values(codec.concat([codec.slice_tokens(cv, 32), cv])), torch.Tensor)


def test_headq_calibrate_and_correction_with_tensors():
    codec = KVCodec("headq", 2, D, seed=0)
    basis = codec.calibrate(_rows((200, D), seed=4))
    assert isinstance(basis, torch.Tensor) and basis.dtype == torch.float32
    ck = codec.encode_keys(_rows((1, 33, D), seed=5))
    corr = codec.score_correction(_rows((1, 2, D), seed=6), ck)
    assert isinstance(corr, torch.Tensor)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: kvqrs.hadamard(x, seed=1),
        lambda x: kvqrs.mse_encode(x, 4, seed=1),
        lambda x: KVCodec("kqv", 4, D).encode_keys(x[None]),
    ],
    ids=["hadamard", "mse_encode", "KVCodec.encode_keys"],
)
def test_requires_grad_is_detached_with_a_warning(call):
    x = _rows((3, D)).requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(x)
    msgs = [w for w in caught if "requires grad" in str(w.message)]
    assert msgs, [str(w.message) for w in caught]
    assert msgs[0].category is UserWarning
    assert msgs[0].filename == __file__  # the caller's line, not kvqrs' internals
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(x.detach())  # no warning without grad
