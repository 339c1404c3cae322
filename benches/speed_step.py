"""One layer's decode step in a loop and with the caches cold (the ``step`` section).

Inside ``model.generate`` a layer's attention runs after the rest of the model has passed its
weights through the CPU caches, and after the cache's worker threads slept through that work.
This section times one layer's decode step (``update`` of one token, then the attention of one
token's query rows) of SmolLM2-135M's shape (3 KV heads x 3 query heads each, head_dim 64) two
ways: back to back, and with 64 MiB of other memory written before each call (the caches cold,
the workers asleep). The dense row is ``DynamicCache.update`` plus torch SDPA on its float32
cache; the quantized rows are ``QuantizedKVCache`` (window ``--residual``, default 128) through
the kvqrs attention function's call (``cache.attend``: one native call that writes the step's
token, encodes a chunk leaving the window and attends over the codes, sinks and window).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from kvqrs.hf import QuantConfig, QuantizedKVCache
from speed_common import AttentionModule, table
from transformers import DynamicCache

HEADS, GROUPS, HEAD_DIM = 3, 3, 64
EVICT_BYTES = 64 << 20


def _layer(cfg: QuantConfig | None, context: int):
    """A one-layer cache holding ``context`` tokens, and ``step()``: one decode step on it."""
    rng = np.random.default_rng(0)
    kv = lambda t: torch.from_numpy(rng.standard_normal((1, HEADS, t, HEAD_DIM)).astype(np.float32))  # noqa: E731
    q = torch.from_numpy(rng.standard_normal((1, HEADS * GROUPS, 1, HEAD_DIM)).astype(np.float32))
    module, scale = AttentionModule(0, GROUPS), HEAD_DIM**-0.5
    cache = DynamicCache() if cfg is None else QuantizedKVCache(cfg, 1)
    k, v = cache.update(kv(context), kv(context), 0)
    new = kv(1)

    def dense_step():
        k, v = cache.update(new, new, 0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def coded_step():
        k, v = cache.update(new, new, 0)
        out = cache.attend(module, q, k, v, None, scale)
        if out is None:  # the cache did not serve this call: nothing of it would be timed
            raise RuntimeError("QuantizedKVCache.attend returned None on a decode step")
        return out

    if cfg is not None:
        cache.attend(module, q, k, v, None, scale)  # the decode state: update returns the window alone
    return dense_step if cfg is None else coded_step


def _times(step, calls: int, evict: np.ndarray | None) -> float:
    """Median seconds of ``calls`` steps, each after writing ``evict`` (None: back to back)."""
    out = []
    for _ in range(calls):
        if evict is not None:
            evict += 1.0
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def step_table(contexts: list[int], quick: bool, residual: int = 128) -> str:
    """Microseconds per layer per decode step, warm and cold, and each quantized row's speed
    against the dense row in the same state (dense time / row time); ``residual``: the
    quantized caches' full-precision window."""
    calls = 20 if quick else 200
    evict = np.zeros(EVICT_BYTES // 8)
    rows = [
        ("dense DynamicCache + SDPA", None),
        (f"QuantizedKVCache kqv k4 v4 (window {residual})", QuantConfig("kqv", 4, "kqv", 4, residual_length=residual)),
        (f"QuantizedKVCache kivi k4 v4 (window {residual})", QuantConfig("kivi", 4, "kivi", 4, residual_length=residual)),
    ]
    out = []
    for ctx in contexts:
        base = None
        for name, cfg in rows:
            step = _layer(cfg, ctx)
            _times(step, 5, None)
            warm, cold = _times(step, calls, None), _times(step, calls, evict)
            base = base or (warm, cold)
            out.append(
                (
                    str(ctx),
                    name,
                    f"{warm * 1e6:.0f}",
                    f"{cold * 1e6:.0f}",
                    f"{cold / warm:.2f}",
                    f"{base[0] / warm:.2f}x",
                    f"{base[1] / cold:.2f}x",
                )
            )
    return table(
        ["cached tokens", "cache", "warm us", "cold us", "cold / warm", "vs dense, warm", "vs dense, cold"],
        out,
        "rlrrrrr",
    )
