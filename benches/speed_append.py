"""Python-to-Rust overhead of appending one token (part (b) of the harness).

The Rust work of one token is timed from a batch of 4096 rows through the native call (the
call's fixed cost spread over the rows); the Python calls that append one token are timed back
to back, and the difference is the overhead the binding and the Python layer add.
"""

from __future__ import annotations

import numpy as np
import torch
from kvqrs import _native
from kvqrs.hf import QuantConfig, QuantizedKVCache
from kvqrs.schemes import KVCodec
from speed_common import AttentionModule, best_of, per_call, table
from transformers import DynamicCache

HEAD_DIM, BITS, SEED = 128, 4, 1
BATCH = 4096


def _rust_per_token(x: np.ndarray) -> float:
    """Seconds per row of the native MSE encode + 4-bit packing on ``BATCH`` rows."""
    flat = np.ascontiguousarray(x).reshape(-1)

    def run():
        codes, _ = _native.mse_encode(flat, HEAD_DIM, BITS, SEED)
        _native.pack_bits(codes, HEAD_DIM, BITS)  # rows of head_dim codes (no padding at 128)

    return best_of(run, 20) / len(x)  # the least disturbed call: this is the reference


def _cache_update(cfg: QuantConfig | None, context: int, calls: int, clock) -> float:
    """Seconds per ``update`` of one decode token on one layer of SmolLM2-135M's shape (3 KV
    heads, head_dim 64) holding ``context`` tokens; the cache grows by one token per call. A
    ``QuantizedKVCache`` is first put into its decode state by one attention call, as the model
    does (only then does ``update`` hand back the window alone)."""
    rng = np.random.default_rng(0)
    kv = lambda t: torch.from_numpy(rng.standard_normal((1, 3, t, 64)).astype(np.float32))  # noqa: E731
    cache = DynamicCache() if cfg is None else QuantizedKVCache(cfg, 1)
    k, v = cache.update(kv(context), kv(context), 0)
    if cfg is not None:
        q = torch.from_numpy(rng.standard_normal((1, 9, 1, 64)).astype(np.float32))
        cache.attend(AttentionModule(0, 3), q, k, v, None, 64**-0.5)
    steps = [(kv(1), kv(1)) for _ in range(calls * 8 + 1)]
    it = iter(steps)
    return per_call(lambda: cache.update(*next(it), 0), calls, repeats=7, clock=clock)


def append_table(contexts: list[int], quick: bool) -> str:
    """Wall and thread-CPU microseconds per call; the overhead is the call's CPU time minus the
    Rust work of one token (wall time per row of a 4096-row call, which rayon may split). The
    cache rows run at each of ``contexts`` cached tokens: an update whose cost grows with the
    context would show here (the codes are appended in place, amortised O(1) per token)."""
    import time

    rng = np.random.default_rng(0)
    batch = rng.standard_normal((BATCH, HEAD_DIM)).astype(np.float32)
    one = batch[:1].copy()
    codec = KVCodec("kqv", BITS, HEAD_DIM, seed=SEED)
    calls, upd = (50, 10) if quick else (2000, 200)
    flat1 = one.reshape(-1)
    small = [
        (
            "one native call: _native.mse_encode, 1 row",
            lambda: _native.mse_encode(flat1, HEAD_DIM, BITS, SEED),
            calls,
            "the binding's floor",
        ),
        ("KVCodec.encode_keys, 1 token (kqv k4)", lambda: codec.encode_keys(one), calls, "smallest Python call appending a token"),
        ("KVCodec.encode_values, 1 token (kqv v4: 3-bit MSE + QJL)", lambda: codec.encode_values(one), calls // 4, "five kernel calls"),
    ]
    rust = _rust_per_token(batch)
    out = [("Rust: MSE encode + pack of one token (from a 4096-row call)", f"{rust * 1e6:.2f}", "", "", "")]
    for i, (name, fn, n, note) in enumerate(small):
        wall, cpu = per_call(fn, n), per_call(fn, n, clock=time.thread_time)
        out.append((name, f"{wall * 1e6:.2f}", f"{cpu * 1e6:.2f}", f"{(cpu - rust) * 1e6:.2f}" if i < 2 else "", note))
    cfgs = [
        ("DynamicCache.update (dense)", None),
        ("QuantizedKVCache.update, kqv k4 v4", QuantConfig("kqv", 4, "kqv", 4, residual_length=128)),
        ("QuantizedKVCache.update, kivi k4 v4", QuantConfig("kivi", 4, "kivi", 4, residual_length=128)),
    ]
    for ctx in contexts:
        for name, cfg in cfgs:
            wall, cpu = _cache_update(cfg, ctx, upd, time.perf_counter), _cache_update(cfg, ctx, upd, time.thread_time)
            out.append(
                (f"{name}, 1 token x 3 heads x 64, {ctx} cached", f"{wall * 1e6:.1f}", f"{cpu * 1e6:.1f}", "", "per layer per decode step")
            )
    return table(["call", "us (wall)", "us (thread CPU)", "overhead over the Rust work, us", "note"], out, "lrrrl")
