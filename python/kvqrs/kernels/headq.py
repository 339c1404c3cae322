"""HeadQ side code: a low-rank code of the key residual in a PCA basis of calibration queries,
added back in score space with the live query (docs/kernels.md section 7)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import _native
from .._arrays import (
    KvqrsError,
    as_code_rows,
    as_float_rows,
    as_scalars,
    check_bits,
    check_finite_output,
    check_out_dtype,
    check_positive_int,
    restore,
    tensors_in_out,
)

MAX_BASIS_DIM = 4096
"""Largest head_dim :func:`headq_basis` accepts (it eigendecomposes a dense d x d matrix)."""

if TYPE_CHECKING:
    from .._arrays import Array, DTypeLike


class HeadQCode(NamedTuple):
    """Output of :func:`headq_encode`.

    Attributes:
        codes: uint8 ``(..., rank)`` side codes of ``U^T e`` (unpacked, ``bits`` each).
        scales: ``(...)`` per-token scale of the symmetric uniform side quantizer (float16, or
            float32 outside float16's normal range).
        bits: side-code width q.
    """

    codes: np.ndarray
    scales: np.ndarray
    bits: int


def _basis(basis: Any) -> tuple[np.ndarray, int, int]:
    arr = np.asarray(basis)
    if arr.ndim != 2:
        raise KvqrsError(f"basis: expected a (head_dim, rank) array, got shape {arr.shape}")
    flat, _, rank, _ = as_float_rows(arr, "basis")
    return flat, arr.shape[0], rank


@tensors_in_out()
def headq_encode(residual: Array, basis: Array, bits: int) -> HeadQCode:
    """Encode ``z = Q_side(U^T e)`` per row.

    ``scale = max|U^T e| / h`` with ``h = (2^q - 1) / 2``, stored, then
    ``code = clamp(floor(p / scale + h + 0.5), 0, 2^q - 1)`` (HeadQ, side code of the key
    residual).

    Args:
        residual: float array ``(..., head_dim)``: ``k - k_base``.
        basis: float array ``(head_dim, rank)`` with orthonormal columns.
        bits: side-code bits q, 1..8.

    Returns:
        :class:`HeadQCode`.

    Raises:
        KvqrsError: shape mismatch, bad bits, NaN/Inf in the residual or basis.
    """
    q = check_bits(bits)
    u, d, rank = _basis(basis)
    flat, leading, de, _ = as_float_rows(residual, "residual")
    if de != d:
        raise KvqrsError(f"residual: expected a last axis of {d} (the basis head_dim), got {de}")
    codes, scales = _native.headq_encode(flat, u, d, rank, q)
    return HeadQCode(codes.reshape(*leading, rank), scales.reshape(leading), q)


def _code_parts(code: HeadQCode, rank: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    if not isinstance(code, HeadQCode):
        raise KvqrsError(f"code: expected a HeadQCode from headq_encode, got {type(code).__name__}")
    q = check_bits(code.bits, "code.bits")
    flat, leading, width = as_code_rows(code.codes, "code.codes", q)
    if width != rank:
        raise KvqrsError(f"code.codes: expected a last axis of {rank} (the basis rank), got {width}")
    return flat, as_scalars(code.scales, "code.scales", leading), leading


@tensors_in_out()
def headq_decode(code: HeadQCode, basis: Array, dtype: DTypeLike = np.float32) -> Array:
    """Reconstruct the side estimate ``U z`` of the residual.

    Returns:
        array ``(..., head_dim)`` of ``dtype``. The HeadQ read path never needs this: it adds
        :func:`headq_score_correction` to the base scores instead.
    """
    u, d, rank = _basis(basis)
    flat, scales, leading = _code_parts(code, rank)
    out = _native.headq_decode(flat, scales, u, d, rank, code.bits)
    return restore(out, leading, d, check_out_dtype(dtype))


@tensors_in_out()
def headq_score_correction(q: Array, code: HeadQCode, basis: Array) -> Array:
    """Score-space correction ``(U^T q_i) . z_j`` for every query row i and coded key j.

    The corrected attention logit is ``(q . k_base + correction) / sqrt(head_dim)``
    (HeadQ, score-space side code).

    Args:
        q: float array ``(*Lq, head_dim)`` of live (post-RoPE) queries.
        code: side codes with leading shape ``Lk``.
        basis: the ``(head_dim, rank)`` basis used to encode.

    Returns:
        float32 array ``(*Lq, *Lk)``.
    """
    u, d, rank = _basis(basis)
    qf, lq, dq, _ = as_float_rows(q, "q")
    if dq != d:
        raise KvqrsError(f"q: expected a last axis of {d} (the basis head_dim), got {dq}")
    flat, scales, lk = _code_parts(code, rank)
    out = _native.headq_score_correction(qf, flat, scales, u, d, rank, code.bits)
    return check_finite_output(out.reshape((*lq, *lk)))


@tensors_in_out()
def headq_basis(queries: Array, rank: int) -> Array:
    """Calibration basis: top-``rank`` eigenvectors of the uncentred second moment ``Q^T Q / n``.

    Each column's sign is fixed so that its largest-magnitude entry is positive.

    Args:
        queries: float array ``(..., head_dim)`` of post-RoPE calibration queries (all heads of
            one KV group stacked).
        rank: 1 <= rank <= head_dim.

    Returns:
        float32 ``(head_dim, rank)`` with orthonormal columns.

    Raises:
        KvqrsError: bad rank, no queries, or NaN/Inf in ``queries``.
    """
    flat, _, d, _ = as_float_rows(queries, "queries")
    if d > MAX_BASIS_DIM:
        raise KvqrsError(f"queries: expected head_dim <= {MAX_BASIS_DIM} (a dense eigendecomposition), got {d}")
    r = check_positive_int(rank, "rank")
    if r > d:
        raise KvqrsError(f"rank: expected 1 <= rank <= head_dim = {d}, got {r}")
    qm = flat.reshape(-1, d).astype(np.float64)
    if qm.shape[0] == 0:
        raise KvqrsError("queries: expected at least one calibration query, got 0 rows")
    if not np.isfinite(qm).all():
        row, col = np.argwhere(~np.isfinite(qm))[0]
        raise KvqrsError(f"queries: expected finite values, got {qm[row, col]} at row {row}, position {col}")
    _, vecs = np.linalg.eigh(qm.T @ qm / qm.shape[0])
    top = vecs[:, ::-1][:, :r]
    signs = np.sign(top[np.argmax(np.abs(top), axis=0), np.arange(r)])
    return (top * np.where(signs == 0, 1.0, signs)).astype(np.float32)
