"""A prototype stand-in coder: bitshift trellis-coded quantization (TCQ) at a ``matched``
codec's own widths and side information, to measure on llama.cpp's protocol what a trellis coder
would give before any kernel of it is built (as :mod:`.channel` measures ideal Gaussian coders).

The trellis (the bitshift trellis of QTIP, Tseng et al. 2024, after Marcellin and Fischer's TCQ,
1990): a sequence of ``T`` samples is stored as ``T k`` bits read circularly; sample ``t``
decodes to ``book[s_t]``, where the state ``s_t`` is the ``L``-bit window of the stream ending
with sample ``t``'s ``k`` bits, so ``s_t = (s_(t-1) << k | b_t) mod 2^L``. The Viterbi algorithm
finds the stream of least squared error. Tail-biting (the first window wraps around to the
stream's last ``L - k`` bits) costs no bits beyond ``k`` per sample; the encoder runs a free-start
pass over the sequence twice, takes the state it reaches where the second lap begins, and forces
that prefix at both ends of a final pass.

Stand-ins (float64 arithmetic, NumPy, slow: a prototype, not a codec):

- keys: per scale group of tokens and coded coordinate ``y_i = ((k - mu) U)_i`` of width
  ``b_i > 0``, the group's range midpoint and half width (float16, as the coder's zero point and
  scale), the range-normalised sequence along the group's tokens through the trellis at
  ``k = b_i`` with ``L = min(k + 6, 14)`` over a uniform grid of ``[-1, 1]`` (``2^L`` points in a
  seeded random order), so the group's extremes stay representable;
- values: per token, the codec's own decoded norm (its stored, norm-preserving scale), and the
  direction ``(v - mu) / ||v - mu||`` rotated by a seeded random orthogonal matrix and scaled by
  ``sqrt(d)`` through the trellis along its ``d`` coordinates at the layer's value width, with
  ``L = min(k + 8, 14)`` over Gaussian quantiles in a seeded random order; the decoded direction
  is normalised to that norm.

Bits are the codec's: the same widths, the same 16-bit group scalars and token norms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._arrays import KvqrsError
from ..schemes.matched import MatchedCoder, MatchedValueCoder, head_mean
from .channel import StandIn

SIDES = ("trellis-keys", "trellis-values", "trellis-both")
"""What a trellis row passes through the trellis: keys, values or both (the rest through the codec)."""

KEY_MEMORY, VALUE_MEMORY, MAX_STATE_BITS = 6, 8, 14
"""State bits ``L = min(k + memory, MAX_STATE_BITS)`` of the keys' and the values' trellis."""


@functools.lru_cache(maxsize=64)
def codebook(state_bits: int, kind: str, seed: int) -> np.ndarray:
    """The ``2^L`` reconstruction values of a trellis, in a seeded random order: ``"gaussian"``
    (standard normal quantiles at ``(i + 1/2) / 2^L``) or ``"uniform"`` (``2^L`` evenly spaced
    points of ``[-1, 1]``, both ends included). float64, read-only."""
    from scipy.stats import norm

    n = 1 << state_bits
    if kind == "gaussian":
        values = norm.ppf((np.arange(n) + 0.5) / n)
    elif kind == "uniform":
        values = np.linspace(-1.0, 1.0, n)
    else:
        raise KvqrsError(f"trellis codebook: expected 'gaussian' or 'uniform', got {kind!r}")
    out = values[np.random.default_rng(seed).permutation(n)]
    out.flags.writeable = False
    return out


def viterbi(x: np.ndarray, k: int, book: np.ndarray, prefix: np.ndarray | None = None) -> np.ndarray:
    """States ``(S, T)`` (int64) of least squared error for ``S`` sequences ``x`` ``(S, T)``
    through the bitshift trellis of ``k`` bits per sample over ``book`` (``2^L`` values, ``L >
    k``). ``prefix`` ``(S,)``: the first state's top ``L - k`` bits, forced equal to the last
    state's low ``L - k`` bits (tail-biting); None: the first state is free."""
    s_count, t_count = x.shape
    state_bits = int(book.size).bit_length() - 1
    if book.size != 1 << state_bits or not 1 <= k < state_bits:
        raise KvqrsError(f"trellis: expected a codebook of 2^L values with L > k = {k}, got {book.size}")
    m, kk = 1 << (state_bits - k), 1 << k
    every = np.arange(book.size)
    cost = (x[:, :1] - book[None, :]) ** 2
    if prefix is not None:
        cost = np.where((every[None, :] >> k) == prefix[:, None], cost, np.inf)
    back = np.empty((t_count, s_count, m), np.uint16)
    for t in range(1, t_count):
        # State j * m + u follows any state whose low L - k bits are u's: min over j.
        r = cost.reshape(s_count, kk, m)
        j = r.argmin(axis=1)
        back[t] = j
        best = np.take_along_axis(r, j[:, None, :], axis=1)[:, 0, :]
        cost = np.repeat(best, kk, axis=1) + (x[:, t : t + 1] - book[None, :]) ** 2
    if prefix is not None:
        cost = np.where((every[None, :] % m) == prefix[:, None], cost, np.inf)
    states = np.empty((s_count, t_count), np.int64)
    s = cost.argmin(axis=1)
    states[:, -1] = s
    rows = np.arange(s_count)
    for t in range(t_count - 1, 0, -1):
        u = s >> k
        s = back[t][rows, u].astype(np.int64) * m + u
        states[:, t - 1] = s
    return states


