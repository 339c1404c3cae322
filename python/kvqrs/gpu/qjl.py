"""The QJL sign sketch and its estimators on the device (shaders/qjl.wgsl, with mse.wgsl for
``||r||`` and pack.wgsl for the sign bits; docs/kernels.md section 6).

``S`` is built on the host by the Rust generator (float64 Box-Muller, which WGSL cannot do) and
uploaded once per (seed, m, dim). Same arguments, results and errors as :mod:`kvqrs.kernels.qjl`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._arrays import (
    KvqrsError,
    as_float_rows,
    check_finite_output,
    check_out_dtype,
    check_positive_int,
    check_seed,
    restore,
    tensors_in_out,
)
from ..kernels.pack import packed_size
from ..kernels.qjl import QJL_CONSTANT, QJLSketch, _sketch_parts
from ..kernels.rng import qjl_matrix
from ._device import Call, Device
from ._device import device as _device
from ._host import check_finite, check_overflow, check_row_len, check_stored, store
from .mse import norms_on_device
from .pack import pack_on_device

__all__ = ["QJLSketch", "QJL_CONSTANT", "qjl_inner_product", "qjl_sketch", "qjl_vector_estimate"]

MAX_MATRIX_ENTRIES = 1 << 28
"""Largest ``m * dim`` (as the Rust path)."""


def _matrix(dev: Device, seed: int, m: int, dim: int) -> Any:
    check_row_len(dim, "dim")
    check_row_len(m, "m")
    if m * dim > MAX_MATRIX_ENTRIES:
        raise KvqrsError(f"m * dim: expected at most {MAX_MATRIX_ENTRIES} matrix entries, got {m * dim}")
    return dev.constant(("qjl", seed, m, dim), lambda: qjl_matrix(seed, m, dim))


def _k(m: int) -> np.float32:
    return np.float32(math.sqrt(math.pi / 2) / m)


def _project(call: Call, s_buf: Any, vecs: Any, rows: int, dim: int, m: int) -> Any:
    out = call.empty(4 * rows * m)
    call.dispatch("qjl", "project", rows * m, [dim, m, m, np.float32(0)], {1: s_buf, 2: vecs, 4: out})
    return out


@tensors_in_out()
def qjl_sketch(r: Any, seed: int, m: int | None = None, *, device: Any = None) -> QJLSketch:
    """Sketch residual rows: ``sign(S r)`` packed, plus ``||r||`` (on the device).

    Args:
        r: float array ``(..., dim)``.
        seed: integer in ``[0, 2**64)`` selecting ``S``.
        m: sketch size (default ``dim``).
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        :class:`~kvqrs.QJLSketch`, usable by the CPU estimators too.

    Raises:
        KvqrsError: bad dtype, seed or m, NaN/Inf in ``r``, or a norm beyond float32.
    """
    flat, leading, d, _ = as_float_rows(r, "r")
    s = check_seed(seed, optional=False)
    mm = d if m is None else check_positive_int(m, "m")
    rows = flat.size // d
    check_finite(flat, d, "r")
    nbytes = packed_size(mm, 1)
    if rows == 0:
        return QJLSketch(np.zeros((*leading, nbytes), np.uint8), np.zeros(leading, np.float16), mm, d)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        rb = call.upload(flat)
        sb = _matrix(dev, s, mm, d)
        norms = norms_on_device(call, rb, rows, d)
        bits = call.empty(rows * mm)
        call.dispatch("qjl", "sketch_bits", -(-rows * mm // 4), [d, mm, rows * mm, np.float32(0)], {1: sb, 2: rb, 3: bits})
        packed = pack_on_device(call, bits, rows, mm, 1)
        n = call.read(norms, np.float32, rows)
        signs = call.read(packed, np.uint8, rows * nbytes)
    check_overflow(n, 1, "r")
    return QJLSketch(signs.reshape(*leading, nbytes), store(n).reshape(leading), mm, d)


def _sketch_on_device(call: Call, sketch: QJLSketch) -> tuple[Any, Any, tuple[int, ...], int]:
    signs, norms, lr = _sketch_parts(sketch)
    nv = check_stored(norms, "norms")
    return call.upload(signs), call.upload(nv), lr, nv.size


@tensors_in_out()
def qjl_inner_product(y: Any, sketch: QJLSketch, seed: int, *, device: Any = None) -> np.ndarray:
    """Unbiased estimates of ``<y_i, r_j>`` for every query row i and sketched row j (on the device).

    ``sqrt(pi/2) / m * ||r_j|| * <S y_i, sign(S r_j)>``.

    Args:
        y: float array ``(*Ly, dim)``.
        sketch: from :func:`qjl_sketch` (either path) with leading shape ``Lr``.
        seed: the sketch's seed.
        device: as in :func:`qjl_sketch`.

    Returns:
        float32 array ``(*Ly, *Lr)``.

    Raises:
        KvqrsError: mismatched dims, a bad seed or sketch, NaN/Inf in ``y``.
    """
    flat, ly, d, _ = as_float_rows(y, "y")
    if not isinstance(sketch, QJLSketch):
        raise KvqrsError(f"sketch: expected a QJLSketch from qjl_sketch, got {type(sketch).__name__}")
    if d != sketch.dim:
        raise KvqrsError(f"y: expected a last axis of {sketch.dim} (the sketched dimension), got {d}")
    s = check_seed(seed, optional=False)
    check_finite(flat, d, "y")
    ny = flat.size // d
    dev = _device(device or "wgpu")
    with dev.call() as call:
        signs, norms, lr, nr = _sketch_on_device(call, sketch)
        if ny * nr == 0:
            return np.zeros((*ly, *lr), dtype=np.float32)
        m = sketch.m
        sb = _matrix(dev, s, m, d)
        sy = _project(call, sb, call.upload(flat), ny, d, m)
        out = call.empty(4 * ny * nr)
        call.dispatch("qjl", "inner_product", ny * nr, [d, m, nr, _k(m)], {4: out, 5: sy, 6: signs, 7: norms})
        est = call.read(out, np.float32, ny * nr)
    return check_finite_output(est.reshape((*ly, *lr)))


@tensors_in_out()
def qjl_vector_estimate(sketch: QJLSketch, seed: int, dtype: Any = np.float32, *, device: Any = None) -> np.ndarray:
    """Unbiased vector estimate ``r_hat = sqrt(pi/2) / m * ||r|| * S^T sign(S r)`` (on the device).

    Returns:
        array ``(..., dim)`` of ``dtype``.

    Raises:
        KvqrsError: a bad seed, sketch or dtype.
    """
    if not isinstance(sketch, QJLSketch):
        raise KvqrsError(f"sketch: expected a QJLSketch from qjl_sketch, got {type(sketch).__name__}")
    s = check_seed(seed, optional=False)
    out_dtype = check_out_dtype(dtype)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        signs, norms, lr, rows = _sketch_on_device(call, sketch)
        d, m = sketch.dim, sketch.m
        if rows == 0:
            return np.zeros((*lr, d), dtype=out_dtype)
        out = call.empty(4 * rows * d)
        call.dispatch("qjl", "vector_estimate", rows * d, [d, m, 0, _k(m)], {1: _matrix(dev, s, m, d), 4: out, 6: signs, 7: norms})
        est = call.read(out, np.float32, rows * d)
    return restore(est, lr, d, out_dtype)
