"""Report of ``kvqrs eval --task needle``: Markdown tables, CSV of every (row, context, depth)
cell, JSON of everything (every generation included) and a heat map of retrieval accuracy per
row over depth and context."""

from __future__ import annotations

import csv
import json
import pathlib

from .model_report import model_title

CELL_COLUMNS = ("row", "context", "depth", "trials", "correct", "accuracy")


def summary_table(result: dict) -> str:
    """One line per row: accuracy per context and overall, cache bytes per token, seconds."""
    ctx = result["contexts"]
    lines = [
        "| row | " + " | ".join(f"{c} tokens" for c in ctx) + " | all | cache bytes / token | seconds |",
        "| --- | " + " | ".join("---:" for _ in ctx) + " | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        accs = " | ".join(f"{r[f'acc_{c}']:.2f}" for c in ctx)
        lines.append(f"| {r['row']} | {accs} | {r['accuracy']:.2f} | {r['cache_bytes_per_token']:,.0f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def depth_table(result: dict) -> str:
    """Accuracy per (row, context) line and depth column (correct / trials)."""
    depths = result["depths"]
    by = {(c["row"], c["context"], c["depth"]): c for c in result["cells"]}
    lines = [
        "| row | context | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in depths) + " |",
    ]
    for r in result["rows"]:
        for c in result["contexts"]:
            cells = [by[(r["row"], c, d)] for d in depths]
            lines.append(f"| {r['row']} | {c} | " + " | ".join(f"{x['correct']}/{x['trials']}" for x in cells) + " |")
    return "\n".join(lines)


def summary(result: dict, seconds: float, machine: str = "") -> str:
    n_prompts = len(result["contexts"]) * len(result["depths"]) * result["trials_per_cell"]
    lines = [
        f"# kvqrs eval --task needle: {model_title(result)}",
        "",
        f"Pass key retrieval: a {len(result['trials'][0]['key'])}-digit key stated once in filler text "
        f"({result['source']}) at each depth (fraction of the filler before it), asked for at the end in the chat template; "
        f"{result['trials_per_cell']} trial(s) per (context, depth), {n_prompts} prompts per row, the same prompts for every row "
        f"(seed {result['seed']}). Greedy `generate` of {result['max_new_tokens']} tokens through the real cache "
        f"(prefill in chunks of {result['prefill_chunk']} tokens, attention by {result.get('prefill', 'eager')}, then decode); correct = the answer's first digits are the key. "
        f"{seconds:.0f} s{' on ' + machine if machine else ''}.",
        "",
        f'Needle: "{result["needle"]}"; question: "{result["question"]}"; the answer starts "{result["answer_prefix"]}".',
        "",
        "Cache bytes per token: the real cache after the longest context (dense: DynamicCache, float32).",
        "",
        summary_table(result),
        "",
        "Correct answers per depth (correct / trials):",
        "",
        depth_table(result),
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    """One heat map per row: accuracy over depth (y) and context (x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, ctx, depths = result["rows"], result["contexts"], result["depths"]
    by = {(c["row"], c["context"], c["depth"]): c["accuracy"] for c in result["cells"]}
    cols = min(4, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols + 1, 2.8 * nrows), squeeze=False)
    image = None
    for ax, r in zip(axes.flat, rows):
        grid = np.array([[by[(r["row"], c, d)] for c in ctx] for d in depths])
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(ctx)), [str(c) for c in ctx], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(f"{r['row']} ({r['accuracy']:.2f})", fontsize=9)
        ax.set_xlabel("context (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="retrieval accuracy")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict, out: pathlib.Path, seconds: float, machine: str = "") -> pathlib.Path:
    """Write ``needle.md``, ``needle.csv`` (one line per row, context and depth), ``needle.json``
    and ``needle_accuracy.png`` into ``out``; returns the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "needle.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CELL_COLUMNS))
        w.writeheader()
        w.writerows(result["cells"])
    (out / "needle.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "needle_accuracy.png")
    md = out / "needle.md"
    md.write_text(summary(result, seconds, machine) + "\n![retrieval accuracy](needle_accuracy.png)\n")
    return md
