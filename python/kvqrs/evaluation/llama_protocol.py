"""``kvqrs eval --protocol llama``: llama.cpp's perplexity protocol, so that every kvqrs row sits
beside llama.cpp's quantized-cache numbers on the same model, text and scored tokens.

The text is tokenized once and cut into consecutive chunks of ``ctx`` tokens; each chunk is
evaluated from an empty cache in one pass in which every key and value is read quantized (the
prefill of a cache that holds the whole chunk: no full-precision window; sinks only where the
row says so, and counted); the predictions of positions ``ctx/2 .. ctx-2`` are scored (llama.cpp
``tools/perplexity/perplexity.cpp``: the last ``ctx/2 - 1`` of each chunk). Per row: perplexity,
KL of the next-token distribution against the unquantized model per scored token (mean, 99th
percentile, max), the rate at which the argmax agrees, and bits per element with every stored
byte counted (codes, norms, scales, zero points, and the sink tokens in full precision).
"""

from __future__ import annotations

import csv
import json
import math
import pathlib
from dataclasses import dataclass

import numpy as np
import torch

from .._arrays import KvqrsError
from ..hf import QuantConfig, fake_quant
from ..hf.attention import active
from ..schemes.width_classes import unit_weights
from . import trellis
from .capture import Recorder
from .channel import SIDES, channel_wrap
from .model import DEFAULT_NAME
from .model_report import model_title

LLAMA_CPP = [
    # llama.cpp's own numbers on this protocol (SmolLM2-135M-Instruct Q4_1 GGUF, wiki.test.raw,
    # ctx 512, 40 chunks), measured with its perplexity tool: label, bits/element, ppl, excess, KL, same top.
    ("llama.cpp f16 / f16 (its reference)", 16.0, 23.568, None, None, None),
    ("llama.cpp q8_0 / q8_0", 8.5, 23.601, 0.0014, 0.0040, 0.959),
    ("llama.cpp q8_0 / q4_0, rotation", 6.5, 23.630, 0.0026, 0.0106, 0.940),
    ("llama.cpp q4_1 / q4_1, rotation", 5.0, 24.438, 0.0369, 0.0401, 0.880),
    ("llama.cpp iq4_nl / iq4_nl, rotation", 4.5, 24.474, 0.0384, 0.0409, 0.882),
    ("llama.cpp q4_0 / q4_0, rotation", 4.5, 24.782, 0.0515, 0.0482, 0.872),
    ("llama.cpp q4_0 / q4_0, no rotation", 4.5, 27.790, 0.179, 0.1438, 0.789),
]
"""llama.cpp's rows, measured with its own tool (the commands are in docs/evaluation.md); they
are quoted beside the kvqrs rows, never recomputed here."""


@dataclass(frozen=True)
class LlamaRow:
    """One row: a label and its config (None = dense). ``channel``: the side (``keys``,
    ``values`` or ``both``) passed through the Gaussian test channel at the config's widths
    instead of its coder (:mod:`kvqrs.evaluation.channel`), or coded by the prototype trellis
    (``trellis-keys``, ``trellis-values``, ``trellis-both``: :mod:`kvqrs.evaluation.trellis`);
    None: the codec itself."""

    name: str
    config: QuantConfig | None
    channel: str | None = None


def llama_rows(calibration: dict | None = None) -> list[LlamaRow]:
    """The rows compared with llama.cpp: the baselines of every scheme at 4, 3 and 2 bits, and
    the ``matched`` presets with each of their techniques alone."""
    rows = [
        LlamaRow("dense", None),
        LlamaRow("kivi k4 v4", QuantConfig("kivi", 4, "kivi", 4)),
        LlamaRow("block k4 v4", QuantConfig("block", 4, "block", 4)),
        LlamaRow("kqv k4", QuantConfig("kqv", 4)),
        LlamaRow("kqv k4 v4", QuantConfig("kqv", 4, "kqv", 4)),
        LlamaRow("kv k4 v4 (rotation-free MSE)", QuantConfig("kv", 4, "kv", 4)),
        LlamaRow("kivi k2 v2", QuantConfig("kivi", 2, "kivi", 2)),
        LlamaRow("kqv k3 v3", QuantConfig("kqv", 3, "kqv", 3)),
        # No calibration file: each chunk's prefill calibrates the layers (channel transform),
        # the calibration counted in the bits as side information of the chunk.
        LlamaRow(
            "matched k4 g256 v4 sinks:1 self-calibrated",
            QuantConfig("matched", 4, "matched", 4, group=256, sink_tokens=1, calibration="prefill"),
        ),
        # The presets as QuantConfig.preset(name) gives them without a file: calibrated on
        # each chunk's prefill, equal widths (a file adds per-layer widths).
        *(LlamaRow(f"{name} preset, prompt-calibrated", QuantConfig.preset(name)) for name in ("4bit", "3bit", "2bit")),
    ]
    if calibration is not None:
        rows += matched_rows(calibration)
    return rows


