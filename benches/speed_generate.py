"""``model.generate`` tokens per second on SmolLM2-135M, dense cache against
``QuantizedKVCache`` (part (c) of the harness).

For each context length the prompt (seeded random token ids) is prefilled once, in chunks,
into a dense cache; every row then starts from a copy of those keys and values (a
``QuantizedKVCache`` receives them through ``update`` and one attention read per layer, as in
a prefill forward, and quantizes all but its full-precision window) and generates ``new_tokens`` greedy tokens. The rate is taken
between the first and the last generated token (a logits processor stamps each step), so
neither the prefill nor the first step (which for ``QuantizedKVCache`` decodes the cache once
before the fused path engages) is counted.

Memory: before each row, freed heap is handed back to the system (``malloc_trim``), so that
memory a previous row freed is not counted as already resident; a thread then samples the
resident set (``/proc/self/statm``) every millisecond from just before the cache is made until
``generate`` returns. The row reports the peak above the resident set at the start (the model
and the shared prompt keys and values are already there, so what grows is the cache's own keys
and values plus the temporaries of loading it and of each step), its ratio to the dense SDPA
row's, and the bytes the cache itself holds at the end (``QuantizedKVCache.nbytes``; the dense
layers' tensors).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import torch
from kvqrs.hf import QuantConfig, QuantizedKVCache
from kvqrs.hf.heap import release_freed
from speed_common import AttentionModule, row, table
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

PREFILL_CHUNK = 1024


class _Stamps(LogitsProcessor):
    """Records the time of every generation step."""

    def __init__(self):
        self.t: list[float] = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def _cache_bytes(cache) -> int:
    """Bytes of keys and values the cache holds."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


class _PeakRss:
    """Peak resident set size, in bytes above the size at entry, sampled by a thread."""

    PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, period_s: float = 1e-3):
        self.period_s, self.peak = period_s, 0

    @classmethod
    def rss(cls) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * cls.PAGE

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss() - self.start)
            self._stop.wait(self.period_s)

    def __enter__(self) -> _PeakRss:
        gc.collect()
        release_freed()  # freed heap back to the system first
        self.start, self._stop = self.rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss() - self.start)


def _prefill(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values of every layer after the prompt, computed with SDPA in chunks."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache()
    with torch.no_grad():
        for s in range(0, ids.shape[1], PREFILL_CHUNK):
            model(ids[:, s : s + PREFILL_CHUNK], past_key_values=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _generate(model, ids, kv, make, attn: str, new_tokens: int) -> tuple[float, torch.Tensor, int, int]:
    """Tokens per second of ``new_tokens`` greedy steps from ``kv`` loaded into a cache from
    ``make()``, the generated tokens, the peak resident bytes above the start and the bytes the
    cache holds at the end."""
    with _PeakRss() as mem:
        cache = make()
        rate, toks = _run(model, ids, kv, cache, attn, new_tokens)
    return rate, toks, mem.peak, _cache_bytes(cache)


def _load(model, kv, cache) -> None:
    """Hand the prompt's keys and values to ``cache`` layer by layer as a prefill forward
    does: ``update``, then (a ``QuantizedKVCache``) the layer's attention read, by one query
    row (a prefill's attention reads the originals of the tokens it flushed, which the layer
    then lets go)."""
    cfg = model.config
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    for i, (k, v) in enumerate(kv):
        k_out, v_out = cache.update(k, v, i)
        if isinstance(cache, QuantizedKVCache):
            q = torch.zeros(k.shape[0], heads, 1, getattr(cfg, "head_dim", None) or d)
            cache.attend(AttentionModule(i, heads // k.shape[1]), q, k_out, v_out, None, q.shape[-1] ** -0.5)


def _run(model, ids, kv, cache, attn: str, new_tokens: int) -> tuple[float, torch.Tensor]:
    _load(model, kv, cache)
    model.set_attn_implementation(attn)
    stamps = _Stamps()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([stamps]),
            pad_token_id=model.config.eos_token_id,
        )
    t = stamps.t
    return (len(t) - 1) / (t[-1] - t[0]), out[0, ids.shape[1] :]


def rows_for(layers: int, residual: int) -> list[tuple[str, str, object]]:
    """``(label, attention implementation, cache factory)`` of every row."""
    return [
        ("dense DynamicCache, SDPA", "sdpa", DynamicCache),
        ("dense DynamicCache, eager", "eager", DynamicCache),
        (
            f"QuantizedKVCache kqv k4 v4 (window {residual})",
            "kvqrs",
            lambda: QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=residual), layers),
        ),
        (
            f"QuantizedKVCache kivi k4 v4 (window {residual})",
            "kvqrs",
            lambda: QuantizedKVCache(QuantConfig("kivi", 4, "kivi", 4, residual_length=residual), layers),
        ),
    ]


def generation_table(contexts: list[int], new_tokens: int, residual: int, rounds: int = 2) -> None:
    """Print the table context by context (a 16k-token prefill takes minutes). The rows of a
    context run ``rounds`` times, interleaved (dense, quantized, ..., dense, quantized, ...), and
    each keeps its best rate: single runs of the dense row alone varied by 25% here."""
    from kvqrs.evaluation.model import load

    model, _ = load("float32")
    layers = model.config.num_hidden_layers
    rng = np.random.default_rng(0)
    heads = [
        "context",
        "cache",
        "tokens/s",
        "vs dense SDPA",
        "tokens equal to dense",
        "peak RSS above start MiB",
        "vs dense",
        "cache MiB",
        "shared prefill s",
    ]
    print(table(heads, [], "rlrrrrrrr"), flush=True)
    for ctx in contexts:
        ids = torch.from_numpy(rng.integers(0, model.config.vocab_size, (1, ctx)))
        t0 = time.perf_counter()
        kv = _prefill(model, ids[:, :-1])
        prefill_s = time.perf_counter() - t0
        rows = rows_for(layers, residual)
        best: list[float] = [0.0] * len(rows)
        peak: list[int] = [0] * len(rows)
        held: list[int] = [0] * len(rows)
        tokens: list[torch.Tensor | None] = [None] * len(rows)
        for _ in range(max(1, rounds)):
            for i, (_label, attn, make) in enumerate(rows):
                rate, toks, mem, held[i] = _generate(model, ids, kv, make, attn, new_tokens)
                best[i], tokens[i], peak[i] = max(best[i], rate), toks, max(peak[i], mem)
        for i, (label, _attn, _make) in enumerate(rows):
            same = int((tokens[i] == tokens[0]).cumprod(0).sum())
            mib, ratio = peak[i] / 2**20, peak[i] / max(peak[0], 1)
            cells = (
                ctx,
                label,
                f"{best[i]:.2f}",
                f"{best[i] / best[0]:.2f}x",
                f"{same}/{new_tokens}",
                f"{mib:.0f}",
                f"{ratio:.2f}x",
                f"{held[i] / 2**20:.1f}",
                f"{prefill_s:.0f}",
            )
            print(row(cells), flush=True)
        del kv
    model.set_attn_implementation("kvqrs")
