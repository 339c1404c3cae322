"""The Gaussian test channel at a ``matched`` codec's own code widths: what an ideal coder of a
Gaussian model of every coded coordinate would cost, so that a row's distance from its target
splits into the coder's inefficiency (codec row against channel row) and the rate itself (the
channel row against the target).

Rate-distortion theory (Cover and Thomas, *Elements of Information Theory*, Theorem 10.3.2 and
its backward test channel, Section 10.3.2): a Gaussian source of variance ``s^2`` coded at ``b``
bits per sample has distortion at best ``D = s^2 2^(-2b)``, reached by ``x_hat = mu + a (x - mu)
+ sqrt(a D) z`` with ``a = 1 - D / s^2`` and ``z`` standard normal independent of ``x``. Here:

- keys: each transform coordinate ``y_i = ((k - mu) U)_i`` of width ``b_i > 0``, per scale group
  of tokens, with the group's own mean and variance (what the coder's zero point and scale
  adapt to); coordinates of width 0 are dropped as the coder drops them;
- values: each token's centred vector ``v - mu``, variance ``||v - mu||^2 / d`` per coordinate
  (the rotated coordinates the Lloyd-Max stage codes), at the layer's value width.

The channel is told the exact means and variances the coder stores in 16 or fewer bits, and real
keys and values are not Gaussian (a heavy-tailed source of the same variance has a lower
rate-distortion bound), so a channel row is neither an upper nor a lower bound on what any coder
reaches: it is the codec's design with its scalar quantizers replaced by ideal Gaussian ones.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import numpy as np

from .._arrays import KvqrsError
from ..schemes.matched import MatchedCoder, MatchedValueCoder, head_mean

SIDES = ("keys", "values", "both")
"""What a channel row passes through the channel: the keys, the values, or both (the rest
through the codec itself)."""


def gaussian_channel(y: np.ndarray, variance: np.ndarray, bits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The backward test channel of a zero-mean Gaussian at ``bits`` per sample: ``a y + sqrt(a D)
    z`` with ``D = variance 2^(-2 bits)``, ``a = 1 - D / variance`` (0 where the variance is 0).

    Args:
        y: float64 centred samples, any shape.
        variance: float64, broadcast against ``y``: the variance the channel is designed for.
        bits: broadcast against ``y``: bits per sample (``>= 0``; 0 gives ``a = 0``, the mean).
        rng: the noise's generator.

    Returns:
        float64 of ``y``'s shape, with ``E[(y_hat - y)^2] = D`` when ``y`` has that variance.
    """
    d = variance * np.exp2(-2.0 * np.asarray(bits, dtype=np.float64))
    a = np.where(variance > 0, 1.0 - d / np.where(variance > 0, variance, 1.0), 0.0)
    return a * y + np.sqrt(a * d) * rng.standard_normal(y.shape)


