"""Bit packing on the device (shaders/pack.wgsl; docs/kernels.md section 2).

Same arguments, results and errors as :mod:`kvqrs.kernels.pack`; the packed bytes are the
Rust path's, byte for byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_code_rows, check_bits, tensors_in_out
from ..kernels.pack import packed_rows, packed_size
from ._device import Call
from ._device import device as _device
from ._host import check_code_range

__all__ = ["pack_bits", "packed_size", "unpack_bits", "pack_on_device"]


def pack_on_device(call: Call, codes: Any, rows: int, count: int, bits: int) -> Any:
    """Queue the packing of a device buffer of ``rows * count`` code bytes; returns the buffer
    of ``rows * packed_size(count, bits)`` packed bytes (used by the QJL sketch too)."""
    row_bytes = packed_size(count, bits)
    total = rows * row_bytes
    out = call.empty(total)
    call.dispatch("pack", "pack", -(-total // 4), [rows, count, bits, row_bytes], {1: codes, 2: out})
    return out


@tensors_in_out()
def pack_bits(codes: Any, bits: int, *, device: Any = None) -> np.ndarray:
    """Pack b-bit codes, little-endian within each row (on the device).

    Args:
        codes: integer array ``(..., m)``, every value in ``[0, 2**bits)``.
        bits: code width, 1..8.
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        uint8 array ``(..., ceil(m * bits / 8))``, equal to :func:`kvqrs.pack_bits`.

    Raises:
        KvqrsError: bits outside 1..8, a non-integer dtype, or a code that does not fit (the
            message gives its position).
    """
    b = check_bits(bits)
    flat, leading, m = as_code_rows(codes, "codes", b)
    rows = int(np.prod(leading, dtype=np.int64))
    check_code_range(flat, m, b, "codes")
    row_bytes = packed_size(m, b)
    if flat.size == 0 or row_bytes == 0:
        return np.zeros((*leading, row_bytes), dtype=np.uint8)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = pack_on_device(call, call.upload(flat), rows, m, b)
        return call.read(out, np.uint8, rows * row_bytes).reshape(*leading, row_bytes)


def unpack_on_device(call: Call, packed: Any, rows: int, count: int, bits: int) -> Any:
    """Queue the unpacking of a device buffer of packed rows; returns the code-byte buffer."""
    out = call.empty(rows * count)
    call.dispatch("pack", "unpack", -(-rows * count // 4), [rows, count, bits, packed_size(count, bits)], {3: packed, 4: out})
    return out


@tensors_in_out()
def unpack_bits(packed: Any, bits: int, count: int, *, device: Any = None) -> np.ndarray:
    """Exact inverse of :func:`pack_bits` (on the device).

    Args:
        packed: uint8 array ``(..., ceil(count * bits / 8))``.
        bits: code width, 1..8.
        count: codes per row.
        device: as in :func:`pack_bits`.

    Returns:
        uint8 array ``(..., count)``.

    Raises:
        KvqrsError: bits outside 1..8, a non-uint8 dtype, or a last axis that is not
            ``ceil(count * bits / 8)`` bytes.
    """
    flat, leading, b, n = packed_rows(packed, bits, count)
    rows = int(np.prod(leading, dtype=np.int64))
    if rows == 0 or n == 0:
        return np.zeros((*leading, n), dtype=np.uint8)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = unpack_on_device(call, call.upload(flat), rows, n, b)
        return call.read(out, np.uint8, rows * n).reshape(*leading, n)
