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


def per_head_matched_calibration(heads: int, d: int, seed: int):
    """A ``matched`` calibration with one seeded random orthonormal basis and a nonzero mean
    per KV head for keys and for values (values transform-coded), widths in several runs
    with width-0 columns (keys 5/3/2/1/0, values 4/2/0 over quarters and eighths of ``d``)."""
    from kvqrs.kernels.rng import random_orthonormal_basis
    from kvqrs.schemes.matched import MatchedBasis, MatchedCalibration

    rng = np.random.default_rng(seed)
    e = d // 8

    def side(widths: list[int], mean: np.ndarray) -> MatchedBasis:
        basis = np.stack([random_orthonormal_basis(int(rng.integers(2**63)), d, d) for _ in range(heads)])
        return MatchedBasis(mean, basis, np.array(widths + [0] * (d - len(widths)), np.uint8))

    key_mean = (rng.standard_normal((heads, d)) * 2).astype(np.float32)
    value_mean = rng.standard_normal((heads, d)).astype(np.float32)
    keys = side([5] * e + [3] * (2 * e) + [2] * (2 * e) + [1] * e, key_mean)
    values = side([4] * (2 * e) + [2] * (3 * e), value_mean)
    return MatchedCalibration(keys, value_mean, values=values)


def tiny_llama(
    kv_heads: int,
    groups: int,
    head_dim: int,
    layers: int = 2,
    vocab: int = 96,
    hidden: int = 64,
    intermediate: int = 64,
    positions: int = 256,
):
    """A seeded random Llama of ``layers`` layers, ``kv_heads`` KV heads of ``groups`` query
    heads each, on the ``kvqrs`` attention (registered)."""
    from kvqrs.hf import register
    from transformers import LlamaConfig, LlamaForCausalLM

    register()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=kv_heads * groups,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=positions,
        attn_implementation="kvqrs",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()
