"""The randomized Walsh-Hadamard rotation on the device (shaders/hadamard.wgsl; docs/kernels.md section 3). Same arguments, results and errors as
:mod:`kvqrs.kernels.hadamard`; bit for bit the Rust path's float32 arithmetic."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import KvqrsError, as_float_rows, check_positive_int, check_seed, restore, tensors_in_out
from ..kernels.hadamard import padded_dim
from ._device import Call, Device
from ._device import device as _device
from ._host import check_finite, check_overflow
from .rng import signs_buffer

__all__ = ["hadamard", "inverse_hadamard", "padded_dim", "forward_on_device", "inverse_on_device"]


def _scale(dp: int) -> np.float32:
    # 1/sqrt(d') in float32 with IEEE sqrt and division, as the Rust path computes it.
    return np.float32(1.0) / np.sqrt(np.float32(dp))


def _signs(call: Call, dev: Device, seed: int | None, dp: int) -> Any:
    return call.empty(4) if seed is None else signs_buffer(dev, seed, dp)


BLOCK = 64
"""Coordinates transformed by one invocation of ``butterfly_block`` (stages below BLOCK)."""


def _butterflies(call: Call, work: Any, rows: int, params: list[Any]) -> None:
    dp = params[1]
    h = min(BLOCK, dp)
    call.dispatch("hadamard", "butterfly_block", rows * dp // h, [*params, h], {2: work})
    while h < dp:
        call.dispatch("hadamard", "butterfly", rows * dp // 2, [*params, h], {2: work})
        h *= 2


def forward_on_device(call: Call, dev: Device, x: Any, rows: int, d: int, seed: int | None) -> Any:
    """Queue the rotation of ``rows`` rows of ``d`` floats in device buffer ``x``; returns the
    buffer of ``rows * d'`` rotated floats."""
    dp = padded_dim(d)
    work = call.empty(4 * rows * dp)
    params = [d, dp, int(seed is not None), 0, _scale(dp)]
    call.dispatch("hadamard", "forward_scale", rows * dp, [*params, 0], {1: x, 2: work, 3: _signs(call, dev, seed, dp)})
    _butterflies(call, work, rows, params)
    return work


def inverse_on_device(call: Call, dev: Device, y: Any, rows: int, d: int, seed: int | None, row_scale: Any = None) -> Any:
    """Queue the inverse rotation of ``rows`` rows of ``d'`` floats in ``y`` (overwritten), keeping
    ``d`` coordinates, times ``row_scale[row]`` when given; returns the ``rows * d`` buffer."""
    dp = padded_dim(d)
    out = call.empty(4 * rows * d)
    params = [d, dp, int(seed is not None), int(row_scale is not None), _scale(dp)]
    call.dispatch("hadamard", "inverse_scale", rows * dp, [*params, 0], {2: y})
    _butterflies(call, y, rows, params)
    bind = {1: out, 2: y, 3: _signs(call, dev, seed, dp), 4: row_scale if row_scale is not None else call.empty(4)}
    call.dispatch("hadamard", "inverse_finish", rows * d, [*params, 0], bind)
    return out


@tensors_in_out(keep_dtype=True)
def hadamard(x: Any, seed: int | None = None, *, device: Any = None) -> np.ndarray:
    """Rotate rows with the randomized Walsh-Hadamard transform (on the device).

    Args:
        x: float array ``(..., head_dim)`` (float16, bfloat16, float32 or float64), head_dim >= 2.
        seed: integer in ``[0, 2**64)`` selecting the signs; None for the plain orthonormal
            transform.
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        array ``(..., d')`` in the dtype of ``x`` (computed in float32), equal to
        :func:`kvqrs.hadamard`.

    Raises:
        KvqrsError: unsupported dtype, head_dim < 2, a bad seed, NaN/Inf in ``x``, or a result
            beyond float32.
    """
    flat, leading, d, dtype = as_float_rows(x, "x", min_dim=2)
    s = check_seed(seed)
    dp = padded_dim(d)
    rows = flat.size // d
    check_finite(flat, d, "x")
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = forward_on_device(call, dev, call.upload(flat), rows, d, s)
        y = call.read(out, np.float32, rows * dp)
    check_overflow(y, dp, "x")
    return restore(y, leading, dp, dtype)


@tensors_in_out(keep_dtype=True)
def inverse_hadamard(y: Any, seed: int | None = None, head_dim: int | None = None, *, device: Any = None) -> np.ndarray:
    """Inverse of :func:`hadamard`: ``(diag(s) H_{d'} y / sqrt(d'))[..., :head_dim]`` (on the device).

    Args:
        y: float array ``(..., d')``, ``d'`` a power of two.
        seed: the seed used by :func:`hadamard` (None for the plain transform).
        head_dim: the original dimension (default ``d'``); ``padded_dim(head_dim)`` must equal ``d'``.
        device: as in :func:`hadamard`.

    Returns:
        array ``(..., head_dim)`` in the dtype of ``y``.

    Raises:
        KvqrsError: unsupported dtype, a last axis that is not ``padded_dim(head_dim)``, a bad
            seed, NaN/Inf in ``y``, or a result beyond float32.
    """
    flat, leading, dp, dtype = as_float_rows(y, "y")
    d = dp if head_dim is None else check_positive_int(head_dim, "head_dim", minimum=2)
    if padded_dim(d) != dp:
        raise KvqrsError(f"y: expected a last axis of padded_dim({d}) = {padded_dim(d)}, got shape {(*leading, dp)}")
    if d < 2:
        raise KvqrsError(f"head_dim: expected 2 <= head_dim <= {1 << 20}, got {d}")
    s = check_seed(seed)
    rows = flat.size // dp
    check_finite(flat, dp, "y")
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = inverse_on_device(call, dev, call.upload(flat), rows, d, s)
        x = call.read(out, np.float32, rows * d)
    check_overflow(x, d, "y")
    return restore(x, leading, d, dtype)
