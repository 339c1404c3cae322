"""One sample of the synthetic study: a seeded head, one scheme at one budget, every metric of
docs/evaluation.md on it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..metrics import (
    a2_distortion,
    attention_logits,
    fisher_score_error,
    key_mse,
    kl_divergence,
    kl_summary,
    six_d_point,
    softmax,
    topk_recall,
)
from ..schemes import KVCodec
from ..synthetic import Head, generate

MODEL_DISTRIBUTION = "smollm2"
"""The ``distribution`` label of heads captured from the model (``study --from-model``)."""

CALIBRATION_SEED_OFFSET = 1_000_003
"""HeadQ calibration queries come from this seed offset: disjoint from the evaluated queries."""


@dataclass(frozen=True)
class Cell:
    """One grid cell: scheme x budget x distribution x head_dim."""

    scheme: str
    bits: int
    distribution: str
    head_dim: int


def make_codec(cell: Cell, seed: int, calibration_queries: np.ndarray | None = None) -> KVCodec:
    """The codec of a cell; HeadQ (on the kivi base, rank 4) is calibrated on
    ``calibration_queries`` (held-out queries of the same head or distribution)."""
    codec = KVCodec(cell.scheme, cell.bits, cell.head_dim, seed=seed)
    if cell.scheme == "headq":
        codec.calibrate(calibration_queries)
    return codec


def run_sample(cell: Cell, seed: int, tokens: int, n_queries: int, topk: int = 5) -> dict:
    """All metrics of one seeded synthetic sample; HeadQ calibrates on queries of the same
    distribution from a disjoint seed. Returns a flat dict (one CSV row)."""
    head = generate(cell.distribution, tokens=tokens, n_queries=n_queries, head_dim=cell.head_dim, seed=seed)
    calib = None
    if cell.scheme == "headq":
        calib = generate(
            cell.distribution, tokens=tokens, n_queries=max(4 * n_queries, 64), head_dim=cell.head_dim, seed=seed + CALIBRATION_SEED_OFFSET
        ).queries
    return measure(cell, seed, head, make_codec(cell, seed, calib), topk)


def measure(cell: Cell, seed: int, head: Head, codec: KVCodec, topk: int = 5) -> dict:
    """Every metric of docs/evaluation.md for ``codec`` on one head (synthetic or captured):
    the 6D point, attention KL (nats), top-k recall, Fisher score error, score MSE, raw and
    relative key MSE, A^2 value distortion, bits per element. Returns a flat dict."""
    q, k, v = head.queries, head.keys, head.values
    ck, cv = codec.encode_keys(k), codec.encode_values(v)
    k_hat, v_hat = codec.decode_keys(ck), codec.decode_values(cv)
    s = attention_logits(q, k)
    s_hat = codec.scores(q, ck).astype(np.float64)
    p, p_hat = softmax(s), softmax(s_hat)
    t, t_hat = p @ v.astype(np.float64), p_hat @ v_hat.astype(np.float64)
    kl = kl_divergence(s, s_hat)
    row = {
        "scheme": cell.scheme,
        "bits": cell.bits,
        "distribution": cell.distribution,
        "head_dim": cell.head_dim,
        "seed": seed,
        **six_d_point(k, k_hat, v, v_hat, t, t_hat),
        **kl_summary(kl),
        "topk_recall": float(topk_recall(p, p_hat, topk).mean()),
        "fisher": float(fisher_score_error(p, s_hat - s).mean()),
        "score_mse": float(np.mean((s_hat - s) ** 2)),
        "key_mse": key_mse(k, k_hat),
        "key_mse_rel": key_mse(k, k_hat) / max(float(np.mean(np.sum(k.astype(np.float64) ** 2, axis=-1))), 1e-300),
        "a2": float(a2_distortion(p, v, v_hat).mean()),
        "bpe_k": ck.bits_per_element,
        "bpe_v": cv.bits_per_element,
    }
    return row
