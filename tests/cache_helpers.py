"""Shared by tests that compare two caches: everything a cache holds, as tensors."""

from __future__ import annotations

import numpy as np
import torch


def held_tensors(cache) -> list[torch.Tensor]:
    """Every code part and full-precision tensor a :class:`kvqrs.hf.QuantizedKVCache` holds
    (sinks, window, originals kept for a rollback), layer by layer; a ``DynamicCache``: its
    keys and values."""
    from kvqrs.hf import QuantizedKVCache

    out = []
    for layer in cache.layers:
        if isinstance(cache, QuantizedKVCache):
            for enc in [*layer.chunks_k, *(c for c in layer.chunks_v if c is not None)]:
                out += [torch.from_numpy(np.ascontiguousarray(enc.parts[k])) for k in sorted(enc.parts)]
            out += list(layer._tensors().values())
        else:
            out += [layer.keys, layer.values]
    return out
