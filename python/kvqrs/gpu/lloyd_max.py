"""Lloyd-Max encode and decode on the device (shaders/lloyd_max.wgsl; docs/kernels.md section 4).

The codebook is the host's (:func:`kvqrs.lloyd_max_codebook`, re-exported): a float64 Lloyd
iteration, rounded once to float32 and uploaded once per (head_dim, bits). Same arguments,
results and errors as :mod:`kvqrs.kernels.lloyd_max`; codes equal the Rust path's exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._arrays import as_code_rows, as_float_rows, restore, tensors_in_out
from ..kernels.lloyd_max import Codebook, _check_codebook, lloyd_max_codebook
from ._device import Call, Device
from ._device import device as _device
from ._host import check_code_range, check_finite

__all__ = ["Codebook", "lloyd_max_codebook", "lloyd_max_decode", "lloyd_max_encode", "encode_on_device", "decode_on_device"]


def _table(dev: Device, codebook: Codebook, which: str) -> Any:
    def build() -> np.ndarray:
        return np.asarray(getattr(codebook, which), dtype=np.float32)

    return dev.constant(("lloyd_max", which, codebook.head_dim, codebook.bits), build)


def encode_on_device(call: Call, dev: Device, x: Any, values: int, row_len: int, codebook: Codebook, norms: Any = None) -> Any:
    """Queue ``bucketize(x / norm_row)`` (``x`` alone when ``norms`` is None) over ``values``
    floats in rows of ``row_len``; returns the buffer of ``values`` code bytes."""
    out = call.empty(values)
    params = [row_len, 1 << codebook.bits, int(norms is not None), values]
    bind = {1: x, 2: _table(dev, codebook, "boundaries"), 3: norms if norms is not None else call.empty(4), 4: out}
    call.dispatch("lloyd_max", "encode", -(-values // 4), params, bind)
    return out


def decode_on_device(call: Call, dev: Device, codes: Any, values: int, row_len: int, codebook: Codebook, norms: Any = None) -> Any:
    """Queue ``centroids[code]`` (times ``norm_row`` when ``norms`` is given); returns the
    buffer of ``values`` floats."""
    out = call.empty(4 * values)
    params = [row_len, 1 << codebook.bits, int(norms is not None), values]
    bind = {2: _table(dev, codebook, "centroids"), 3: norms if norms is not None else call.empty(4), 5: codes, 6: out}
    call.dispatch("lloyd_max", "decode", values, params, bind)
    return out


@tensors_in_out()
def lloyd_max_encode(x: Any, codebook: Codebook, *, device: Any = None) -> np.ndarray:
    """``bucketize(x, boundaries)``: the number of float32 boundaries <= each float32 value
    (on the device).

    Args:
        x: float array of any shape (unit-vector coordinates).
        codebook: from :func:`lloyd_max_codebook`.
        device: a :class:`~kvqrs.gpu.Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"`` (default).

    Returns:
        uint8 array of the same shape, equal to :func:`kvqrs.lloyd_max_encode`.

    Raises:
        KvqrsError: not a Codebook, unsupported dtype, or NaN/Inf in ``x``.
    """
    _check_codebook(codebook)
    if np.ndim(x) == 0:
        return lloyd_max_encode(np.reshape(x, (1,)), codebook, device=device).reshape(())
    flat, leading, n, _ = as_float_rows(x, "x", min_dim=0)
    check_finite(flat, n, "x")
    if flat.size == 0:
        return np.zeros((*leading, n), dtype=np.uint8)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = encode_on_device(call, dev, call.upload(flat), flat.size, max(n, 1), codebook)
        return restore(call.read(out, np.uint8, flat.size), leading, n)


@tensors_in_out()
def lloyd_max_decode(codes: Any, codebook: Codebook, *, device: Any = None) -> np.ndarray:
    """``centroids[codes]`` as float32 (the centroids rounded once to float32), on the device.

    Raises:
        KvqrsError: not a Codebook, non-integer codes or a code >= 2**bits.
    """
    _check_codebook(codebook)
    flat, leading, n = as_code_rows(codes, "codes", codebook.bits)
    check_code_range(flat, n, codebook.bits, "codes")
    if flat.size == 0:
        return np.zeros((*leading, n), dtype=np.float32)
    dev = _device(device or "wgpu")
    with dev.call() as call:
        out = decode_on_device(call, dev, call.upload(flat), flat.size, max(n, 1), codebook)
        return restore(call.read(out, np.float32, flat.size), leading, n)
