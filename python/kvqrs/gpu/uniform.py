"""The KIVI asymmetric uniform quantizer on the device (shaders/uniform.wgsl; docs/schemes.md;
docs/kernels.md section 9). Same arguments, results and errors as :mod:`kvqrs.kernels.uniform`."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_rows, check_bits, check_out_dtype, check_positive_int, restore, tensors_in_out
from ..kernels.uniform import UniformCode, decode_args
from ._device import device as _device
from ._host import check_code_range, check_finite, check_overflow, check_row_len, check_stored, store

__all__ = ["UniformCode", "uniform_decode", "uniform_encode"]


def _interleave(scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    return np.stack([scales, zeros], axis=-1).astype(np.float32).reshape(-1)


@tensors_in_out()
def uniform_encode(x: Any, bits: int, group: int, *, device: Any = None) -> UniformCode:
    """Quantize consecutive groups of ``group`` values along the last axis (on the device).

    ``code = clamp(floor((x - zero) / scale + 0.5), 0, 2^bits - 1)`` with the stored (float16,
    or float32 outside its range) scale and zero point.

    Args:
        x: float array ``(..., n)``.
        bits: 1..8.
        group: values per group (the last group may be shorter).
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        :class:`~kvqrs.UniformCode`.

    Raises:
        KvqrsError: bad dtype, bits or group, NaN/Inf in ``x``, or a range beyond float32.
    """
    b = check_bits(bits)
    g = check_positive_int(group, "group")
    flat, leading, n, _ = as_float_rows(x, "x")
    check_finite(flat, n, "x")
    check_row_len(min(g, n), "group")
    groups = -(-n // g)
    rows = flat.size // n
    top = np.float32((1 << b) - 1)
    if rows == 0:
        z = np.zeros((*leading, groups), np.float16)
        return UniformCode(np.zeros((*leading, n), np.uint8), z, z.copy(), g, b)
    dev = _device(device or "wgpu")
    params = [n, g, groups, top, rows * n]
    with dev.call() as call:
        xb = call.upload(flat)
        rb = call.empty(8 * rows * groups)
        call.dispatch("uniform", "ranges", rows * groups, params, {1: xb, 2: rb})
        raw = call.read(rb, np.float32, 2 * rows * groups).reshape(-1, 2)
        check_overflow(raw[:, 0], groups, "x")
        scales, zeros = store(raw[:, 0]), store(raw[:, 1] + np.float32(0.0))  # a -0.0 minimum stored as +0.0
        codes = call.empty(rows * n)
        call.dispatch("uniform", "encode", -(-rows * n // 4), params, {1: xb, 3: call.upload(_interleave(scales, zeros)), 4: codes})
        c = call.read(codes, np.uint8, rows * n)
    return UniformCode(c.reshape(*leading, n), scales.reshape(*leading, groups), zeros.reshape(*leading, groups), g, b)


@tensors_in_out()
def uniform_decode(code: UniformCode, dtype: Any = np.float32, *, device: Any = None) -> np.ndarray:
    """Reconstruct ``zero + scale * code`` per group (on the device).

    Returns:
        array ``(..., n)`` of ``dtype``.

    Raises:
        KvqrsError: codes out of range, scales/zeros of the wrong shape or dtype, negative or
            non-finite scales.
    """
    flat, s_flat, z_flat, leading, n = decode_args(code)
    b, g, groups = code.bits, code.group, -(-n // code.group)
    s = check_stored(s_flat, "scales")
    z = check_stored(z_flat, "zeros", signed=True)
    out_dtype = check_out_dtype(dtype)
    check_code_range(flat, n, b, "codes")
    rows = flat.size // max(n, 1)
    if flat.size == 0:
        return np.zeros((*leading, n), dtype=out_dtype)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = call.empty(4 * rows * n)
        params = [n, g, groups, np.float32((1 << b) - 1), rows * n]
        call.dispatch("uniform", "decode", rows * n, params, {3: call.upload(_interleave(s, z)), 5: call.upload(flat), 6: out})
        x = call.read(out, np.float32, rows * n)
    return restore(x, leading, n, out_dtype)
