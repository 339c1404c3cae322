"""Coders built on the norm-and-direction (MSE) stage, optionally followed by a 1-bit QJL sketch
of the rotated residual (docs/schemes.md: the ``kv``, ``kqv`` and ``qkqv`` rows).

- :class:`MSECoder`: ``||x||`` + b-bit Lloyd-Max codes of ``R x / ||x||`` (no rotation for ``kv``).
- :class:`MSEQJLCoder`: (n-1)-bit MSE stage with rotation + QJL of ``r = R x - ||x|| c``; its
  scores use the QJL inner-product estimator ``<R q, r>`` (Zandieh et al. 2024; TurboQuant-prod).
"""

from __future__ import annotations

import math

import numpy as np

from .. import _native
from .. import layout as lay
from .._arrays import KvqrsError, as_float_rows
from ..kernels import lloyd_max_codebook, packed_size, padded_dim
from ..kernels.attention import MSERows, QJLRows
from ..kernels.log_scalars import MAX_ROW_LEN, LogScalars
from ..kernels.mse import check_scale
from ..kernels.qjl import QJLSketch
from .backend import CPU, Backend
from .base import Coder, Encoded, as_float_array, check_encoded, check_head_dim, flat_rows, split_shape


def decoded_scores(q: np.ndarray, k_hat: np.ndarray) -> np.ndarray:
    """Logits ``q . k_hat / sqrt(d)`` for matching leading dims: ``(..., nq, T)``."""
    d = q.shape[-1]
    return np.einsum("...qd,...td->...qt", q.astype(np.float32), k_hat.astype(np.float32)) / np.float32(math.sqrt(d))


def blockwise(fn, q: np.ndarray, lead: tuple[int, ...], tokens: int) -> np.ndarray:
    """Apply ``fn(b, q_block) -> (nq, tokens)`` over the flattened leading dims shared by
    queries and keys (the kernels' estimators are all-pairs; this keeps heads and batches
    paired). An empty leading shape gives an empty ``(*lead, nq, tokens)``."""
    qb = flat_rows(q, 2)
    out = [fn(b, qb[b]) for b in range(qb.shape[0])]
    return np.stack(out).reshape(*lead, q.shape[-2], tokens) if out else np.zeros((*lead, q.shape[-2], tokens), np.float32)


def scale_params(scale: str) -> dict[str, str]:
    """The coder parameter recording a row-scale mode: none for the default ``"norm"`` (so those
    tensors and files are what they were before the option existed), ``{"scale": scale}``
    otherwise (a tensor then decodes only under the setting it was written with)."""
    return {} if check_scale(scale) == "norm" else {"scale": scale}


NORMS = ("float", "log8")
"""How the MSE stage stores its per-token norms: ``"float"`` (float16, or float32 outside its
range: docs/kernels.md section 5) or ``"log8"`` (8-bit log codes with an exponent byte per
group of tokens: docs/kernels.md section 13)."""


def norm_params(norms: str, group: int | None, names: tuple[str, str] = ("norms", "norm_group")) -> dict[str, object]:
    """The coder parameters recording the norm storage: none for ``"float"`` (tensors and files
    as before the option existed), ``{"norms": "log8", "norm_group": group}`` otherwise.
    ``names``: what errors call ``norms`` and ``group`` (the caller's own settings).

    Raises:
        KvqrsError: an unknown mode, or ``"log8"`` without a group the log code takes
            (``1 .. MAX_ROW_LEN``).
    """
    if norms not in NORMS:
        raise KvqrsError(f"{names[0]}: expected one of {NORMS}, got {norms!r}")
    if norms == "float":
        return {}
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or not 1 <= group <= MAX_ROW_LEN:
        raise KvqrsError(
            f"{names[1]}: log8 norms share an exponent byte per group of tokens; expected a group in 1..{MAX_ROW_LEN}, got {group!r}"
        )
    return {"norms": norms, "norm_group": int(group)}


