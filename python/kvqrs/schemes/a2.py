"""A^2 value allocation (HeadQ): per-token bit widths that minimise the attention-squared
weighted distortion ``sum_j p_j^2 ||v_j - v_hat_j||^2`` at the same average budget (docs/schemes.md).

Each token is coded by the rotated MSE stage at its own width; widths are stored (3 bits per
token, packed) and counted in the bits per element.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._arrays import KvqrsError
from ..kernels import lloyd_max_codebook, padded_dim
from .backend import CPU, Backend
from .base import Coder, Encoded, as_float_array, check_encoded, check_head_dim

MIN_BITS, MAX_BITS = 1, 8


def allocate_bits(weights: np.ndarray, sq_norms: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """Integer widths in 1..8 with mean exactly ``bits`` per row of tokens.

    Minimises ``sum_j w_j ||v_j||^2 D(b_j)`` with ``D`` the Lloyd-Max unit distortion of the
    ``(d', b)`` codebook. ``D`` is convex and decreasing in b, so the marginal gains of each
    token fall as it gets bits and taking the largest gains overall is optimal (greedy on a
    separable convex objective).

    Args:
        weights: ``(..., T)`` non-negative importances (``sum_q p_qj^2``).
        sq_norms: ``(..., T)`` squared value norms.
        bits: average width, 1..8.
        head_dim: d (the codebooks are those of d').

    Returns:
        uint8 ``(..., T)`` widths.
    """
    dp = padded_dim(head_dim)
    dist = np.array([lloyd_max_codebook(dp, b).unit_mse for b in range(MIN_BITS, MAX_BITS + 1)])
    gains = -np.diff(dist)  # D(b) - D(b+1), b = 1..7, decreasing
    w = np.asarray(weights, dtype=np.float64) * np.asarray(sq_norms, dtype=np.float64)
    lead, t = w.shape[:-1], w.shape[-1]
    flat = w.reshape(math.prod(lead), t)  # (not -1: a tensor of no tokens has no rows to infer)
    out = np.empty(flat.shape, dtype=np.uint8)
    extra = (bits - MIN_BITS) * t
    for i, row in enumerate(flat):
        # Gain of the step b -> b+1 for token j is row[j] * gains[b-1]; ties broken by token
        # then step index so the allocation is deterministic.
        g = (row[:, None] * gains[None, :]).reshape(-1)
        order = np.lexsort((np.arange(g.size), -g))[:extra]
        steps = np.zeros(g.size, dtype=bool)
        steps[order] = True
        out[i] = MIN_BITS + steps.reshape(t, gains.size).sum(axis=1)
    return out.reshape(*lead, t)


def check_weights(weights: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``weights`` as float64 importances of ``shape`` (the tokens'); raises :class:`KvqrsError`
    naming the first negative or non-finite one, or another shape."""
    try:
        if np.iscomplexobj(weights):
            raise TypeError("complex")
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise KvqrsError(f"weights: expected real importances of shape {shape}, got {type(weights).__name__}") from None
    if w.shape != shape:
        raise KvqrsError(f"weights: expected importances of shape {shape}, got shape {w.shape}")
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise KvqrsError(f"weights: expected finite non-negative importances, got {w[pos]} at index {pos}")
    return w


class A2ValueCoder(Coder):
    """Rotated MSE values with per-token widths from :func:`allocate_bits`.

    ``encode(v, weights)`` takes the importances ``w_j = sum_q p_qj^2`` (``(..., T)``); with
    ``weights=None`` every token gets ``bits`` (the uniform allocation).
    """

    has_layout, takes_weights = False, True  # parts follow the stored widths; encode(v, weights) (Coder)

    def __init__(self, head_dim: int, bits: int, seed: int, scheme: str = "a2", backend: Backend = CPU):
        if not MIN_BITS <= bits <= MAX_BITS:
            raise KvqrsError(f"bits: expected an average width in {MIN_BITS}..{MAX_BITS}, got {bits}")
        self.head_dim, self.bits, self.seed, self.scheme, self.kind = head_dim, bits, seed, scheme, "values"
        self.code_dim = padded_dim(head_dim)
        self.params = {"bits": bits, "seed": seed}
        self.k = backend

    def encode(self, v, weights=None) -> Encoded:
        v = as_float_array(v, "values")
        check_head_dim(v, self.head_dim, "values")
        v32 = v.astype(np.float32)
        if weights is None:
            widths = np.full(v.shape[:-1], self.bits, dtype=np.uint8)
        else:
            w = check_weights(weights, v.shape[:-1])
            widths = allocate_bits(w, np.sum(v32.astype(np.float64) ** 2, axis=-1), self.bits, self.head_dim)
        # All widths of the tensor form one bit stream: 3 bits per token.
        parts: dict[str, np.ndarray] = {"widths": self.k.pack_bits(widths.reshape(-1) - MIN_BITS, 3)}
        for b in np.unique(widths):
            sel = widths == b
            code = self.k.mse_encode(v32[sel], int(b), self.seed)
            parts[f"codes_{b}"] = self.k.pack_bits(code.codes, int(b))
            parts[f"norms_{b}"] = code.norms
        return Encoded(self.scheme, "values", v.shape, v.dtype, parts, self.params)

    def widths(self, enc: Encoded) -> np.ndarray:
        """Per-token widths ``(..., T)`` (uint8)."""
        n = int(np.prod(enc.shape[:-1]))
        return (self.k.unpack_bits(enc.parts["widths"], 3, n).reshape(enc.shape[:-1]) + MIN_BITS).astype(np.uint8)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, "values", self.params)
        widths = self.widths(enc)
        out = np.zeros(enc.shape, dtype=np.float32)
        for b in np.unique(widths):
            sel = widths == b
            codes = self.k.unpack_bits(enc.parts[f"codes_{b}"], int(b), self.code_dim)
            out[sel] = self.k.mse_decode(codes, enc.parts[f"norms_{b}"], int(b), self.head_dim, self.seed)
        return out
