"""Scale and direction errors: the 6D error point (SNR and angle of K, V and the attention
output T; docs/evaluation.md), raw key MSE.

Degenerate inputs have defined values: an exact reconstruction has SNR ``+inf`` (reported as
:data:`SNR_CEILING_DB` so means stay finite), an all-zero reference with a non-zero error has
SNR ``-SNR_CEILING_DB``, two zero vectors have angle 0 and a zero against a non-zero vector has
angle pi/2 (no direction to agree with).
"""

from __future__ import annotations

import numpy as np

from .._arrays import KvqrsError

SNR_CEILING_DB = 300.0
"""SNR reported for an exact reconstruction (float64 round-off is about 310 dB)."""

SIX_D_NAMES = ("snr_k", "phi_k", "snr_v", "phi_v", "snr_t", "phi_t")


def snr_db(x: np.ndarray, x_hat: np.ndarray) -> float:
    """``10 log10(sum ||x||^2 / sum ||x - x_hat||^2)`` over all rows, in dB (docs/evaluation.md).

    Args:
        x, x_hat: float arrays of the same shape ``(..., d)``.

    Returns:
        float in ``[-SNR_CEILING_DB, SNR_CEILING_DB]``.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.shape != np.shape(x_hat):
        raise KvqrsError(f"x_hat: expected the shape of x {x.shape}, got {np.shape(x_hat)}")
    err = float(np.sum((x - np.asarray(x_hat, dtype=np.float64)) ** 2))
    sig = float(np.sum(x**2))
    if err == 0.0:
        return SNR_CEILING_DB
    if sig == 0.0:
        return -SNR_CEILING_DB
    with np.errstate(divide="ignore", over="ignore"):
        ratio = 10.0 * np.log10(sig / err)
    return float(np.clip(ratio, -SNR_CEILING_DB, SNR_CEILING_DB))


def direction_angles(x: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    """Per-row angle ``arccos(cos(x, x_hat))`` in radians, ``(...)`` (docs/evaluation.md)."""
    x = np.array(x, dtype=np.float64)  # copies: rows are rescaled in place below
    y = np.array(x_hat, dtype=np.float64)
    # Scale each row by its largest magnitude first so norms of huge rows cannot overflow.
    for a in (x, y):
        m = np.max(np.abs(a), axis=-1, keepdims=True) if a.size else np.ones(a.shape[:-1] + (1,))
        a /= np.where(m > 0, m, 1.0)
    nx = np.linalg.norm(x, axis=-1)
    ny = np.linalg.norm(y, axis=-1)
    dot = np.sum(x * y, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.clip(dot / (nx * ny), -1.0, 1.0)
    both_zero = (nx == 0) & (ny == 0)
    one_zero = (nx == 0) ^ (ny == 0)
    cos = np.where(both_zero, 1.0, np.where(one_zero, 0.0, cos))
    return np.arccos(cos)


def direction_error(x: np.ndarray, x_hat: np.ndarray) -> float:
    """Mean per-row angle in radians."""
    a = direction_angles(x, x_hat)
    return float(a.mean()) if a.size else 0.0


def key_mse(k: np.ndarray, k_hat: np.ndarray) -> float:
    """Raw key MSE ``mean ||k - k_hat||^2`` per token (storage-space error)."""
    k = np.asarray(k, dtype=np.float64)
    return float(np.mean(np.sum((k - np.asarray(k_hat, dtype=np.float64)) ** 2, axis=-1))) if k.size else 0.0


def six_d_point(k, k_hat, v, v_hat, t, t_hat) -> dict[str, float]:
    """The six numbers ``(SNR_K, phi_K, SNR_V, phi_V, SNR_T, phi_T)`` (docs/evaluation.md).

    ``t`` and ``t_hat`` are the attention outputs ``p^T V`` and ``p_hat^T V_hat`` per query.
    """
    return {
        "snr_k": snr_db(k, k_hat),
        "phi_k": direction_error(k, k_hat),
        "snr_v": snr_db(v, v_hat),
        "phi_v": direction_error(v, v_hat),
        "snr_t": snr_db(t, t_hat),
        "phi_t": direction_error(t, t_hat),
    }
