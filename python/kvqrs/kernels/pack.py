"""Bit packing of b-bit codes (docs/kernels.md section 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native
from .._arrays import KvqrsError, as_code_rows, check_bits, check_positive_int, tensors_in_out

if TYPE_CHECKING:
    from .._arrays import Array


def packed_size(count: int, bits: int) -> int:
    """Bytes per row for ``count`` codes of ``bits`` bits: ``ceil(count * bits / 8)``."""
    n = check_positive_int(count, "count", minimum=0)
    return (n * check_bits(bits) + 7) // 8


@tensors_in_out()
def pack_bits(codes: Array, bits: int) -> Array:
    """Pack b-bit codes, little-endian within each row.

    Args:
        codes: integer array ``(..., m)``, every value in ``[0, 2**bits)``.
        bits: code width, 1..8.

    Returns:
        uint8 array ``(..., ceil(m * bits / 8))``; code ``i`` occupies bits ``i*bits ..
        i*bits+bits-1`` of the row's bit stream (bit 0 = least significant bit of byte 0).

    Raises:
        KvqrsError: bits outside 1..8, a non-integer dtype, or a code that does not fit (the
            message gives its index).
    """
    b = check_bits(bits)
    flat, leading, m = as_code_rows(codes, "codes", b)
    out = _native.pack_bits(flat, m, b)
    return out.reshape(*leading, packed_size(m, b))


@tensors_in_out()
def unpack_bits(packed: Array, bits: int, count: int) -> Array:
    """Exact inverse of :func:`pack_bits`.

    Args:
        packed: uint8 array ``(..., ceil(count * bits / 8))``.
        bits: code width, 1..8.
        count: codes per row.

    Returns:
        uint8 array ``(..., count)``.

    Raises:
        KvqrsError: bits outside 1..8, a non-uint8 dtype, or a last axis that is not
            ``ceil(count * bits / 8)`` bytes.
    """
    flat, leading, b, n = packed_rows(packed, bits, count)
    return _native.unpack_bits(flat, n, b).reshape(*leading, n)


def packed_rows(packed: Any, bits: int, count: int) -> tuple[np.ndarray, tuple[int, ...], int, int]:
    """Validate :func:`unpack_bits`' arguments; returns ``(flat uint8, leading, bits, count)``."""
    b = check_bits(bits)
    n = check_positive_int(count, "count", minimum=0)
    arr = np.asarray(packed)
    if arr.dtype != np.uint8:
        raise KvqrsError(f"packed: expected a uint8 array, got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise KvqrsError("packed: expected an array of shape (..., bytes), got a scalar")
    want = packed_size(n, b)
    if arr.shape[-1] != want:
        raise KvqrsError(f"packed: expected a last axis of {want} bytes for {n} codes of {b} bits, got shape {arr.shape}")
    return np.ascontiguousarray(arr).reshape(-1), tuple(arr.shape[:-1]), b, n
