"""``kvqrs eval``: the model-level evaluation on SmolLM2-135M.

For every row (a :class:`~kvqrs.hf.QuantConfig`, or dense) and every evaluation window: one
forward pass through the fast path (quantize-dequantize with the cache's schedule, HeadQ in score
space), then perplexity, excess perplexity over dense, KL of next-token distributions against
dense (mean and max), top-1 agreement; bits per element from encoding a real window's keys and
values; cache bytes from a real :class:`~kvqrs.hf.QuantizedKVCache` holding one window's keys and
values of every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._arrays import KvqrsError
from ..hf import QuantConfig, QuantizedKVCache, calibrate, fake_quant
from ..hf.attention import active
from .capture import Recorder

A2_WINDOW = 64
"""Full-precision window of the causal A^2 rows (and their uniform baseline)."""


@dataclass(frozen=True)
class Row:
    """One evaluation row: a label and its config (None = dense), key-only or full KV."""

    name: str
    config: QuantConfig | None
    group: str


def default_rows(quick: bool = False, residual_length: int = 0, calibrations: dict | None = None) -> list[Row]:
    """The default rows: dense; kv / kqv / qkqv at n in {2, 3, 4}; kivi at 2 and 4; the
    llama.cpp-style blockwise 4 and 8 bits with rotation; HeadQ keys at 2 bits, rank 4 on the
    kivi and kqv bases with wrong-sign and random-basis controls. Key-only and full KV. Then the
    ``matched`` presets (:meth:`QuantConfig.preset`: ``4bit``, ``3bit``, ``2bit``) calibrated on
    each window as on a prompt (``matched 4bit (prompt)``), and, per entry of ``calibrations``
    (``{preset name: {layer: MatchedCalibration}}``, :func:`.needle.preset_calibrations`), the
    preset refined by that file (``matched 4bit (file)``)."""
    from ..hf.config import PRESETS

    r = residual_length
    rows = [Row("dense", None, "dense")]
    bits = (2, 4) if quick else (2, 3, 4)
    for scheme in ("kv", "kqv", "qkqv"):
        for n in bits:
            rows.append(Row(f"{scheme} k{n}", QuantConfig(scheme, n, residual_length=r), "key-only"))
            rows.append(Row(f"{scheme} k{n} v{n}", QuantConfig(scheme, n, scheme, n, residual_length=r), "full KV"))
    for n in (2, 4):
        rows.append(Row(f"kivi k{n}", QuantConfig("kivi", n, residual_length=r), "key-only"))
        rows.append(Row(f"kivi k{n} v{n}", QuantConfig("kivi", n, "kivi", n, residual_length=r), "full KV"))
    for n in (4,) if quick else (4, 8):
        rows.append(Row(f"block k{n}", QuantConfig("block", n, residual_length=r), "key-only"))
        rows.append(Row(f"block k{n} v{n}", QuantConfig("block", n, "block", n, residual_length=r), "full KV"))
    # A^2 value allocation against uniform widths, both rotated Lloyd-Max values at 2 bits
    # (keys full precision so only the value code differs).
    rows.append(Row("uniform v2", QuantConfig(None, 2, "a2", 2, residual_length=r, a2_uniform=True), "values-only"))
    rows.append(Row("a2 v2 (oracle weights)", QuantConfig(None, 2, "a2", 2, residual_length=r), "values-only"))
    # The causal A^2 row: importances only from the queries that read each token while it sat in
    # a 64-token full-precision window, against uniform widths with the same window.
    w = max(r, A2_WINDOW)
    rows.append(Row(f"uniform v2 (window {w})", QuantConfig(None, 2, "a2", 2, residual_length=w, a2_uniform=True), "values-only"))
    rows.append(Row(f"a2 v2 (causal, window {w})", QuantConfig(None, 2, "a2", 2, residual_length=w, a2_lookahead=w), "values-only"))
    for base in ("kivi", "kqv"):
        for label, sign, bases in (("", 1, None), (" wrong-sign", -1, None), (" random-basis", 1, "random")):
            cfg = QuantConfig("headq", 2, residual_length=r, headq_base=base, rank=4, side_bits=4, sign=sign, bases=bases)
            rows.append(Row(f"headq({base}) k2{label}", cfg, "key-only"))
    for name in sorted(PRESETS, key=lambda n: -PRESETS[n]["budget"]):
        rows.append(Row(f"matched {name} (prompt)", QuantConfig.preset(name, residual_length=r), "full KV"))
        if name in (calibrations or {}):
            rows.append(Row(f"matched {name} (file)", QuantConfig.preset(name, calibrations[name], residual_length=r), "full KV"))
    return rows


def by_budget(results: list[dict]) -> list[dict]:
    """Result rows ordered as a choice by budget: most stored bits per element first (the mean
    of the key and value bits; dense, at 32, leads), ties in their given order."""
    return sorted(results, key=lambda r: -(r["bpe_k"] + r["bpe_v"]) / 2)


def token_windows(tokenizer, text: str, window: int, count: int) -> list[torch.Tensor]:
    """``count`` non-overlapping windows of ``window`` tokens from the start of ``text``."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = min(count, len(ids) // window)
    return [ids[i * window : (i + 1) * window][None] for i in range(n)]


