"""KIVI (Liu et al. 2024): asymmetric uniform quantization, keys per channel over groups of
``group`` tokens, values per token over groups of ``group`` channels (SPEC 3). Each group stores
a 16-bit scale and a 16-bit zero point (32-bit each outside float16's range)."""

from __future__ import annotations

import numpy as np

from ..kernels import pack_bits, unpack_bits
from ..kernels.uniform import UniformCode, uniform_decode, uniform_encode
from .base import Encoded, as_float_array, check_encoded, check_head_dim
from .mse import decoded_scores


class KIVICoder:
    """Per-channel (keys) or per-token (values) asymmetric uniform quantizer.

    Args:
        head_dim: d.
        bits: 1..8.
        group: tokens per key group / channels per value group (KIVI uses 32).
        per_channel: True for keys (groups run along tokens), False for values.
    """

    def __init__(self, head_dim: int, bits: int, group: int, per_channel: bool, scheme: str, kind: str):
        self.head_dim, self.bits, self.group, self.per_channel = head_dim, bits, group, per_channel
        self.scheme, self.kind = scheme, kind
        self.params = {"bits": bits, "group": group, "per_channel": per_channel}

    def token_axes(self) -> dict[str, int]:
        """Per-channel keys pack tokens along the last axis; per-token values along -2."""
        axis = -1 if self.per_channel else -2
        return {"codes": axis, "scales": axis, "zeros": axis}

    def _layout(self, x: np.ndarray) -> np.ndarray:
        # Per-channel groups run along tokens: lay each channel's tokens out as a row.
        return np.swapaxes(x, -1, -2) if self.per_channel else x

    def encode(self, x) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        code = uniform_encode(self._layout(x), self.bits, self.group)
        parts = {"codes": pack_bits(code.codes, self.bits), "scales": code.scales, "zeros": code.zeros}
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        row = enc.shape[-2] if self.per_channel else enc.shape[-1]
        codes = unpack_bits(enc.parts["codes"], self.bits, row)
        out = uniform_decode(UniformCode(codes, enc.parts["scales"], enc.parts["zeros"], self.group, self.bits))
        return self._layout(out)

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        return decoded_scores(q, self.decode(enc))
