"""The synthetic study (``kvqrs.evaluation``): a tiny grid through ``run_study`` and
``write_report``, the report folder's files, the ``kvqrs study`` command line, and the theory
checks (QJL variance inflation, the 2-pi factor, KL ratio, direction crossover)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from kvqrs import oracle
from kvqrs.evaluation import theory
from kvqrs.evaluation.report import TABLE_METRICS, cell_table, pairwise, write_report
from kvqrs.evaluation.sample import Cell, run_sample
from kvqrs.evaluation.study import STUDY_SCHEMES, StudyConfig, run_study
from kvqrs.metrics import SIX_D_NAMES

ROOT = pathlib.Path(__file__).resolve().parents[2]

# QJL inflation with few sketch seeds: the sample variance over T trials has relative standard
# error sqrt(2 / (T - 1)) (0.1 at T = 200); 0.35 is 3.5 standard errors.
INFLATION_RTOL = 0.35
# Bias z-score of an unbiased estimator over 200 trials: |z| < 4 (p ~ 6e-5 per run).
BIAS_Z_MAX = 4.0
# Measured qkqv / kqv score-error variance ratio on 3 tiny samples against the Lloyd-Max theory
# (pi/2) D_{n-1} / D_n: the sampling error of a ratio of means over 3 x 8 x 64 scores is tens of
# percent; within a factor 2 of the theory.
TWO_PI_FACTOR_SLACK = 2.0

GRID = StudyConfig(schemes=("kqv", "qkqv"), bits=(2, 3), distributions=("gaussian",), head_dims=(64,), seeds=3, tokens=64, n_queries=8)
PERMUTATIONS = 19
REPORT_FILES = {
    "summary.md",
    "samples.csv",
    "samples.json",
    "pairwise.csv",
    "shannon_phi_plane.png",
    "kl_distributions.png",
    "routing_recall.png",
}
ROW_KEYS = [
    "scheme",
    "bits",
    "distribution",
    "head_dim",
    "seed",
    *SIX_D_NAMES,
    "kl_mean",
    "kl_p99",
    "kl_max",
    "topk_recall",
    "fisher",
    "score_mse",
    "key_mse",
    "key_mse_rel",
    "a2",
    "bpe_k",
    "bpe_v",
]


def bpe(scheme, n, d=64, tokens=64):
    """Hand-computed bits per element of the study's cells (keys, values) at d' = d = 64."""
    keys = {"kv": n + 16 / d, "kqv": n + 16 / d, "qkqv": (n - 1) + 1 + 32 / d, "kivi": n + 32 * math.ceil(tokens / 32) / tokens}
    keys["headq"] = keys["kivi"] + 8 * math.ceil(4 * 4 / 8) / d + 16 / d
    values = {
        "kv": n + 16 / d,
        "kqv": (n - 1) + 1 + 32 / d,
        "qkqv": (n - 1) + 1 + 32 / d,
        "kivi": n + 32 * math.ceil(d / 32) / d,
        "headq": n + 32 * math.ceil(d / 32) / d,
    }
    return keys[scheme], values[scheme]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    rows, seconds = run_study(GRID, progress=False)
    out = tmp_path_factory.mktemp("study") / "report"
    summary = write_report(rows, out, GRID, seconds, permutations=PERMUTATIONS)
    return rows, out, summary


# --------------------------------------------------------------------------------------------
# run_study rows
# --------------------------------------------------------------------------------------------


def test_rows_cover_the_grid(study):
    rows, _, _ = study
    assert len(rows) == len(GRID.cells()) * GRID.seeds == 2 * 2 * 3
    got = sorted((r["scheme"], r["bits"], r["seed"]) for r in rows)
    assert got == sorted((s, n, seed) for s in GRID.schemes for n in GRID.bits for seed in range(GRID.seeds))
    for r in rows:
        assert list(r) == ROW_KEYS
        assert r["distribution"] == "gaussian" and r["head_dim"] == 64


def test_rows_have_no_nan_and_sane_ranges(study):
    rows, _, _ = study
    for r in rows:
        vals = np.array([r[k] for k in ROW_KEYS[5:]], dtype=float)
        assert np.all(np.isfinite(vals)), r
        assert 0 <= r["topk_recall"] <= 1 and r["kl_mean"] >= 0 and r["kl_mean"] <= r["kl_max"]
        assert 0 <= r["phi_k"] <= math.pi and r["fisher"] >= 0 and r["a2"] >= 0


def test_bits_per_element_columns(study):
    rows, _, _ = study
    for r in rows:
        assert (r["bpe_k"], r["bpe_v"]) == pytest.approx(bpe(r["scheme"], r["bits"]), abs=1e-12), r


@pytest.mark.parametrize("scheme", ["kv", "kivi", "headq"])
def test_sample_rows_of_other_schemes(scheme):
    row = run_sample(Cell(scheme, 2, "gaussian", 64), seed=1, tokens=64, n_queries=8)
    assert (row["bpe_k"], row["bpe_v"]) == pytest.approx(bpe(scheme, 2), abs=1e-12)
    assert all(np.isfinite(row[k]) for k in ROW_KEYS[5:])
    assert row == run_sample(Cell(scheme, 2, "gaussian", 64), seed=1, tokens=64, n_queries=8)  # deterministic


def test_more_bits_lower_kl_on_average(study):
    rows, _, _ = study
    for s in GRID.schemes:
        kl = {n: np.mean([r["kl_mean"] for r in rows if r["scheme"] == s and r["bits"] == n]) for n in GRID.bits}
        assert kl[3] < kl[2], (s, kl)


def test_quick_config_and_cells():
    q = StudyConfig.quick()
    assert q.schemes == STUDY_SCHEMES and len(q.cells()) == len(q.distributions) * len(q.head_dims) * len(q.bits) * 5
    assert {c.scheme for c in q.cells()} == set(STUDY_SCHEMES)


# --------------------------------------------------------------------------------------------
# Report folder
# --------------------------------------------------------------------------------------------


def test_report_folder_files(study):
    _, out, summary = study
    assert summary == out / "summary.md"
    assert {p.name for p in out.iterdir()} == REPORT_FILES
    for name in REPORT_FILES:
        if name.endswith(".png"):
            data = (out / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_summary_tables(study):
    rows, out, _ = study
    text = (out / "summary.md").read_text()
    header = "| distribution | d | n | scheme | " + " | ".join(TABLE_METRICS) + " |"
    for needle in (
        "# kvqrs synthetic study",
        "## Per-cell means",
        header,
        "## Theory checks",
        "QJL variance inflation",
        "| distribution | d | n | measured | theory |",
        "| distribution | d | n | KL ratio qkqv/kqv |",
        "## Pairwise tests",
        "## Plots",
        "![shannon_phi_plane](shannon_phi_plane.png)",
        f"{len(rows)} samples",
    ):
        assert needle in text, needle
    section = text[text.index(header) : text.index("## Theory checks")]
    cell_lines = [ln for ln in section.splitlines() if ln.startswith("| gaussian | 64 |")]
    assert len(cell_lines) == len(GRID.cells())
    assert all(ln.count("±") == len(TABLE_METRICS) for ln in cell_lines)
    assert "nan" not in text.lower()


def test_samples_csv_and_json(study):
    rows, out, _ = study
    with open(out / "samples.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == len(GRID.cells()) * GRID.seeds
    assert list(recs[0]) == ROW_KEYS
    for rec, row in zip(recs, rows):
        assert rec["scheme"] == row["scheme"] and int(rec["bits"]) == row["bits"]
        for k in ROW_KEYS[5:]:
            assert float(rec[k]) == pytest.approx(row[k], rel=1e-12)
            assert math.isfinite(float(rec[k]))
    assert json.loads((out / "samples.json").read_text()) == rows


def test_pairwise_csv(study):
    rows, out, _ = study
    with open(out / "pairwise.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == len(GRID.bits) * 1  # one pair of schemes per (distribution, d, n) cell
    assert {(r["a"], r["b"]) for r in recs} == {("kqv", "qkqv")}
    for r in recs:
        for k in ("mw_p", "rank_biserial", "ks_d", "ks_p", "energy", "energy_p"):
            assert math.isfinite(float(r[k]))
        assert 1 / (1 + PERMUTATIONS) <= float(r["energy_p"]) <= 1 and -1 <= float(r["rank_biserial"]) <= 1
    again = pairwise(rows, PERMUTATIONS)
    assert [p["mw_p"] for p in again] == pytest.approx([float(r["mw_p"]) for r in recs], rel=1e-12)


def test_cell_table_means(study):
    rows, _, _ = study
    table = cell_table(rows)
    assert len(table) == len(GRID.cells())
    for e in table:
        rs = [r for r in rows if r["scheme"] == e["scheme"] and r["bits"] == e["bits"]]
        assert e["samples"] == GRID.seeds
        m, lo, hi = e["kl_mean"]
        assert m == pytest.approx(np.mean([r["kl_mean"] for r in rs]), rel=1e-12) and lo <= m <= hi


def test_single_scheme_study_writes_a_report(tmp_path):
    config = dataclasses.replace(GRID, schemes=("kv",), bits=(2,), seeds=2, tokens=32, n_queries=4)
    rows, seconds = run_study(config, progress=False)
    write_report(rows, tmp_path, config, seconds, permutations=9)
    assert (tmp_path / "summary.md").exists()


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def test_cli_study_runs(tmp_path):
    out = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "kvqrs",
        "study",
        "--schemes",
        "kv",
        "kivi",
        "--bits",
        "2",
        "--distributions",
        "gaussian",
        "--head-dims",
        "64",
        "--seeds",
        "2",
        "--tokens",
        "32",
        "--queries",
        "4",
        "--permutations",
        "9",
        "--no-progress",
        "--brief",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "kvqrs study: 2 synthetic cells x 2 seeds" in res.stdout
    assert "report:" in res.stdout and "## Per-cell means" not in res.stdout  # --brief: header only
    assert {p.name for p in out.iterdir()} == REPORT_FILES
    with open(out / "samples.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    assert len(recs) == 4 and {r["scheme"] for r in recs} == {"kv", "kivi"}
    assert float(recs[0]["bpe_k"]) == pytest.approx(bpe(recs[0]["scheme"], 2, tokens=32)[0])


# --------------------------------------------------------------------------------------------
# Theory checks
# --------------------------------------------------------------------------------------------


def test_qjl_inflation_is_near_pi_over_2():
    res = theory.qjl_inflation(head_dim=64, trials=200, seed=3)
    assert res["head_dim"] == 64 and res["trials"] == 200
    assert abs(res["theory"] - math.pi / 2) < 0.1  # the <r, y>^2 correction is O(1/d)
    assert res["measured"] == pytest.approx(res["theory"], rel=INFLATION_RTOL)
    assert abs(res["bias_z"]) < BIAS_Z_MAX


def test_two_pi_factor_rows(study):
    rows, _, _ = study
    out = theory.two_pi_factor(rows)
    assert [(r["distribution"], r["head_dim"], r["bits"]) for r in out] == [("gaussian", 64, 2), ("gaussian", 64, 3)]
    for r in out:
        n = r["bits"]
        want = (math.pi / 2) * oracle.lloyd_max_codebook(64, n - 1)[2] / oracle.lloyd_max_codebook(64, n)[2]
        assert r["theory"] == pytest.approx(want, rel=1e-4)
        mse = lambda s, n=n: np.mean([x["score_mse"] for x in rows if x["scheme"] == s and x["bits"] == n])  # noqa: E731
        assert r["ratio"] == pytest.approx(mse("qkqv") / mse("kqv"), rel=1e-12)
        assert want / TWO_PI_FACTOR_SLACK < r["ratio"] < want * TWO_PI_FACTOR_SLACK
    assert theory.two_pi_factor([x for x in rows if x["scheme"] == "kqv"]) == []


def test_kl_ratio_rows(study):
    rows, _, _ = study
    out = theory.kl_ratio(rows)
    assert len(out) == 2
    for r in out:
        kl = lambda s, r=r: np.mean([x["kl_mean"] for x in rows if x["scheme"] == s and x["bits"] == r["bits"]])  # noqa: E731
        assert r["ratio"] == pytest.approx(kl("qkqv") / kl("kqv"), rel=1e-12)
        assert r["samples"] == GRID.seeds and 0 < r["p"] <= 1 and -1 <= r["rank_biserial"] <= 1
    flipped = theory.kl_ratio(rows, "kqv", "qkqv")
    assert [f["ratio"] for f in flipped] == pytest.approx([1 / r["ratio"] for r in out], rel=1e-12)
    assert theory.kl_ratio(rows, "kv", "kqv") == []


def test_direction_crossover_rows(study):
    rows, _, _ = study
    out = theory.direction_crossover(rows)
    assert len(out) == 2
    for r in out:
        phi = lambda s, r=r: np.mean([x["phi_k"] for x in rows if x["scheme"] == s and x["bits"] == r["bits"]])  # noqa: E731
        assert r["phi_k_kqv"] == pytest.approx(phi("kqv")) and r["phi_k_qkqv"] == pytest.approx(phi("qkqv"))
        assert r["better"] == ("qkqv" if r["phi_k_qkqv"] < r["phi_k_kqv"] else "kqv")
        assert 0 < r["p"] <= 1


def test_value_qjl_check_rows():
    out = theory.value_qjl_check(["gaussian"], head_dim=64, bits=(2, 3), seeds=2, tokens=32, n_queries=4)
    assert [(r["distribution"], r["bits"]) for r in out] == [("gaussian", 2), ("gaussian", 3)]
    for r in out:
        vals = [r[k] for k in ("snr_v_scalar", "snr_v_qjl", "snr_t_scalar", "snr_t_qjl", "p")]
        assert all(np.isfinite(vals))
        assert r["snr_v_scalar"] > r["snr_v_qjl"]  # n-bit scalar beats (n-1)-bit + QJL on V itself
    assert out[1]["snr_v_scalar"] > out[0]["snr_v_scalar"]


def test_synthetic_study_does_not_need_torch():
    # `kvqrs study` runs with the study extra alone: no module on its path may import torch.
    code = (
        "import sys; import kvqrs.evaluation.report, kvqrs.evaluation.study, kvqrs.evaluation.mechanisms, kvqrs.cli; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
