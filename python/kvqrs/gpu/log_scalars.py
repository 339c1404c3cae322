"""Log-coded scalars on the device (shaders/log_scalars.wgsl; docs/kernels.md section 13).

Same arguments, results and errors as :mod:`kvqrs.kernels.log_scalars`, and the same bytes and
floats: the grid index is read from the float32 bits with integer and comparison operations,
and decoding is a table read and an exponent shift, so nothing here has a tolerance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import KvqrsError, as_float_rows, check_out_dtype, check_positive_int, restore, tensors_in_out
from ..kernels.log_scalars import MAX_ROW_LEN, LogScalars, decode_args
from ._device import device as _device
from ._host import check_non_negative, check_row_len

__all__ = ["LogScalars", "log_decode", "log_encode"]

_EXP_MIN, _EXP_MAX = 16, 254
"""Valid exponent bytes (``EXP_MIN``, ``EXP_MAX`` of rust/core/src/kernels/log_scalars.rs)."""


def _check_lengths(n: int, group: int) -> None:
    """The Rust path's row and group length checks, with its messages."""
    for arg, v in (("n", n), ("group", group)):
        if not 1 <= v <= MAX_ROW_LEN:
            raise KvqrsError(f"{arg}: expected 1 <= {arg} <= {MAX_ROW_LEN}, got {v}")


@tensors_in_out()
def log_encode(values: Any, group: int, *, device: Any = None) -> LogScalars:
    """Code non-negative scalars along the last axis in 8 bits each (on the device;
    docs/kernels.md section 13).

    Equivalent to :func:`kvqrs.kernels.log_encode`: each value's grid index ``r = round(16 log2 v)``
    is read from its float32 bits; each group of ``group`` values stores the exponent byte
    ``b = clamp(floor(max r / 16) + 127, 16, 254)`` (127 when every value is zero or
    subnormal) and each value the code ``c = e - r``, ``e = 16 (b - 127) + 15`` (0 when
    negative; 254 up to an octave below the smallest level; 255 for zero, subnormals and
    values further below).

    Args:
        values: float array ``(..., n)`` (float16, bfloat16, float32 or float64, taken as
            float32) of finite values ``>= 0`` (norms, scales).
        group: values per exponent byte (the last group of a row may be shorter); at most 8192
            on this path (GPU drivers cap loop lengths).
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        :class:`~kvqrs.kernels.LogScalars`: codes uint8 ``(..., n)``, exps uint8
        ``(..., ceil(n / group))``, ``group``.

    Raises:
        KvqrsError: bad dtype, shape or group, a negative, NaN or infinite value (its row and
            position named), a group longer than 8192 values, or a batch beyond the adapter's
            buffer limit.
    """
    g = check_positive_int(group, "group")
    flat, leading, n, _ = as_float_rows(values, "values")
    _check_lengths(n, g)
    check_non_negative(flat, n, "values")
    check_row_len(min(g, n), "group")
    groups = -(-n // g)
    rows = flat.size // n
    if rows == 0:
        return LogScalars(np.zeros((*leading, n), np.uint8), np.zeros((*leading, groups), np.uint8), g)
    dev = _device(device or "wgpu")
    params = [n, g, groups, rows * n, rows * groups]
    with dev.call() as call:
        vb = call.upload(flat)
        eb = call.empty(rows * groups)
        call.dispatch("log_scalars", "exponents", -(-rows * groups // 4), params, {1: vb, 2: eb})
        cb = call.empty(rows * n)
        call.dispatch("log_scalars", "encode", -(-rows * n // 4), params, {1: vb, 3: eb, 4: cb})
        codes = call.read(cb, np.uint8, rows * n)
        exps = call.read(eb, np.uint8, rows * groups)
    return LogScalars(codes.reshape(*leading, n), exps.reshape(*leading, groups), g)


@tensors_in_out()
def log_decode(code: LogScalars, dtype: Any = np.float32, *, device: Any = None) -> Any:
    """The coded values ``L_(k mod 16) 2^floor(k / 16)``, ``k = 16 (b - 127) + 15 - c``
    (code 255: 0), exact (on the device; docs/kernels.md section 13).

    Equivalent to :func:`kvqrs.kernels.log_decode`, bit for bit.

    Args:
        code: a :class:`~kvqrs.kernels.LogScalars` (codes uint8 ``(..., n)``, exps uint8
            ``(..., ceil(n / group))`` in ``16..254``).
        dtype: output float dtype (float16, bfloat16, float32 or float64).
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        array ``(..., n)`` of ``dtype``.

    Raises:
        KvqrsError: not a :class:`~kvqrs.kernels.LogScalars`, codes that are not integers in 0..255,
            exponent bytes of the wrong shape or dtype or outside ``16..254``, a bad ``dtype``
            or a value beyond it (float16), or a batch beyond the adapter's buffer limit.
    """
    flat, exps, leading, n, g = decode_args(code)
    _check_lengths(n, g)
    bad = (exps < _EXP_MIN) | (exps > _EXP_MAX)
    if bad.any():
        i = int(np.argmax(bad))
        raise KvqrsError(f"exps: expected log-code exponent bytes in {_EXP_MIN}..={_EXP_MAX}, got {int(exps[i])} at group {i}")
    out_dtype = check_out_dtype(dtype)
    rows = flat.size // n
    if rows == 0:
        return restore(np.zeros(0, np.float32), leading, n, out_dtype)
    dev = _device(device or "wgpu")
    params = [n, g, -(-n // g), rows * n, exps.size]
    with dev.call() as call:
        out = call.empty(4 * rows * n)
        call.dispatch("log_scalars", "decode", rows * n, params, {3: call.upload(exps), 5: call.upload(flat), 6: out})
        v = call.read(out, np.float32, rows * n)
    return restore(v, leading, n, out_dtype)
