"""Host-side checks and conventions the WGSL path shares with the Rust path.

The Rust kernels validate finiteness, code ranges and stored scalars themselves; the shaders
cannot raise, so these checks run on the host before a dispatch, with the Rust path's messages
(argument, row, position). Scalar storage (float16 where every value fits, float32 otherwise;
each value rounded to float16 when it fits) is decided here, exactly as
``rust/core/src/scalars.rs`` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import KvqrsError

F16_MIN_NORMAL = np.float32(2.0**-14)
F16_MAX = np.float32(65504.0)

MAX_LOOP_ROW = 8192
"""Longest row an invocation of the WGSL path loops over (norms, projections, estimators, KIVI
groups). llvmpipe (Mesa's CPU Vulkan driver) stops a loop after 65535 iterations per
invocation, silently; the norm loops twice over its row and the QJL sketch projects four rows
per invocation, so 8192 keeps every loop below that bound. The rotation alone has no limit."""


def check_row_len(n: int, arg: str) -> None:
    """Raise for a row longer than :data:`MAX_LOOP_ROW` (the WGSL path's per-invocation loops)."""
    if n > MAX_LOOP_ROW:
        raise KvqrsError(
            f"{arg}: the WGSL path loops over at most {MAX_LOOP_ROW} values per row (GPU drivers such as lavapipe cap loop lengths), got {n}; use the cpu backend"
        )


def rust_float(v: Any) -> str:
    """A float32 as Rust's ``Display`` writes it (``NaN``, ``inf``, ``-1.5``, no exponent), so
    that messages equal the Rust path's."""
    f = np.float32(v)
    if np.isnan(f):
        return "NaN"
    if np.isinf(f):
        return "inf" if f > 0 else "-inf"
    return np.format_float_positional(f, trim="-")


def _position(mask: np.ndarray, dim: int) -> tuple[int, int, int]:
    i = int(np.argmax(mask))
    return i, i // max(dim, 1), i % max(dim, 1)


def check_finite(flat: np.ndarray, dim: int, arg: str) -> None:
    """Raise ``KvqrsError`` naming the first NaN/Inf of flat rows of ``dim`` values."""
    bad = ~np.isfinite(flat)
    if bad.any():
        i, row, col = _position(bad, dim)
        raise KvqrsError(f"{arg}: expected finite values, got {rust_float(flat[i])} at row {row}, position {col}")


def check_non_negative(flat: np.ndarray, dim: int, arg: str) -> None:
    """Raise ``KvqrsError`` naming the first negative, NaN or infinite value of flat rows of
    ``dim`` values by its row and position."""
    bad = ~(np.isfinite(flat) & (flat >= 0))
    if bad.any():
        i, row, col = _position(bad, dim)
        raise KvqrsError(f"{arg}: expected finite non-negative values, got {rust_float(flat[i])} at row {row}, position {col}")


def check_code_range(flat: np.ndarray, width: int, bits: int, arg: str) -> None:
    """Raise for a uint8 code ``>= 2**bits`` (other dtypes are checked by ``as_code_rows``)."""
    limit = 1 << bits
    if flat.size and bits < 8 and int(flat.max()) >= limit:
        i, row, col = _position(flat >= limit, width)
        raise KvqrsError(f"{arg}: code {int(flat[i])} at row {row}, position {col} does not fit in {bits} bits (expected < {limit})")


def check_stored(values: np.ndarray, arg: str, signed: bool = False) -> np.ndarray:
    """Stored scalars (norms, scales; zero points when ``signed``) as float32, checked finite
    and, unless ``signed``, non-negative."""
    v = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    bad = ~np.isfinite(v) if signed else ~(np.isfinite(v) & (v >= 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise KvqrsError(f"{arg}: expected finite stored scalars (non-negative for norms and scales), got {rust_float(v[i])} at row {i}")
    return v


def check_overflow(values: np.ndarray, per_row: int, arg: str) -> None:
    """Raise the Rust path's overflow error for the first row holding a non-finite result."""
    bad = ~np.isfinite(values)
    if bad.any():
        _, row, _ = _position(bad, per_row)
        raise KvqrsError(f"{arg}: row {row} overflows float32 (expected values whose norm, range or result stays below 3.4e38)")


def store(values: np.ndarray) -> np.ndarray:
    """Storage of per-vector scalars (``ScalarPlane::store``; round to nearest even): each value
    that is 0 or has a magnitude in ``[2**-14, 65504)`` is rounded to float16; float16 when all
    are, else float32 holding the others unrounded."""
    v = np.asarray(values, dtype=np.float32)
    a = np.abs(v)
    fits = (v == 0) | ((a >= F16_MIN_NORMAL) & (a < F16_MAX))
    with np.errstate(over="ignore"):  # values beyond float16 are discarded by the where
        half = v.astype(np.float16)
    if np.all(fits):
        return half
    return np.where(fits, half.astype(np.float32), v)