def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)


def score_row(lp: torch.Tensor, lp_dense: torch.Tensor, ids: torch.Tensor) -> dict:
    """Per-window sums: NLL, KL(dense || row) per position, top-1 agreement."""
    target = ids[0, 1:]
    nll = -lp.gather(1, target[:, None])[:, 0]
    kl = (lp_dense.exp() * (lp_dense - lp)).sum(-1).clamp_min(0)
    agree = (lp.argmax(-1) == lp_dense.argmax(-1)).float()
    return {"nll": nll.sum().item(), "kl_sum": kl.sum().item(), "kl_max": kl.max().item(), "agree": agree.sum().item(), "n": len(target)}


def storage(cfg: QuantConfig, kv: dict[int, tuple[np.ndarray, np.ndarray]], queries: dict | None = None, dtype_bits: int = 32) -> dict:
    """Bits per element of keys and values (encoding a real window's layer-0 K and V) and the
    real bytes of a QuantizedKVCache holding that window's keys and values of every layer
    ``{layer: (kv_heads, window, d)}``, beside the dense cache. Rows the cache cannot hold
    (value-only, A^2) report no cache bytes (-1). ``matched`` rows, whose widths differ per
    layer, count what the cache holds in every layer: the codes, the tokens of a scale group not
    yet full (in full precision, at ``dtype_bits``), their sinks (at ``dtype_bits`` or their
    ``sink_dtype``'s) and, calibrated on the window (``calibration="prefill"``), the calibration
    each layer fits on it from ``queries`` ``{layer: (q_heads, window, d)}``."""
    if cfg.key_scheme == "matched":
        return _matched_storage(cfg, kv, queries, dtype_bits)
    k0, v0 = kv[0]
    codec = cfg.codec(0, k0.shape[-1])
    bpe_k = codec.encode_keys(k0).bits_per_element if cfg.quantizes_keys else 32.0
    bpe_v = 32.0 if codec.values is None else codec.encode_values(v0).bits_per_element
    if not cfg.quantizes_keys or cfg.value_scheme == "a2":
        return {"bpe_k": bpe_k, "bpe_v": bpe_v, "cache_bytes": -1}
    cache = QuantizedKVCache(cfg, len(kv))
    for layer, (k, v) in sorted(kv.items()):
        cache.update(torch.from_numpy(k)[None], torch.from_numpy(v)[None], layer)
    return {"bpe_k": bpe_k, "bpe_v": bpe_v, "cache_bytes": cache.nbytes()}


