"""``kvqrs eval --task needle``: long-context retrieval through the real cache.

A passkey retrieval test (Mohtashami and Jaggi, "Landmark Attention", 2023; the "needle in a
haystack" layout of G. Kamradt, 2023): a 5-digit pass key is stated once inside natural filler
text taken from the evaluation corpus, at a chosen depth (fraction of the filler before it), and
the chat-templated question at the end asks for it. The model answers by greedy ``generate``
with the KV cache under test (``QuantizedKVCache`` for a quantized row, ``DynamicCache`` for
dense): a chunked prefill of the whole prompt, then token-by-token decode reading the stored
codes. An answer is correct when its first run of digits is exactly the pass key.

Prompts are built in token ids so that each has exactly the stated number of tokens; every
(context, depth, trial) has its own seed, so all rows see the same prompts.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from .._arrays import KvqrsError
from ..hf import QuantConfig, QuantizedKVCache
from ..hf.attention import active, sdpa_prefill
from ..hf.config import PRESETS
from .model_eval import Row

INSTRUCTION = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. I will ask you about it."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"
"""The assistant turn starts with these words (prefilled), so the first generated tokens are the key."""

KEY_DIGITS = 5
MAX_NEW_TOKENS = 8
"""A 5-digit key is 5 tokens (SmolLM2's tokenizer splits digits), plus a leading space and a period."""
MAX_POSITIONS = 8192
"""SmolLM2-135M's trained context (``max_position_embeddings``)."""
PREFILL_CHUNK = 1024
"""Prompt tokens per prefill forward (transformers' ``prefill_chunk_size``): bounds the eager
attention's logits to ``heads x 1024 x context`` floats."""

CONTEXTS = (1000, 2000, 4000, 8000)
DEPTHS = (0.0, 0.5, 1.0)
TRIALS = 2
QUICK_CONTEXTS = (1000,)
QUICK_DEPTHS = (0.25, 0.75)
QUICK_TRIALS = 2
PREFILLS = ("sdpa", "eager")
"""How the prompt's attention is computed during prefill: ``sdpa`` (the default,
:func:`kvqrs.hf.sdpa_prefill`: the same softmax over the same keys and values, by blocked SDPA)
or ``eager`` (logits materialized, as the decode-time reference)."""

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")
_SENTINEL = "\x00NEEDLE-CONTENT\x00"


def needle_rows(residual_length: int = 0, quick: bool = False, calibrations: dict | None = None) -> list[Row]:
    """Rows of the retrieval table: dense; kqv, kivi and block with keys and values at 4 and at
    2 bits (quick: dense, kqv 4/4, kivi 2/2); then, per entry of ``calibrations`` (``{preset
    name: {layer: MatchedCalibration}}``, see :func:`preset_calibrations`), the ``matched``
    preset row ``matched 4bit`` etc. (:meth:`QuantConfig.preset`). A row is a label and a
    :class:`QuantConfig`; adding a scheme is one more entry here."""
    r = residual_length
    rows = [Row("dense", None, "dense")]
    for scheme in ("kqv", "kivi", "block"):
        for n in (4, 2):
            rows.append(Row(f"{scheme} k{n} v{n}", QuantConfig(scheme, n, scheme, n, residual_length=r), "full KV"))
    if quick:
        rows = [row for row in rows if row.name in ("dense", "kqv k4 v4", "kivi k2 v2")]
    for name in sorted(calibrations or {}, key=lambda n: -PRESETS[n]["budget"]):
        rows.append(Row(f"matched {name}", QuantConfig.preset(name, calibrations[name], residual_length=r), "preset"))
    return rows


def preset_calibrations(paths) -> dict:
    """``{preset name: calibration}`` from ``kvqrs calibrate --preset NAME`` files (the preset
    each was fitted for is recorded in it). Raises :class:`KvqrsError` for a file fitted for no
    preset, or a preset given twice."""
    from ..hf.calibration import calibration_meta, load_matched

    out: dict = {}
    for path in paths:
        name = calibration_meta(path).get("preset")
        if name not in PRESETS:
            raise KvqrsError(
                f"--calibration: {str(path)!r} was not fitted for a preset; write it with `kvqrs calibrate --preset NAME` "
                f"(NAME one of {', '.join(sorted(PRESETS))})"
            )
        if name in out:
            raise KvqrsError(f"--calibration: two files for the {name} preset")
        out[name] = load_matched(path)
    return out


@dataclass(frozen=True)
class NeedlePrompt:
    """One prompt: ``ids`` (1, context) int64, the pass key, the requested depth and where the
    needle landed: ``needle_start`` / ``needle_len`` in ``ids``, the filler span
    ``filler_start .. filler_start + filler_len`` (the needle sits inside it) and ``offset``, the
    corpus token where the filler begins."""

    ids: torch.Tensor
    key: str
    context: int
    depth: float
    seed: int
    needle_start: int
    needle_len: int
    filler_start: int
    filler_len: int
    offset: int

    @property
    def actual_depth(self) -> float:
        """Fraction of the filler tokens before the needle."""
        return (self.needle_start - self.filler_start) / self.filler_len


class Haystack:
    """Builds passkey prompts from a tokenizer with a chat template and a filler corpus.

    The corpus is tokenized once; the filler of a prompt is a contiguous run of its tokens that
    starts after a sentence end and ends at a sentence or line end. The needle goes in at the
    last sentence or line end at or before ``round(depth * filler_len)`` (Kamradt's placement),
    so it never splits a sentence.

    Raises :class:`KvqrsError` if the tokenizer has no chat template, or the corpus is shorter
    than the filler a prompt needs.
    """

    def __init__(self, tokenizer, corpus: str, source: str = "corpus"):
        if not getattr(tokenizer, "chat_template", None):
            raise KvqrsError("tokenizer: the needle task needs a chat template (an instruct model)")
        self.tokenizer, self.source = tokenizer, source
        self.corpus = np.asarray(tokenizer(corpus, add_special_tokens=False).input_ids, dtype=np.int64)
        self.opens, self.boundary = self._sentence_boundaries()
        head, tail = self._template()
        self.head = self._encode(head + INSTRUCTION)
        self.tail = self._encode(QUESTION + tail + ANSWER_PREFIX)

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False).input_ids, dtype=np.int64)

    def _template(self) -> tuple[str, str]:
        """The chat template's text before and after the user message (with the assistant's
        generation prompt)."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True)
        head, sep, tail = text.partition(_SENTINEL)
        if not sep:
            raise KvqrsError("tokenizer: its chat template does not reproduce the user message")
        return head, tail

    def _sentence_boundaries(self) -> tuple[np.ndarray, np.ndarray]:
        """``(opens, boundary)``, both of ``len(corpus) + 1``. ``opens[i]``: a sentence ends just
        before corpus token ``i`` and token ``i`` opens the next one with a space (a filler
        starts there). ``boundary[i]``: that, or token ``i - 1`` ends a line (a needle may go in
        there: lists and headings have no sentence ends); ``boundary[len]`` when the corpus ends
        a sentence or a line."""
        ids = np.unique(self.corpus)
        texts = self.tokenizer.batch_decode(ids[:, None])
        ends = np.isin(self.corpus, ids[[bool(_SENTENCE_END.search(t)) for t in texts]])
        spaced = np.isin(self.corpus, ids[[t.startswith(" ") and t[1:2].strip() != "" for t in texts]])
        lines = np.isin(self.corpus, ids[[t.endswith("\n") for t in texts]])
        opens = np.zeros(len(self.corpus) + 1, dtype=bool)
        opens[1:-1] = ends[:-1] & spaced[1:]
        boundary = opens.copy()
        boundary[1:] |= lines
        boundary[-1] |= bool(ends[-1]) if len(ends) else False
        return opens, boundary

    def needle(self, key: str) -> np.ndarray:
        return self._encode(NEEDLE.format(key=key))

    def build(self, context: int, depth: float, seed: int) -> NeedlePrompt:
        """The prompt of ``context`` tokens with the needle at ``depth`` (0 = right after the
        instruction, 1 = right before the question), from the seeded key and filler offset. The
        filler is whole sentences: it starts after a sentence end and ends with one."""
        if not 0.0 <= depth <= 1.0:
            raise KvqrsError(f"depth: expected a fraction in [0, 1], got {depth}")
        rng = np.random.default_rng(seed)
        key = str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)))
        needle = self.needle(key)
        n = context - len(self.head) - len(self.tail) - len(needle)
        if n < 1:
            raise KvqrsError(f"context: expected more than {context - n} tokens (the template, question and needle), got {context}")
        starts = np.flatnonzero(self.opens[: len(self.corpus) - n + 1] & self.boundary[n:])
        if len(starts) == 0:
            raise KvqrsError(
                f"text: the filler corpus ({self.source}, {len(self.corpus)} tokens) has no run of whole sentences "
                f"of the {n} filler tokens needed"
            )
        offset = int(starts[rng.integers(len(starts))])
        filler = self.corpus[offset : offset + n]
        cut = np.flatnonzero(self.boundary[offset : offset + int(round(depth * n)) + 1])
        at = int(cut[-1])  # offset itself is a boundary, so cut is never empty
        ids = np.concatenate([self.head, filler[:at], needle, filler[at:], self.tail])
        return NeedlePrompt(
            ids=torch.from_numpy(ids)[None],
            key=key,
            context=context,
            depth=depth,
            seed=seed,
            needle_start=len(self.head) + at,
            needle_len=len(needle),
            filler_start=len(self.head),
            filler_len=n,
            offset=offset,
        )


def cell_seed(seed: int, context: int, depth_index: int, trial: int) -> int:
    """The seed of one prompt: the same for every row, distinct per (context, depth, trial)."""
    return int(np.random.SeedSequence([seed, context, depth_index, trial]).generate_state(1)[0])


def answer_digits(answer: str) -> str | None:
    """The first run of digits in ``answer``, or None."""
    m = re.search(r"\d+", answer)
    return m.group(0) if m else None


def is_correct(answer: str, key: str) -> bool:
    """Exact match: the answer's first run of digits is the key (``"48213."`` and
    ``" 48213 is the pass key"`` are right; ``"4821"``, ``"482130"`` and ``"The key"`` are not)."""
    return answer_digits(answer) == key


def make_cache(model, config: QuantConfig | None):
    """A fresh cache for one generation: ``DynamicCache`` (dense) or ``QuantizedKVCache``."""
    if config is None:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=model.config)
    return QuantizedKVCache(config, model.config.num_hidden_layers)


def cache_nbytes(cache) -> int:
    """Bytes the cache holds: ``QuantizedKVCache.nbytes`` or the dense tensors of a ``DynamicCache``."""
    if isinstance(cache, QuantizedKVCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def retrieve(model, tokenizer, prompt: NeedlePrompt, config: QuantConfig | None, prefill: str = "sdpa", cache=None) -> dict:
    """Greedy ``generate`` of the answer to one prompt through a fresh cache (or ``cache``,
    empty); returns the answer text, whether it is right, the cache's bytes per token after
    generation, and seconds. ``prefill``: see :data:`PREFILLS`."""
    if prefill not in PREFILLS:
        raise KvqrsError(f"prefill: expected one of {PREFILLS}, got {prefill!r}")
    cache = make_cache(model, config) if cache is None else cache
    start = time.perf_counter()
    # no outer attention state serves a layer the cache declines
    with torch.no_grad(), active(None), sdpa_prefill(prefill == "sdpa"):
        out = model.generate(
            prompt.ids,
            attention_mask=torch.ones_like(prompt.ids),
            cache=cache,
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            prefill_chunk_size=PREFILL_CHUNK,
            pad_token_id=tokenizer.eos_token_id,
        )
    seconds = time.perf_counter() - start
    answer = tokenizer.decode(out[0, prompt.context :], skip_special_tokens=True)
    return {
        "answer": answer,
        "digits": answer_digits(answer),
        "correct": is_correct(answer, prompt.key),
        "cache_bytes_per_token": cache_nbytes(cache) / cache.get_seq_length(),
        "seconds": seconds,
    }


def trial_key(row: str, context: int, depth: float, seed: int, prefill: str) -> tuple:
    """What identifies one logged generation: the row label and the prompt (context, depth,
    seed) under one prefill."""
    return (row, int(context), float(depth), int(seed), prefill)


def read_trials(paths) -> dict:
    """``{trial_key: generation}`` from the JSON-lines logs of :func:`run_needle` (``--resume``);
    a later line wins. Raises :class:`KvqrsError` for a missing file or a line that is not a
    logged generation."""
    import json

    out = {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            raise KvqrsError(f"--resume: cannot read {str(path)!r}: {e}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                t = json.loads(line)
                out[trial_key(t["row"], t["context"], t["depth"], t["seed"], t["prefill"])] = t
            except (ValueError, KeyError, TypeError) as e:
                raise KvqrsError(f"--resume: {str(path)!r} line {n} is not a logged needle generation ({e})") from None
    return out


def check_grid(contexts, depths, trials: int, positions: int = MAX_POSITIONS) -> None:
    """Refuse a grid the model cannot run: contexts beyond its trained ``positions`` (less the
    answer), depths outside [0, 1], no trials."""
    if trials < 1:
        raise KvqrsError(f"--trials: expected a positive integer, got {trials}")
    for c in contexts:
        if not 1 <= c <= positions - MAX_NEW_TOKENS:
            raise KvqrsError(
                f"--contexts: expected 1 .. {positions - MAX_NEW_TOKENS} tokens (the model's {positions} positions less the answer), got {c}"
            )
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise KvqrsError(f"--depths: expected fractions in [0, 1], got {d}")


def machine_line() -> str:
    """CPU model, logical CPUs, load average, torch threads and kvqrs' dispatch summary, for the
    report."""
    import os
    import pathlib
    import platform

    from .._native import simd_summary

    info = pathlib.Path("/proc/cpuinfo")
    names = (
        [line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("model name")] if info.exists() else []
    )
    cpu = names[0] if names else platform.processor() or platform.machine()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, load average {load}, torch {torch.get_num_threads()} thread(s), torch {torch.__version__}; "
        f"kvqrs {simd_summary()}"
    )


def run_needle(
    model,
    tokenizer,
    texts,
    rows: list[Row],
    contexts,
    depths,
    trials: int,
    seed: int = 0,
    progress: bool = True,
    prefill: str = "sdpa",
    log=None,
    reuse: dict | None = None,
) -> dict:
    """Every row on every (context, depth, trial) prompt; returns ``{"rows": [...], "cells":
    [...], "trials": [...], ...}``: per row the overall accuracy, per (row, context, depth) the
    accuracy over trials, and every generation.

    The prompts run shortest context first, every row at a context before the next context,
    so that an interrupted run has whole contexts. ``log``: a path; each generation is appended
    to it as a JSON line as soon as it ends. ``reuse``: generations from such logs
    (:func:`read_trials`); a prompt whose (row, context, depth, seed, prefill) is among them is
    not generated again, its logged generation counts."""
    import json

    from tqdm import tqdm

    check_grid(contexts, depths, trials)
    if prefill not in PREFILLS:
        raise KvqrsError(f"prefill: expected one of {PREFILLS}, got {prefill!r}")
    hay = Haystack(tokenizer, texts.evaluation, texts.source)
    prompts = [hay.build(c, d, cell_seed(seed, c, i, t)) for c in contexts for i, d in enumerate(depths) for t in range(trials)]
    reuse = reuse or {}
    runs, rows_out, cells = [], [], []
    done: dict[str, list] = {row.name: [] for row in rows}
    bar = tqdm(total=len(rows) * len(prompts), desc="needle", unit="prompt", disable=not progress)
    for c in contexts:
        for row in rows:
            mine = done[row.name]
            for p in (p for p in prompts if p.context == c):
                t = reuse.get(trial_key(row.name, p.context, p.depth, p.seed, prefill))
                if t is None:
                    r = retrieve(model, tokenizer, p, row.config, prefill)
                    t = {"row": row.name, "context": p.context, "depth": p.depth, "actual_depth": p.actual_depth, "key": p.key}
                    t.update(seed=p.seed, prefill=prefill, **r)
                    if log is not None:
                        with open(log, "a") as f:
                            f.write(json.dumps(t) + "\n")
                mine.append(t)
                bar.update()
                bar.set_postfix(row=row.name, context=c, acc=f"{np.mean([m['correct'] for m in mine]):.2f}")
    for row in rows:
        mine = done[row.name]
        runs += mine
        for c in contexts:
            for d in depths:
                hits = [m["correct"] for m in mine if m["context"] == c and m["depth"] == d]
                cells.append(
                    {
                        "row": row.name,
                        "context": c,
                        "depth": d,
                        "trials": len(hits),
                        "correct": sum(hits),
                        "accuracy": sum(hits) / len(hits),
                    }
                )
        longest = [m for m in mine if m["context"] == max(contexts)]
        rows_out.append(
            {
                "row": row.name,
                "group": row.group,
                "accuracy": float(np.mean([m["correct"] for m in mine])),
                **{f"acc_{c}": float(np.mean([m["correct"] for m in mine if m["context"] == c])) for c in contexts},
                "cache_bytes_per_token": float(np.mean([m["cache_bytes_per_token"] for m in longest])),
                "seconds": float(sum(m["seconds"] for m in mine)),
            }
        )
    bar.close()
    return {
        "rows": rows_out,
        "cells": cells,
        "trials": runs,
        "contexts": list(contexts),
        "depths": list(depths),
        "trials_per_cell": trials,
        "seed": seed,
        "source": texts.source,
        "needle": NEEDLE.strip(),
        "question": QUESTION.strip(),
        "answer_prefix": ANSWER_PREFIX,
        "max_new_tokens": MAX_NEW_TOKENS,
        "prefill_chunk": PREFILL_CHUNK,
        "prefill": prefill,
    }
