"""Symmetric per-row absmax codes: one float16 scale per row and a bit width per coordinate
(docs/kernels.md section 14). They code the keys of a calibrated-basis codec with a fixed size
per token: each row is one token's coordinates, already divided by their calibrated standard
deviations by the caller.

Per row, in float32 and in this order, over the coded coordinates ``C = {i : widths[i] > 0}``:
``a = max_(i in C) |x_i|`` (0 when ``C`` is empty); ``s = float16(a)`` (round to nearest even;
an error if that is infinite); for ``i`` in ``C``, with ``L = 2^w_i - 1``: ``u = x_i / s`` (0
when ``s = 0``), ``t = ((u + 1) * 0.5) * L``, ``code = clamp(floor(t + 0.5), 0, L)``; code 0
elsewhere. Decoding gives ``((2 code - L) / L) * s`` in ``C`` and 0 elsewhere: the levels of
width ``w`` are ``(2c - L) / L``, ``c = 0..L``, both ends -1 and +1 included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import _native
from .._arrays import KvqrsError, as_array, as_code_rows, as_float_rows, check_out_dtype, restore, tensors_in_out

if TYPE_CHECKING:
    from .._arrays import Array, DTypeLike

MAX_WIDTH = 8
"""The widest code of a coordinate (``MAX_WIDTH`` of rust/core/src/kernels/absmax.rs)."""


class AbsmaxCode(NamedTuple):
    """Output of :func:`absmax_encode`.

    Attributes:
        codes: uint8 ``(..., d)``, unpacked, one byte per coordinate (``0..2^w_i - 1``; 0 where
            ``w_i = 0``). A caller packs each run of equal widths with :func:`~kvqrs.pack_bits`.
        scales: float16 ``(...)``: each row's largest coded magnitude, rounded to float16.
        widths: uint8 ``(d,)``: each coordinate's bit width, 0..8 (0: not coded).
    """

    codes: np.ndarray
    scales: np.ndarray
    widths: np.ndarray


def check_widths(widths: Any, arg: str = "widths") -> np.ndarray:
    """``widths`` as a contiguous uint8 array of shape ``(d,)``, ``d >= 1``, each in 0..8, or a
    :class:`KvqrsError` naming ``arg`` and the first bad position."""
    w = as_array(widths, arg)
    if w.dtype.kind not in "ui":
        raise KvqrsError(f"{arg}: expected an integer array of bit widths (uint8), got dtype {w.dtype}")
    if w.ndim != 1 or w.size == 0:
        raise KvqrsError(f"{arg}: expected shape (d,) with d >= 1 (one bit width per coordinate), got {w.shape}")
    bad = (w < 0) | (w > MAX_WIDTH)
    if bad.any():
        i = int(np.argmax(bad))
        raise KvqrsError(f"{arg}: expected bit widths in 0..{MAX_WIDTH}, got {int(w[i])} at position {i}")
    return np.ascontiguousarray(w, dtype=np.uint8)


@tensors_in_out()
def absmax_encode(x: Array, widths: Array) -> AbsmaxCode:
    """Code each row with a float16 absmax scale and a bit width per coordinate.

    Per row (float32, in this order): ``a = max |x_i|`` over the coded coordinates ``C = {i :
    widths[i] > 0}`` (0 when ``C`` is empty); ``s = float16(a)`` (round to nearest even) as
    float32; for ``i`` in ``C`` with ``L = 2^widths[i] - 1``: ``u = x_i / s`` (0 when ``s = 0``),
    ``t = ((u + 1) * 0.5) * L``, ``code = clamp(floor(t + 0.5), 0, L)``; code 0 for ``i`` not
    in ``C``. Rows are independent (a batch codes as its rows one by one).

    Args:
        x: float array ``(..., d)`` (float16, bfloat16, float32 or float64; computed on its
            float32 values), any leading shape, empty included.
        widths: integer array ``(d,)`` of bit widths 0..8 (0: the coordinate is not coded).

    Returns:
        :class:`AbsmaxCode`: codes uint8 ``(..., d)``, scales float16 ``(...)``, widths uint8
        ``(d,)``.

    Raises:
        KvqrsError: bad dtype or shape of ``x`` or ``widths``, a width outside 0..8 (naming its
            position), a last axis of ``x`` other than ``len(widths)``, NaN or infinity anywhere
            in ``x`` (uncoded coordinates too; named by row of the flattened leading axes and
            position), or a row whose largest coded magnitude rounds to float16 infinity
            (``>= 65520``: "x: absmax scale overflows float16 at row r ...").
    """
    w = check_widths(widths)
    flat, leading, d, _ = as_float_rows(x, "x")
    if d != w.size:
        raise KvqrsError(f"x: expected a last axis of length {w.size} (one value per width), got shape {(*leading, d)}")
    codes, scales = _native.absmax_encode(flat, w)
    return AbsmaxCode(codes.reshape(*leading, d), scales.reshape(leading), w)


@tensors_in_out()
def absmax_decode(code: AbsmaxCode, dtype: DTypeLike = np.float32) -> Array:
    """Reconstruct ``((2 code - L) / L) * s`` per coded coordinate (``L = 2^w - 1``; the integer
    ``2 code - L`` converted to float32, one float32 division, one multiply) and 0 in the
    uncoded ones.

    Args:
        code: an :class:`AbsmaxCode` of :func:`absmax_encode`. Its codes are uint8 there; as in
            every kvqrs kernel that reads codes (:func:`~kvqrs.mse_decode`,
            :func:`~kvqrs.pack_bits`, ...), codes of another integer dtype (int64 from
            arithmetic on them) are taken by value when every value fits in 0..255, never
            wrapped: a value outside is refused naming its index, a float or bool array by its
            dtype.
        dtype: the output's float dtype.

    Returns:
        array ``(..., d)`` of ``dtype``.

    Raises:
        KvqrsError: not an :class:`AbsmaxCode`; widths of the wrong dtype, shape or range; codes
            not of an integer dtype, with a value outside 0..255, or whose last axis is not
            ``len(widths)``; scales that are not float16 of the codes'
            leading shape, or negative or non-finite; a code above its coordinate's ``2^w - 1``
            (any nonzero code where ``w = 0``), named by row and position.
    """
    flat, scales, w, leading, d = decode_args(code)
    out = _native.absmax_decode(flat, scales, w)
    return restore(out, leading, d, check_out_dtype(dtype), finite=True)


def decode_args(code: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, ...], int]:
    """Validate :func:`absmax_decode`'s code; returns ``(flat codes, flat float16 scales, uint8
    widths, leading, d)``."""
    if not isinstance(code, AbsmaxCode):
        raise KvqrsError(f"code: expected an AbsmaxCode from absmax_encode, got {type(code).__name__}")
    w = check_widths(code.widths, "code.widths")
    flat, leading, d = as_code_rows(code.codes, "code.codes")
    if d != w.size:
        raise KvqrsError(f"code.codes: expected a last axis of length {w.size} (one code per width), got shape {(*leading, d)}")
    scales = as_array(code.scales, "code.scales")
    if scales.dtype != np.float16 or scales.shape != leading:
        raise KvqrsError(f"code.scales: expected float16 shape {leading} (one per row), got {scales.dtype} {scales.shape}")
    return flat, np.ascontiguousarray(scales).reshape(-1), w, leading, d