def _matched_storage(cfg: QuantConfig, kv: dict, queries: dict | None, dtype_bits: int) -> dict:
    """:func:`storage` of a ``matched`` row: the bits and bytes of a cache holding the window
    (a self-calibrated layer's calibration, fitted on the window as on a prompt, counted as the
    cache counts it). The bits are what the cache holds (:func:`_held_bits`): a scale group not
    yet full stays in full precision and is counted so."""
    import dataclasses

    from ..hf.calibration import prefill_calibration

    if cfg.calibration == "prefill" and queries is None:
        raise KvqrsError("storage: a row calibrated on the window needs the window's queries")
    fitted = None
    if cfg.calibration == "prefill":
        s = cfg.sink_tokens
        fitted = {
            layer: prefill_calibration(cfg, *(torch.from_numpy(x) for x in (queries[layer][None], k[None, :, s:], v[None, :, s:])))
            for layer, (k, v) in kv.items()
        }
    side = 0
    held = cfg
    if fitted is not None:
        side = sum(c.nbytes for c in fitted.values())
        held = dataclasses.replace(cfg, calibration=fitted)
    cache = QuantizedKVCache(held, len(kv))
    for layer, (k, v) in sorted(kv.items()):
        cache.update(torch.from_numpy(k)[None], torch.from_numpy(v)[None], layer)
    bpe_k, bpe_v = _held_bits(cache, cfg, fitted, dtype_bits)
    return {"bpe_k": bpe_k, "bpe_v": bpe_v, "cache_bytes": cache.nbytes() + side}


def _held_bits(cache: QuantizedKVCache, cfg: QuantConfig, fitted: dict | None, dtype_bits: int) -> tuple[float, float]:
    """Bits per element of keys and of values as ``cache`` holds them, every stored byte counted:
    the codes, the tokens still in full precision (at ``dtype_bits``, the model's), the sinks
    (at the config's sink bits) and, for layers calibrated on the window (``fitted``
    ``{layer: MatchedCalibration}``), each calibration (its key side to the keys)."""
    bits = {"k": 0.0, "v": 0.0}
    numel = 0
    for i, layer in enumerate(cache.layers):
        b, h, _, d = layer.keys.shape
        numel += b * h * layer.get_seq_length() * d
        for side, window, sink in (("k", layer.keys, layer.sink_k), ("v", layer.values, layer.sink_v)):
            bits[side] += window.numel() * dtype_bits + sink.numel() * cfg.sink_bits(dtype_bits)
        if layer.store is not None:
            bits["k"] += 8 * sum(np.asarray(p).nbytes for p in layer.store.keys().parts.values())
            vals = layer.store.values()
            held = [vals] if isinstance(vals, torch.Tensor) else [torch.from_numpy(np.asarray(p)) for p in vals.parts.values()]
            bits["v"] += 8 * sum(t.numel() * t.element_size() for t in held)
        if fitted is not None:
            fit = fitted[i]
            side_v = fit.value_mean.nbytes if fit.values is None else fit.values.nbytes
            bits["k"] += 8 * (fit.nbytes - side_v)
            bits["v"] += 8 * side_v
    return bits["k"] / numel, bits["v"] / numel


@dataclass
class EvalInputs:
    """What every row is scored against: the evaluation windows, dense log-probabilities of each
    (through kvqrs' attention), the last window's keys and values of every layer
    ``{layer: (kv_heads, window, d)}``, and the number of calibration windows used."""

    windows: list[torch.Tensor]
    dense_log_probs: list[torch.Tensor]
    kv: dict[int, tuple[np.ndarray, np.ndarray]]
    calibration_windows: int
    queries: dict[int, np.ndarray] | None = None


