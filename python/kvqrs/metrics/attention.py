"""Attention-level metrics (docs/evaluation.md): softmax probabilities, KL divergence with its mean /
99th percentile / max over queries, top-k routing recall, the Fisher score error and the A^2
value distortion."""

from __future__ import annotations

import numpy as np
from scipy.special import log_softmax

from .._arrays import KvqrsError


def attention_logits(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``q k^T / sqrt(d)`` in float64: ``(..., nq, T)`` from q ``(..., nq, d)``, k ``(..., T, d)``."""
    q = np.asarray(q, dtype=np.float64)
    return q @ np.swapaxes(np.asarray(k, dtype=np.float64), -1, -2) / np.sqrt(q.shape[-1])


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (``exp(log_softmax)``, stable for any logits)."""
    return np.exp(log_softmax(np.asarray(logits, dtype=np.float64), axis=-1))


def kl_divergence(logits: np.ndarray, logits_hat: np.ndarray) -> np.ndarray:
    """``KL(p || p_hat)`` per query row from logits, in nats, ``(..., nq)``.

    Computed from log-softmax, so a probability that underflows to 0 never yields inf or NaN;
    a single token gives 0.
    """
    a = np.asarray(logits, dtype=np.float64)
    b = np.asarray(logits_hat, dtype=np.float64)
    if a.shape != b.shape or a.ndim == 0 or a.shape[-1] == 0:
        raise KvqrsError(f"logits: expected two equal shapes (..., tokens >= 1), got {a.shape} and {b.shape}")
    if np.isnan(a).any() or np.isnan(b).any() or np.isposinf(a).any() or np.isposinf(b).any():
        raise KvqrsError("logits: expected finite logits (or -inf for masked tokens), got NaN or +inf")
    lp = log_softmax(a, axis=-1)
    lq = log_softmax(b, axis=-1)
    p = np.exp(lp)
    # A token with p = 0 (a masked, -inf logit) contributes nothing, whatever p_hat is.
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (lp - lq), 0.0)
    return np.maximum(np.sum(terms, axis=-1), 0.0)


def kl_summary(kl: np.ndarray) -> dict[str, float]:
    """Mean, 99th percentile and max of per-query KL (worst cases matter)."""
    kl = np.asarray(kl, dtype=np.float64).reshape(-1)
    if kl.size == 0:
        return {"kl_mean": 0.0, "kl_p99": 0.0, "kl_max": 0.0}
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max())}


def topk_recall(p: np.ndarray, p_hat: np.ndarray, k: int = 5) -> np.ndarray:
    """``|topk(p) & topk(p_hat)| / k`` per query row (``k`` capped at the token count).

    Ties are broken by token index (stable sort), identically on both sides.
    """
    p = np.asarray(p)
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise KvqrsError(f"k: expected an integer >= 1, got {k!r}")
    if np.shape(p_hat) != p.shape:
        raise KvqrsError(f"p_hat: expected the shape of p {p.shape}, got {np.shape(p_hat)}")
    kk = min(int(k), p.shape[-1])
    if kk == 0:
        return np.ones(p.shape[:-1])
    top = np.argsort(-p, axis=-1, kind="stable")[..., :kk]
    top_hat = np.argsort(-np.asarray(p_hat), axis=-1, kind="stable")[..., :kk]
    hits = (top[..., :, None] == top_hat[..., None, :]).any(axis=-1).sum(axis=-1)
    return hits / kk


def fisher_score_error(p: np.ndarray, delta_s: np.ndarray) -> np.ndarray:
    """``Var_p(delta_s) = sum p_j delta_j^2 - (sum p_j delta_j)^2`` per query (HeadQ; local KL is
    about half of it). ``delta_s = (K_hat - K) q / sqrt(d)``, shape ``(..., nq, T)``."""
    p = np.asarray(p, dtype=np.float64)
    ds = np.asarray(delta_s, dtype=np.float64)
    m1 = np.sum(p * ds, axis=-1)
    return np.maximum(np.sum(p * ds * ds, axis=-1) - m1 * m1, 0.0)


def a2_distortion(p: np.ndarray, v: np.ndarray, v_hat: np.ndarray) -> np.ndarray:
    """``sum_j p_j^2 ||v_j - v_hat_j||^2`` per query (HeadQ's A^2 value distortion).

    p ``(..., nq, T)``, v and v_hat ``(..., T, d)``; returns ``(..., nq)``.
    """
    err = np.sum((np.asarray(v, dtype=np.float64) - np.asarray(v_hat, dtype=np.float64)) ** 2, axis=-1)
    return np.einsum("...qt,...t->...q", np.asarray(p, dtype=np.float64) ** 2, err)
