"""HeadQ keys: any base key coder plus a rank-r side code of the key residual in a PCA basis of
calibration queries, applied as a score-space correction with the live query (docs/kernels.md section 7, docs/schemes.md).

Controls: ``sign=-1`` subtracts the correction (wrong-sign); a seeded random orthonormal basis
of the same rank replaces the calibrated one (random-basis).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from .. import layout as lay
from .._arrays import KvqrsError, first_nonfinite
from ..kernels.attention import SideRows
from ..kernels.headq import HeadQCode
from .base import Coder, Encoded, as_float_array, check_encoded, flat_rows, split_shape
from .mse import blockwise


class HeadQCoder(Coder):
    """Base key coder + side code ``z = Q_side(U^T (k - k_base))``.

    Args:
        base: a key coder (``encode``/``decode``/``scores``).
        basis: ``(head_dim, rank)`` or per KV head ``(kv_heads, head_dim, rank)`` float array
            with orthonormal columns; keys then have shape ``(..., kv_heads, tokens, d)``.
        side_bits: bits per side coordinate q.
        sign: +1, or -1 for the wrong-sign control.

    The side code runs on the base coder's compute backend (its ``k`` attribute).
    """

    def __init__(self, base: Coder, basis: np.ndarray, side_bits: int, sign: int, scheme: str):
        if sign not in (1, -1):
            raise KvqrsError(f"sign: expected +1 or -1, got {sign}")
        b = np.asarray(basis, dtype=np.float32)
        if b.ndim not in (2, 3) or b.shape[-2] != base.head_dim:
            raise KvqrsError(f"basis: expected (head_dim={base.head_dim}, rank) or (kv_heads, head_dim, rank), got shape {b.shape}")
        first_nonfinite(b, "basis")  # refused here, not at the first encode
        _check_orthonormal(b)
        self.base, self.basis, self.side_bits, self.sign = base, b, side_bits, sign
        self.k = base.k
        self.head_dim, self.rank, self.scheme, self.kind = base.head_dim, b.shape[-1], scheme, "keys"
        # The basis identity travels with the codes: decoding under another basis raises.
        self.params = {
            "base": dict(base.params, scheme=base.scheme),
            "side_bits": side_bits,
            "rank": self.rank,
            "sign": sign,
            "basis_sha256": hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest()[:16],
        }

    @property
    def fused(self) -> bool:
        """A fused read path wherever the base coder has one (the side code always has)."""
        return self.base.fused

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """The base coder's parts prefixed ``base_``, then the side code: ``side_codes``
        ``(..., T, packed(rank, side_bits))`` and ``side_scales`` ``(..., T)``."""
        lead, t, _ = split_shape(shape)
        return {**lay.prefixed("base_", self.base.layout(shape)), **lay.prefixed("side_", lay.side(lead, t, self.rank, self.side_bits))}

    def _bases(self, lead: tuple[int, ...]) -> list[np.ndarray]:
        """One basis per flattened leading index (heads are the last leading axis)."""
        count = int(np.prod(lead)) if lead else 1
        if self.basis.ndim == 2:
            return [self.basis] * count
        if not lead or lead[-1] != self.basis.shape[0]:
            raise KvqrsError(
                f"keys: expected shape (..., kv_heads={self.basis.shape[0]}, tokens, d) for a per-head basis, got leading dims {lead}"
            )
        return [self.basis[i % self.basis.shape[0]] for i in range(count)]

    def encode(self, k) -> Encoded:
        k = as_float_array(k, "keys")
        base = self.base.encode(k)
        residual = flat_rows(k.astype(np.float32) - self.base.decode(base), 2)
        bases = self._bases(k.shape[:-2])
        sides = [self.k.headq_encode(residual[i], bases[i], self.side_bits) for i in range(len(bases))]
        if not sides:  # no batch rows or heads: an empty code, with the kernel's dtypes
            sides = [
                self.k.headq_encode(residual.reshape(0, self.head_dim), self.basis.reshape(-1, self.head_dim, self.rank)[0], self.side_bits)
            ]
        lead = k.shape[:-1]
        codes = np.stack([s.codes for s in sides]).reshape(*lead, self.rank)
        scales = np.stack([s.scales for s in sides]).reshape(lead)
        parts = {
            **{f"base_{n}": v for n, v in base.parts.items()},
            "side_codes": self.k.pack_bits(codes, self.side_bits),
            "side_scales": scales,
        }
        return Encoded(self.scheme, "keys", k.shape, k.dtype, parts, self.params)

    def _base(self, enc: Encoded) -> Encoded:
        """The base coder's parts of ``enc`` as its own ``Encoded`` (after checking ``enc``)."""
        check_encoded(enc, self.scheme, "keys", self.params)
        base_parts = {n[5:]: v for n, v in enc.parts.items() if n.startswith("base_")}
        base_params = {k: v for k, v in enc.params["base"].items() if k != "scheme"}
        return Encoded(self.base.scheme, "keys", enc.shape, enc.dtype, base_parts, base_params)

    def _split(self, enc: Encoded) -> tuple[Encoded, HeadQCode]:
        base = self._base(enc)
        codes = self.k.unpack_bits(enc.parts["side_codes"], self.side_bits, self.rank)
        return base, HeadQCode(codes, enc.parts["side_scales"], self.side_bits)

    def attention_rows(self, enc: Encoded):
        """``(base rows, SideRows)`` as the fused attention kernel reads them, or None when the
        base coder has no fused read path."""
        rows = getattr(self.base, "attention_rows", None)
        if rows is None:
            return None
        base = self._base(enc)
        side = SideRows(enc.parts["side_codes"], enc.parts["side_scales"], self.basis, self.side_bits, self.sign)
        return rows(base), side

    def decode_base(self, enc: Encoded) -> np.ndarray:
        """The base keys alone (what attention multiplies the live query with)."""
        base, _ = self._split(enc)
        return self.base.decode(base)

    def correction(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        """``sign * (U^T q) . z / sqrt(d)`` for matching leading dims: ``(..., nq, T)``."""
        _, side = self._split(enc)
        lead = q.shape[:-2]
        bases = self._bases(lead)
        codes = flat_rows(side.codes, 2)
        scales = flat_rows(side.scales, 1)

        def block(b: int, qb: np.ndarray) -> np.ndarray:
            return self.k.headq_score_correction(qb, HeadQCode(codes[b], scales[b], self.side_bits), bases[b])

        corr = blockwise(block, q.astype(np.float32), lead, enc.shape[-2])
        return np.float32(self.sign / math.sqrt(self.head_dim)) * corr

    def decode(self, enc: Encoded) -> np.ndarray:
        base, side = self._split(enc)
        k_base = self.base.decode(base)
        lead = enc.shape[:-2]
        codes = flat_rows(side.codes, 2)
        scales = flat_rows(side.scales, 1)
        bases = self._bases(lead)
        if not bases:  # nothing to correct in an empty tensor
            return k_base
        corr = np.stack([self.k.headq_decode(HeadQCode(codes[i], scales[i], self.side_bits), bases[i]) for i in range(len(bases))])
        return k_base + self.sign * corr.reshape(k_base.shape)

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        """``(q . k_base + sign * (U^T q) . z) / sqrt(d)``: the correction is added in score
        space with the live query; the key is never rebuilt for it."""
        base, _ = self._split(enc)
        return self.base.scores(q, base) + self.correction(q, enc)


# Columns of a float32 PCA or QR basis are orthonormal to ~1e-6; 1e-3 leaves room for bases
# computed in float32 elsewhere while refusing a zero, scaled or skewed matrix.
ORTHONORMAL_TOL = 1e-3


def _check_orthonormal(b: np.ndarray) -> None:
    """HeadQ's correction ``(U^T q) . z`` equals ``q^T U U^T e`` only for orthonormal columns
    (HeadQ, the side code in a PCA basis): refuse any other basis when the codec is built."""
    u = b.astype(np.float64).reshape(-1, *b.shape[-2:])
    gram = np.einsum("hdr,hds->hrs", u, u)
    err = np.abs(gram - np.eye(u.shape[-1])).max(axis=(1, 2))
    if err.size and float(err.max()) > ORTHONORMAL_TOL:
        h = int(err.argmax())
        where = f" of KV head {h}" if b.ndim == 3 else ""
        raise KvqrsError(
            f"basis: expected orthonormal columns (U^T U = I within {ORTHONORMAL_TOL}), got a deviation of {float(err[h]):.3g}{where}"
        )
