"""``kvqrs eval`` (the model-level evaluation): evaluation / calibration texts, the scoring of a
row from log-probabilities, the HeadQ recovery arithmetic, the default rows, a tiny end-to-end
``run_eval`` on SmolLM2-135M with its report, and the command line."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.evaluation import model_report, text  # noqa: E402
from kvqrs.evaluation.model_eval import Row, default_rows, headq_recovered, run_eval, score_row, token_windows  # noqa: E402
from kvqrs.hf.attention import _STATE  # noqa: E402

from tests.process_helpers import cli_refusal  # noqa: E402

# Dense perplexity through kvqrs' eager attention vs transformers' own loss with SDPA, float32 on
# one 32-token window: only summation order differs (measured ~2e-7 .. 7e-7); 1e-4 is the bound
# the evaluation's stated tolerance and still catches a wrong mask, scaling or GQA mapping (those move it by >1%).
DENSE_CHECK_RTOL = 1e-4
# The dense row's perplexity (sum of float32 log-probs, then exp) vs the dense check's (mean,
# then exp) on the same forward: float32 summation of 31 terms, ~1e-7 relative.
SAME_FORWARD_RTOL = 1e-6
# KL and agreement of a row with itself are computed from identical tensors: exact.
EXACT = 0.0
# The command line on 2 busy cores: model load (~25 s) + the gensim text + 5 tiny rows.
CLI_TIMEOUT_S = 240

PARAGRAPHS = [
    "Anthropology is the study of humans and their societies in the past and present. Its main "
    "subdivisions are social anthropology and cultural anthropology, which describe the workings of "
    "societies around the world.",
    "Archaeology studies past cultures through the material remains they left behind: tools, "
    "pottery, buildings and the traces of daily life that survive in the ground for thousands of years.",
    "Linguistic anthropology looks at how language shapes communication, forms social identity and "
    "group membership, and organizes large-scale cultural beliefs and ideologies.",
    "Biological anthropology concerns the biological and behavioural aspects of human beings, their "
    "extinct hominin ancestors and related non-human primates, from an evolutionary perspective.",
    "Fieldwork remains the central method: the anthropologist lives among the people studied for a "
    "long period, takes part in their daily life and records what is seen and heard in detailed notes.",
]


pytestmark = pytest.mark.usefixtures("isolated_attention_state")


# --- texts ----------------------------------------------------------------------------------------


def test_from_file_splits_at_a_paragraph_break(tmp_path):
    body = "\n".join(PARAGRAPHS) + "\n"
    p = tmp_path / "t.txt"
    p.write_text(body, encoding="utf-8")
    t = text.from_file(p)
    assert t.calibration + t.evaluation == body  # disjoint and nothing lost
    assert len(t.calibration) >= len(body) // 5  # at least 20% calibrates
    assert t.evaluation.startswith("\n")  # the cut sits on a line break
    assert t.calibration and t.evaluation.strip()
    assert t.calibration.startswith(PARAGRAPHS[0][:40])
    assert str(p) in t.source


def test_from_file_without_line_breaks_and_bad_bytes(tmp_path):
    p = tmp_path / "flat.txt"
    p.write_bytes(b"word " * 100 + b"\xff tail")
    t = text.from_file(p)
    assert len(t.calibration) == len(t.calibration + t.evaluation) // 5
    assert "\ufffd" in t.evaluation  # invalid UTF-8 replaced, not an exception


@pytest.mark.parametrize("make", [lambda d: d / "missing.txt", lambda d: d], ids=["missing", "directory"])
def test_from_file_errors(tmp_path, make):
    with pytest.raises(KvqrsError, match="--data"):
        text.from_file(make(tmp_path))


@pytest.mark.parametrize("content", ["", " \n\t\n"])
def test_from_file_refuses_a_file_without_text(tmp_path, content):
    p = tmp_path / "empty.txt"
    p.write_text(content)
    with pytest.raises(KvqrsError, match="--data: .*empty.txt' holds no text"):
        text.from_file(p)


def test_from_wikitext(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(" = Test =\n" + PARAGRAPHS[0], encoding="utf-8")
    (tmp_path / "wiki.valid.tokens").write_text(" = Tokens =\n" + PARAGRAPHS[2], encoding="utf-8")
    t = text.from_wikitext(tmp_path)
    assert t.evaluation == " = Test =\n" + PARAGRAPHS[0]
    assert t.calibration == " = Tokens =\n" + PARAGRAPHS[2]  # .tokens when there is no .raw
    (tmp_path / "wiki.valid.raw").write_text(" = Valid =\n" + PARAGRAPHS[1], encoding="utf-8")
    t = text.from_wikitext(tmp_path)
    assert t.calibration == " = Valid =\n" + PARAGRAPHS[1]  # .raw preferred
    assert str(tmp_path) in t.source


@pytest.mark.parametrize("present", [(), ("wiki.test.raw",), ("wiki.valid.raw",)], ids=["empty", "no-valid", "no-test"])
def test_from_wikitext_errors(tmp_path, present):
    for name in present:
        (tmp_path / name).write_text("x", encoding="utf-8")
    with pytest.raises(KvqrsError, match="--wikitext"):
        text.from_wikitext(tmp_path)


def test_default_text_is_local_disjoint_and_clean():
    pytest.importorskip("gensim", reason="the default evaluation text ships in gensim's wheel")
    t = text.default()
    assert "gensim" in t.source
    titles = lambda s: re.findall(r"^= (.+) =$", s, re.M)  # noqa: E731
    cal, ev = titles(t.calibration), titles(t.evaluation)
    assert len(cal) == 20 and len(ev) >= 20
    assert not set(cal) & set(ev)
    assert t.calibration[:500] not in t.evaluation and t.evaluation[:500] not in t.calibration
    for s in (t.calibration, t.evaluation):
        assert "[[" not in s and "{{" not in s and "''" not in s  # wiki markup stripped
    assert len(t.evaluation) > 100_000  # enough for several 512-token windows


# --- scoring ----------------------------------------------------------------------------------------


def _lp(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_score_row_identical_distributions():
    ids = torch.tensor([[0, 1, 2, 1]])
    lp = _lp([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.25, 0.5, 0.25]])
    s = score_row(lp, lp.clone(), ids)
    assert s["n"] == 3
    assert s["kl_sum"] == EXACT and s["kl_max"] == EXACT
    assert s["agree"] == 3
    expected_nll = -(math.log(0.2) + math.log(0.6) + math.log(0.5))
    assert s["nll"] == pytest.approx(expected_nll, rel=1e-6)


def test_score_row_kl_and_top1_by_hand():
    ids = torch.tensor([[0, 0, 1]])
    dense = _lp([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    row = _lp([[0.2, 0.7, 0.1], [0.1, 0.5, 0.4]])
    s = score_row(row, dense, ids)
    kl0 = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    kl1 = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.4)
    assert s["kl_sum"] == pytest.approx(kl0 + kl1, rel=1e-5)  # KL(dense || row), not reversed
    assert s["kl_max"] == pytest.approx(kl0, rel=1e-5)
    assert s["agree"] == 1  # position 0 flips its top-1 (0 -> 1), position 1 keeps token 1
    assert s["nll"] == pytest.approx(-(math.log(0.2) + math.log(0.5)), rel=1e-6)
    assert s["n"] == 2


def test_headq_recovered_arithmetic():
    results = [
        {"row": "dense", "ppl": 10.0},
        {"row": "kivi k2", "ppl": 14.0},
        {"row": "headq(kivi) k2", "ppl": 11.0},
        {"row": "headq(kivi) k2 wrong-sign", "ppl": 16.0},
        {"row": "headq(kivi) k2 random-basis", "ppl": 14.0},
        {"row": "headq(kqv) k2", "ppl": 12.0},  # no "kqv k2" baseline: skipped
    ]
    out = headq_recovered(results)
    assert [(h["baseline"], h["row"]) for h in out] == [
        ("kivi k2", "headq(kivi) k2"),
        ("kivi k2", "headq(kivi) k2 wrong-sign"),
        ("kivi k2", "headq(kivi) k2 random-basis"),
    ]
    assert [h["recovered"] for h in out] == pytest.approx([0.75, -0.5, 0.0])
    # a baseline as good as dense has no excess to recover: no division by zero, no entry
    assert headq_recovered([{"row": "dense", "ppl": 5.0}, {"row": "kqv k2", "ppl": 5.0}, {"row": "headq(kqv) k2", "ppl": 6.0}]) == []


def _expected_rows(quick: bool) -> dict[str, tuple[str, str | None, int, str | None]]:
    """name -> (group, key scheme, key bits, value scheme) of the evaluation's named rows."""
    rows = {"dense": ("dense", None, 0, None)}
    for scheme in ("kv", "kqv", "qkqv"):
        for n in (2, 4) if quick else (2, 3, 4):
            rows[f"{scheme} k{n}"] = ("key-only", scheme, n, None)
            rows[f"{scheme} k{n} v{n}"] = ("full KV", scheme, n, scheme)
    for n in (2, 4):
        rows[f"kivi k{n}"] = ("key-only", "kivi", n, None)
        rows[f"kivi k{n} v{n}"] = ("full KV", "kivi", n, "kivi")
    for n in (4,) if quick else (4, 8):
        rows[f"block k{n}"] = ("key-only", "block", n, None)
        rows[f"block k{n} v{n}"] = ("full KV", "block", n, "block")
    for base in ("kivi", "kqv"):
        for label in ("", " wrong-sign", " random-basis"):
            rows[f"headq({base}) k2{label}"] = ("key-only", "headq", 2, None)
    return rows


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("residual", [0, 16])
def test_default_rows_contain_the_named_rows(quick, residual):
    rows = default_rows(quick=quick, residual_length=residual)
    names = [r.name for r in rows]
    assert len(names) == len(set(names))
    assert names[0] == "dense" and rows[0].config is None
    by = {r.name: r for r in rows}
    expected = _expected_rows(quick)
    assert set(expected) <= set(by), f"missing rows: {sorted(set(expected) - set(by))}"
    if quick:
        assert not {"kqv k3", "block k8"} & set(by)
    for name, (group, scheme, bits, value_scheme) in expected.items():
        row = by[name]
        assert row.group == group, name
        if scheme is None:
            continue
        cfg = row.config
        assert (cfg.key_scheme, cfg.key_bits, cfg.value_scheme) == (scheme, bits, value_scheme), name
        assert cfg.residual_length == residual
        if value_scheme is not None:
            assert (cfg.value_bits or cfg.key_bits) == bits
        if scheme == "headq":
            base = name[len("headq(") : name.index(")")]
            assert (cfg.headq_base, cfg.rank) == (base, 4)
            assert cfg.sign == (-1 if "wrong-sign" in name else 1)
            assert cfg.bases == ("random" if "random-basis" in name else None)
    # A^2 against uniform values at 2 bits: the oracle pair in the run's window, the causal pair
    # (importances only from queries inside a full-precision window) in a window of >= 64.
    w = max(residual, 64)
    pairs = {
        "uniform v2": (residual, True, None),
        "a2 v2 (oracle weights)": (residual, False, None),
        f"uniform v2 (window {w})": (w, True, None),
        f"a2 v2 (causal, window {w})": (w, False, w),
    }
    for name, (window, uniform, lookahead) in pairs.items():
        cfg = by[name].config
        assert by[name].group == "values-only" and cfg.key_scheme is None and (cfg.value_scheme, cfg.value_bits) == ("a2", 2)
        assert (cfg.residual_length, cfg.a2_uniform, cfg.a2_lookahead) == (window, uniform, lookahead), name


