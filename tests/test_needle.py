"""``kvqrs eval --task needle`` (pass key retrieval through the real cache): the prompt builder
(length, needle placement at the stated depth, whole-sentence filler, determinism by seed), the
scorer, the rows, the report files from a made-up result, and the quick command line on
SmolLM2-135M (dense retrieves; the quantized row really ran through QuantizedKVCache)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.evaluation import needle, needle_report  # noqa: E402
from kvqrs.evaluation.needle import Haystack, answer_digits, cell_seed, is_correct, needle_rows  # noqa: E402
from kvqrs.hf import QuantConfig  # noqa: E402

# The command line on 2 busy cores: model load (~25-45 s), the gensim text and its tokenization
# (~10 s), 8 generations of 512 tokens (~5-10 s each when the other core is busy).
CLI_TIMEOUT_S = 420

WORDS = (
    "the river old mill village north market stone bridge church farmers winter harvest road castle forest "
    "king merchant valley hill school library museum painter song city wall garden tower ship harbour"
).split()


def _corpus(sentences: int, seed: int = 0) -> str:
    """Digit-free filler: seeded sentences of 6-17 words, paragraphs of 5 sentences."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(sentences):
        words = rng.choice(WORDS, size=int(rng.integers(6, 18)))
        out.append(" ".join(words).capitalize() + "." + ("\n" if i % 5 == 4 else ""))
    return " ".join(out)


@pytest.fixture(scope="module")
def tok(model32):
    return model32[1]


@pytest.fixture(scope="module")
def hay(tok):
    return Haystack(tok, _corpus(600), "made-up sentences")


def _strip_needle(p):
    ids = p.ids[0].numpy()
    return np.concatenate([ids[: p.needle_start], ids[p.needle_start + p.needle_len :]])


@pytest.mark.parametrize("context", [120, 512, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_prompt_length_layout_and_depth(tok, hay, context, depth):
    p = hay.build(context, depth, seed=7)
    ids = p.ids[0].numpy()
    assert p.ids.shape == (1, context) and p.ids.dtype == torch.int64
    assert np.array_equal(ids[: len(hay.head)], hay.head) and np.array_equal(ids[-len(hay.tail) :], hay.tail)
    assert p.filler_start == len(hay.head) and p.filler_len == context - len(hay.head) - len(hay.tail) - p.needle_len
    # the needle, with this prompt's key, sits at needle_start
    assert tok.decode(ids[p.needle_start : p.needle_start + p.needle_len]) == needle.NEEDLE.format(key=p.key)
    # without the needle, the filler is one contiguous run of corpus tokens, whole sentences
    filler = _strip_needle(p)[len(hay.head) : len(hay.head) + p.filler_len]
    assert np.array_equal(filler, hay.corpus[p.offset : p.offset + p.filler_len])
    assert hay.opens[p.offset] and hay.boundary[p.offset + p.filler_len]
    # the needle is at the last sentence boundary at or before the stated depth
    at, target = p.needle_start - p.filler_start, int(round(depth * p.filler_len))
    assert at <= target and hay.boundary[p.offset + at]
    assert not hay.boundary[p.offset + at + 1 : p.offset + target + 1].any()
    assert p.actual_depth == at / p.filler_len
    if depth == 0.0:
        assert at == 0
    if depth == 1.0:
        assert at == p.filler_len  # right before the question
    longest_sentence = np.diff(np.flatnonzero(hay.boundary)).max()
    assert abs(p.actual_depth - depth) <= longest_sentence / p.filler_len


def test_prompt_text_reads_as_a_chat(tok, hay):
    p = hay.build(300, 0.5, seed=3)
    text = tok.decode(p.ids[0])
    assert text.count("<|im_start|>user\n" + needle.INSTRUCTION) == 1
    assert text.endswith(needle.QUESTION + "<|im_end|>\n<|im_start|>assistant\n" + needle.ANSWER_PREFIX)
    assert text.count(p.key) == 2  # only the needle states the key (twice); the filler has no digits
    before, after = text.split(needle.NEEDLE.format(key=p.key))
    assert before.endswith((".", "\n")) and after.startswith((" ", "\n"))  # between two sentences or lines


def test_prompts_are_deterministic_by_seed(hay):
    a, b = hay.build(400, 0.4, seed=11), hay.build(400, 0.4, seed=11)
    assert torch.equal(a.ids, b.ids) and (a.key, a.offset, a.needle_start) == (b.key, b.offset, b.needle_start)
    others = [hay.build(400, 0.4, seed=s) for s in range(12, 20)]
    assert len({p.key for p in others} | {a.key}) == 9  # a fresh key per seed
    assert len({p.offset for p in others} | {a.offset}) > 1  # and filler from elsewhere
    for p in others:
        assert len(p.key) == needle.KEY_DIGITS and p.key[0] != "0"


def test_cell_seeds_are_distinct_and_fixed():
    seeds = {cell_seed(0, c, i, t) for c in (1000, 2000) for i in range(5) for t in range(3)}
    assert len(seeds) == 30
    assert cell_seed(0, 1000, 2, 1) == cell_seed(0, 1000, 2, 1) != cell_seed(1, 1000, 2, 1)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda h: h.build(400, 1.5, seed=0), "depth"),
        (lambda h: h.build(400, -0.1, seed=0), "depth"),
        (lambda h: h.build(40, 0.5, seed=0), "context"),
        (lambda h: h.build(20000, 0.5, seed=0), "shorter|no run"),
    ],
)
def test_build_errors(hay, make, match):
    with pytest.raises(KvqrsError, match=match):
        make(hay)