def matched_rows(calibration: dict) -> list[LlamaRow]:
    """The ``matched`` rows: ``calibration`` maps ``(key code bits, key scale group)`` to
    ``{layer: MatchedCalibration}`` fitted at that budget. Values take the Lloyd-Max width
    ``ceil(bits)``; each budget also gets its keys-only and its sink-free row (each technique's
    effect alone)."""
    out = []
    for bits, group in sorted(calibration, reverse=True):
        cal = calibration[bits, group]
        vb = max(1, math.ceil(bits))
        g = "" if group == 128 else f" g{group}"
        kw = {"group": group, "calibration": cal}
        out.append(LlamaRow(f"matched k{bits:g}{g} v{vb} sinks:1", QuantConfig("matched", vb, "matched", vb, sink_tokens=1, **kw)))
        out.append(LlamaRow(f"matched k{bits:g}{g} sinks:1 (keys only)", QuantConfig("matched", vb, None, sink_tokens=1, **kw)))
        out.append(LlamaRow(f"matched k{bits:g}{g} v{vb} (no sinks)", QuantConfig("matched", vb, "matched", vb, **kw)))
    return out


def file_row(path, value_scale: str | None = None) -> LlamaRow:
    """The row of a ``kvqrs calibrate`` file: the group, sinks, sink dtype, value norms and value
    scale it records (:func:`kvqrs.hf.calibration.recorded_settings`, as ``QuantConfig`` applies
    them), values at its per-layer widths (``--budget``) or at ``ceil(bits)``, storing
    ``value_scale`` per value token instead of the file's when given
    (:data:`kvqrs.kernels.mse.SCALES`)."""
    from ..hf import load_matched

    cal = load_matched(path)
    meta = cal.meta
    try:
        bits = float(meta.get("bits", meta.get("budget", 4)))
    except ValueError:
        raise KvqrsError(f"calibration: {str(path)!r} has unreadable metadata {meta}") from None
    vb = max(1, math.ceil(bits))
    what = f"budget {meta['budget']}, per-layer widths" if "budget" in meta else f"k{bits:g} v{vb}"
    config = QuantConfig("matched", vb, "matched", vb, calibration=cal, **({} if value_scale is None else {"value_scale": value_scale}))
    scale, norms, sink_dtype = config.value_scale, config.value_norms, config.sink_dtype
    tags = {"norm": "", "least_squares": " ls-scale"}.get(scale, f" {scale}") + (f" {norms}-norms" if norms != "float" else "")
    tags += f" {sink_dtype}-sinks" if sink_dtype else ""
    tags += " a2-classes" if any(c.value_classes for c in cal.values()) else ""
    label = f"matched {what} g{config.group} sinks:{config.sink_tokens}{tags} ({pathlib.Path(path).name})"
    return LlamaRow(label, config)


