"""KIVI (Liu et al. 2024): asymmetric uniform quantization, keys per channel over groups of
``group`` tokens, values per token over groups of ``group`` channels (docs/schemes.md). Each group stores
a 16-bit scale and a 16-bit zero point (32-bit each outside float16's range)."""

from __future__ import annotations

import numpy as np

from .._arrays import KvqrsError
from ..kernels.attention import UniformRows
from ..kernels.uniform import UniformCode
from .backend import CPU, Backend
from .base import Encoded, as_float_array, check_encoded, check_head_dim, slice_rows
from .mse import decoded_scores


class KIVICoder:
    """Per-channel (keys) or per-token (values) asymmetric uniform quantizer.

    Args:
        head_dim: d.
        bits: 1..8.
        group: tokens per key group / channels per value group (KIVI uses 32).
        per_channel: True for keys (groups run along tokens), False for values.
        backend: the kernels' compute path, the Rust one by default.
    """

    def __init__(self, head_dim: int, bits: int, group: int, per_channel: bool, scheme: str, kind: str, backend: Backend = CPU):
        self.head_dim, self.bits, self.group, self.per_channel = head_dim, bits, group, per_channel
        self.k = backend
        self.scheme, self.kind = scheme, kind
        self.params = {"bits": bits, "group": group, "per_channel": per_channel}

    def token_axes(self) -> dict[str, int]:
        """Per-channel keys pack tokens along the last axis; per-token values along -2."""
        axis = -1 if self.per_channel else -2
        return {"codes": axis, "scales": axis, "zeros": axis}

    def check_concat(self, encs: list[Encoded]) -> None:
        """Per-channel key chunks join only if every chunk but the last holds whole groups."""
        if self.per_channel and any(e.shape[-2] % self.group or (e.shape[-2] * self.bits) % 8 for e in encs[:-1]):
            raise KvqrsError(
                f"encoded: per-channel KIVI key chunks must hold whole groups of {self.group} tokens, got {[e.shape[-2] for e in encs]}"
            )

    def slice_tokens(self, enc: Encoded, n: int) -> Encoded:
        """The first ``n`` tokens. Per-channel keys keep whole groups only: ``n`` must be a
        multiple of ``group`` whose codes end on a byte (``n * bits % 8 == 0``)."""
        if not self.per_channel:
            return slice_rows(enc, self.token_axes(), n)
        if n % self.group or (n * self.bits) % 8:
            raise KvqrsError(f"n: per-channel KIVI keys can only keep whole groups of {self.group} tokens, got {n}")
        parts = {
            "codes": np.asarray(enc.parts["codes"])[..., : n * self.bits // 8],
            "scales": np.asarray(enc.parts["scales"])[..., : n // self.group],
            "zeros": np.asarray(enc.parts["zeros"])[..., : n // self.group],
        }
        return Encoded(enc.scheme, enc.kind, (*enc.shape[:-2], n, enc.shape[-1]), enc.dtype, parts, enc.params)

    def _layout(self, x: np.ndarray) -> np.ndarray:
        # Per-channel groups run along tokens: lay each channel's tokens out as a row.
        return np.swapaxes(x, -1, -2) if self.per_channel else x

    def encode(self, x) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        if self.per_channel and x.shape[-2] == 0:
            # No tokens: every channel's row is empty, so there are no groups to store.
            empty = (*x.shape[:-2], self.head_dim, 0)
            parts = {"codes": np.zeros(empty, np.uint8), "scales": np.zeros(empty, np.float16), "zeros": np.zeros(empty, np.float16)}
            return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)
        code = self.k.uniform_encode(self._layout(x), self.bits, self.group)
        parts = {"codes": self.k.pack_bits(code.codes, self.bits), "scales": code.scales, "zeros": code.zeros}
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        if self.per_channel and enc.shape[-2] == 0:
            return np.zeros(enc.shape, np.float32)
        row = enc.shape[-2] if self.per_channel else enc.shape[-1]
        codes = self.k.unpack_bits(enc.parts["codes"], self.bits, row)
        out = self.k.uniform_decode(UniformCode(codes, enc.parts["scales"], enc.parts["zeros"], self.group, self.bits))
        return self._layout(out)

    def attention_rows(self, enc: Encoded) -> UniformRows:
        """The stored parts as the fused attention kernel reads them (codes stay packed)."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        p = enc.parts
        return UniformRows(p["codes"], p["scales"], p["zeros"], self.bits, self.group, per_channel=self.per_channel)

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        return decoded_scores(q, self.decode(enc))
