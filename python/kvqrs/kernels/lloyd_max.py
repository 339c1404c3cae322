"""Lloyd-Max codebooks for one coordinate of a random unit vector (docs/kernels.md section 4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native
from .._arrays import KvqrsError, as_code_rows, as_float_rows, check_bits, check_positive_int, restore, tensors_in_out

if TYPE_CHECKING:
    from .._arrays import Array


@dataclass(frozen=True)
class Codebook:
    """An MSE-optimal scalar quantizer for the sphere marginal in R^head_dim.

    Attributes:
        head_dim: dimension D of the unit vectors (``d'`` after a rotation).
        bits: bits per coordinate.
        centroids: float64 ``(2**bits,)``, ascending, unit-vector coordinates.
        boundaries: float64 ``(2**bits - 1,)``, midpoints of adjacent centroids.
        distortion: per-coordinate MSE ``D_b`` under the density
            ``(1 - x^2)^((D-3)/2) / B(1/2, (D-1)/2)``.
    """

    head_dim: int
    bits: int
    centroids: np.ndarray
    boundaries: np.ndarray
    distortion: float

    @property
    def unit_mse(self) -> float:
        """Expected ``||u - u_hat||^2`` for a random unit vector: ``head_dim * distortion``."""
        return self.head_dim * self.distortion

    def encode(self, x: Array) -> Array:
        """Codes of unit-vector coordinates; see :func:`lloyd_max_encode`."""
        return lloyd_max_encode(x, self)

    def decode(self, codes: Array) -> Array:
        """Centroids of codes; see :func:`lloyd_max_decode`."""
        return lloyd_max_decode(codes, self)


def lloyd_max_codebook(head_dim: int, bits: int) -> Codebook:
    """The cached Lloyd-Max codebook for unit vectors in R^head_dim at ``bits`` bits.

    Computed by Lloyd iteration on the exact marginal (regularized incomplete beta for cell
    probabilities, closed-form first moments) to better than 1e-6 relative accuracy.

    Args:
        head_dim: dimension D, ``2 <= D <= 16384``.
        bits: 1..8.

    Returns:
        :class:`Codebook` with float64 ``centroids`` and ``boundaries``.

    Raises:
        KvqrsError: head_dim or bits out of range.
    """
    d = check_positive_int(head_dim, "head_dim", minimum=2)
    b = check_bits(bits)
    centroids, boundaries, distortion = _native.lloyd_max_codebook(d, b)
    centroids.flags.writeable = False
    boundaries.flags.writeable = False
    return Codebook(d, b, centroids, boundaries, float(distortion))


def _check_codebook(codebook: Any) -> None:
    # A codebook is identified by (head_dim, bits): the native side uses its own cached copy.
    if not isinstance(codebook, Codebook):
        raise KvqrsError(f"codebook: expected a Codebook from lloyd_max_codebook, got {type(codebook).__name__}")
    check_positive_int(codebook.head_dim, "codebook.head_dim", minimum=2)
    check_bits(codebook.bits, "codebook.bits")


@tensors_in_out()
def lloyd_max_encode(x: Array, codebook: Codebook) -> Array:
    """``bucketize(x, boundaries)``: the number of float32 boundaries <= each float32 value.

    Args:
        x: float array of any shape (unit-vector coordinates).
        codebook: from :func:`lloyd_max_codebook`.

    Returns:
        uint8 array of the same shape.

    Raises:
        KvqrsError: unsupported dtype or NaN/Inf in ``x``.
    """
    _check_codebook(codebook)
    if np.ndim(x) == 0:
        return lloyd_max_encode(np.reshape(x, (1,)), codebook).reshape(())
    flat, leading, n, _ = as_float_rows(x, "x", min_dim=0)
    out = _native.lloyd_max_encode(flat, codebook.head_dim, codebook.bits, n)
    return restore(out, leading, n)


@tensors_in_out()
def lloyd_max_decode(codes: Array, codebook: Codebook) -> Array:
    """``centroids[codes]`` as float32 (the centroids rounded once to float32).

    Raises:
        KvqrsError: non-integer codes or a code >= 2**bits.
    """
    _check_codebook(codebook)
    flat, leading, n = as_code_rows(codes, "codes", codebook.bits)
    out = _native.lloyd_max_decode(flat, codebook.head_dim, codebook.bits)
    return restore(out, leading, n)