def test_default_rows_end_with_the_presets():
    """The three presets calibrated on the prompt, and each refined by a file where one is given."""
    from kvqrs.hf.config import PRESETS
    from kvqrs.schemes.matched import random_calibration

    names = [r.name for r in default_rows()]
    assert names[-3:] == ["matched 4bit (prompt)", "matched 3bit (prompt)", "matched 2bit (prompt)"]
    cal = {layer: random_calibration(64, 3, layer) for layer in range(2)}
    rows = default_rows(residual_length=16, calibrations={"3bit": cal})
    by = {r.name: r for r in rows}
    for name, p in PRESETS.items():
        cfg = by[f"matched {name} (prompt)"].config
        assert (cfg.key_scheme, cfg.value_scheme, cfg.calibration, cfg.group, cfg.value_norms) == (
            "matched",
            "matched",
            "prefill",
            p["group"],
            p["value_norms"],
        )
        assert cfg.residual_length == 16 and by[f"matched {name} (prompt)"].group == "full KV"
    assert by["matched 3bit (file)"].config.calibration is cal and "matched 4bit (file)" not in by


def test_results_read_by_budget():
    from kvqrs.evaluation.model_eval import by_budget

    rows = [{"row": n, "bpe_k": k, "bpe_v": v} for n, k, v in [("a", 4.0, 4.0), ("dense", 32, 32), ("b", 2.0, 32), ("c", 5.0, 3.0)]]
    assert [r["row"] for r in by_budget(rows)] == ["dense", "b", "a", "c"]  # 32, 17, then 4 and 4 in their given order


