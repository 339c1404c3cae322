"""KIVI (Liu et al. 2024): asymmetric uniform quantization, keys per channel over groups of
``group`` tokens, values per token over groups of ``group`` channels (docs/schemes.md). Each group stores
a 16-bit scale and a 16-bit zero point (32-bit each outside float16's range)."""

from __future__ import annotations

import numpy as np

from .. import layout as lay
from ..kernels.attention import UniformRows
from ..kernels.uniform import UniformCode
from .backend import CPU, Backend
from .base import Coder, Encoded, as_float_array, check_encoded, check_head_dim, split_shape
from .mse import decoded_scores


class KIVICoder(Coder):
    """Per-channel (keys) or per-token (values) asymmetric uniform quantizer.

    Args:
        head_dim: d.
        bits: 1..8.
        group: tokens per key group / channels per value group (KIVI uses 32).
        per_channel: True for keys (groups run along tokens), False for values.
        backend: the kernels' compute path, the Rust one by default.
    """

    fused = True  # attention_rows below (Coder.fused)

    def __init__(self, head_dim: int, bits: int, group: int, per_channel: bool, scheme: str, kind: str, backend: Backend = CPU):
        self.head_dim, self.bits, self.group, self.per_channel = head_dim, bits, group, per_channel
        self.k = backend
        self.scheme, self.kind = scheme, kind
        self.params = {"bits": bits, "group": group, "per_channel": per_channel}

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """Per-channel keys: each channel's tokens packed along the last axis, one scale and
        zero point per group of ``group`` tokens (``(..., d, packed(T, bits))``, ``(..., d,
        ceil(T / group))``; chunks join and are cut at whole groups and bytes). Per-token values:
        ``(..., T, packed(d, bits))`` and ``(..., T, ceil(d / group))``."""
        lead, t, d = split_shape(shape)
        if self.per_channel:
            return lay.uniform_channels(lead, t, d, self.bits, self.group)
        return lay.uniform_tokens(lead, t, d, self.bits, self.group)

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
