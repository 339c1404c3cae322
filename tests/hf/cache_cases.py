"""Shared by the tests/hf/test_cache_*.py modules: synthetic keys and values, the cache
configurations they sweep (per-token and grouped schemes, the crop schemes), a cache and a
DynamicCache fed the same tokens, the text the SmolLM2 tests read."""

from __future__ import annotations

import pytest
import torch
from kvqrs.hf import QuantConfig, QuantizedKVCache
from transformers.cache_utils import DynamicCache

HEAD_DIM = 64

TEXT = (
    "Anthropology is the study of humans and their societies in the past and present. Its main "
    "subdivisions are social anthropology and cultural anthropology, which describe the workings "
    "of societies around the world, and physical anthropology, which studies the evolution of the "
    "human body. Archaeology studies past cultures through their material remains."
)


def _layers(model) -> int:
    return model.config.num_hidden_layers


def _kv(batch=2, heads=3, tokens=70, dim=HEAD_DIM, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, tokens, dim, generator=g) * 2 + 0.5
    v = torch.randn(batch, heads, tokens, dim, generator=g)
    return k.to(dtype), v.to(dtype)


PER_TOKEN = [
    pytest.param(QuantConfig("kv", 2, "kv", 2, residual_length=3), id="kv"),
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4), id="kqv"),
    pytest.param(QuantConfig("qkqv", 3, "qkqv", 3, residual_length=2), id="qkqv"),
    pytest.param(QuantConfig("block", 4, "block", 4, residual_length=5), id="block"),
    pytest.param(QuantConfig("kqv", 4, residual_length=1), id="kqv-keyonly"),
    pytest.param(QuantConfig("headq", 2, residual_length=2, headq_base="kqv", bases="random"), id="headq-kqv"),
]
GROUPED = [
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=5), id="kivi"),
    pytest.param(QuantConfig("headq", 2, residual_length=0, bases="random"), id="headq-kivi"),
    pytest.param(QuantConfig("matched", 3, "matched", 3, residual_length=2, group=8, calibration="random"), id="matched"),
    pytest.param(QuantConfig("kivi", 2, "kv", 3, residual_length=5, group=8, value_norms="log8"), id="kivi-kv-log8"),
    pytest.param(QuantConfig("kqv", 3, "kv", 3, residual_length=2, group=8, value_norms="log8"), id="kqv-kv-log8"),
]

CROP_SCHEMES = [
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=6), id="kqv"),
    pytest.param(QuantConfig("kv", 4, "kv", 4, residual_length=6), id="kv"),
    pytest.param(QuantConfig("qkqv", 3, "qkqv", 3, residual_length=6), id="qkqv"),
    pytest.param(QuantConfig("block", 4, "block", 4, residual_length=6), id="block"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=6, group=8), id="kivi"),
    pytest.param(QuantConfig("kqv", 4, residual_length=6), id="kqv-keyonly"),
    pytest.param(QuantConfig("headq", 2, residual_length=6, headq_base="kqv", bases="random"), id="headq-kqv"),
    pytest.param(QuantConfig("matched", 3, "matched", 3, residual_length=6, group=8, calibration="random"), id="matched"),
    pytest.param(
        QuantConfig("matched", 3, "matched", 3, residual_length=6, group=8, calibration="random", value_norms="log8"), id="matched-log8"
    ),
]


def _pair(cfg, k, v, layers=2):
    qc, dc = QuantizedKVCache(cfg, layers), DynamicCache()
    for i in range(layers):
        qc.update(k, v, i)
        dc.update(k, v, i)
    return qc, dc


def _dense_bytes(dc: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in dc.layers for t in (layer.keys, layer.values))
