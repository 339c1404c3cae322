"""The norm-and-direction (MSE) stage on the device (shaders/mse.wgsl for the norm and the
least-squares scale, composed with hadamard.wgsl and lloyd_max.wgsl in one submission;
docs/kernels.md section 5).

Same arguments, results and errors as :mod:`kvqrs.kernels.mse`. The norm is a float32
reduction on the device (the Rust path's is float64): stored norms can differ from the Rust
path's by a rounding, and codes only for coordinates within rounding of a boundary.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_float_rows, check_bits, check_out_dtype, check_seed, restore, tensors_in_out
from ..kernels.hadamard import padded_dim
from ..kernels.lloyd_max import lloyd_max_codebook
from ..kernels.mse import MSECode, check_scale, decode_args
from ._device import Call
from ._device import device as _device
from ._host import check_code_range, check_finite, check_overflow, check_row_len, check_stored, store
from .hadamard import forward_on_device, inverse_on_device
from .lloyd_max import decode_on_device, encode_on_device

__all__ = ["MSECode", "ls_scales_on_device", "mse_decode", "mse_encode", "norms_on_device", "pn_scales_on_device"]


def norms_on_device(call: Call, x: Any, rows: int, dim: int) -> Any:
    """Queue the float32 norms of ``rows`` rows of ``dim`` floats; returns their buffer."""
    out = call.empty(4 * rows)
    call.dispatch("mse", "norms", rows, [dim], {1: x, 2: out})
    return out


def _direction_on_device(call: Call, dev: Any, codes: Any, rows: int, d: int, seed: int | None, codebook: Any) -> Any:
    """Queue the decoded directions ``r`` (the decode with scale 1) of ``rows`` coded rows."""
    code_dim = d if seed is None else padded_dim(d)
    c = decode_on_device(call, dev, codes, rows * code_dim, code_dim, codebook)
    return c if seed is None else inverse_on_device(call, dev, c, rows, d, seed)


def ls_scales_on_device(call: Call, dev: Any, x: Any, codes: Any, rows: int, d: int, seed: int | None, codebook: Any) -> Any:
    """Queue the least-squares scales ``dot(x, r) / dot(r, r)`` of ``rows`` coded rows, ``r``
    the decoded direction (the decode with scale 1); returns their buffer of ``rows`` floats."""
    r = _direction_on_device(call, dev, codes, rows, d, seed, codebook)
    out = call.empty(4 * rows)
    call.dispatch("mse", "ls_scales", rows, [d], {1: x, 2: out, 3: r})
    return out


def pn_scales_on_device(call: Call, dev: Any, norms: Any, codes: Any, rows: int, d: int, seed: int | None, codebook: Any) -> Any:
    """Queue the norm-preserving scales ``norm / sqrt(dot(r, r))`` of ``rows`` coded rows of
    norms ``norms`` (a buffer of ``rows`` floats), ``r`` the decoded direction; returns their
    buffer of ``rows`` floats."""
    r = _direction_on_device(call, dev, codes, rows, d, seed, codebook)
    out = call.empty(4 * rows)
    call.dispatch("mse", "pn_scales", rows, [d], {1: norms, 2: out, 3: r})
    return out


@tensors_in_out()
def mse_encode(x: Any, bits: int, seed: int | None = None, scale: str = "norm", *, device: Any = None) -> MSECode:
    """Quantize rows as ``(||x||, codes of R x / ||x||)`` on the device.

    Args:
        x: float array ``(..., head_dim)``, head_dim >= 2.
        bits: 1..8 bits per coordinate.
        seed: rotation seed, or None for no rotation.
        scale: what each row stores, ``"norm"`` (default), ``"least_squares"`` or
            ``"preserve_norm"`` (:func:`kvqrs.mse_encode`).
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        :class:`~kvqrs.MSECode`: uint8 codes ``(..., code_dim)`` and norms ``(...)`` (float16,
        or float32 outside float16's range), decodable by :func:`kvqrs.mse_decode`.

    Raises:
        KvqrsError: bad dtype, bits, seed or scale, NaN/Inf in ``x`` (position named), or a norm
            (or least-squares scale) beyond float32.
    """
    flat, leading, d, _ = as_float_rows(x, "x", min_dim=2)
    b = check_bits(bits)
    s = check_seed(seed)
    mode = check_scale(scale)
    code_dim = d if s is None else padded_dim(d)
    rows = flat.size // d
    check_finite(flat, d, "x")
    check_row_len(d, "x")
    if rows == 0:
        return MSECode(np.zeros((*leading, code_dim), np.uint8), np.zeros(leading, np.float16))
    codebook = lloyd_max_codebook(code_dim, b)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        xb = call.upload(flat)
        norms = norms_on_device(call, xb, rows, d)
        y = xb if s is None else forward_on_device(call, dev, xb, rows, d, s)
        codes = encode_on_device(call, dev, y, rows * code_dim, code_dim, codebook, norms)
        n = call.read(norms, np.float32, rows)
        check_overflow(n, 1, "x")
        if mode != "norm":
            scales = ls_scales_on_device if mode == "least_squares" else pn_scales_on_device
            n = call.read(scales(call, dev, xb if mode == "least_squares" else norms, codes, rows, d, s, codebook), np.float32, rows)
            check_overflow(n, 1, "x")
        c = call.read(codes, np.uint8, rows * code_dim)
    return MSECode(c.reshape(*leading, code_dim), store(n).reshape(leading))


@tensors_in_out()
def mse_decode(
    codes: Any,
    norms: Any,
    bits: int,
    head_dim: int,
    seed: int | None = None,
    dtype: Any = np.float32,
    *,
    device: Any = None,
) -> np.ndarray:
    """Reconstruct ``norm * R^T centroids[codes]`` (first ``head_dim`` coordinates) on the device.

    Args:
        codes: uint8 ``(..., code_dim)`` from :func:`mse_encode` (or :func:`kvqrs.mse_encode`).
        norms: float16 or float32 ``(...)``.
        bits, head_dim, seed: as given to the encoder.
        dtype: output float dtype (default float32).
        device: as in :func:`mse_encode`.

    Returns:
        array ``(..., head_dim)`` of ``dtype``.

    Raises:
        KvqrsError: codes of the wrong width or out of range, norms of the wrong shape or dtype,
            negative or non-finite norms.
    """
    flat, norms_flat, leading, b, d, s = decode_args(codes, norms, bits, head_dim, seed)
    code_dim = d if s is None else padded_dim(d)
    nv = check_stored(norms_flat, "norms")
    out_dtype = check_out_dtype(dtype)
    check_code_range(flat, code_dim, b, "codes")
    rows = flat.size // code_dim
    if rows == 0:
        return np.zeros((*leading, d), dtype=out_dtype)
    codebook = lloyd_max_codebook(code_dim, b)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        nb = call.upload(nv)
        if s is None:
            out = decode_on_device(call, dev, call.upload(flat), rows * d, d, codebook, nb)
        else:
            c = decode_on_device(call, dev, call.upload(flat), rows * code_dim, code_dim, codebook)
            out = inverse_on_device(call, dev, c, rows, d, s, nb)
        x = call.read(out, np.float32, rows * d)
    return restore(x, leading, d, out_dtype)
