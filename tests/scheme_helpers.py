"""Codecs for the tests that sweep every registered scheme (kvqrs.schemes.registry)."""

from __future__ import annotations

from typing import Any

from kvqrs.schemes import KVCodec
from kvqrs.schemes.registry import REGISTRY


def scheme_codec(scheme: str, bits: int, head_dim: int, seed: int = 0, **kw: Any) -> KVCodec:
    """``KVCodec`` of key scheme ``scheme`` at ``bits`` brought into the range its keys take (its
    values, unless ``value_bits`` is given, into the range theirs take), with its seeded
    uncalibrated control where it needs a calibration (HeadQ's random basis, matched's random
    calibration); ``kw`` as ``KVCodec`` takes them (they override the control's)."""
    spec = REGISTRY[scheme]
    values = kw.get("value_scheme") or (scheme if spec.values else "kivi")
    kw.setdefault("value_bits", REGISTRY[values].values.bits(bits))
    bits = spec.keys.bits(bits)
    return KVCodec(scheme, bits, head_dim, seed=seed, **{**spec.control_kwargs(head_dim, bits, seed), **kw})
