"""Captured real heads and the HeadQ paper's mechanism checks: the capture matches the model's
own cache and GQA grouping, the score-space ranking and the softmax-null intervention behave as
their definitions say, and ``kvqrs study --from-model`` writes its report."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.evaluation import text  # noqa: E402
from kvqrs.evaluation.capture import MODEL_DISTRIBUTION, _group_queries, capture_heads  # noqa: E402
from kvqrs.evaluation.mechanisms import score_space_ranking, softmax_null, softmax_null_head  # noqa: E402
from kvqrs.evaluation.sample import Cell, make_codec, measure  # noqa: E402
from kvqrs.hf.attention import _STATE  # noqa: E402

# Keys captured through the attention interface against the keys transformers' DynamicCache stores
# for the same forward: the same float32 tensor, so equal bit for bit.
EXACT = 0.0
# Restoring the mean makes the damage independent of any shift shared by all keys, up to the
# float32 rounding of k + c - mu (c of size 30 against keys of size ~3: ~1e-5 relative).
SHIFT_RTOL = 2e-3
CLI_TIMEOUT_S = 300

TEXT = (
    "The river rises in the northern hills and flows south through farmland, past three market "
    "towns and a cathedral city, before it reaches the estuary and the sea. "
) * 40


@pytest.fixture(autouse=True)
def _no_state():
    _STATE.set(None)
    yield
    _STATE.set(None)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT + "\n" + TEXT.replace("river", "road"), encoding="utf-8")
    return text.from_file(p)


@pytest.fixture(scope="module")
def captured(model32, texts):
    model, tok = model32
    return capture_heads(model, tok, texts, tokens=48, n_queries=7)


def test_group_queries_order():
    # q[head, position, :] = (head, position): heads 3..5 read KV head 1 when g = 3.
    q = np.zeros((6, 10, 2), np.float32)
    q[..., 0] = np.arange(6)[:, None]
    q[..., 1] = np.arange(10)[None, :]
    got = _group_queries(q, kv_heads=2, h=1, positions=slice(4, 6))
    assert got.tolist() == [[3, 4], [4, 4], [5, 4], [3, 5], [4, 5], [5, 5]]


def test_capture_shapes_and_layout(model32, captured):
    model, _ = model32
    cfg = model.config
    assert len(captured.heads) == cfg.num_hidden_layers * cfg.num_key_value_heads
    assert captured.kv_heads == cfg.num_key_value_heads
    assert captured.layer_head(len(captured.heads) - 1) == (cfg.num_hidden_layers - 1, cfg.num_key_value_heads - 1)
    for h, cq in zip(captured.heads, captured.calibration_queries):
        assert h.keys.shape == h.values.shape == (48, 64) and h.queries.shape == (7, 64)
        assert h.distribution == MODEL_DISTRIBUTION
        assert h.keys.dtype == h.queries.dtype == np.float32
        assert cq.shape[0] == 3 * (48 + 3) and cq.shape[1] == 64  # g = 3 heads x (48 + ceil(7 / 3)) positions
        assert np.all(np.isfinite(h.queries)) and np.all(np.isfinite(h.keys))


def test_captured_keys_are_the_models_cached_keys(model32, texts, captured):
    from transformers import DynamicCache

    model, tok = model32
    ids = tok(texts.evaluation, return_tensors="pt").input_ids[:, :51]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    for index in (0, 4, len(captured.heads) - 1):
        layer, h = captured.layer_head(index)
        k = cache.layers[layer].keys[0, h, :48].numpy()
        v = cache.layers[layer].values[0, h, :48].numpy()
        assert np.max(np.abs(captured.heads[index].keys - k)) == EXACT
        assert np.max(np.abs(captured.heads[index].values - v)) == EXACT


def test_capture_rejects_a_short_text(model32, tmp_path):
    model, tok = model32
    p = tmp_path / "short.txt"
    p.write_text("A few words.\nAnd a few more words here.\n")
    with pytest.raises(KvqrsError, match="fewer than the .* needed"):
        capture_heads(model, tok, text.from_file(p), tokens=48, n_queries=7)


def test_measure_on_captured_heads(captured):
    for scheme in ("kqv", "headq"):
        cell = Cell(scheme, 2, MODEL_DISTRIBUTION, 64)
        row = measure(cell, 3, captured.heads[3], make_codec(cell, 3, captured.calibration_queries[3]))
        assert row["distribution"] == MODEL_DISTRIBUTION and row["seed"] == 3
        assert all(np.isfinite(v) for v in row.values() if isinstance(v, float))
        assert row["kl_mean"] > 0 and row["fisher"] > 0 and row["key_mse"] > 0


def test_score_space_ranking_definition():
    rng = np.random.default_rng(0)
    rows = []
    for scheme in ("a", "b"):
        for _ in range(20):
            kl = float(rng.uniform(0.1, 1.0))
            rows.append({"scheme": scheme, "bits": 2, "kl_mean": kl, "fisher": 2 * kl, "score_mse": -kl, "key_mse": float(rng.uniform())})
    out = score_space_ranking(rows)
    assert [(r["scheme"], r["bits"], r["samples"]) for r in out] == [("all", "all", 40), ("a", 2, 20), ("b", 2, 20)]
    for r in out:
        assert r["rho_fisher"] == pytest.approx(1.0) and r["rho_score_mse"] == pytest.approx(-1.0)
        assert abs(r["rho_key_mse"]) < 0.6 and r["p_fisher"] < 1e-6


def test_softmax_null_restored_damage_ignores_a_shared_shift():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((16, 64)).astype(np.float32)
    k = rng.standard_normal((200, 64)).astype(np.float32)
    c = (30 * rng.standard_normal(64)).astype(np.float32)
    for scheme in ("kv", "kqv", "block"):
        base = softmax_null_head(q, k, scheme, 3, seed=5)
        shifted = softmax_null_head(q, k + c, scheme, 3, seed=5)
        assert shifted["fisher_restored"] == pytest.approx(base["fisher_restored"], rel=SHIFT_RTOL)
        # Left in, the shift swamps a fixed-grid code: far more damage than with it restored.
        assert shifted["fisher_as_is"] > 5 * shifted["fisher_restored"]
        assert shifted["key_mse_as_is"] > 5 * shifted["key_mse_restored"]
        assert shifted["mean_share"] > 0.9 > base["mean_share"]


def test_softmax_null_kivi_is_the_control(captured):
    rows, summary = softmax_null(captured.heads[:6], schemes=("kqv", "kivi"), bits=(2,))
    assert len(rows) == 12 and {(s["scheme"], s["bits"], s["heads"]) for s in summary} == {("kqv", 2, 6), ("kivi", 2, 6)}
    by = {s["scheme"]: s for s in summary}
    # KIVI's per-channel zero point absorbs the mean: removing it first changes (almost) nothing.
    assert by["kivi"]["median_key_mse_ratio"] == pytest.approx(1.0, abs=0.05)
    assert by["kqv"]["median_key_mse_ratio"] > 1.2
    assert all(0 < r["mean_share"] < 1 for r in rows)


def test_cli_study_from_model(tmp_path):
    pytest.importorskip("gensim", reason="the default text ships in gensim's wheel")
    from kvqrs.evaluation import model as model_mod

    try:
        model_mod.model_dir()
    except KvqrsError as e:
        pytest.skip(f"SmolLM2 model not available: {e}")
    out = tmp_path / "study"
    cmd = [
        sys.executable,
        "-m",
        "kvqrs",
        "study",
        "--from-model",
        "--quick",
        "--seeds",
        "2",
        "--tokens",
        "64",
        "--queries",
        "6",
        "--schemes",
        "kqv",
        "kivi",
        "--bits",
        "2",
        "--distributions",
        "gaussian",
        "--permutations",
        "9",
        "--no-progress",
        "--brief",
        "--out",
        str(out),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "captured 90 heads" in proc.stdout
    summary = (out / "summary.md").read_text()
    assert "## Mechanism checks on 90 captured heads" in summary and "Softmax-null intervention" in summary
    assert "| smollm2 | 64 | 2 | kqv |" in summary and "| gaussian | 64 | 2 | kqv |" in summary
    with open(out / "samples.csv", newline="") as f:
        samples = list(csv.DictReader(f))
    assert len(samples) == 2 * 2 + 90 * 2  # synthetic: 2 seeds x 2 schemes; model: 90 heads x 2 schemes
    with open(out / "softmax_null.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 90 * 4  # 90 heads x (kv, kqv, block, kivi) x n = 2
    with open(out / "mechanisms_ranking.csv", newline="") as f:
        assert [r["scheme"] for r in csv.DictReader(f)] == ["all", "kivi", "kqv"]
