"""Log-coded scalars: non-negative values (the MSE stage's norms) in 8 bits each on a grid of
1/16 octave, relative to one exponent per group of consecutive values (docs/kernels.md
section 13)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import _native
from .._arrays import (
    KvqrsError,
    as_array,
    as_code_rows,
    as_float_rows,
    check_out_dtype,
    check_positive_int,
    restore,
    tensors_in_out,
)

if TYPE_CHECKING:
    from .._arrays import Array, DTypeLike

MAX_ROW_LEN = 1 << 20
"""The longest row and group the log code takes (``MAX_ROW_LEN`` of rust/core/src/kernels/mod.rs)."""
STEPS_PER_OCTAVE = 16
"""Grid steps per factor of two: a coded value is within ``2^(1/32) - 1 = 2.2%`` of its input."""


class LogScalars(NamedTuple):
    """Output of :func:`log_encode`.

    Attributes:
        codes: uint8 ``(..., n)``: ``e - round(16 log2 v)`` (0..254), 255 for zero.
        exps: uint8 ``(..., ceil(n / group))``: each group's exponent byte ``b``, the octave
            ``b - 127`` of its largest value (``e = 16 (b - 127) + 15``, the top level of
            that octave).
        group: values per exponent.
    """

    codes: np.ndarray
    exps: np.ndarray
    group: int


@tensors_in_out()
def log_encode(values: Array, group: int) -> LogScalars:
    """Code non-negative scalars along the last axis in 8 bits each (docs/kernels.md section 13).

    ``v ~ 2^((e - c) / 16)``: the grid index ``r = round(16 log2 v)`` is read from the float32
    bits; each group of ``group`` values shares the octave of its largest index (stored as the
    byte ``b = floor(max r / 16) + 127``, clamped to ``16..254`` so every level is a normal
    float32), ``e = 16 (b - 127) + 15`` is the top level of that octave and each value stores
    ``c = e - r``. The levels reach 14.9 to 15.9 octaves below the largest value; a value more
    than an octave below the smallest level (``2^((e - 254) / 16)``), zero and float32
    subnormals store 255 (zero).

    Args:
        values: float array ``(..., n)`` of finite values ``>= 0`` (norms, scales).
        group: values per exponent (the last group may be shorter).

    Returns:
        :class:`LogScalars`.

    Raises:
        KvqrsError: bad dtype or group, a negative or non-finite value (named by its row of
            the flattened leading axes and its position along the last axis, as the other
            kernels name a non-finite value).
    """
    g = check_positive_int(group, "group")
    flat, leading, n, _ = as_float_rows(values, "values")
    codes, exps = _native.log_encode(flat, n, g)
    return LogScalars(codes.reshape(*leading, n), exps.reshape(*leading, -(-n // g)), g)


@tensors_in_out()
def log_decode(code: LogScalars, dtype: DTypeLike = np.float32) -> Array:
    """The coded values ``L_(k mod 16) 2^floor(k / 16)``, ``k = e - c`` (code 255: 0), exact.

    Returns:
        array ``(..., n)`` of ``dtype``.

    Raises:
        KvqrsError: not a :class:`LogScalars`, exponent bytes of the wrong shape or dtype or
            outside ``16..254``.
    """
    flat, exps, leading, n, g = decode_args(code)
    out = _native.log_decode(flat, exps, n, g)
    return restore(out, leading, n, check_out_dtype(dtype))


def decode_args(code: Any) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], int, int]:
    """Validate :func:`log_decode`'s code; returns ``(flat codes, flat exponent bytes, leading,
    n, group)``."""
    if not isinstance(code, LogScalars):
        raise KvqrsError(f"code: expected a LogScalars from log_encode, got {type(code).__name__}")
    g = check_positive_int(code.group, "code.group")
    flat, leading, n = as_code_rows(code.codes, "code.codes")
    exps = as_array(code.exps, "code.exps")
    groups = -(-n // g)
    if exps.dtype != np.uint8 or exps.shape != (*leading, groups):
        raise KvqrsError(f"code.exps: expected uint8 shape {(*leading, groups)} (one per group), got {exps.dtype} {exps.shape}")
    return flat, np.ascontiguousarray(exps).reshape(-1), leading, n, g
