"""Report of ``kvqrs eval``: Markdown table, CSV / JSON of every row, and a plot of quality
against bits per element per scheme."""

from __future__ import annotations

import csv
import json
import pathlib

COLUMNS = ("row", "group", "ppl", "excess_ppl", "kl_mean", "kl_max", "top1", "bpe_k", "bpe_v", "cache_bytes")


def table(result: dict) -> str:
    """The Markdown table of every row."""
    lines = [
        "| row | kind | perplexity | excess | KL mean | KL max | top-1 agree | key bits/elem | value bits/elem | cache bytes / window |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['row']} | {r['group']} | {r['ppl']:.3f} | {r['excess_ppl']:+.3f} | {r['kl_mean']:.4f} | {r['kl_max']:.3f} | "
            f"{r['top1']:.3f} | {r['bpe_k']:.3f} | {r['bpe_v']:.3f} | {r['cache_bytes']:,} |".replace("| -1 |", "| n/a (fast path only) |")
        )
    return "\n".join(lines)


def held_note(result: dict) -> list[str]:
    """A paragraph naming the coded full-KV rows that held part of each window in full
    precision (over 9 bits per element on either side, the widest coded row's: 8-bit blocks
    with their scales; a ``matched`` group of 256 tokens is coded only once full, so a 512-token
    window keeps its last, partial group), else none."""
    held = [r["row"] for r in result["rows"] if r["group"] == "full KV" and max(r["bpe_k"], r["bpe_v"]) > 9]
    if not held:
        return []
    return [
        f"Rows above 9 bits per element on a side ({', '.join(held)}) held part of each window in full precision: a "
        "`matched` key group is coded only once full, so the tokens after the window's last full group are read in "
        "full precision (counted in the bits). Their quality is that of a mostly unquantized cache; compare the "
        "presets at their budget with `--protocol llama` (docs/evaluation.md).",
        "",
    ]


def model_title(result: dict) -> str:
    """The model a report's ``result`` was measured on (its ``model`` entry's summary: name,
    dtype and layer types; results from before ``--model`` were SmolLM2's)."""
    model = result.get("model")
    return "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)" if model is None else model["summary"]


def summary(result: dict, seconds: float) -> str:
    c = result["dense_check"]
    lines = [
        f"# kvqrs eval: {model_title(result)}",
        "",
        f"Text: {result['source']}; {result['windows']} windows of {result['window']} tokens "
        f"({sum(1 for _ in result['rows'])} rows); HeadQ calibrated on {result['calibration_windows']} disjoint windows. {seconds:.0f} s.",
        "",
        *([f"Kernels: {result['simd']}.", ""] if "simd" in result else []),
        f"Dense check: perplexity {c['ppl_kvqrs']:.4f} through kvqrs' attention function, {c['ppl_transformers']:.4f} from "
        f"transformers' own loss with its {c['transformers_attention']} attention on the same windows "
        f"(relative difference {c['relative_difference']:.1e}).",
        "",
        "KL is KL(dense || row) of next-token distributions, in nats per token; bits per element count every stored bit "
        "(32 = full precision); cache bytes are a real QuantizedKVCache holding one window of every layer (dense: float32).",
        "",
        table(result),
        "",
        *held_note(result),
    ]
    if result["headq_recovered"]:
        lines += ["Fraction of the 2-bit baseline's excess perplexity that HeadQ removes (the HeadQ paper: 84-94% on WikiText-103):", ""]
        lines += [f"- {h['row']} vs {h['baseline']}: {100 * h['recovered']:.1f}%" for h in result["headq_recovered"]]
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    """Excess perplexity (log) against total bits per element, one series per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    # One colour per scheme in both panels; excess at or below zero is drawn at 1e-3 (log axis).
    colours = {s: f"C{i}" for i, s in enumerate(sorted({r["row"].split(" ")[0] for r in result["rows"]}))}
    for ax, group in zip(axes, ("key-only", "full KV")):
        series: dict[str, list] = {}
        for r in result["rows"]:
            if r["group"] != group:
                continue
            scheme = r["row"].split(" ")[0]
            bpe = r["bpe_k"] if group == "key-only" else (r["bpe_k"] + r["bpe_v"]) / 2
            series.setdefault(scheme, []).append((bpe, max(r["excess_ppl"], 1e-3)))
        for scheme, pts in sorted(series.items()):
            pts.sort()
            ax.plot(*zip(*pts), marker="o", color=colours[scheme], label=scheme)
        ax.set_yscale("log")
        ax.set_xlabel("bits per element (keys)" if group == "key-only" else "bits per element (mean of K and V)")
        ax.set_ylabel("excess perplexity over dense (<= 0 drawn at 1e-3)")
        ax.set_title(group)
        if series:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict, out: pathlib.Path, seconds: float) -> pathlib.Path:
    """Write ``eval.md``, ``eval.csv``, ``eval.json`` and ``quality_vs_bits.png``; returns the
    Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "eval.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        w.writeheader()
        w.writerows(result["rows"])
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "quality_vs_bits.png")
    md = out / "eval.md"
    md.write_text(summary(result, seconds) + "\n![quality vs bits](quality_vs_bits.png)\n")
    return md
