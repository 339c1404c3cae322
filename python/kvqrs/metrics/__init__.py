"""Metrics of docs/evaluation.md: the 6D error point, attention KL, routing recall, Fisher score
error, raw key MSE, A^2 value distortion, and the statistical comparisons between schemes."""

from .attention import (
    a2_distortion,
    attention_logits,
    fisher_score_error,
    kl_divergence,
    kl_summary,
    softmax,
    topk_recall,
)
from .compare import TestResult, energy_distance, kolmogorov_smirnov, mann_whitney, mean_ci, spearman
from .errors import SIX_D_NAMES, SNR_CEILING_DB, direction_angles, direction_error, key_mse, six_d_point, snr_db

__all__ = [
    "SIX_D_NAMES",
    "SNR_CEILING_DB",
    "TestResult",
    "a2_distortion",
    "attention_logits",
    "direction_angles",
    "direction_error",
    "energy_distance",
    "fisher_score_error",
    "key_mse",
    "kl_divergence",
    "kl_summary",
    "kolmogorov_smirnov",
    "mann_whitney",
    "mean_ci",
    "six_d_point",
    "snr_db",
    "softmax",
    "spearman",
    "topk_recall",
]