def prepare(
    model, tokenizer, texts, rows: list[Row], window: int, windows: int, calib_windows: int, calibrate_rows: bool = True
) -> EvalInputs:
    """Tokenize the windows, run dense, and (``calibrate_rows``) fit the HeadQ bases of the rows
    that need them on the calibration windows, writing them into those rows' configs. Raises
    KvqrsError when a text is shorter than one window."""
    ev = token_windows(tokenizer, texts.evaluation, window, windows)
    cal = token_windows(tokenizer, texts.calibration, window, calib_windows)
    if not ev:
        raise KvqrsError(
            f"text: the evaluation text is shorter than one window of {window} tokens ({texts.source}); use a smaller --window"
        )
    uncalibrated = [r for r in rows if r.config is not None and r.config.key_scheme == "headq" and r.config.bases is None]
    if uncalibrated and not cal:
        raise KvqrsError(
            f"text: the calibration text is shorter than one window of {window} tokens ({texts.source}); use a smaller --window"
        )
    if uncalibrated and calibrate_rows:
        bases = calibrate(model, cal, rank=4)
        for r in uncalibrated:
            r.config.bases = bases
    rec = Recorder()
    dense_lp = []
    for ids in ev:
        with active(rec):
            dense_lp.append(_log_probs(model, ids))
    kv = {layer: t[1:] for layer, t in rec.tensors.items()}  # the last window's keys and values, every layer
    return EvalInputs(ev, dense_lp, kv, len(cal), {layer: t[0] for layer, t in rec.tensors.items()})


def evaluate_row(model, inputs: EvalInputs, row: Row) -> dict:
    """Perplexity, KL against dense (mean and max), top-1 agreement, bits per element and cache
    bytes of one row over every evaluation window."""
    cfg = row.config
    acc = {"nll": 0.0, "kl_sum": 0.0, "kl_max": 0.0, "agree": 0.0, "n": 0}
    for ids, lpd in zip(inputs.windows, inputs.dense_log_probs):
        if cfg is None:
            lp = lpd
        else:
            with fake_quant(cfg):
                lp = _log_probs(model, ids)
        s = score_row(lp, lpd, ids)
        for k in ("nll", "kl_sum", "agree", "n"):
            acc[k] += s[k]
        acc["kl_max"] = max(acc["kl_max"], s["kl_max"])
    out = {
        "row": row.name,
        "group": row.group,
        "ppl": math.exp(acc["nll"] / acc["n"]),
        "kl_mean": acc["kl_sum"] / acc["n"],
        "kl_max": acc["kl_max"],
        "top1": acc["agree"] / acc["n"],
        "tokens": acc["n"],
    }
    if cfg is None:
        kv = inputs.kv
        d = model.config.head_dim if hasattr(model.config, "head_dim") else kv[0][0].shape[-1]
        window = inputs.windows[0].shape[-1]
        out.update(
            bpe_k=32.0, bpe_v=32.0, cache_bytes=2 * model.config.num_hidden_layers * model.config.num_key_value_heads * window * d * 4
        )
    else:
        out.update(storage(cfg, inputs.kv, inputs.queries, torch.finfo(model.dtype).bits))
    return out


