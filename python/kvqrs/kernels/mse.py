"""Norm-and-direction quantization, the MSE stage (docs/kernels.md section 5)."""

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
    check_out_dtype,
    check_positive_int,
    check_seed,
    restore,
    tensors_in_out,
)
from .hadamard import padded_dim
from .pack import packed_rows, packed_size

if TYPE_CHECKING:
    from .._arrays import Array, DTypeLike


SCALES = ("norm", "least_squares", "preserve_norm")
"""What the MSE stage may store per row (docs/kernels.md section 5): ``"norm"`` (``||x||``, the
default), ``"least_squares"`` (the scale of the decoded direction minimising the row's squared
error) or ``"preserve_norm"`` (``||x|| / ||r||``, ``r`` the decoded direction: the decoded row
keeps the input's norm). The decoders read every one the same way."""


def check_scale(scale: Any, name: str = "scale") -> str:
    """Validate an MSE row-scale mode (one of :data:`SCALES`); returns it.

    Raises:
        KvqrsError: anything else (the message lists the modes).
    """
    if not isinstance(scale, str) or scale not in SCALES:
        raise KvqrsError(f"{name}: expected one of {SCALES}, got {scale!r}")
    return scale


class MSECode(NamedTuple):
    """Output of :func:`mse_encode`.

    Attributes:
        codes: uint8 ``(..., code_dim)`` unpacked Lloyd-Max codes (``code_dim = d'`` with a
            rotation, ``head_dim`` without).
        norms: ``(...)`` stored per-row scales: the norms ``||x||`` (``scale="norm"``) or the
            least-squares or norm-preserving scales (``scale=``); float16 when every non-zero value
            lies in ``[2**-14, 65504)``, float32 otherwise (16 or 32 bits per vector).
    """

    codes: np.ndarray
    norms: np.ndarray


@tensors_in_out()
def mse_encode(x: Array, bits: int, seed: int | None = None, scale: str = "norm") -> MSECode:
    """Quantize rows as ``(||x||, codes of R x / ||x||)``.

    Equivalent to ``oracle.mse_encode``: rotate (``seed`` given) or not (``seed=None``, the
    ``kv`` scheme), divide by the norm, bucketize each coordinate with the
    ``(code_dim, bits)`` Lloyd-Max codebook. A zero row gives norm 0.

    With ``scale="least_squares"`` the codes are the same and each row stores, instead of
    ``||x||``, ``s = dot(x, r) / dot(r, r)`` with ``r`` the decoded direction (the
    :func:`mse_decode` of the codes with scale 1): the ``s`` minimising ``||x - s r||^2``, so
    the decode (unchanged, ``s r``) is never further from ``x`` than with the norm, up to the
    float16 rounding of the stored value (docs/kernels.md section 5). ``s = 0`` when
    ``dot(x, r) <= 0`` (a zero row). With ``scale="preserve_norm"`` each row stores
    ``s = ||x|| / ||r||``: the decode keeps the row's norm (the Lloyd-Max centroids are
    conditional means, so ``||r|| < 1`` on average and the plain norm shrinks every decoded row
    by about ``sqrt(1 - D)``, ``D`` the codebook's distortion: a bias of the attention output's
    scale, the 6D framework's value scale error).

    Args:
        x: float array ``(..., head_dim)``, head_dim >= 2.
        bits: 1..8 bits per coordinate.
        seed: rotation seed, or None for no rotation.
        scale: what each row stores, ``"norm"`` (default), ``"least_squares"`` or
            ``"preserve_norm"``.

    Returns:
        :class:`MSECode`.

    Raises:
        KvqrsError: bad dtype, bits, seed or scale, NaN/Inf in ``x`` (position named), or a norm
            (or least-squares scale) beyond float32.
    """
    flat, leading, d, _ = as_float_rows(x, "x", min_dim=2)
    b = check_bits(bits)
    s = check_seed(seed)
    codes, norms = _native.mse_encode(flat, d, b, s, check_scale(scale))
    code_dim = d if s is None else padded_dim(d)
    return MSECode(codes.reshape(*leading, code_dim), norms.reshape(leading))