def trellis_quantize(x: np.ndarray, k: int, book: np.ndarray) -> np.ndarray:
    """``x`` ``(S, T)`` float64 through the tail-biting trellis of ``k`` bits per sample over
    ``book``: the reconstruction ``book[s_t]``, float64 ``(S, T)``."""
    if x.shape[1] == 0 or x.shape[0] == 0:
        return np.zeros_like(x)
    lap = viterbi(np.concatenate([x, x], axis=1), k, book)
    prefix = lap[:, x.shape[1]] >> k
    return book[viterbi(x, k, book, prefix)]


def _state_bits(k: int, memory: int) -> int:
    return min(k + memory, MAX_STATE_BITS)


def trellis_keys(coder: MatchedCoder, x: np.ndarray) -> np.ndarray:
    """Keys ``(..., kv_heads, T, d)`` through the keys' trellis at ``coder``'s widths, per scale
    group of ``coder.group`` tokens; float32 of ``x``'s shape. Width-0 coordinates decode to the
    key mean, as the coder's do."""
    mean, basis = (m.astype(np.float64) for m in coder.heads(x))
    y = np.matmul(x.astype(np.float64) - mean, basis)
    widths = coder.cal.widths.astype(np.int64)
    out = np.zeros_like(y)
    for s in range(0, y.shape[-2], coder.group):
        block = y[..., s : s + coder.group, :]
        lo, hi = block.min(axis=-2, keepdims=True), block.max(axis=-2, keepdims=True)
        mid = ((hi + lo) / 2).astype(np.float16).astype(np.float64)
        half = ((hi - lo) / 2).astype(np.float16).astype(np.float64)
        half = np.where(half > 0, half, 1.0)
        z, rec = (block - mid) / half, np.zeros_like(block)
        for k in sorted(set(widths[widths > 0].tolist())):
            cols = np.flatnonzero(widths == k)
            zz = np.moveaxis(z[..., cols], -2, -1)
            book = codebook(_state_bits(k, KEY_MEMORY), "uniform", k)
            q = trellis_quantize(zz.reshape(-1, zz.shape[-1]), k, book).reshape(zz.shape)
            rec[..., cols] = np.moveaxis(q, -1, -2)
        out[..., s : s + coder.group, :] = np.where(widths > 0, mid + half * rec, 0.0)
    return (np.matmul(out, np.swapaxes(basis, -1, -2)) + mean).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _rotation(d: int) -> np.ndarray:
    """A seeded random orthogonal ``d x d`` matrix (QR of a Gaussian matrix, signs fixed)."""
    q, r = np.linalg.qr(np.random.default_rng(7).standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def trellis_values(coder: MatchedValueCoder, decoded: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Values ``(..., kv_heads, T, d)`` through the values' trellis at ``coder``'s width: each
    token's direction coded by the trellis, its norm that of ``decoded`` (the codec's decoded
    values of ``v``: its stored, norm-preserving scale); float32 of ``v``'s shape."""
    mean = head_mean(coder.mean, v, "values").astype(np.float64)
    norms = np.linalg.norm(decoded.astype(np.float64) - mean, axis=-1, keepdims=True)
    y = v.astype(np.float64) - mean
    d = y.shape[-1]
    ny = np.linalg.norm(y, axis=-1, keepdims=True)
    u = (y / np.where(ny > 0, ny, 1.0)) @ _rotation(d).T * np.sqrt(d)
    k = int(coder.bits)
    book = codebook(_state_bits(k, VALUE_MEMORY), "gaussian", k)
    q = trellis_quantize(u.reshape(-1, d), k, book).reshape(u.shape) @ _rotation(d)
    nq = np.linalg.norm(q, axis=-1, keepdims=True)
    return (q / np.where(nq > 0, nq, 1.0) * norms + mean).astype(np.float32)


class TrellisCodec(StandIn):
    """:class:`~kvqrs.evaluation.channel.StandIn` with the keys, values or both (``side``) coded
    by the prototype trellis (:func:`trellis_keys`, :func:`trellis_values`).

    Raises:
        KvqrsError: ``side`` not one of :data:`SIDES`, or a codec whose keys or values (the side
            coded by the trellis) are not the ``matched`` transform or Lloyd-Max coders.
    """

    def __init__(self, codec: Any, side: str):
        if side not in SIDES:
            raise KvqrsError(f"trellis: expected one of {SIDES}, got {side!r}")
        super().__init__(codec, side in ("trellis-keys", "trellis-both"), side in ("trellis-values", "trellis-both"), "trellis")

    def stand_in_keys(self, k: np.ndarray) -> np.ndarray:
        return trellis_keys(self.codec.keys, k)

    def stand_in_values(self, v: np.ndarray) -> np.ndarray:
        return trellis_values(self.codec.values, self.codec.decode_values(self.codec.encode_values(v)), v)


def trellis_wrap(side: str) -> Callable[[Any], TrellisCodec]:
    """The ``wrap`` argument of :func:`kvqrs.hf.fake_quant` for a trellis row."""
    if side not in SIDES:
        raise KvqrsError(f"trellis: expected one of {SIDES}, got {side!r}")
    return lambda codec: TrellisCodec(codec, side)