def test_haystack_needs_a_chat_template(tok):
    class Plain:
        chat_template = None

    with pytest.raises(KvqrsError, match="chat template"):
        Haystack(Plain(), "Some text.", "tiny")


@pytest.mark.parametrize(
    "answer, right",
    [
        (" 48213.", True),
        ("48213", True),
        (" 48213 is the pass key.", True),
        ("The pass key is 48213, as stated.", True),
        (" 4821.", False),
        (" 482130.", False),
        (" 4821 3.", False),
        (" 12345. 48213", False),  # only the first number counts
        (" The pass key.", False),
        ("", False),
    ],
)
def test_scorer(answer, right):
    assert is_correct(answer, "48213") is right


def test_answer_digits():
    assert answer_digits(" 48213.") == "48213"
    assert answer_digits("none") is None


def test_needle_rows():
    rows = needle_rows(residual_length=16)
    assert [r.name for r in rows] == ["dense", "kqv k4 v4", "kqv k2 v2", "kivi k4 v4", "kivi k2 v2", "block k4 v4", "block k2 v2"]
    assert rows[0].config is None
    for r in rows[1:]:
        scheme, bits = r.name.split()[0], int(r.name.split()[1][1:])
        assert r.config == QuantConfig(scheme, bits, scheme, bits, residual_length=16)
    assert [r.name for r in needle_rows(quick=True)] == ["dense", "kqv k4 v4", "kivi k2 v2"]


@pytest.mark.parametrize(
    "contexts, depths, trials, match",
    [
        ((8200,), (0.5,), 1, "--contexts"),
        ((0,), (0.5,), 1, "--contexts"),
        ((1000,), (1.2,), 1, "--depths"),
        ((1000,), (0.5,), 0, "--trials"),
    ],
)
def test_check_grid(contexts, depths, trials, match):
    with pytest.raises(KvqrsError, match=match):
        needle.check_grid(contexts, depths, trials)