def test_matched_prompt_row_counts_its_calibration(model32):
    """A preset calibrated on the window counts every layer's codes, its float16 sink, the
    calibration each layer fits (as the cache that fits it on its prompt holds it) and the tokens
    of a group not yet full, which the cache holds in full precision."""
    from kvqrs.evaluation.capture import record
    from kvqrs.evaluation.model_eval import storage
    from kvqrs.hf import QuantConfig

    model, tok = model32
    ids = tok(" ".join(PARAGRAPHS), return_tensors="pt").input_ids[:, :65]
    qkv = record(model, ids)
    kv, queries = {layer: t[1:] for layer, t in qkv.items()}, {layer: t[0] for layer, t in qkv.items()}
    whole = storage(QuantConfig.preset("4bit", group=16), kv, queries)  # 64 tokens after the sink: 4 groups, all coded
    assert 4.0 < whole["bpe_k"] < 8.0 and 4.0 < whole["bpe_v"] < 8.0  # codes, sink and the fitted calibration, on 65 tokens
    cfg = QuantConfig.preset("4bit", group=24)  # 2 groups coded, 16 tokens in full precision (float32: 32 bits)
    got = storage(cfg, kv, queries)
    for side in ("bpe_k", "bpe_v"):
        assert 16 * 32 / 65 + 2.0 < got[side] < 16 * 32 / 65 + 8.0
    dense = 2 * sum(k.nbytes for k, _ in kv.values())
    assert dense / 4 < got["cache_bytes"] < dense / 2
    with pytest.raises(KvqrsError, match="needs the window's queries"):
        storage(cfg, kv)