def channel_rows(row: LlamaRow, sides: list[str]) -> list[LlamaRow]:
    """``row`` (a ``matched`` row) with each of ``sides`` passed through the Gaussian test channel
    (:data:`kvqrs.evaluation.channel.SIDES`) or coded by the prototype trellis
    (:data:`kvqrs.evaluation.trellis.SIDES`): one row each, its bits those of the codec it
    stands in for."""
    if row.config is None:
        raise KvqrsError(f"channel: the row {row.name!r} has no codec to stand in for")
    known = SIDES + trellis.SIDES
    if isinstance(sides, str) or len(set(sides)) != len(sides) or any(side not in known for side in sides):
        raise KvqrsError(f"channel: expected a list of distinct sides among {known}, got {sides!r}")
    cal = row.config.calibration
    if row.config.key_scheme != "matched" or row.config.value_scheme not in ("matched", None):
        raise KvqrsError(f"channel: the row {row.name!r} is not a matched row (the channel stands in for matched coders)")
    fitted = cal.values() if isinstance(cal, dict) else ()
    if any(s not in ("keys", "trellis-keys") for s in sides) and any(c.values is not None or c.value_classes for c in fitted):
        raise KvqrsError(
            f"channel: the row {row.name!r} codes its values by transform or in width classes; the channel models the "
            "per-token Lloyd-Max value stage only (--channel keys runs)"
        )
    label = lambda side: f"{side} (prototype)" if side in trellis.SIDES else f"Gaussian test channel ({side})"  # noqa: E731
    return [LlamaRow(f"{row.name}, {label(side)}", row.config, side) for side in sides]


