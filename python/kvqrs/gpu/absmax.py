"""Symmetric per-row absmax codes on the device (shaders/absmax.wgsl; docs/kernels.md section 14).
Same arguments, results and errors as :mod:`kvqrs.kernels.absmax`.

The row maxima are exact and the float16 scales are rounded on the host (as the Rust path
rounds them), so the scales equal the Rust path's; decoding reads a table of the levels
``(2c - L) / L`` computed on the host in float32 and multiplies by the scale, bit for bit the
Rust path's floats. The division ``x / s`` of the encode is WGSL's (2.5 ulp), so a code can
differ from the Rust path's only where ``t + 0.5`` lies within rounding of an integer.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._arrays import KvqrsError, as_float_rows, check_out_dtype, restore, tensors_in_out
from ..kernels.absmax import AbsmaxCode, check_widths, decode_args
from ._device import device as _device
from ._host import check_finite, check_row_len, check_stored, rust_float

__all__ = ["AbsmaxCode", "absmax_decode", "absmax_encode"]


@functools.cache
def _levels() -> np.ndarray:
    """The levels ``(2c - L) / L`` (float32 division, as the Rust path divides) of every width:
    width ``w`` at ``2^w - 1 + c``; width 0 holds one level, 0."""
    out = [np.zeros(1, np.float32)]
    for w in range(1, 9):
        top = (1 << w) - 1
        out.append((2 * np.arange(top + 1, dtype=np.int64) - top).astype(np.float32) / np.float32(top))
    return np.concatenate(out)


def _tops(w: np.ndarray) -> np.ndarray:
    return ((1 << w.astype(np.int64)) - 1).astype(np.float32)


@tensors_in_out()
def absmax_encode(x: Any, widths: Any, *, device: Any = None) -> AbsmaxCode:
    """Code each row with a float16 absmax scale and a bit width per coordinate (on the device).

    Equivalent to :func:`kvqrs.kernels.absmax_encode`: ``a = max |x_i|`` over the coded
    coordinates, ``s = float16(a)``, ``code = clamp(floor(((x_i / s + 1) * 0.5) * L + 0.5), 0,
    L)`` with ``L = 2^widths[i] - 1``, 0 where ``widths[i] = 0``.

    Args:
        x: float array ``(..., d)``.
        widths: integer array ``(d,)`` of bit widths 0..8; ``d`` at most 8192 on this path (GPU
            drivers cap loop lengths).
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        :class:`~kvqrs.AbsmaxCode`.

    Raises:
        KvqrsError: the Rust path's errors (bad dtype or shape, a width outside 0..8, NaN or
            infinity in ``x``, a row whose scale overflows float16), a row longer than 8192
            values, or a batch beyond the adapter's buffer limit.
    """
    w = check_widths(widths)
    flat, leading, d, _ = as_float_rows(x, "x")
    if d != w.size:
        raise KvqrsError(f"x: expected a last axis of length {w.size} (one value per width), got shape {(*leading, d)}")
    check_finite(flat, d, "x")
    check_row_len(d, "x")
    rows = flat.size // d
    if rows == 0:
        return AbsmaxCode(np.zeros((*leading, d), np.uint8), np.zeros(leading, np.float16), w)
    dev = _device(device or "wgpu")
    params = [d, rows * d]
    with dev.call() as call:
        xb, tb = call.upload(flat), call.upload(_tops(w))
        ab = call.empty(4 * rows)
        call.dispatch("absmax", "absmax", rows, params, {1: xb, 2: ab, 4: tb})
        a = call.read(ab, np.float32, rows)
        with np.errstate(over="ignore"):
            scales = a.astype(np.float16)
        bad = ~np.isfinite(scales)
        if bad.any():
            row = int(np.argmax(bad))
            raise KvqrsError(
                f"x: absmax scale overflows float16 at row {row} (its largest coded magnitude is {rust_float(a[row])}; "
                "expected below 65520, which rounds to float16's largest finite value 65504)"
            )
        cb = call.empty(rows * d)
        call.dispatch("absmax", "encode", -(-rows * d // 4), params, {1: xb, 3: call.upload(scales.astype(np.float32)), 4: tb, 5: cb})
        codes = call.read(cb, np.uint8, rows * d)
    return AbsmaxCode(codes.reshape(*leading, d), scales.reshape(leading), w)


@tensors_in_out()
def absmax_decode(code: AbsmaxCode, dtype: Any = np.float32, *, device: Any = None) -> Any:
    """Reconstruct ``((2 code - L) / L) * s`` per coded coordinate and 0 in the others (on the
    device), bit for bit :func:`kvqrs.kernels.absmax_decode`.

    Returns:
        array ``(..., d)`` of ``dtype``.

    Raises:
        KvqrsError: the Rust path's errors (not an :class:`~kvqrs.AbsmaxCode`, widths, codes or
            scales of the wrong dtype, shape or range, a code above its coordinate's ``2^w - 1``),
            or a batch beyond the adapter's buffer limit.
    """
    flat, scales, w, leading, d = decode_args(code)
    s = check_stored(scales, "scales")
    rows = flat.size // d
    bad = flat.reshape(rows, d) >= (1 << w.astype(np.int64))[None, :]
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        row, col = divmod(i, d)
        raise KvqrsError(
            f"codes: code {int(flat[i])} at row {row}, position {col} does not fit in {int(w[col])} bits (expected < {1 << int(w[col])})"
        )
    out_dtype = check_out_dtype(dtype)
    if rows == 0:
        return restore(np.zeros(0, np.float32), leading, d, out_dtype)
    dev = _device(device or "wgpu")
    bases = ((1 << w.astype(np.uint32)) - 1).astype(np.uint32)
    with dev.call() as call:
        out = call.empty(4 * rows * d)
        bind = {3: call.upload(s), 6: call.upload(flat), 7: call.upload(_levels()), 8: call.upload(bases), 9: out}
        call.dispatch("absmax", "decode", rows * d, [d, rows * d], bind)
        v = call.read(out, np.float32, rows * d)
    return restore(v, leading, d, out_dtype)
