"""Asymmetric min-max uniform quantization of consecutive groups: the KIVI quantizer
(docs/schemes.md; docs/kernels.md section 9)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .. import _native
from .._arrays import (
    KvqrsError,
    as_code_rows,
    as_float_rows,
    as_scalars,
    check_bits,
    check_out_dtype,
    check_positive_int,
    restore,
    tensors_in_out,
)

if TYPE_CHECKING:
    from .._arrays import Array, DTypeLike


class UniformCode(NamedTuple):
    """Output of :func:`uniform_encode`.

    Attributes:
        codes: uint8 ``(..., n)`` codes (unpacked, ``bits`` each).
        scales: ``(..., ceil(n / group))`` scales ``(max - min) / (2^bits - 1)``.
        zeros: ``(..., ceil(n / group))`` zero points (the group minima).
        group: values per group.
        bits: code width.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    group: int
    bits: int


@tensors_in_out()
def uniform_encode(x: Array, bits: int, group: int) -> UniformCode:
    """Quantize consecutive groups of ``group`` values along the last axis.

    ``code = clamp(floor((x - zero) / scale + 0.5), 0, 2^bits - 1)`` with the stored (float16,
    or float32 outside its range) scale and zero point (KIVI, Liu et al. 2024, eq. 1-2).

    Args:
        x: float array ``(..., n)``.
        bits: 1..8.
        group: values per group (the last group may be shorter).

    Returns:
        :class:`UniformCode`.

    Raises:
        KvqrsError: bad dtype, bits or group, NaN/Inf in ``x``, or a group whose range
            ``max - min`` overflows float32 (naming its row).
    """
    b = check_bits(bits)
    g = check_positive_int(group, "group")
    flat, leading, n, _ = as_float_rows(x, "x")
    codes, scales, zeros = _native.uniform_encode(flat, n, g, b)
    groups = -(-n // g)
    return UniformCode(codes.reshape(*leading, n), scales.reshape(*leading, groups), zeros.reshape(*leading, groups), g, b)


@tensors_in_out()
def uniform_decode(code: UniformCode, dtype: DTypeLike = np.float32) -> Array:
    """Reconstruct ``zero + scale * code`` per group.

    Returns:
        array ``(..., n)`` of ``dtype``.

    Raises:
        KvqrsError: codes out of range, scales/zeros of the wrong shape or dtype, negative or
            non-finite scales.
    """
    flat, s, z, leading, n = decode_args(code)
    out = _native.uniform_decode(flat, s, z, n, code.group, code.bits)
    return restore(out, leading, n, check_out_dtype(dtype))


def decode_args(code: UniformCode) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...], int]:
    """Validate :func:`uniform_decode`'s code; returns ``(flat codes, flat scales, flat zeros,
    leading, n)``."""
    if not isinstance(code, UniformCode):
        raise KvqrsError(f"code: expected a UniformCode from uniform_encode, got {type(code).__name__}")
    b = check_bits(code.bits, "code.bits")
    g = check_positive_int(code.group, "code.group")
    flat, leading, n = as_code_rows(code.codes, "code.codes", b)
    groups = -(-n // g)
    if np.shape(code.scales) != (*leading, groups) or np.shape(code.zeros) != (*leading, groups):
        raise KvqrsError(
            f"code.scales/zeros: expected shape {(*leading, groups)} (one per group), got {np.shape(code.scales)} and {np.shape(code.zeros)}"
        )
    s = as_scalars(np.asarray(code.scales), "code.scales", (*leading, groups))
    z = as_scalars(np.asarray(code.zeros), "code.zeros", (*leading, groups))
    return flat, s, z, leading, n
