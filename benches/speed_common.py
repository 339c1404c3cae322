"""Shared pieces of the speed harness (``benches/bench_speed.py``): the machine description
printed above every table, timing, and Markdown tables."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any, Callable


def _first(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _l3() -> str:
    """Size of the last-level cache, as lscpu reports it."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    sizes = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(("L3 cache", "L2 cache"))]
    return sizes[-1] if sizes else "unknown"


def machine(threads: int) -> str:
    """One line: CPU model, cores, LLC, RAM, load average, thread counts, kvqrs' dispatch summary
    (each primitive's path and why), versions."""
    import kvqrs
    import kvqrs._native
    import numpy as np
    import torch

    cpu = _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    mem = _first("/proc/meminfo", "MemTotal")
    ram = f"{int(mem.split()[0]) / 2**20:.0f} GiB" if mem else "unknown"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rayon = os.environ.get("RAYON_NUM_THREADS", f"default ({os.cpu_count()})")
    return (
        f"machine: {cpu}, {os.cpu_count()} logical CPUs, LLC {_l3()}, RAM {ram}, load average {load}; "
        f"threads: torch {threads} (OpenMP wait policy {os.environ.get('OMP_WAIT_POLICY', 'default: spin, then sleep')}), kvqrs rayon {rayon}; kvqrs {kvqrs.__version__} ({kvqrs.simd_summary()}), "
        f"numpy {np.__version__}, torch {torch.__version__}, Python {platform.python_version()}"
    )


def best_of(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None, budget_s: float = 20.0) -> float:
    """Smallest wall time in seconds of up to ``repeats`` calls of ``fn`` after one warm-up call
    (``setup``, untimed, runs before each call); stops early once ``budget_s`` seconds were spent
    (at least one timed call), so that the slow baselines do not dominate the run. The minimum
    is the least disturbed run on a shared machine."""
    times: list[float] = []
    spent = 0.0
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        spent += dt
        if i:
            times.append(dt)
            if spent > budget_s:
                break
    return min(times)


def per_call(fn: Callable[[], Any], calls: int, repeats: int = 7, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``calls`` back-to-back calls
    (for microsecond-scale calls). ``clock=time.thread_time`` counts the calling thread's CPU
    time only: robust to other processes on a shared machine (equal to wall time on an idle
    one), but blind to work handed to other threads."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        runs.append((clock() - t0) / calls)
    return statistics.median(runs)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A Markdown table; ``align`` is one character per column (``l`` or ``r``), default:
    first column left, the rest right."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += [row(r) for r in rows]
    return "\n".join(lines)


def row(cells: Sequence[Any]) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def gbs(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class AttentionModule:
    """What the kvqrs attention function reads from a transformers attention module: its
    layer and its query heads per KV head."""

    def __init__(self, layer_idx: int = 0, groups: int = 3):
        self.layer_idx, self.num_key_value_groups = layer_idx, groups
