"""The everyday baseline: a llama.cpp-style blockwise quantizer (Q4_1 / Q8_1-like: asymmetric,
blocks of 32 channels, a 16-bit scale and minimum per block) applied after the randomized
Walsh-Hadamard rotation (docs/schemes.md rows of the model evaluation)."""

from __future__ import annotations

import numpy as np

from .. import layout as lay
from ..kernels import padded_dim
from ..kernels.attention import UniformRows
from ..kernels.uniform import UniformCode
from .backend import CPU, Backend
from .base import Coder, Encoded, as_float_array, check_encoded, check_head_dim, split_shape
from .mse import decoded_scores


class BlockCoder(Coder):
    """Rotation + asymmetric uniform blocks of ``group`` rotated coordinates."""

    fused = True  # attention_rows below (Coder.fused)

    def __init__(self, head_dim: int, bits: int, seed: int, group: int, scheme: str, kind: str, backend: Backend = CPU):
        self.head_dim, self.bits, self.seed, self.group = head_dim, bits, seed, group
        self.k = backend
        self.scheme, self.kind = scheme, kind
        self.code_dim = padded_dim(head_dim)
        self.params = {"bits": bits, "seed": seed, "group": group}

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """Groups of ``group`` rotated coordinates per token: codes ``(..., T, packed(d',
        bits))``, scales and zero points ``(..., T, ceil(d' / group))``."""
        lead, t, _ = split_shape(shape)
        return lay.uniform_tokens(lead, t, self.code_dim, self.bits, self.group)

    def encode(self, x) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        code = self.k.uniform_encode(self.k.hadamard(x.astype(np.float32), self.seed), self.bits, self.group)
        parts = {"codes": self.k.pack_bits(code.codes, self.bits), "scales": code.scales, "zeros": code.zeros}
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        codes = self.k.unpack_bits(enc.parts["codes"], self.bits, self.code_dim)
        y = self.k.uniform_decode(UniformCode(codes, enc.parts["scales"], enc.parts["zeros"], self.group, self.bits))
        return self.k.inverse_hadamard(y, self.seed, self.head_dim)

    def attention_rows(self, enc: Encoded) -> UniformRows:
        """The stored parts as the fused attention kernel reads them (rotated coordinates)."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        p = enc.parts
        return UniformRows(p["codes"], p["scales"], p["zeros"], self.bits, self.group, seed=self.seed)

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        return decoded_scores(q, self.decode(enc))
