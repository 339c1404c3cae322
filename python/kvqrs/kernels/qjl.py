"""QJL: the 1-bit Johnson-Lindenstrauss sign sketch of a residual and its unbiased estimators
(docs/kernels.md section 6). ``S`` is the seeded dense Gaussian matrix (m x dim)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .. import _native
from .._arrays import (
    KvqrsError,
    as_float_rows,
    as_scalars,
    check_finite_output,
    check_out_dtype,
    check_positive_int,
    check_seed,
    restore,
    tensors_in_out,
)
from .pack import packed_size

if TYPE_CHECKING:
    from .._arrays import Array, DTypeLike


class QJLSketch(NamedTuple):
    """Output of :func:`qjl_sketch`.

    Attributes:
        signs: uint8 ``(..., ceil(m / 8))`` packed sign bits of ``S r`` (bit 1 = negative,
            ``sign(0) = +1``), 1 bit per sketched coordinate.
        norms: ``(...)`` stored ``||r||`` (float16, or float32 outside float16's normal range).
        m: sketch size.
        dim: residual dimension.
    """

    signs: np.ndarray
    norms: np.ndarray
    m: int
    dim: int


@tensors_in_out()
def qjl_sketch(r: Array, seed: int, m: int | None = None) -> QJLSketch:
    """Sketch residual rows: ``sign(S r)`` packed, plus ``||r||``.

    Args:
        r: float array ``(..., dim)`` (the residual, usually in the rotated domain).
        seed: integer in ``[0, 2**64)`` selecting ``S``.
        m: sketch size (default ``dim``).

    Returns:
        :class:`QJLSketch`.

    Raises:
        KvqrsError: bad dtype, seed or m, or NaN/Inf in ``r``.
    """
    flat, leading, d, _ = as_float_rows(r, "r")
    s = check_seed(seed, optional=False)
    mm = d if m is None else check_positive_int(m, "m")
    signs, norms = _native.qjl_sketch(flat, d, mm, s)
    return QJLSketch(signs.reshape(*leading, packed_size(mm, 1)), norms.reshape(leading), mm, d)


def _sketch_parts(sketch: QJLSketch) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    if not isinstance(sketch, QJLSketch):
        raise KvqrsError(f"sketch: expected a QJLSketch from qjl_sketch, got {type(sketch).__name__}")
    check_positive_int(sketch.m, "sketch.m")
    check_positive_int(sketch.dim, "sketch.dim")
    signs = np.asarray(sketch.signs)
    if signs.dtype != np.uint8 or signs.ndim == 0:
        raise KvqrsError(f"sketch.signs: expected a uint8 array (..., ceil(m/8)), got dtype {signs.dtype}, shape {signs.shape}")
    if signs.shape[-1] != packed_size(sketch.m, 1):
        raise KvqrsError(
            f"sketch.signs: expected a last axis of {packed_size(sketch.m, 1)} bytes for m = {sketch.m}, got shape {signs.shape}"
        )
    leading = tuple(signs.shape[:-1])
    norms = as_scalars(sketch.norms, "sketch.norms", leading)
    return np.ascontiguousarray(signs).reshape(-1), norms, leading


@tensors_in_out()
def qjl_inner_product(y: Array, sketch: QJLSketch, seed: int) -> Array:
    """Unbiased estimates of ``<y_i, r_j>`` for every query row i and sketched row j.

    ``sqrt(pi/2) / m * ||r_j|| * <S y_i, sign(S r_j)>`` (QJL, Zandieh et al. 2024, Lemma 3.2);
    variance about ``(pi/2) ||r||^2 ||y||^2 / m``.

    Args:
        y: float array ``(*Ly, dim)``.
        sketch: from :func:`qjl_sketch` with leading shape ``Lr``.
        seed: the sketch's seed.

    Returns:
        float32 array ``(*Ly, *Lr)``.

    Raises:
        KvqrsError: mismatched dims, a bad seed or sketch, NaN/Inf in ``y``.
    """
    signs, norms, lr = _sketch_parts(sketch)
    flat, ly, d, _ = as_float_rows(y, "y")
    if d != sketch.dim:
        raise KvqrsError(f"y: expected a last axis of {sketch.dim} (the sketched dimension), got {d}")
    out = _native.qjl_inner_product(flat, signs, norms, d, sketch.m, check_seed(seed, optional=False))
    return check_finite_output(out.reshape((*ly, *lr)))


@tensors_in_out()
def qjl_vector_estimate(sketch: QJLSketch, seed: int, dtype: DTypeLike = np.float32) -> Array:
    """Unbiased vector estimate ``r_hat = sqrt(pi/2) / m * ||r|| * S^T sign(S r)``.

    Returns:
        array ``(..., dim)`` of ``dtype`` (``E[r_hat] = r``).

    Raises:
        KvqrsError: a bad seed or sketch.
    """
    signs, norms, lr = _sketch_parts(sketch)
    out = _native.qjl_vector_estimate(signs, norms, sketch.dim, sketch.m, check_seed(seed, optional=False))
    return restore(out, lr, sketch.dim, check_out_dtype(dtype))


QJL_CONSTANT = math.sqrt(math.pi / 2)
"""The unbiasing constant ``sqrt(pi/2)`` of the Gaussian sign sketch."""
