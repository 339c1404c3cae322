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

from tests.cache_helpers import held_tensors  # noqa: E402
from tests.process_helpers import cli_refusal  # noqa: E402

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


def _tiny_model(tok, dtype):
    """A tiny random Llama over SmolLM2's vocabulary (kvqrs attention, fixed seed)."""
    import transformers
    from kvqrs.hf import register

    register()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("kvqrs")
    return model


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "config",
    [
        None,
        QuantConfig("kqv", 4, "kqv", 4),
        QuantConfig("kivi", 2, "kivi", 2),
        QuantConfig("matched", 2, "matched", 2, group=128, sink_tokens=1, calibration="random"),
    ],
    ids=["dense", "kqv", "kivi", "matched"],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_sdpa_prefill_gives_the_eager_answers_and_cache(tok, hay, monkeypatch, config, dtype):
    """retrieve() with the SDPA prefill (the needle task's default) against the eager one on a
    tiny random model and a real 2,500-token needle prompt (prefill chunks of 1,024, decode
    through the fused path): the same answer tokens and the same cache. float64: every code and
    full-precision token exactly equal. float32 (the task's dtype): keys differ by float
    rounding (~1e-7), so a code whose input sits on a decision boundary may flip: at most 1 in
    1,000 code bytes, every other part equal to float rounding."""
    import torch.nn.functional as F

    model = _tiny_model(tok, dtype)
    prompt = hay.build(2500, 0.5, seed=5)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    runs, held = {}, {}
    for prefill in ("eager", "sdpa"):
        cache = needle.make_cache(model, config)
        calls.clear()
        runs[prefill] = needle.retrieve(model, tok, prompt, config, prefill, cache=cache)
        held[prefill] = (held_tensors(cache), len(calls))
    assert held["eager"][1] == 0 and held["sdpa"][1] >= 2 * 3  # 2 layers x 3 prefill chunks at least
    assert runs["eager"]["answer"] == runs["sdpa"]["answer"]
    assert runs["eager"]["cache_bytes_per_token"] == runs["sdpa"]["cache_bytes_per_token"]
    a, b = held["eager"][0], held["sdpa"][0]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        if dtype == torch.float64:
            assert torch.equal(x, y)
        elif x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4)
        else:
            assert (x != y).float().mean() <= 1e-3
    with pytest.raises(KvqrsError, match="prefill"):
        needle.retrieve(model, tok, prompt, config, "flash")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_run_needle_logs_and_resumes(tok, tmp_path, monkeypatch):
    """Each generation is appended to the log as it ends; a run given those generations
    (``--resume``) generates nothing again and returns the same result; prompts or a prefill
    not in the log are generated."""
    from types import SimpleNamespace

    model = _tiny_model(tok, torch.float32)
    texts = SimpleNamespace(evaluation=_corpus(600), source="made-up sentences")
    rows = needle_rows()[:2]
    log = tmp_path / "t.jsonl"
    first = needle.run_needle(model, tok, texts, rows, (200, 300), (0.0, 1.0), 1, progress=False, log=log)
    logged = needle.read_trials([log])
    assert len(logged) == len(first["trials"]) == 8
    assert [t["context"] for t in first["trials"][:4]] == [200, 200, 300, 300]  # per row, shortest context first
    generated = []
    real = needle.retrieve
    monkeypatch.setattr(needle, "retrieve", lambda *a, **k: generated.append(a[2].context) or real(*a, **k))
    again = needle.run_needle(model, tok, texts, rows, (200, 300), (0.0, 1.0), 1, progress=False, reuse=logged)
    assert generated == [] and again == first
    more = needle.run_needle(model, tok, texts, rows, (200, 300, 400), (0.0, 1.0), 1, progress=False, reuse=logged)
    assert generated == [400] * 4 and more["trials"][:4] == first["trials"][:4]
    needle.run_needle(model, tok, texts, rows[:1], (200,), (0.0,), 1, progress=False, prefill="eager", reuse=logged)
    assert generated == [400] * 4 + [200]
    log.write_text(log.read_text() + "not json\n")
    with pytest.raises(KvqrsError, match="line 9 is not a logged needle generation"):
        needle.read_trials([log])
    with pytest.raises(KvqrsError, match="cannot read"):
        needle.read_trials([tmp_path / "missing.jsonl"])


