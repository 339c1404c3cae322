"""Checks of the theory behind the study, each reported with its measured value:

- QJL variance inflation: the inner-product estimator's error variance over that of an
  isotropic residual of the same norm, ``||r||^2 ||y||^2 / m`` (theory: pi/2 - <r,y>^2 term);
- the 2*pi factor: score-error variance of (n-1)-bit + 1-bit QJL keys over n-bit scalar keys
  (theory ``(pi/2) D_{n-1} / D_n``, about 2*pi when each bit quarters the distortion);
- KQV against QKQV KL at each n per distribution (the paper: about 2.25x lower at n = 4);
- the K-direction crossover (the paper: QKQV better phi_K at n = 2, 3);
- KV (no rotation) under heavy tails; the low-rank case.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from ..kernels import lloyd_max_codebook, padded_dim, qjl_inner_product, qjl_sketch
from ..metrics import attention_logits, mann_whitney, snr_db, softmax
from ..schemes import MSECoder, MSEQJLCoder
from ..synthetic import generate


def qjl_inflation(head_dim: int = 128, trials: int = 2000, seed: int = 0) -> dict:
    """Measured ``Var(QJL estimate - <y, r>) / (||r||^2 ||y||^2 / m)`` over sketch seeds, for
    independent Gaussian r and y (m = d)."""
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(head_dim).astype(np.float32)
    y = rng.standard_normal(head_dim).astype(np.float32)
    truth = float(np.dot(r.astype(np.float64), y))
    est = np.array([float(qjl_inner_product(y, qjl_sketch(r, s), s)) for s in range(trials)])
    scale = float(np.sum(r.astype(np.float64) ** 2) * np.sum(y.astype(np.float64) ** 2)) / head_dim
    measured = float(np.var(est - truth, ddof=1)) / scale
    exact = math.pi / 2 - truth**2 / scale / head_dim
    return {
        "head_dim": head_dim,
        "trials": trials,
        "measured": measured,
        "theory": exact,
        "bias_z": float(np.mean(est - truth) / (np.std(est, ddof=1) / math.sqrt(trials))),
    }


def group_by(rows: list[dict], *keys: str) -> dict:
    """Sample rows grouped by the values of ``keys`` (tuple keys)."""
    out: dict = defaultdict(list)
    for r in rows:
        out[tuple(r[k] for k in keys)].append(r)
    return out


def two_pi_factor(rows: list[dict]) -> list[dict]:
    """Score-error variance ratio qkqv / kqv keys per (distribution, head_dim, n)."""
    out = []
    for (dist, d, n), rs in sorted(group_by(rows, "distribution", "head_dim", "bits").items()):
        a = [r["score_mse"] for r in rs if r["scheme"] == "qkqv"]
        b = [r["score_mse"] for r in rs if r["scheme"] == "kqv"]
        if not a or not b:
            continue
        dp = padded_dim(d)
        theory = (math.pi / 2) * lloyd_max_codebook(dp, n - 1).distortion / lloyd_max_codebook(dp, n).distortion
        out.append({"distribution": dist, "head_dim": d, "bits": n, "ratio": float(np.mean(a) / np.mean(b)), "theory": theory})
    return out


def kl_ratio(rows: list[dict], num: str = "qkqv", den: str = "kqv") -> list[dict]:
    """Mean-KL ratio ``num / den`` per (distribution, head_dim, n), with the Mann-Whitney test on
    per-sample mean KL."""
    out = []
    for (dist, d, n), rs in sorted(group_by(rows, "distribution", "head_dim", "bits").items()):
        a = [r["kl_mean"] for r in rs if r["scheme"] == num]
        b = [r["kl_mean"] for r in rs if r["scheme"] == den]
        if not a or not b:
            continue
        mw = mann_whitney(a, b)
        out.append(
            {
                "distribution": dist,
                "head_dim": d,
                "bits": n,
                "ratio": float(np.mean(a) / max(np.mean(b), 1e-300)),
                "p": mw.pvalue,
                "rank_biserial": mw.effect,
                "samples": len(a),
            }
        )
    return out


def lowrank_vs_gaussian(rows: list[dict]) -> list[dict]:
    """Per scheme, head_dim and n: mean KL and top-5 recall on every ``lowrank-*`` distribution
    against ``gaussian`` (rotation-based codebooks assume isotropic directions; low-rank keys
    are not)."""
    out = []
    by = group_by(rows, "distribution", "head_dim", "bits", "scheme")
    for (dist, d, n, s), rs in sorted(by.items()):
        if not dist.startswith("lowrank") or ("gaussian", d, n, s) not in by:
            continue
        g = by[("gaussian", d, n, s)]
        out.append(
            {
                "distribution": dist,
                "head_dim": d,
                "bits": n,
                "scheme": s,
                "kl_ratio": float(np.mean([r["kl_mean"] for r in rs]) / max(np.mean([r["kl_mean"] for r in g]), 1e-300)),
                "recall_lowrank": float(np.mean([r["topk_recall"] for r in rs])),
                "recall_gaussian": float(np.mean([r["topk_recall"] for r in g])),
            }
        )
    return out


def direction_crossover(rows: list[dict]) -> list[dict]:
    """Mean phi_K of kqv and qkqv per (distribution, head_dim, n) and which is smaller."""
    out = []
    for (dist, d, n), rs in sorted(group_by(rows, "distribution", "head_dim", "bits").items()):
        a = [r["phi_k"] for r in rs if r["scheme"] == "kqv"]
        b = [r["phi_k"] for r in rs if r["scheme"] == "qkqv"]
        if not a or not b:
            continue
        mw = mann_whitney(b, a)
        out.append(
            {
                "distribution": dist,
                "head_dim": d,
                "bits": n,
                "phi_k_kqv": float(np.mean(a)),
                "phi_k_qkqv": float(np.mean(b)),
                "better": "qkqv" if np.mean(b) < np.mean(a) else "kqv",
                "p": mw.pvalue,
            }
        )
    return out


def value_qjl_check(
    distributions, head_dim: int = 128, bits=(2, 3, 4), seeds: int = 8, tokens: int = 256, n_queries: int = 32
) -> list[dict]:
    """Values alone: rotated n-bit scalar against (n-1)-bit + 1-bit QJL at the same budget, with
    the exact attention probabilities, so only the value code differs. Reports SNR of V and of
    the output T: QJL's errors are unbiased and independent across tokens, so they average out
    in ``T = p^T V`` where the scalar code's shrinkage does not (the paper's claim that QJL
    helps values)."""
    out = []
    for dist in distributions:
        for n in bits:
            acc = {"scalar": ([], []), "qjl": ([], [])}
            for seed in range(seeds):
                head = generate(dist, tokens=tokens, n_queries=n_queries, head_dim=head_dim, seed=seed)
                p = softmax(attention_logits(head.queries, head.keys))
                t = p @ head.values.astype(np.float64)
                coders = {
                    "scalar": MSECoder(head_dim, n, seed, "study", "values"),
                    "qjl": MSEQJLCoder(head_dim, n, seed, seed + 1, "study", "values"),
                }
                for name, coder in coders.items():
                    v_hat = coder.decode(coder.encode(head.values)).astype(np.float64)
                    acc[name][0].append(snr_db(head.values, v_hat))
                    acc[name][1].append(snr_db(t, p @ v_hat))
            mw = mann_whitney(acc["qjl"][1], acc["scalar"][1])
            out.append(
                {
                    "distribution": dist,
                    "head_dim": head_dim,
                    "bits": n,
                    "snr_v_scalar": float(np.mean(acc["scalar"][0])),
                    "snr_v_qjl": float(np.mean(acc["qjl"][0])),
                    "snr_t_scalar": float(np.mean(acc["scalar"][1])),
                    "snr_t_qjl": float(np.mean(acc["qjl"][1])),
                    "p": mw.pvalue,
                }
            )
    return out