def run_eval(
    model,
    tokenizer,
    texts,
    rows: list[Row],
    window: int,
    windows: int,
    calib_windows: int,
    progress: bool = True,
    ray=None,
    threads: int = 1,
    source=None,
) -> dict:
    """Evaluate every row; returns ``{"rows": [...], "dense_check": {...}, ...}``.

    ``ray``: a connected ``ray`` module (:func:`.distributed.connect`): the rows are spread over
    actors that each load the model (``threads`` PyTorch threads and as many CPUs each, as many
    actors as the cluster's CPUs allow) and score against their own dense pass; the HeadQ bases
    are fitted here once and sent with the rows. The results equal the serial run's when the
    actors run the same PyTorch build with the same thread count. ``source``: where the actors
    load the model from (a :func:`.model.source`; None: SmolLM2), at ``model``'s dtype."""
    from tqdm import tqdm

    inputs = prepare(model, tokenizer, texts, rows, window, windows, calib_windows)
    check = dense_check(model, inputs.windows, inputs.dense_log_probs)
    if ray is None:
        results = [evaluate_row(model, inputs, row) for row in tqdm(rows, desc="eval", unit="row", disable=not progress)]
    else:
        from .distributed import cluster_cpus, map_actors

        count = max(1, cluster_cpus(ray) // threads)
        args = (texts, window, windows, calib_windows, threads, source, str(model.dtype).removeprefix("torch."))
        results = map_actors(ray, RowWorker, args, rows, "evaluate", count, threads, progress, "eval")
    dense_ppl = results[0]["ppl"]
    for r in results:
        r["excess_ppl"] = r["ppl"] - dense_ppl
    return {
        "rows": by_budget(results),
        "dense_check": check,
        "windows": len(inputs.windows),
        "window": window,
        "source": texts.source,
        "calibration_windows": inputs.calibration_windows,
        "headq_recovered": headq_recovered(results),
    }


class RowWorker:
    """A Ray actor of the distributed :func:`run_eval`: the model, loaded once, and its own dense
    pass over the same windows; :meth:`evaluate` scores one row (HeadQ rows arrive calibrated)."""

    def __init__(self, texts, window: int, windows: int, calib_windows: int, threads: int, source=None, dtype: str = "float32"):
        from . import model as model_mod

        torch.set_num_threads(threads)
        self.model, tokenizer = model_mod.load(dtype, model=source)
        self.inputs = prepare(self.model, tokenizer, texts, [], window, windows, calib_windows, calibrate_rows=False)

    def evaluate(self, row: Row) -> dict:
        return evaluate_row(self.model, self.inputs, row)


def dense_check(model, windows: list[torch.Tensor], log_probs: list[torch.Tensor]) -> dict:
    """Dense perplexity through kvqrs' attention function (``log_probs``: the dense row's
    log-probabilities of ``windows``) against transformers' own loss (``labels=``) with its
    SDPA attention on the same windows, or its eager attention for a model that has no SDPA
    path (logit soft-capping, learned sinks: Gemma-2, gpt-oss). Returns ``ppl_kvqrs``,
    ``ppl_transformers``, ``transformers_attention`` (``"sdpa"`` or ``"eager"``) and
    ``relative_difference``."""
    ours = [-lp.gather(1, ids[0, 1:, None]).mean().item() for ids, lp in zip(windows, log_probs)]
    theirs = []
    attention = "sdpa"
    try:
        model.set_attn_implementation(attention)
    except ValueError:  # transformers refuses SDPA for attention it does not compute
        attention = "eager"
        model.set_attn_implementation(attention)
    try:
        with torch.no_grad():
            for ids in windows:
                theirs.append(model(ids, labels=ids).loss.item())
    finally:
        model.set_attn_implementation("kvqrs")
    a, b = math.exp(float(np.mean(ours))), math.exp(float(np.mean(theirs)))
    return {"ppl_kvqrs": a, "ppl_transformers": b, "transformers_attention": attention, "relative_difference": abs(a - b) / b}


def headq_recovered(results: list[dict]) -> list[dict]:
    """Fraction of the kivi (and kqv) 2-bit key-only baseline's excess perplexity that each
    HeadQ row removes: ``(ppl_base - ppl_headq) / (ppl_base - ppl_dense)``."""
    by = {r["row"]: r for r in results}
    dense = by["dense"]["ppl"]
    out = []
    for base in ("kivi", "kqv"):
        b = by.get(f"{base} k2")
        if b is None:
            continue
        for label in ("", " wrong-sign", " random-basis"):
            h = by.get(f"headq({base}) k2{label}")
            if h is not None and b["ppl"] != dense:
                out.append({"baseline": f"{base} k2", "row": h["row"], "recovered": (b["ppl"] - h["ppl"]) / (b["ppl"] - dense)})
    return out