def test_needle_rows():
    rows = needle_rows(residual_length=16)
    assert [r.name for r in rows] == ["dense", "kqv k4 v4", "kqv k2 v2", "kivi k4 v4", "kivi k2 v2", "block k4 v4", "block k2 v2"]
    assert rows[0].config is None
    for r in rows[1:]:
        scheme, bits = r.name.split()[0], int(r.name.split()[1][1:])
        assert r.config == QuantConfig(scheme, bits, scheme, bits, residual_length=16)
    assert [r.name for r in needle_rows(quick=True)] == ["dense", "kqv k4 v4", "kivi k2 v2"]


def test_needle_rows_with_preset_calibrations(tmp_path):
    """--calibration files add the matched preset row each was fitted for (the preset `kvqrs
    calibrate --preset` records); a file fitted for no preset, or two for one preset, is refused."""
    from kvqrs.hf import save_matched
    from kvqrs.schemes.matched import random_calibration

    from tests.schemes.test_matched import preset_meta

    cal = {i: random_calibration(64, 4, i) for i in range(3)}
    paths = {}
    for name, preset in {"a": "4bit", "b": "2bit", "c": None, "d": "4bit"}.items():
        meta = {"group": 256, "sink_tokens": 1, "source": "t"} | ({"budget": 3.0} if preset is None else preset_meta(preset))
        paths[name] = save_matched(tmp_path / f"{name}.npz", cal, meta)
    cals = needle.preset_calibrations([paths["b"], paths["a"]])
    assert sorted(cals) == ["2bit", "4bit"] and sorted(cals["4bit"]) == [0, 1, 2]
    rows = needle_rows(residual_length=0, calibrations=cals)
    assert [r.name for r in rows][-2:] == ["matched 4bit", "matched 2bit"]
    assert rows[-2].config == QuantConfig.preset("4bit", cals["4bit"], residual_length=0)
    assert rows[-1].config == QuantConfig.preset("2bit", cals["2bit"], residual_length=0)
    assert (rows[-2].config.group, rows[-2].config.sink_tokens, rows[-1].config.key_bits) == (256, 1, 2)
    with pytest.raises(KvqrsError, match="was not fitted for a preset"):
        needle.preset_calibrations([paths["c"]])
    with pytest.raises(KvqrsError, match="two files for the 4bit preset"):
        needle.preset_calibrations([paths["a"], paths["d"]])
    bare = save_matched(tmp_path / "bare.npz", cal)
    with pytest.raises(KvqrsError, match="was not fitted for a preset"):
        needle.preset_calibrations([bare])


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
        "prefill": "sdpa",
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
    assert {p.name for p in out.iterdir()} == {"needle.md", "needle.csv", "needle.json", "needle_accuracy.png", "needle.trials.jsonl"}
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
    logged = [json.loads(line) for line in (out / "needle.trials.jsonl").read_text().splitlines()]
    assert sorted(map(str, logged)) == sorted(map(str, res["trials"]))  # every generation logged as it ended
    assert {t["prefill"] for t in logged} == {"sdpa"} and res["prefill"] == "sdpa"
    assert f"report: {out / 'needle.md'}" in proc.stdout
    assert "| kqv k4 v4 | 512 |" in (out / "needle.md").read_text()


@pytest.mark.parametrize(
    "args, match",
    [
        (["--rows", "nosuch"], "--rows: no row label starts with 'nosuch'; the labels are 'dense', 'kqv k4 v4'"),
        (["--protocol", "llama"], "--protocol: the needle task has no protocol 'llama'"),
        (["--contexts", "9000"], "--contexts"),
        (["--trials", "0"], "--trials"),
        (["--calibration", "missing.npz"], "calibration: cannot read 'missing.npz'"),
        (["--resume", "missing.jsonl"], "--resume: cannot read 'missing.jsonl'"),
        (["--prefill", "flash"], "invalid choice: 'flash'"),
    ],
)
def test_cli_needle_bad_options_fail_before_the_model_loads(tmp_path, monkeypatch, capsys, args, match):
    err = cli_refusal(["eval", "--task", "needle", *args, "--out", str(tmp_path / "o")], tmp_path, monkeypatch, capsys)
    assert match in err, err[-2000:]
    assert not (tmp_path / "o").exists()