def channel_keys(coder: MatchedCoder, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Keys ``(..., kv_heads, T, d)`` through the channel at ``coder``'s widths, per scale group of
    ``coder.group`` tokens; float32 of ``x``'s shape."""
    cal = coder.cal
    mean, basis = (m.astype(np.float64) for m in coder.heads(x))
    y = np.matmul(x.astype(np.float64) - mean, basis)  # (..., T, d)
    widths = cal.widths.astype(np.float64)
    out = np.zeros_like(y)
    for s in range(0, y.shape[-2], coder.group):
        block = y[..., s : s + coder.group, :]
        mu = block.mean(axis=-2, keepdims=True)
        var = ((block - mu) ** 2).mean(axis=-2, keepdims=True)
        out[..., s : s + coder.group, :] = np.where(widths > 0, mu + gaussian_channel(block - mu, var, widths, rng), 0.0)
    return (np.matmul(out, np.swapaxes(basis, -1, -2)) + mean).astype(np.float32)


def channel_values(coder: MatchedValueCoder, v: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Values ``(..., kv_heads, T, d)`` through the channel at ``coder``'s width, each token's
    centred vector at its own per-coordinate variance; float32 of ``v``'s shape."""
    mean = head_mean(coder.mean, v, "values").astype(np.float64)
    y = v.astype(np.float64) - mean
    var = (y**2).mean(axis=-1, keepdims=True)
    return (gaussian_channel(y, var, np.float64(coder.bits), rng) + mean).astype(np.float32)


class StandIn(abc.ABC):
    """A ``matched`` :class:`~kvqrs.schemes.KVCodec` with its keys, values or both (``keys``,
    ``values``: whether each is stood in for) decoded by another coder, :meth:`stand_in_keys`
    and :meth:`stand_in_values` of the originals; what the fast path
    (:func:`kvqrs.hf.fake_quant`) calls of a codec. The other side goes through the codec.

    Raises:
        KvqrsError: a codec whose keys or values (the side stood in for) are not the ``matched``
            transform or Lloyd-Max coders (``what`` names the stand-in).
    """

    def __init__(self, codec: Any, keys: bool, values: bool, what: str):
        self.codec, self.keys_through, self.values_through = codec, keys, values
        if keys and not isinstance(codec.keys, MatchedCoder):
            raise KvqrsError(f"{what}: the keys must be matched transform-coded keys, got {type(codec.keys).__name__}")
        if values and not isinstance(codec.values, MatchedValueCoder):
            raise KvqrsError(f"{what}: the values must be matched Lloyd-Max values, got {type(codec.values).__name__}")
        self.values = codec.values
        self.needs_weights = codec.needs_weights and not values

    @abc.abstractmethod
    def stand_in_keys(self, k: np.ndarray) -> np.ndarray:
        """Keys ``(..., kv_heads, T, d)`` as the stand-in decodes them (float32)."""

    @abc.abstractmethod
    def stand_in_values(self, v: np.ndarray) -> np.ndarray:
        """Values ``(..., kv_heads, T, d)`` as the stand-in decodes them (float32)."""

    def encode_keys(self, k: np.ndarray) -> Any:
        return k if self.keys_through else self.codec.encode_keys(k)

    def decode_keys(self, ck: Any, base_only: bool = False) -> np.ndarray:
        return self.stand_in_keys(ck) if self.keys_through else self.codec.decode_keys(ck, base_only)

    def score_correction(self, q: np.ndarray, ck: Any) -> np.ndarray | None:
        return None if self.keys_through else self.codec.score_correction(q, ck)

    def encode_values(self, v: np.ndarray, weights: np.ndarray | None = None) -> Any:
        return v if self.values_through else self.codec.encode_values(v, weights)

    def decode_values(self, cv: Any) -> np.ndarray:
        return self.stand_in_values(cv) if self.values_through else self.codec.decode_values(cv)


class ChannelCodec(StandIn):
    """:class:`StandIn` with the keys, values or both (``sides``) passed through the Gaussian
    test channel (:func:`gaussian_channel`).

    Raises:
        KvqrsError: ``sides`` not one of :data:`SIDES`, or as :class:`StandIn`.
    """

    def __init__(self, codec: Any, sides: str, rng: np.random.Generator):
        if sides not in SIDES:
            raise KvqrsError(f"channel: expected one of {SIDES}, got {sides!r}")
        super().__init__(codec, sides in ("keys", "both"), sides in ("values", "both"), "channel")
        self.rng = rng

    def stand_in_keys(self, k: np.ndarray) -> np.ndarray:
        return channel_keys(self.codec.keys, k, self.rng)

    def stand_in_values(self, v: np.ndarray) -> np.ndarray:
        return channel_values(self.codec.values, v, self.rng)


def channel_wrap(sides: str, seed: int = 0) -> Callable[[Any], ChannelCodec]:
    """The ``wrap`` argument of :func:`kvqrs.hf.fake_quant` for a channel row: every layer's codec
    becomes a :class:`ChannelCodec` drawing from one generator seeded with ``seed``."""
    if sides not in SIDES:
        raise KvqrsError(f"channel: expected one of {SIDES}, got {sides!r}")
    rng = np.random.default_rng(seed)
    return lambda codec: ChannelCodec(codec, sides, rng)
