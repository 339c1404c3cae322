"""The torch adapter: torch tensors in, torch tensors out (float32 / float16 / bfloat16, any
device), through the NumPy-facing kvqrs API.

A float32 contiguous CPU tensor is shared with NumPy without a copy; anything else (another
dtype, a strided view, a device tensor) is staged once into a contiguous float32 CPU tensor.
Results come back in the caller's dtype and on the caller's device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from ._arrays import KvqrsError, warn_if_grad

if TYPE_CHECKING:
    from .schemes.codec import KVCodec

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def to_numpy(t: torch.Tensor, arg: str = "x") -> np.ndarray:
    """A float32 NumPy view of ``t`` (zero-copy for contiguous float32 CPU tensors; otherwise
    one contiguous staging copy). Raises :class:`KvqrsError` for non-float tensors; a tensor that
    requires grad is detached with a :class:`UserWarning` (kvqrs is outside autograd)."""
    if not isinstance(t, torch.Tensor):
        raise KvqrsError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise KvqrsError(f"{arg}: expected a float32, float16, bfloat16 or float64 tensor, got {t.dtype}")
    if t.layout != torch.strided:
        raise KvqrsError(f"{arg}: expected a dense (strided) tensor, got layout {t.layout}; call .to_dense() first")
    warn_if_grad(t, arg)
    staged = t.detach()
    if staged.device.type != "cpu" or staged.dtype != torch.float32 or not staged.is_contiguous():
        staged = staged.to(device="cpu", dtype=torch.float32).contiguous()
    return staged.numpy()


def check_finite(t: torch.Tensor, arg: str) -> None:
    """Raise :class:`KvqrsError` naming the first NaN or infinity of ``t`` by its index (a
    cache must refuse it on arrival: held in the window, it would only fail, or poison every
    later softmax, steps later). The sum is checked first: NaN and infinities reach it, and
    one reduction costs a decode step a third of the element-wise check, which runs only to
    name the culprit (or when the sum of finite values overflows)."""
    t = t.detach()
    if math.isfinite(t.sum().item()):
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        i = tuple(int(j) for j in bad.nonzero()[0])
        raise KvqrsError(f"{arg}: expected finite values, got {float(t[i])} at index {i}")


def check_storable(t: torch.Tensor, arg: str) -> None:
    """:func:`check_finite`, then refuse a value beyond ``kvqrs._native.MAX_STATE`` (1e35) in
    magnitude, named by its index: a cache codes its tokens steps after their arrival, with
    those of other updates, and past that bound a norm, a group's range or a rotated coordinate
    could overflow float32 then (the window's native append makes the same check)."""
    from . import _native

    t = t.detach()
    if not t.numel() or float(t.abs().max()) <= _native.MAX_STATE:  # one pass: NaN fails it too
        return
    check_finite(t, arg)  # names a NaN or infinity
    i = tuple(int(j) for j in (t.abs() > _native.MAX_STATE).nonzero()[0])
    raise KvqrsError(f"{arg}: expected values of magnitude <= {_native.MAX_STATE:.0e}, got {float(t[i]):.6g} at index {i}")


def from_numpy(a: np.ndarray, like: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """``a`` as a tensor with ``like``'s float dtype and device. A finite value past that
    dtype's range raises, or with ``saturate`` (reconstructions of inputs that were in range,
    a step or a rounding past it) becomes the dtype's largest value of its sign."""
    out = torch.from_numpy(np.ascontiguousarray(a))
    if out.is_floating_point() and out.dtype != like.dtype:
        if saturate and like.dtype.is_floating_point and torch.finfo(like.dtype).max < torch.finfo(out.dtype).max:
            top = torch.finfo(like.dtype).max
            out = out.clamp(-top, top)
        cast = out.to(dtype=like.dtype)
        bad = torch.isinf(cast) & torch.isfinite(out)
        if bool(bad.any()):
            i = tuple(int(j) for j in bad.nonzero()[0])
            raise KvqrsError(f"result: value {float(out[i]):.6g} at {i} does not fit {like.dtype}; use a wider input dtype")
        out = cast
    return out.to(device=like.device)


def apply(fn: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Run a float-in / float-out kvqrs function on a tensor (``kvqrs.torch.apply(kvqrs.hadamard,
    x, seed=1)``)."""
    return from_numpy(fn(to_numpy(x), *args, **kwargs), x)


def hadamard(x: torch.Tensor, seed: int | None = None) -> torch.Tensor:
    """:func:`kvqrs.hadamard` on a tensor ``(..., head_dim)`` -> ``(..., d')``."""
    from .kernels import hadamard as _h

    return apply(_h, x, seed)


def inverse_hadamard(y: torch.Tensor, seed: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """:func:`kvqrs.inverse_hadamard` on a tensor ``(..., d')`` -> ``(..., head_dim)``."""
    from .kernels import inverse_hadamard as _ih

    return apply(_ih, y, seed, head_dim)


def quantize_dequantize(codec: KVCodec, x: torch.Tensor, kind: str = "keys") -> torch.Tensor:
    """Encode then decode ``x`` ``(..., tokens, head_dim)`` with a :class:`kvqrs.schemes.KVCodec`
    (``kind`` = ``"keys"`` or ``"values"``); returns a tensor like ``x``."""
    a = to_numpy(x, kind)
    if kind == "keys":
        out = codec.decode_keys(codec.encode_keys(a))
    elif kind == "values":
        out = codec.decode_values(codec.encode_values(a))
    else:
        raise KvqrsError(f"kind: expected 'keys' or 'values', got {kind!r}")
    return from_numpy(out, x)