def _made_up_result():
    contexts, depths, names = [1000, 2000], [0.0, 1.0], ["dense", "kqv k2 v2"]
    cells, runs = [], []
    for name in names:
        for c in contexts:
            for d in depths:
                hits = [name == "dense" or d == 1.0, True]
                cells.append({"row": name, "context": c, "depth": d, "trials": 2, "correct": sum(hits), "accuracy": sum(hits) / 2})
                runs += [{"row": name, "context": c, "depth": d, "key": "12345", "correct": h} for h in hits]
    rows = [
        {
            "row": "dense",
            "group": "dense",
            "accuracy": 1.0,
            "acc_1000": 1.0,
            "acc_2000": 1.0,
            "cache_bytes_per_token": 46080.0,
            "seconds": 10.0,
        },
        {
            "row": "kqv k2 v2",
            "group": "full KV",
            "accuracy": 0.75,
            "acc_1000": 0.75,
            "acc_2000": 0.75,
            "cache_bytes_per_token": 3600.0,
            "seconds": 12.0,
        },
    ]
    return {
        "rows": rows,
        "cells": cells,
        "trials": runs,
        "contexts": contexts,
        "depths": depths,
        "trials_per_cell": 2,
        "seed": 0,
        "source": "made up",
        "needle": needle.NEEDLE.strip(),
        "question": needle.QUESTION.strip(),
        "answer_prefix": needle.ANSWER_PREFIX,
        "max_new_tokens": needle.MAX_NEW_TOKENS,
        "prefill_chunk": needle.PREFILL_CHUNK,
    }


def test_report_files(tmp_path):
    res = _made_up_result()
    md = needle_report.write(res, tmp_path, 30.0, "test machine")
    assert md == tmp_path / "needle.md"
    assert {p.name for p in tmp_path.iterdir()} == {"needle.md", "needle.csv", "needle.json", "needle_accuracy.png"}
    with open(tmp_path / "needle.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8 and tuple(table[0]) == needle_report.CELL_COLUMNS
    assert {(r["row"], r["context"], r["depth"], r["correct"]) for r in table} >= {
        ("kqv k2 v2", "2000", "0.0", "1"),
        ("dense", "1000", "0.0", "2"),
    }
    assert json.loads((tmp_path / "needle.json").read_text()) == res
    assert (tmp_path / "needle_accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    body = md.read_text()
    assert "test machine" in body and "needle_accuracy.png" in body
    assert "| dense | 1.00 | 1.00 | 1.00 | 46,080 | 10 |" in body
    assert "| kqv k2 v2 | 0.75 | 0.75 | 0.75 | 3,600 | 12 |" in body
    assert "| kqv k2 v2 | 2000 | 1/2 | 2/2 |" in body


def test_cli_needle_quick(tmp_path, smollm2_installed):
    out = tmp_path / "needle"
    cmd = [sys.executable, "-m", "kvqrs", "eval", "--task", "needle", "--quick", "--rows", "kqv", "--contexts", "512", "--threads", "1"]
    cmd += ["--out", str(out), "--no-progress"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"needle.md", "needle.csv", "needle.json", "needle_accuracy.png"}
    res = json.loads((out / "needle.json").read_text())
    assert [r["row"] for r in res["rows"]] == ["dense", "kqv k4 v4"]
    assert (res["contexts"], res["depths"], res["trials_per_cell"]) == ([512], list(needle.QUICK_DEPTHS), needle.QUICK_TRIALS)
    assert "gensim" in res["source"]
    by = {r["row"]: r for r in res["rows"]}
    # Greedy decoding from fixed seeds: dense SmolLM2-135M answers every quick prompt right
    # (measured); the quantized row ran through QuantizedKVCache (its bytes per token are the
    # cache's: 4-bit keys and values, ~7x below dense float32).
    assert by["dense"]["accuracy"] == 1.0
    assert by["kqv k4 v4"]["cache_bytes_per_token"] < by["dense"]["cache_bytes_per_token"] / 6
    n = len(needle.QUICK_DEPTHS) * needle.QUICK_TRIALS
    assert len(res["trials"]) == 2 * n and len(res["cells"]) == 2 * len(needle.QUICK_DEPTHS)
    assert len({t["key"] for t in res["trials"]}) == n  # a fresh key per prompt, the same prompts for both rows
    for t in res["trials"]:
        assert t["correct"] == (t["digits"] == t["key"])
    assert f"report: {out / 'needle.md'}" in proc.stdout
    assert "| kqv k4 v4 | 512 |" in (out / "needle.md").read_text()
