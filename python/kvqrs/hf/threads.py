"""PyTorch's intra-op thread count for generation with a quantized cache.

torch starts one OpenMP thread per core. On idle cores that is fastest (two threads run
SmolLM2-135M's forward about 1.9x faster than one), but when another process keeps a core busy
the spinning workers slow small ops down badly (32 generated tokens: 42 s on two threads, 5 s on
one, measured on a shared 2-core machine). :func:`fastest_threads` measures instead of guessing;
``kvqrs eval`` calls it unless ``--threads`` is given. kvqrs' own kernels use a rayon pool sized
by ``RAYON_NUM_THREADS`` (read once, at the first parallel call); their results do not depend on it.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from .._arrays import KvqrsError, check_positive_int

if TYPE_CHECKING:
    import torch


def set_num_threads(n: int) -> int:
    """Set PyTorch's intra-op threads to ``n`` (>= 1) and return the previous count.

    Raises:
        KvqrsError: ``n`` is not a positive integer.
    """
    import torch

    n = check_positive_int(n, "n")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def fastest_threads(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[int, dict[int, float]]:
    """Time one forward of ``input_ids`` (``(batch, tokens)`` token ids) with one intra-op thread
    and with every core, keep the faster setting (``torch.set_num_threads``) and return it with
    the timings in seconds. A warm-up forward runs first (one-off allocations).

    Raises:
        KvqrsError: ``input_ids`` holds no tokens.
    """
    import torch

    if input_ids.ndim != 2 or input_ids.shape[-1] == 0:
        raise KvqrsError(f"input_ids: expected (batch, tokens) with at least one token, got shape {tuple(input_ids.shape)}")
    timings = {}
    with torch.no_grad():
        model(input_ids)
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        with torch.no_grad():
            start = time.perf_counter()
            model(input_ids)
            timings[n] = time.perf_counter() - start
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best, timings
