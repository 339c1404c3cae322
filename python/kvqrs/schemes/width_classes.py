"""Token-weighted value widths in fixed classes (HeadQ's A^2 objective, per token).

The attention output's error from value token ``j`` is weighted by how much the queries read
it: minimising ``sum_j w_j ||v_j - mu||^2 D(b_j)`` (``w_j = sum_q p_qj^2``, ``D(b)`` the
Lloyd-Max unit distortion at ``b`` bits) at a fixed average width gives the important tokens
more bits and the others fewer (:func:`kvqrs.schemes.a2.allocate_bits`). A free allocation has
data-dependent sizes; here every chunk of ``chunk`` tokens holds a fixed number of tokens per
width (a layer's *classes*, fitted on calibration text from the free allocations there): the
tokens of a chunk, ordered by weight, fill the widest class first. Each class is an ordinary
MSE stage at its width over its slots, so the stored layout depends on the shape only (chunks
join and cut at whole chunks), and only the class of each token is stored besides (``ceil(log2
classes)`` bits). Measured on SmolLM2-135M (docs/evaluation.md): fixed classes lose almost
nothing against the free allocation; they cut the KL where a full-precision window holds the
newest 64 tokens, and raise it where every token is read quantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from .. import layout as lay
from .._arrays import KvqrsError, check_bits, check_positive_int
from .a2 import check_weights
from .base import Coder, Encoded, as_float_array, check_encoded, check_head_dim, split_shape
from .matched import head_mean
from .mse import MSECoder

MAX_WIDTH = 8
IMPORTANCE_QUERIES = 16
"""Queries that weigh a token: its own and the ones before it
(:func:`kvqrs.hf.attention.causal_importance`), so its importance depends on no later token.
Its class is then decided by rank within its chunk (as a group's scale is by the group's
tokens): a cache codes a chunk once all of its tokens have arrived."""
IMPORTANCE_WINDOW = 64
"""Latest keys (after the sinks) in each of those queries' softmax."""