def test_default_rows_are_fresh_objects():
    # run_eval writes calibrated bases into headq rows: two calls must not share configs
    a, b = default_rows(), default_rows()
    assert all(x.config is not y.config for x, y in zip(a, b) if x.config is not None)


# --- the model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text("\n".join(PARAGRAPHS * 2) + "\n", encoding="utf-8")
    return text.from_file(p)


@pytest.fixture(scope="module")
def result(model32, texts):
    model, tok = model32
    wanted = ("dense", "kqv k2", "headq(kqv) k2")
    rows = [r for r in default_rows() if r.name in wanted]
    assert [r.name for r in rows] == list(wanted)
    start = time.perf_counter()
    out = run_eval(model, tok, texts, rows, window=32, windows=1, calib_windows=1, progress=False)
    _STATE.set(None)  # see the isolated_attention_state fixture
    return out, rows, time.perf_counter() - start


def test_token_windows(model32):
    _, tok = model32
    ids = tok(" ".join(PARAGRAPHS), return_tensors="pt").input_ids[0]
    w = token_windows(tok, " ".join(PARAGRAPHS), 32, 100)
    assert len(w) == len(ids) // 32 >= 2
    assert all(x.shape == (1, 32) for x in w)
    assert torch.equal(torch.cat([x[0] for x in w]), ids[: 32 * len(w)])  # consecutive, no overlap
    assert len(token_windows(tok, " ".join(PARAGRAPHS), 32, 1)) == 1


