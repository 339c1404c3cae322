"""Randomized Walsh-Hadamard rotation ``R = H_{d'} diag(s) / sqrt(d')`` with zero padding
(docs/kernels.md section 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _native
from .._arrays import KvqrsError, as_float_rows, check_positive_int, check_seed, restore, tensors_in_out

if TYPE_CHECKING:
    from .._arrays import Array


def padded_dim(head_dim: int) -> int:
    """The rotated dimension ``d'``: the next power of two >= ``head_dim``."""
    d = check_positive_int(head_dim, "head_dim", minimum=1)
    return 1 << (d - 1).bit_length()


@tensors_in_out()
def hadamard(x: Array, seed: int | None = None) -> Array:
    """Rotate rows with the randomized Walsh-Hadamard transform.

    Equivalent to ``(H_{d'} @ (s * pad(x))) / sqrt(d')`` with ``H`` the Sylvester Hadamard
    matrix and ``s`` the seeded sign vector (``oracle.hadamard``).

    Args:
        x: float array ``(..., head_dim)`` (float16, bfloat16, float32 or float64), head_dim >= 2.
        seed: integer in ``[0, 2**64)`` selecting the signs; None for the plain orthonormal
            transform.

    Returns:
        array ``(..., d')`` with ``d' = padded_dim(head_dim)``, in the dtype of ``x``
        (computed in float32).

    Raises:
        KvqrsError: unsupported dtype, head_dim < 2, a bad seed, or NaN/Inf in ``x``.
    """
    flat, leading, d, dtype = as_float_rows(x, "x", min_dim=2)
    s = check_seed(seed)
    out = _native.hadamard(flat, d, s)
    return restore(out, leading, padded_dim(d), dtype, finite=True)


@tensors_in_out()
def inverse_hadamard(y: Array, seed: int | None = None, head_dim: int | None = None) -> Array:
    """Inverse of :func:`hadamard`: ``(diag(s) H_{d'} y / sqrt(d'))[..., :head_dim]``.

    Args:
        y: float array ``(..., d')``, ``d'`` a power of two.
        seed: the seed used by :func:`hadamard` (None for the plain transform).
        head_dim: the original dimension (default ``d'``); ``padded_dim(head_dim)`` must equal
            ``d'``.

    Returns:
        array ``(..., head_dim)`` in the dtype of ``y``.

    Raises:
        KvqrsError: unsupported dtype, a last axis that is not ``padded_dim(head_dim)``, a bad
            seed, or NaN/Inf in ``y``.
    """
    flat, leading, dp, dtype = as_float_rows(y, "y")
    d = dp if head_dim is None else check_positive_int(head_dim, "head_dim", minimum=2)
    if padded_dim(d) != dp:
        raise KvqrsError(f"y: expected a last axis of padded_dim({d}) = {padded_dim(d)}, got shape {(*leading, dp)}")
    out = _native.inverse_hadamard(flat, d, check_seed(seed))
    return restore(out, leading, d, dtype, finite=True)