@tensors_in_out()
def mse_decode(
    codes: Array,
    norms: Array,
    bits: int,
    head_dim: int,
    seed: int | None = None,
    dtype: DTypeLike = np.float32,
) -> Array:
    """Reconstruct ``norm * R^T centroids[codes]`` (first ``head_dim`` coordinates).

    Args:
        codes: uint8 ``(..., code_dim)`` from :func:`mse_encode`.
        norms: float16 or float32 ``(...)``.
        bits, head_dim, seed: as given to :func:`mse_encode`.
        dtype: output float dtype (default float32).

    Returns:
        array ``(..., head_dim)`` of ``dtype``.

    Raises:
        KvqrsError: codes of the wrong width or out of range, norms of the wrong shape or dtype,
            negative or non-finite norms.
    """
    flat, n, leading, b, d, s = decode_args(codes, norms, bits, head_dim, seed)
    out = _native.mse_decode(flat, n, d, b, s)
    return restore(out, leading, d, check_out_dtype(dtype), finite=True)


@tensors_in_out()
def mse_encode_packed(x: Array, bits: int, seed: int | None = None, scale: str = "norm") -> MSECode:
    """:func:`mse_encode` followed by :func:`~kvqrs.pack_bits`, fused row by row in Rust: the
    same bytes without the unpacked ``(..., code_dim)`` intermediate (what the schemes store).

    Args:
        x: float array ``(..., head_dim)``, head_dim >= 2.
        bits: 1..8 bits per coordinate.
        seed: rotation seed, or None for no rotation.
        scale: what each row stores, ``"norm"`` (default), ``"least_squares"`` or ``"preserve_norm"`` (as
            :func:`mse_encode`).

    Returns:
        :class:`MSECode` whose ``codes`` are packed: uint8 ``(..., ceil(code_dim * bits / 8))``
        (docs/kernels.md section 2 bit order).

    Raises:
        KvqrsError: as :func:`mse_encode`.
    """
    flat, leading, d, _ = as_float_rows(x, "x", min_dim=2)
    b = check_bits(bits)
    s = check_seed(seed)
    packed, norms = _native.mse_encode_packed(flat, d, b, s, check_scale(scale))
    code_dim = d if s is None else padded_dim(d)
    return MSECode(packed.reshape(*leading, packed_size(code_dim, b)), norms.reshape(leading))


@tensors_in_out()
def mse_decode_packed(
    packed: Array,
    norms: Array,
    bits: int,
    head_dim: int,
    seed: int | None = None,
    dtype: DTypeLike = np.float32,
) -> Array:
    """:func:`~kvqrs.unpack_bits` followed by :func:`mse_decode`, fused row by row in Rust.

    Args:
        packed: uint8 ``(..., ceil(code_dim * bits / 8))`` from :func:`mse_encode_packed`.
        norms: float16 or float32 ``(...)``.
        bits, head_dim, seed: as given to the encoder.
        dtype: output float dtype (default float32).

    Returns:
        array ``(..., head_dim)`` of ``dtype``.

    Raises:
        KvqrsError: a last axis of the wrong byte count, norms of the wrong shape or dtype,
            negative or non-finite norms, bad bits, head_dim or seed.
    """
    b = check_bits(bits)
    d = check_positive_int(head_dim, "head_dim", minimum=2)
    s = check_seed(seed)
    flat, leading, b, _ = packed_rows(packed, b, d if s is None else padded_dim(d))
    out = _native.mse_decode_packed(flat, as_scalars(norms, "norms", leading), d, b, s)
    return restore(out, leading, d, check_out_dtype(dtype), finite=True)


def decode_args(
    codes: Any, norms: Any, bits: int, head_dim: int, seed: int | None
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], int, int, int | None]:
    """Validate :func:`mse_decode`'s arguments; returns ``(flat codes, flat norms, leading,
    bits, head_dim, seed)``."""
    b = check_bits(bits)
    d = check_positive_int(head_dim, "head_dim", minimum=2)
    s = check_seed(seed)
    flat, leading, width = as_code_rows(codes, "codes", b)
    code_dim = d if s is None else padded_dim(d)
    if width != code_dim:
        raise KvqrsError(f"codes: expected a last axis of {code_dim} codes for head_dim {d}, got {width}")
    return flat, as_scalars(norms, "norms", leading), leading, b, d, s