def test_run_eval_dense_row_and_check(model32, result):
    model, _ = model32
    res, _, _ = result
    assert (res["windows"], res["window"], res["calibration_windows"]) == (1, 32, 1)
    check = res["dense_check"]
    assert check["relative_difference"] < DENSE_CHECK_RTOL
    assert check["relative_difference"] == pytest.approx(abs(check["ppl_kvqrs"] - check["ppl_transformers"]) / check["ppl_transformers"])
    assert check["transformers_attention"] == "sdpa"
    dense = res["rows"][0]
    assert dense["row"] == "dense" and dense["tokens"] == 31
    assert dense["ppl"] == pytest.approx(check["ppl_kvqrs"], rel=SAME_FORWARD_RTOL)
    assert (dense["kl_mean"], dense["kl_max"], dense["top1"], dense["excess_ppl"]) == (0.0, 0.0, 1.0, 0.0)
    assert (dense["bpe_k"], dense["bpe_v"]) == (32.0, 32.0)
    # dense cache bytes: what transformers' own DynamicCache holds for one window
    cfg = model.config
    assert dense["cache_bytes"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * 64 * 4


def test_run_eval_quantized_rows(model32, result):
    model, _ = model32
    res, rows, _ = result
    by = {r["row"]: r for r in res["rows"]}
    dense = by["dense"]
    for name in ("kqv k2", "headq(kqv) k2"):
        r = by[name]
        assert set(r) >= {"ppl", "excess_ppl", "kl_mean", "kl_max", "top1", "bpe_k", "bpe_v", "cache_bytes", "tokens"}
        assert math.isfinite(r["ppl"]) and r["ppl"] > 0
        assert r["excess_ppl"] == pytest.approx(r["ppl"] - dense["ppl"])
        assert 0 < r["kl_mean"] <= r["kl_max"]
        assert 0 < r["top1"] < 1
        assert r["bpe_v"] == 32.0  # key-only
        assert 0 < r["cache_bytes"] < dense["cache_bytes"]
    kqv = by["kqv k2"]
    # 2-bit codes (64 x 2 bits = 16 bytes) + a float16 norm per 64-dim key
    assert kqv["bpe_k"] == 8 * (16 + 2) / 64
    cfg = model.config
    per_token_head = (16 + 2) + 64 * 4  # quantized key + float32 value
    assert kqv["cache_bytes"] == cfg.num_hidden_layers * cfg.num_key_value_heads * 32 * per_token_head
    assert kqv["ppl"] > dense["ppl"]  # 2-bit keys with no window cost perplexity
    headq = by["headq(kqv) k2"]
    assert headq["bpe_k"] > kqv["bpe_k"]  # the side code costs bits
    # run_eval calibrated the headq row's bases and wrote them into its config
    bases = rows[2].config.bases
    assert isinstance(bases, dict) and sorted(bases) == list(range(cfg.num_hidden_layers))
    rec = res["headq_recovered"]
    assert len(rec) == 1 and rec[0]["baseline"] == "kqv k2" and rec[0]["row"] == "headq(kqv) k2"
    assert rec[0]["recovered"] == pytest.approx((kqv["ppl"] - headq["ppl"]) / (kqv["ppl"] - dense["ppl"]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_run_eval_text_shorter_than_a_window(model32):
    model, tok = model32
    short = text.Texts("Too short.", " ".join(PARAGRAPHS), "tiny")
    with pytest.raises(KvqrsError):
        run_eval(model, tok, short, [Row("dense", None, "dense")], window=32, windows=1, calib_windows=1, progress=False)


def test_report_files(tmp_path, result):
    res, _, seconds = result
    md = model_report.write(res, tmp_path / "out", seconds)
    out = tmp_path / "out"
    assert md == out / "eval.md"
    assert {p.name for p in out.iterdir()} == {"eval.md", "eval.csv", "eval.json", "quality_vs_bits.png"}
    with open(out / "eval.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["row"] for r in table] == ["dense", "headq(kqv) k2", "kqv k2"]  # by budget: 17.25 then 17.125 bits per element
    assert set(model_report.COLUMNS) <= set(table[0])
    for got, want in zip(table, res["rows"]):
        assert float(got["ppl"]) == pytest.approx(want["ppl"], rel=1e-12)
        assert int(got["cache_bytes"]) == want["cache_bytes"]
    assert json.loads((out / "eval.json").read_text()) == json.loads(json.dumps(res))
    assert (out / "quality_vs_bits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    body = md.read_text()
    assert "Dense check" in body and "quality_vs_bits.png" in body
    for r in res["rows"]:
        assert f"| {r['row']} |" in body
    assert "headq(kqv) k2 vs kqv k2" in body


def test_held_note_names_the_coded_rows_held_partly_in_full_precision():
    rows = [
        {"row": "dense", "group": "dense", "bpe_k": 32.0, "bpe_v": 32.0},
        {"row": "block k8 v8", "group": "full KV", "bpe_k": 9.0, "bpe_v": 9.0},
        {"row": "matched 4bit (prompt)", "group": "full KV", "bpe_k": 18.115, "bpe_v": 18.094},
        {"row": "kivi k4", "group": "key-only", "bpe_k": 5.0, "bpe_v": 32.0},
    ]
    note = model_report.held_note({"rows": rows})
    assert len(note) == 2 and "side (matched 4bit (prompt)) held part of each window in full precision" in note[0]
    assert model_report.held_note({"rows": [r for r in rows if not r["row"].startswith("matched")]}) == []


# --- command line -------------------------------------------------------------------------------------


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # see model32: contention makes two threads ~10x slower
    return env


def test_cli_eval_missing_data_file_is_a_clean_error(tmp_path, monkeypatch, capsys):
    err = cli_refusal(["eval", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")], tmp_path, monkeypatch, capsys)
    assert "kvqrs eval: error: --data" in err
    assert not (tmp_path / "o").exists()


def test_cli_eval_quick(tmp_path):
    try:
        from kvqrs.evaluation import model as model_mod

        model_mod.model_dir()
    except KvqrsError as e:
        pytest.skip(f"SmolLM2 model not available: {e}")
    pytest.importorskip("gensim", reason="the default evaluation text ships in gensim's wheel")
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "kvqrs",
        "eval",
        "--quick",
        "--rows",
        "kqv",
        "--window",
        "32",
        "--windows",
        "1",
        "--calibration-windows",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=CLI_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"eval.md", "eval.csv", "eval.json", "quality_vs_bits.png"}
    res = json.loads((out / "eval.json").read_text())
    assert [r["row"] for r in res["rows"]] == ["dense", "kqv k4", "kqv k2", "kqv k4 v4", "kqv k2 v2"]  # by budget
    assert (res["window"], res["windows"], res["calibration_windows"]) == (32, 1, 1)
    assert "gensim" in res["source"]
    assert res["dense_check"]["relative_difference"] < DENSE_CHECK_RTOL
    by = {r["row"]: r for r in res["rows"]}
    for n in (2, 4):
        key_only, full = by[f"kqv k{n}"], by[f"kqv k{n} v{n}"]
        assert full["cache_bytes"] < key_only["cache_bytes"] < by["dense"]["cache_bytes"]
        assert full["bpe_v"] < 32.0 == key_only["bpe_v"]
        assert all(np.isfinite(r[k]) for r in (key_only, full) for k in ("ppl", "kl_mean", "kl_max", "top1"))
    assert by["kqv k2"]["bpe_k"] < by["kqv k4"]["bpe_k"]
    with open(out / "eval.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 5
    assert f"report: {out / 'eval.md'}" in proc.stdout
    assert "| kqv k4 v4 |" in (out / "eval.md").read_text()


@pytest.mark.parametrize("args, match", [(["--window", "1"], "--window: expected at least 2"), (["--window", "9000"], "8192")])
def test_cli_eval_window_bounds(tmp_path, monkeypatch, capsys, args, match):
    assert match in cli_refusal(["eval", *args, "--out", str(tmp_path / "o")], tmp_path, monkeypatch, capsys)


def test_fastest_threads_keeps_the_faster_setting(model32):
    import os as _os

    from kvqrs.evaluation.model import fastest_threads

    model, tok = model32
    before = torch.get_num_threads()
    try:
        n, timings = fastest_threads(model, tok(PARAGRAPHS[0], return_tensors="pt").input_ids[:, :16])
        assert set(timings) == {1, _os.cpu_count() or 1} and all(t > 0 for t in timings.values())
        assert timings[n] == min(timings.values()) and torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)