def _native_rows(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """``x`` as the native encoders take it: flat float32 rows and the leading shape (what
    :func:`as_float_rows` returns, without its copies for a float32 C-contiguous array)."""
    if x.dtype == np.float32 and x.flags.c_contiguous:
        return x.reshape(-1), x.shape[:-1]
    flat, lead, _, _ = as_float_rows(x, "x", min_dim=2)
    return flat, lead


class MSECoder(Coder):
    """``||x||`` (16 or 32 bits) + ``bits``-bit codes of every code coordinate.

    Args:
        head_dim: d.
        bits: 1..8.
        seed: rotation seed, or None for no rotation (the ``kv`` scheme).
        scheme, kind: labels recorded in the encoded tensors.
        backend: the kernels' compute path (:mod:`kvqrs.schemes.backend`), the Rust one by default.
        scale: what each token stores, ``"norm"`` (``||x||``, default) or ``"least_squares"``
            (the least-squares scale of the decoded direction, :func:`kvqrs.mse_encode`); the
            stored layout and the decode are the same.
        norms: how that scale is stored (:data:`NORMS`): ``"float"`` (default) or ``"log8"``
            (the stored scale coded in 8 bits on a 1/16-octave grid, an exponent byte per
            ``norm_group`` tokens: parts ``norms`` uint8 ``(..., T)`` and ``norm_exps`` uint8
            ``(..., ceil(T / norm_group))``; chunks join at whole groups).
        norm_group: tokens per exponent of ``"log8"`` norms.

    Raises:
        KvqrsError: an unknown ``scale`` or ``norms``, ``"log8"`` without a group.
    """

    fused = True  # attention_rows below (Coder.fused)

    def __init__(
        self,
        head_dim: int,
        bits: int,
        seed: int | None,
        scheme: str,
        kind: str,
        backend: Backend = CPU,
        scale: str = "norm",
        norms: str = "float",
        norm_group: int | None = None,
    ):
        self.head_dim, self.bits, self.seed, self.scheme, self.kind = head_dim, bits, seed, scheme, kind
        self.k = backend
        self.code_dim = head_dim if seed is None else padded_dim(head_dim)
        self.codebook = lloyd_max_codebook(self.code_dim, bits)
        self.params = {"bits": bits, "seed": seed, **scale_params(scale), **norm_params(norms, norm_group)}
        self.scale, self.norms = scale, norms
        self.norm_group = int(norm_group) if norms == "log8" else None
        self.row_bytes = packed_size(self.code_dim, bits)

    def encode(self, x) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        if self.k is CPU:
            enc = self._encode_native(x)
        else:
            code = self.k.mse_encode_packed(x, self.bits, self.seed, self.scale)
            enc = Encoded(self.scheme, self.kind, x.shape, x.dtype, {"codes": code.codes, "norms": code.norms}, self.params)
        if self.norm_group is not None:
            n = enc.parts["norms"]
            if n.shape[-1]:
                log = self.k.log_encode(n, self.norm_group)
                enc.parts.update(norms=log.codes, norm_exps=log.exps)
            else:  # no tokens: no groups
                enc.parts.update(norms=np.zeros(n.shape, np.uint8), norm_exps=np.zeros(n.shape, np.uint8))
        return enc

    def _encode_native(self, x: np.ndarray) -> Encoded:
        """The Rust path in one native call: the settings were validated once by the
        constructor, so a one-token append (a decode step) pays no per-call re-validation in
        ``kvqrs.kernels``; the input is validated as there, and the native kernel reports
        NaN/Inf and norm overflow with the same messages. Same bytes as the general path."""
        flat, lead = _native_rows(x)
        packed, norms = _native.mse_encode_packed(flat, self.head_dim, self.bits, self.seed, self.scale)
        parts = {"codes": packed.reshape(*lead, self.row_bytes), "norms": norms.reshape(lead)}
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """Stored parts of a ``(..., T, d)`` tensor: packed codes ``(..., T, packed(code_dim,
        bits))`` and norms ``(..., T)``."""
        lead, t, _ = split_shape(shape)
        parts = lay.mse(lead, t, self.code_dim, self.bits)
        if self.norm_group is not None:
            parts.update(lay.log_norms(lead, t, self.norm_group))
        return parts

    def stored_norms(self, enc: Encoded) -> np.ndarray | LogScalars:
        """The stored scales of the MSE parts of ``enc``: the float16/float32 array, or the
        :class:`~kvqrs.kernels.log_scalars.LogScalars` of ``"log8"`` norms."""
        if self.norm_group is None:
            return enc.parts["norms"]
        return LogScalars(enc.parts["norms"], enc.parts["norm_exps"], self.norm_group)

    def norm_values(self, enc: Encoded) -> np.ndarray:
        """The stored scales of ``enc`` as float16/float32 values (``"log8"`` norms decoded to
        float32)."""
        n = self.stored_norms(enc)
        if not isinstance(n, LogScalars):
            return n
        return self.k.log_decode(n) if n.codes.shape[-1] else np.zeros(n.codes.shape, np.float32)

    def codes(self, enc: Encoded) -> np.ndarray:
        """Unpacked codes ``(..., tokens, code_dim)``."""
        return self.k.unpack_bits(enc.parts["codes"], self.bits, self.code_dim)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        return self.decode_unchecked(enc)

    def decode_unchecked(self, enc: Encoded) -> np.ndarray:
        """Decode the MSE parts of ``enc`` (also when ``enc`` belongs to a composite coder)."""
        return self.k.mse_decode_packed(enc.parts["codes"], self.norm_values(enc), self.bits, self.head_dim, self.seed)

    def attention_rows(self, enc: Encoded) -> MSERows:
        """The stored parts as the fused attention kernel reads them (codes stay packed)."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        return self.rows_unchecked(enc)

    def rows_unchecked(self, enc: Encoded) -> MSERows:
        """:meth:`attention_rows` of the MSE parts of ``enc`` (also of a composite coder's)."""
        return MSERows(enc.parts["codes"], self.stored_norms(enc), self.bits, self.seed)

    def rotated(self, enc: Encoded) -> np.ndarray:
        """The reconstruction in the code domain: ``stored scale * centroids[codes]`` (float32)."""
        c = self.k.lloyd_max_decode(self.codes(enc), self.codebook)
        return c * self.norm_values(enc).astype(np.float32)[..., None]

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        return decoded_scores(q, self.decode(enc))


class MSEQJLCoder(Coder):
    """(n-1)-bit rotated MSE stage + 1-bit QJL sketch of the rotated residual (n >= 2).

    Stored per token: ``(n-1) * d'`` code bits, the norm (or, with ``scale="least_squares"``,
    the MSE stage's least-squares scale; the residual is then ``R x - s c``), ``d'`` sign bits
    and ``||r||``.
    """

    fused = True  # attention_rows below (Coder.fused)

    def __init__(
        self, head_dim: int, bits: int, seed: int, qjl_seed: int, scheme: str, kind: str, backend: Backend = CPU, scale: str = "norm"
    ):
        if bits < 2:
            raise KvqrsError(f"bits: expected >= 2 for {kind} with a QJL residual ((n-1)-bit Lloyd-Max + 1-bit QJL), got {bits}")
        self.head_dim, self.bits, self.seed, self.qjl_seed = head_dim, bits, seed, qjl_seed
        self.scheme, self.kind = scheme, kind
        self.k = backend
        self.mse = MSECoder(head_dim, bits - 1, seed, scheme, kind, backend, scale)
        self.code_dim = self.mse.code_dim
        self.params = {"bits": bits, "seed": seed, "qjl_seed": qjl_seed, **scale_params(scale)}

    def encode(self, x) -> Encoded:
        x = as_float_array(x, self.kind)
        if self.k is CPU and self.mse.scale == "norm":  # the one-call encoder stores norms
            check_head_dim(x, self.head_dim, self.kind)
            return self._encode_native(x)
        return self.encode_composed(x)

    def _encode_native(self, x: np.ndarray) -> Encoded:
        """The Rust path in one native call (``_native.mse_qjl_encode_packed``): a decode step
        appending one token pays one call instead of :meth:`encode_composed`'s five. Same
        bytes; inputs validated and errors reported as :meth:`MSECoder._encode_native` does."""
        flat, lead = _native_rows(x)
        packed, norms, signs, qjl_norms = _native.mse_qjl_encode_packed(flat, self.head_dim, self.bits, self.seed, self.qjl_seed)
        parts = {
            "codes": packed.reshape(*lead, self.mse.row_bytes),
            "norms": norms.reshape(lead),
            "qjl_signs": signs.reshape(*lead, packed_size(self.code_dim, 1)),
            "qjl_norms": qjl_norms.reshape(lead),
        }
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def encode_composed(self, x) -> Encoded:
        """:meth:`encode` as the backend's kernels in sequence (the path of every backend but
        the Rust one, whose single call gives the same bytes)."""
        x = as_float_array(x, self.kind)
        base = self.mse.encode(x)
        residual = self.k.hadamard(x.astype(np.float32), self.seed) - self.mse.rotated(base)
        sketch = self.k.qjl_sketch(residual, self.qjl_seed)
        parts = dict(base.parts, qjl_signs=sketch.signs, qjl_norms=sketch.norms)
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """The MSE stage's parts, then the sketch: ``qjl_signs`` ``(..., T, ceil(d'/8))`` and
        ``qjl_norms`` ``(..., T)``."""
        lead, t, _ = split_shape(shape)
        return {**self.mse.layout(shape), **lay.prefixed("qjl_", lay.qjl(lead, t, self.code_dim))}

    def _sketch(self, enc: Encoded) -> QJLSketch:
        return QJLSketch(enc.parts["qjl_signs"], enc.parts["qjl_norms"], self.code_dim, self.code_dim)

    def attention_rows(self, enc: Encoded) -> MSERows:
        """MSE parts plus the QJL sketch, as the fused attention kernel reads them."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        qjl = QJLRows(enc.parts["qjl_signs"], enc.parts["qjl_norms"], self.qjl_seed)
        return self.mse.rows_unchecked(enc)._replace(qjl=qjl)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        r_hat = self.k.qjl_vector_estimate(self._sketch(enc), self.qjl_seed)
        return self.k.inverse_hadamard(self.mse.rotated(enc) + r_hat, self.seed, self.head_dim)

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        """``(q . k_mse + <R q, r>_QJL) / sqrt(d)``: the residual enters through the unbiased
        inner-product estimator, never through a rebuilt key."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        base = decoded_scores(q, self.mse.decode_unchecked(enc))
        rq = self.k.hadamard(q.astype(np.float32), self.seed)
        sk = self._sketch(enc)
        lead = q.shape[:-2]
        signs = flat_rows(sk.signs, 2)
        norms = flat_rows(sk.norms, 1)

        def block(b: int, qb: np.ndarray) -> np.ndarray:
            part = QJLSketch(signs[b], norms[b], sk.m, sk.dim)
            return self.k.qjl_inner_product(qb, part, self.qjl_seed)

        est = blockwise(block, rq, lead, enc.shape[-2])
        return base + est / np.float32(math.sqrt(self.head_dim))