def llama_chunks(tokenizer, text: str, ctx: int, count: int) -> list[torch.Tensor]:
    """The text tokenized once (no BOS added by SmolLM2's tokenizer), cut into ``count``
    consecutive chunks of ``ctx`` tokens ``(1, ctx)``."""
    if ctx < 4:
        raise KvqrsError(f"--ctx: expected at least 4 tokens, got {ctx}")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = min(count, len(ids) // ctx)
    if n == 0:
        raise KvqrsError(f"text: {len(ids)} tokens, fewer than one chunk of {ctx}")
    return [ids[i * ctx : (i + 1) * ctx][None] for i in range(n)]


def _scored_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the scored predictions: positions ``ctx/2 .. ctx-2``, float64."""
    ctx = ids.shape[-1]
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, ctx // 2 : ctx - 1].double(), dim=-1)


def chunk_bits(
    cfg: QuantConfig, qkv: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], dtype_bits: int = 32, fitted: dict | None = None
) -> tuple[float, float]:
    """Bits per element of keys and of values of one chunk of every layer, every stored byte
    counted: the codes of the tokens after the sinks, plus the sinks at ``dtype_bits`` (their
    ``sink_dtype``'s when set), plus,
    for a self-calibrated config (``calibration="prefill"``), the calibration each layer fits
    on the chunk (its key side to the keys, its value side to the values).

    ``qkv``: per layer the chunk's queries ``(1, q_heads, n, d)``, keys and values ``(1,
    kv_heads, n, d)``; ``fitted``: the self-calibrated layers' calibrations already fitted on
    this chunk ``{layer: MatchedCalibration}`` (default: fitted here)."""
    from ..hf.calibration import prefill_calibration

    sink = cfg.sink_tokens
    bits = {"k": 0.0, "v": 0.0}
    numel = 0
    for layer, (q, k, v) in sorted(qkv.items()):
        fitted = None
        fit = None
        if cfg.calibration == "prefill":
            t = [torch.from_numpy(x) for x in (q, k[..., sink:, :], v[..., sink:, :])]
            fit = prefill_calibration(cfg, *t) if fitted is None else fitted[layer]
            side_v = fit.value_mean.nbytes if fit.values is None else fit.values.nbytes
            bits["k"] += 8 * (fit.nbytes - side_v)
            bits["v"] += 8 * side_v
        codec = cfg.codec(layer, k.shape[-1], fit)
        numel += k.size
        sink_bits = k[..., :sink, :].size * cfg.sink_bits(dtype_bits)
        bits["k"] += sink_bits + (
            8 * codec.encode_keys(k[..., sink:, :]).nbytes if cfg.quantizes_keys else k[..., sink:, :].size * dtype_bits
        )
        bits["v"] += sink_bits + (
            8 * codec.encode_values(v[..., sink:, :], unit_weights(codec, v[..., sink:, :])).nbytes
            if codec.values is not None
            else v[..., sink:, :].size * dtype_bits
        )
    return bits["k"] / numel, bits["v"] / numel


def run_llama(model, tokenizer, texts, rows: list[LlamaRow], ctx: int = 512, chunks: int = 40, progress: bool = True) -> dict:
    """Evaluate every row on llama.cpp's perplexity protocol; returns ``{"rows": [...], ...}``."""
    from tqdm import tqdm

    ev = llama_chunks(tokenizer, texts.evaluation, ctx, chunks)
    rec = Recorder()
    dense = []
    for ids in tqdm(ev, desc="dense", unit="chunk", disable=not progress):
        with active(rec):
            dense.append(_scored_log_probs(model, ids))
    qkv = {layer: tuple(x[None] for x in t) for layer, t in rec.tensors.items()}  # the last chunk, every layer
    results = []
    for row in tqdm(rows, desc="llama protocol", unit="row", disable=not progress):
        nll, kls, agree, n = 0.0, [], 0, 0
        wrap = None if row.channel is None else (trellis.trellis_wrap if row.channel in trellis.SIDES else channel_wrap)(row.channel)
        for ids, lpd in zip(ev, dense):
            if row.config is None:
                lp = lpd
            else:
                with fake_quant(row.config, one_shot=True, wrap=wrap):
                    lp = _scored_log_probs(model, ids)
            target = ids[0, ctx // 2 + 1 :]
            nll -= lp.gather(1, target[:, None]).sum().item()
            kls.append((lpd.exp() * (lpd - lp)).sum(-1).clamp_min(0))
            agree += int((lp.argmax(-1) == lpd.argmax(-1)).sum())
            n += len(target)
        kl = torch.cat(kls).numpy()
        bk, bv = (32.0, 32.0) if row.config is None else chunk_bits(row.config, qkv)
        results.append(
            {
                "row": row.name,
                "ppl": math.exp(nll / n),
                "kl_mean": float(kl.mean()),
                "kl_p99": float(np.quantile(kl, 0.99)),
                "kl_max": float(kl.max()),
                "same_top": agree / n,
                "bpe_k": bk,
                "bpe_v": bv,
                "bpe": (bk + bv) / 2,
                "tokens": n,
            }
        )
    dense_ppl = results[0]["ppl"] if results and results[0]["row"] == "dense" else float("nan")
    for r in results:
        r["excess"] = r["ppl"] / dense_ppl - 1
    return {"rows": results, "ctx": ctx, "chunks": len(ev), "scored_tokens": results[0]["tokens"] if results else 0, "source": texts.source}


def markdown(result: dict) -> str:
    """The kvqrs rows beside llama.cpp's own rows."""
    lines = [
        f"Model: {model_title(result)}",
        "",
        f"llama.cpp perplexity protocol: {result['chunks']} chunks of {result['ctx']} tokens, "
        f"{result['scored_tokens']} scored tokens, text: {result['source']}",
        "",
        "| row | bits/element K / V (avg) | perplexity | excess | mean KL | KL p99 | KL max | same top |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['row']} | {r['bpe_k']:.3f} / {r['bpe_v']:.3f} ({r['bpe']:.3f}) | {r['ppl']:.3f} | {100 * r['excess']:+.2f}% | "
            f"{r['kl_mean']:.4f} | {r['kl_p99']:.3f} | {r['kl_max']:.2f} | {100 * r['same_top']:.1f}% |"
        )
    if "model" in result and result["model"]["name"] != DEFAULT_NAME:
        return "\n".join(lines) + "\n"  # llama.cpp's rows were measured on SmolLM2
    lines += ["", "llama.cpp's own rows (its tool, same model, text and protocol; f16 reference):", ""]
    lines += ["| llama.cpp cache | bits/element | perplexity | excess | mean KL | same top |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, bpe, ppl, ex, kl, top in LLAMA_CPP:
        lines.append(
            f"| {name} | {bpe} | {ppl:.3f} | {'-' if ex is None else f'{100 * ex:+.2f}%'} | {'-' if kl is None else f'{kl:.4f}'} | "
            f"{'-' if top is None else f'{100 * top:.1f}%'} |"
        )
    return "\n".join(lines) + "\n"


def write(result: dict, out: pathlib.Path, seconds: float) -> pathlib.Path:
    """``llama.md``, ``llama.csv`` and ``llama.json`` in ``out``; returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "llama.md"
    md.write_text(markdown(result) + f"\nwall time: {seconds:.0f} s\n", encoding="utf-8")
    (out / "llama.json").write_text(json.dumps({**result, "seconds": seconds}, indent=2), encoding="utf-8")
    with open(out / "llama.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        w.writeheader()
        w.writerows(result["rows"])
    return md