def check_classes(classes: Any, chunk: int | None = None, what: str = "value_classes") -> tuple[tuple[int, int], ...]:
    """``classes`` as ``((width, count), ...)`` sorted by width, widest first: distinct integer
    widths 1..8 with positive integer counts summing to ``chunk`` (None: any total). Raises
    :class:`KvqrsError` otherwise (floats and booleans are not integers here)."""

    def integer(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    try:
        pairs = [tuple(p) for p in classes]
    except TypeError:
        pairs = None
    if not pairs or any(len(p) != 2 or not all(map(integer, p)) for p in pairs):
        raise KvqrsError(f"{what}: expected a sequence of (width, count) integer pairs, got {classes!r}")
    pairs = [(int(w), int(c)) for w, c in pairs]
    widths = [w for w, _ in pairs]
    if len(set(widths)) != len(widths) or any(not 1 <= w <= MAX_WIDTH or c < 1 for w, c in pairs):
        raise KvqrsError(f"{what}: expected distinct widths in 1..{MAX_WIDTH} with positive counts, got {classes!r}")
    total = sum(c for _, c in pairs)
    if chunk is not None and total != chunk:
        raise KvqrsError(f"{what}: the counts must sum to the chunk of {chunk} tokens, got {total}")
    return tuple(sorted(pairs, reverse=True))


def class_counts(histogram: Any, bits: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """Integer classes for chunks of ``chunk`` tokens from a histogram of widths.

    Args:
        histogram: ``(9,)`` how often each width 0..8 was allocated (widths 1..8 used).
        bits: the mean width the classes must hold exactly (``sum w c == bits * chunk``).
        chunk: tokens per chunk.

    Returns:
        ``((width, count), ...)`` widest first (:func:`check_classes`): the histogram's
        fractions rounded to counts, then single tokens moved between neighbouring widths
        until the mean is exact.
    """
    h = np.asarray(histogram, dtype=np.float64).reshape(-1)
    if h.shape != (MAX_WIDTH + 1,) or not np.isfinite(h).all() or (h < 0).any() or h[1:].sum() <= 0:
        raise KvqrsError(f"histogram: expected 9 non-negative counts of widths 0..8 (some of 1..8), got {histogram!r}")
    bits, chunk = check_bits(bits, "bits", 1, MAX_WIDTH), check_positive_int(chunk, "chunk")
    frac = h[1:] / h[1:].sum() * chunk
    c = np.floor(frac).astype(np.int64)
    for i in np.argsort(-(frac - c), kind="stable")[: chunk - int(c.sum())]:
        c[i] += 1
    w = np.arange(1, MAX_WIDTH + 1)
    while (excess := int((w * c).sum()) - bits * chunk) != 0:
        used = np.flatnonzero(c)
        i = used[-1] if excess > 0 else used[0]  # narrow the widest token, or widen the narrowest
        j = i - 1 if excess > 0 else i + 1
        c[i], c[j] = c[i] - 1, c[j] + 1
    return check_classes([(int(w[i]), int(c[i])) for i in np.flatnonzero(c)], chunk)


def assign(weights: np.ndarray, classes: tuple[tuple[int, int], ...], chunk: int) -> np.ndarray:
    """Class index (into ``classes``, widest first) of each token ``(..., T)``: in each chunk of
    ``chunk`` tokens, the tokens by decreasing weight (ties: the earlier token first) fill the
    classes in order. A last chunk of fewer tokens fills them the same way, leaving the
    narrowest classes' slots unused."""
    w = np.asarray(weights, dtype=np.float64)
    lead, t = w.shape[:-1], w.shape[-1]
    n_chunks = -(-t // chunk)
    padded = np.full((*lead, n_chunks * chunk), -np.inf)
    padded[..., :t] = w
    order = np.argsort(-padded.reshape(*lead, n_chunks, chunk), axis=-1, kind="stable")
    rank_class = np.repeat(np.arange(len(classes), dtype=np.uint8), [c for _, c in classes])
    out = np.empty(order.shape, np.uint8)
    np.put_along_axis(out, order, np.broadcast_to(rank_class, order.shape), axis=-1)
    return out.reshape(*lead, n_chunks * chunk)[..., :t]


def slots(cls: np.ndarray, index: int, count: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, valid)`` ``(..., chunks, count)``: the token (within its chunk) in each slot of
    class ``index``, the chunk's tokens of that class in token order, and whether the slot is
    used (a short last chunk leaves slots empty)."""
    lead, t = cls.shape[:-1], cls.shape[-1]
    n_chunks = -(-t // chunk)
    padded = np.full((*lead, n_chunks * chunk), 255, np.uint8)
    padded[..., :t] = cls
    c = padded.reshape(*lead, n_chunks, chunk)
    key = np.where(c == index, 0, 1)  # the class's tokens first, each group in token order
    tokens = np.argsort(key, axis=-1, kind="stable")[..., :count]
    valid = np.take_along_axis(c, tokens, axis=-1) == index
    return tokens, valid


class WidthClassCoder(Coder):
    """MSE value rows (rotated Lloyd-Max, around an optional mean) whose widths follow fixed
    per-chunk classes chosen by token weight (module docstring).

    ``encode(x, weights)`` needs the weights ``(..., T)`` (A^2 importances, non-negative); the
    ordering weight of a token is ``weights_j * ||x_j - mean||^2``.

    Stored parts, for ``C = ceil(T / chunk)`` chunks (docs/layouts.md): ``classes`` uint8
    ``(..., C, packed(chunk, k))`` (each token's class index, ``k = ceil(log2 classes)`` bits, at
    least 1), and per class of width ``b`` with ``c`` slots the MSE stage's parts over
    ``(..., C, c)`` slots, suffixed ``_<b>``: ``codes_<b>`` ``(..., C, c, packed(d', b))``,
    ``norms_<b>`` ``(..., C, c)`` (and ``norm_exps_<b>`` ``(..., C, ceil(c / norm_group))``
    with ``"log8"`` norms). Unused slots of a short last chunk hold a zero row.

    Args:
        classes: ``((width, count), ...)`` per chunk (:func:`check_classes`).
        chunk: tokens per chunk.
        mean: float32 ``(kv_heads, d)`` subtracted before coding and added back (``matched``).
        stage: ``stage(bits)`` the :class:`~kvqrs.schemes.mse.MSECoder` of one class (its
            rotation seed, scale and norms; the same for every width).
    """

    takes_weights = needs_weights = True  # encode(x, weights) (Coder)

    def __init__(self, classes: Any, chunk: int, mean: np.ndarray, stage: Callable[[int], MSECoder]):
        self.classes = check_classes(classes, int(chunk))
        self.stages = [stage(b) for b, _ in self.classes]
        first = self.stages[0]
        self.head_dim, self.chunk, self.scheme, self.kind, self.k = first.head_dim, int(chunk), first.scheme, first.kind, first.k
        self.mean = np.asarray(mean, dtype=np.float32)
        self.code_dim = first.code_dim
        self.index_bits = max(1, math.ceil(math.log2(len(self.classes))))
        digest = __import__("hashlib").blake2b(self.mean.tobytes(), digest_size=8).hexdigest()
        self.bits = sum(b * c for b, c in self.classes) / self.chunk
        self.params = {**self.stages[0].params, "bits": self.bits, "classes": str(self.classes), "chunk": self.chunk, "mean": digest}

    def encode(self, x: Any, weights: Any = None) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        if weights is None:
            raise KvqrsError(f"weights: {self.kind} coded in width classes need each token's A^2 importance (..., tokens)")
        w = check_weights(weights, x.shape[:-1])
        y = x.astype(np.float32) - head_mean(self.mean, x, self.kind)
        cls = assign(w * np.sum(y.astype(np.float64) ** 2, axis=-1), self.classes, self.chunk)
        lead, t, d = split_shape(x.shape)
        n_chunks = -(-t // self.chunk)
        idx = np.zeros((*lead, n_chunks * self.chunk), np.uint8)
        idx[..., :t] = cls
        parts = {"classes": self.k.pack_bits(idx.reshape(*lead, n_chunks, self.chunk), self.index_bits)}
        rows = np.zeros((*lead, n_chunks * self.chunk, d), np.float32)
        rows[..., :t, :] = y
        rows = rows.reshape(*lead, n_chunks, self.chunk, d)
        for i, ((b, c), stage) in enumerate(zip(self.classes, self.stages)):
            tok, valid = slots(cls, i, c, self.chunk)
            picked = np.take_along_axis(rows, tok[..., None], axis=-2) * valid[..., None]
            enc = stage.encode(picked)
            parts.update({f"{name}_{b}": a for name, a in enc.parts.items()})
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        lead, t, d = split_shape(shape)
        # One entry per chunk of ``chunk`` tokens along each part's token axis (the chunk axis).
        rate = Fraction(1, self.chunk)
        n_chunks = lay.entries(t, rate)
        parts = {"classes": lay.Part((*lead, n_chunks, -(-self.chunk * self.index_bits // 8)), "uint8", -2, self.chunk, rate)}
        for (b, c), stage in zip(self.classes, self.stages):
            for name, p in stage.layout((*lead, n_chunks, c, d)).items():
                parts[f"{name}_{b}"] = lay.Part(p.shape, p.dtype, p.token_axis - 1, self.chunk, rate)
        return parts

    def class_index(self, enc: Encoded) -> np.ndarray:
        """Each token's class index ``(..., T)`` (uint8, into :attr:`classes`)."""
        lead, t, _ = split_shape(enc.shape)
        packed = enc.parts["classes"]
        n_chunks = packed.shape[-2]
        idx = self.k.unpack_bits(packed, self.index_bits, self.chunk).reshape(*lead, n_chunks * self.chunk)
        return idx[..., :t].astype(np.uint8)

    def widths(self, enc: Encoded) -> np.ndarray:
        """Each token's width in bits ``(..., T)`` (uint8)."""
        return np.array([b for b, _ in self.classes], np.uint8)[self.class_index(enc)]

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        cls = self.class_index(enc)
        lead, t, d = split_shape(enc.shape)
        n_chunks = -(-t // self.chunk)
        out = np.zeros((*lead, n_chunks, self.chunk, d), np.float32)
        for i, ((b, c), stage) in enumerate(zip(self.classes, self.stages)):
            sub = Encoded(self.scheme, self.kind, (*lead, n_chunks, c, d), enc.dtype, {}, stage.params)
            sub.parts.update({name: enc.parts[f"{name}_{b}"] for name in stage.layout(sub.shape)})
            rows = stage.decode_unchecked(sub)
            tok, valid = slots(cls, i, c, self.chunk)
            # Unused slots point at a token of another class: write only the used ones.
            np.put_along_axis(
                out, tok[..., None], np.where(valid[..., None], rows, np.take_along_axis(out, tok[..., None], axis=-2)), axis=-2
            )
        y = out.reshape(*lead, n_chunks * self.chunk, d)[..., :t, :]
        return y + head_mean(self.mean, y, self.kind)


def unit_weights(codec: Any, v: np.ndarray) -> np.ndarray | None:
    """Equal importances ``(..., T)`` for values ``v`` when ``codec``'s values are in width
    classes (their stored size depends on the shape only: what counting bits needs), else None."""
    return np.ones(v.shape[:-1]) if codec.values is not None and codec.values.needs_weights else None
