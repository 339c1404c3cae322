"""The scoreboard (the ``scoreboard`` section of the harness): every speed and memory target of
``QuantizedKVCache`` in ``model.generate`` beside its measured value and its bound, in one run.

Targets, for ``kqv`` 4/4, ``kivi`` 4/4 and the ``4bit`` preset (``matched``), SmolLM2-135M
float32, torch threads as :func:`kvqrs.hf.fastest_threads` chooses them:

- ``generate`` at the shortest context (1k by default) no slower than the dense
  ``DynamicCache`` with SDPA: tokens/s ratio >= 1.0;
- at the longer contexts (4k and 16k), >= 0.8 of the physical bound. The bound is dense's
  decode step time at that context over its step time at a 16-token context (measured in the
  same run, the same way): a KV cache that cost nothing to read could not beat dense by more;
- the cache update (one token, one layer of SmolLM2's shape) <= 20 us at every context;
- peak resident memory at the longest context: what grows during the row (the cache's keys and
  values and each step's temporaries, ``speed_generate``) <= 0.3x the dense row's.

The ``4bit`` preset row uses a calibration file (``kvqrs calibrate --preset 4bit``: per-layer
widths, as the preset is measured; without a file a preset is calibrated on the prompt); speed
does not depend on how well it was fitted, so when none is given the harness fits a small one
(1 window of 256 calibration tokens and 1 probe window) once and keeps it in ``~/.cache/kvqrs``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from kvqrs.hf import QuantConfig, QuantizedKVCache, fastest_threads
from speed_append import _cache_update
from speed_common import table
from speed_generate import _generate, _prefill
from transformers import DynamicCache

BOUND_CONTEXT = 16
SPEED_AT_SHORT, SHARE_OF_BOUND, UPDATE_US, RSS_SHARE = 1.0, 0.8, 20.0, 0.3
CALIBRATION = Path.home() / ".cache" / "kvqrs" / "bench-4bit-calibration.npz"


def preset_calibration(path: str | None) -> str:
    """The ``4bit`` calibration file: ``path``, else the harness's own (fitted once)."""
    if path is not None:
        return path
    if not CALIBRATION.exists():
        CALIBRATION.parent.mkdir(parents=True, exist_ok=True)
        kvqrs_cli = [sys.executable, "-m", "kvqrs.cli", "calibrate", "--preset", "4bit"]
        small = ["--windows", "1", "--probe-windows", "1", "--ctx", "256", "--no-progress", "--out", str(CALIBRATION)]
        print(f"(fitting a small 4bit calibration for the speed rows: {CALIBRATION})", flush=True)
        subprocess.run(kvqrs_cli + small, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return str(CALIBRATION)


def caches(layers: int, residual: int, calibration: str) -> list[tuple[str, QuantConfig, object]]:
    """``(label, config, cache factory)`` of the coded rows."""
    preset = QuantConfig.preset("4bit", calibration, residual_length=residual)
    configs = [
        (f"kqv k4 v4 (window {residual})", QuantConfig("kqv", 4, "kqv", 4, residual_length=residual)),
        (f"kivi k4 v4 (window {residual})", QuantConfig("kivi", 4, "kivi", 4, residual_length=residual)),
        (f"4bit preset, matched (window {residual})", preset),
    ]
    return [(label, cfg, (lambda c=cfg: QuantizedKVCache(c, layers))) for label, cfg in configs]


def _rates(model, ctx: int, new_tokens: int, rows, rounds: int) -> tuple[list[float], list[int]]:
    """Best tokens/s and peak RSS (bytes above the start) of dense SDPA (first) and each row at
    ``ctx`` tokens of context, rounds interleaved."""
    ids = torch.from_numpy(np.random.default_rng(ctx).integers(0, model.config.vocab_size, (1, ctx)))
    kv = _prefill(model, ids[:, :-1])
    makers = [("sdpa", DynamicCache)] + [("kvqrs", make) for _label, _cfg, make in rows]
    best, peak = [0.0] * len(makers), [0] * len(makers)
    for _ in range(rounds):
        for i, (attn, make) in enumerate(makers):
            rate, _toks, mem, _held = _generate(model, ids, kv, make, attn, new_tokens)
            best[i], peak[i] = max(best[i], rate), max(peak[i], mem)
    return best, peak


def _verdict(value: float, goal: float, at_least: bool) -> str:
    ok = value >= goal if at_least else value <= goal
    if ok:
        return "met"
    return f"missed by {goal / value:.2f}x" if at_least else f"missed by {value / goal:.2f}x"


def scoreboard(contexts: list[int], new_tokens: int, residual: int, rounds: int, threads: int | None, calibration: str | None) -> str:
    """Run every row and return the scoreboard (Markdown), the threads it ran with first."""
    from kvqrs.evaluation.model import load

    cal = preset_calibration(calibration)
    model, _ = load("float32")
    probe = torch.from_numpy(np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 64)))
    if threads is None:
        threads, timings = fastest_threads(model, probe)
        chosen = f"torch threads {threads} (fastest_threads: " + ", ".join(f"{n}: {s * 1e3:.0f} ms" for n, s in timings.items()) + ")"
    else:
        torch.set_num_threads(threads)
        chosen = f"torch threads {threads} (given)"
    layers = model.config.num_hidden_layers
    rows = caches(layers, residual, cal)
    t0 = time.perf_counter()
    short, _ = _rates(model, BOUND_CONTEXT, new_tokens, [], rounds)
    out = []
    for ctx in contexts:
        best, peak = _rates(model, ctx, new_tokens, rows, rounds)
        bound = short[0] / best[0]
        for (label, _cfg, _make), rate, mem in zip(rows, best[1:], peak[1:]):
            ratio = rate / best[0]
            if ctx == min(contexts):
                goal, target = SPEED_AT_SHORT, f">= {SPEED_AT_SHORT:.1f}x dense"
            else:
                goal, target = SHARE_OF_BOUND * bound, f">= {SHARE_OF_BOUND} x bound = {SHARE_OF_BOUND * bound:.2f}x"
            cells = ("generate tokens/s vs dense", ctx, label, f"{ratio:.2f}x ({rate:.2f} vs {best[0]:.2f})", f"{bound:.2f}x", target)
            out.append((*cells, _verdict(ratio, goal, True)))
            if ctx == max(contexts):
                share = mem / max(peak[0], 1)
                cells = (
                    "peak RSS growth vs dense",
                    ctx,
                    label,
                    f"{share:.2f}x ({mem / 2**20:.0f} vs {peak[0] / 2**20:.0f} MiB)",
                    "",
                    f"<= {RSS_SHARE}x",
                )
                out.append((*cells, _verdict(share, RSS_SHARE, False)))
    for ctx in contexts:
        for label, cfg, _make in rows:
            us = _cache_update(cfg, ctx, 200, time.perf_counter) * 1e6
            cells = ("cache update, us per layer per token", ctx, label, f"{us:.1f}", "", f"<= {UPDATE_US:.0f} us")
            out.append((*cells, _verdict(us, UPDATE_US, False)))
    head = (
        f"{chosen}; {new_tokens} greedy tokens per row, best of {rounds} interleaved rounds; bound: dense at "
        f"{BOUND_CONTEXT} tokens of context {short[0]:.2f} tokens/s over dense at the row's context; {time.perf_counter() - t0:.0f} s\n\n"
    )
    return head + table(["target", "context", "cache", "measured", "bound", "target value", "status"], out, "lrlrrll")
