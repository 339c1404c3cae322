"""The HeadQ side code on the device (shaders/headq.wgsl; docs/kernels.md section 7).

The basis is the host's (:func:`kvqrs.headq_basis`, an eigendecomposition, re-exported; or the
random-basis control from :func:`kvqrs.random_orthonormal_basis`). Same arguments, results and
errors as :mod:`kvqrs.kernels.headq`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import KvqrsError, as_float_rows, check_bits, check_finite_output, check_out_dtype, restore, tensors_in_out
from ..kernels.headq import HeadQCode, _basis, _code_parts, headq_basis
from ._device import Call
from ._device import device as _device
from ._host import check_code_range, check_finite, check_overflow, check_row_len, check_stored, store

__all__ = ["HeadQCode", "headq_basis", "headq_decode", "headq_encode", "headq_score_correction"]


def _basis_t(basis: Any) -> tuple[np.ndarray, int, int]:
    u, d, rank = _basis(basis)
    if rank > d:
        raise KvqrsError(
            f"basis: expected a (head_dim, rank) basis with 1 <= rank <= head_dim, got {u.size} values for head_dim {d}, rank {rank}"
        )
    if not np.isfinite(u).all():
        raise KvqrsError("basis: expected finite entries")
    check_row_len(d, "basis")
    return np.ascontiguousarray(u.reshape(d, rank).T), d, rank


def _params(d: int, rank: int, cols: int, bits: int) -> list[Any]:
    top = (1 << bits) - 1
    return [d, rank, cols, np.float32(top) / np.float32(2.0), np.float32(top)]


def _project(call: Call, ub: Any, vecs: Any, rows: int, d: int, rank: int, bits: int) -> Any:
    proj = call.empty(4 * rows * rank)
    call.dispatch("headq", "project", rows * rank, _params(d, rank, rows, bits), {1: ub, 2: vecs, 3: proj})
    return proj


@tensors_in_out()
def headq_encode(residual: Any, basis: Any, bits: int, *, device: Any = None) -> HeadQCode:
    """Encode ``z = Q_side(U^T e)`` per row (on the device).

    Args:
        residual: float array ``(..., head_dim)``: ``k - k_base``.
        basis: float array ``(head_dim, rank)`` with orthonormal columns.
        bits: side-code bits q, 1..8.
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        :class:`~kvqrs.HeadQCode`.

    Raises:
        KvqrsError: shape mismatch, bad bits, NaN/Inf in the residual or basis, or a scale
            beyond float32.
    """
    q = check_bits(bits)
    ut, d, rank = _basis_t(basis)
    flat, leading, de, _ = as_float_rows(residual, "residual")
    if de != d:
        raise KvqrsError(f"residual: expected a last axis of {d} (the basis head_dim), got {de}")
    check_finite(flat, d, "residual")
    rows = flat.size // d
    if rows == 0:
        return HeadQCode(np.zeros((*leading, rank), np.uint8), np.zeros(leading, np.float16), q)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        proj = _project(call, call.upload(ut), call.upload(flat), rows, d, rank, q)
        raw = call.empty(4 * rows)
        call.dispatch("headq", "scales_of", rows, _params(d, rank, rows, q), {3: proj, 4: raw})
        raw_scales = call.read(raw, np.float32, rows)
        check_overflow(raw_scales, 1, "residual")
        scales = store(raw_scales)
        codes = call.empty(rows * rank)
        bind = {3: proj, 5: call.upload(scales.astype(np.float32)), 6: codes}
        call.dispatch("headq", "encode", -(-rows * rank // 4), _params(d, rank, rows, q), bind)
        c = call.read(codes, np.uint8, rows * rank)
    return HeadQCode(c.reshape(*leading, rank), scales.reshape(leading), q)


def _side(call: Call, code: HeadQCode, rank: int) -> tuple[Any, Any, tuple[int, ...], int]:
    flat, scales, leading = _code_parts(code, rank)
    check_code_range(flat, rank, code.bits, "codes")
    s = check_stored(scales, "scales")
    return call.upload(flat), call.upload(s), leading, s.size


@tensors_in_out()
def headq_decode(code: HeadQCode, basis: Any, dtype: Any = np.float32, *, device: Any = None) -> np.ndarray:
    """Reconstruct the side estimate ``U z`` of the residual (on the device).

    Returns:
        array ``(..., head_dim)`` of ``dtype``.

    Raises:
        KvqrsError: codes, scales or basis that do not fit together; a bad dtype.
    """
    ut, d, rank = _basis_t(basis)
    out_dtype = check_out_dtype(dtype)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        codes, scales, leading, rows = _side(call, code, rank)
        if rows == 0:
            return np.zeros((*leading, d), dtype=out_dtype)
        out = call.empty(4 * rows * d)
        bind = {1: call.upload(ut), 5: scales, 7: codes, 8: out}
        call.dispatch("headq", "decode", rows * d, _params(d, rank, rows, code.bits), bind)
        x = call.read(out, np.float32, rows * d)
    return restore(x, leading, d, out_dtype)


@tensors_in_out()
def headq_score_correction(q: Any, code: HeadQCode, basis: Any, *, device: Any = None) -> np.ndarray:
    """Score-space correction ``(U^T q_i) . z_j`` for every query row i and coded key j (on the device).

    Args:
        q: float array ``(*Lq, head_dim)`` of live (post-RoPE) queries.
        code: side codes with leading shape ``Lk``.
        basis: the ``(head_dim, rank)`` basis used to encode.
        device: as in :func:`headq_encode`.

    Returns:
        float32 array ``(*Lq, *Lk)``.

    Raises:
        KvqrsError: mismatched dims, NaN/Inf in ``q``, codes or scales that do not fit.
    """
    ut, d, rank = _basis_t(basis)
    qf, lq, dq, _ = as_float_rows(q, "q")
    if dq != d:
        raise KvqrsError(f"q: expected a last axis of {d} (the basis head_dim), got {dq}")
    check_finite(qf, d, "q")
    nq = qf.size // d
    dev = _device(device or "wgpu")
    with dev.call() as call:
        codes, scales, lk, nk = _side(call, code, rank)
        if nq * nk == 0:
            return np.zeros((*lq, *lk), dtype=np.float32)
        qproj = _project(call, call.upload(ut), call.upload(qf), nq, d, rank, code.bits)
        out = call.empty(4 * nq * nk)
        bind = {5: scales, 7: codes, 8: out, 9: qproj}
        call.dispatch("headq", "correction", nq * nk, _params(d, rank, nk, code.bits), bind)
        corr = call.read(out, np.float32, nq * nk)
    return check_finite_output(corr.reshape((*lq, *lk)))
