"""The HeadQ paper's mechanism checks on real attention heads.

- **Score space against storage space**: across heads, schemes and bit widths, how well does
  each error measure rank the damage to attention? Spearman rho against the per-head mean
  attention KL of the Fisher score error ``Var_p(delta s)`` (HeadQ, eq. for the local KL:
  ``KL ~ Var_p(delta s) / 2``), of the score MSE, and of the raw key MSE ``||k - k_hat||^2``.
- **Softmax-null intervention**: a shift ``mu`` shared by every key changes all logits of a
  query by the same ``q . mu``, which softmax ignores. A quantizer with a fixed grid (a
  data-independent codebook on the normalised, possibly rotated key) still spends its grid on
  that shift. Quantizing ``k - mu`` and restoring ``mu`` afterwards (mu stored exactly: d floats
  per head) removes it; the check measures the Fisher damage and key MSE with the mean left in
  against with it restored after quantization, per head, with a paired Wilcoxon test. KIVI's
  per-channel zero point already absorbs ``mu``: it is the control.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from ..metrics import attention_logits, fisher_score_error, key_mse, kl_divergence, softmax, spearman
from ..schemes import KVCodec
from .theory import group_by

ERROR_MEASURES = ("fisher", "score_mse", "key_mse")
NULL_SCHEMES = ("kv", "kqv", "block", "kivi")


def score_space_ranking(rows: list[dict]) -> list[dict]:
    """Spearman rho (and p) of each error measure against ``kl_mean``: pooled over all rows,
    then within each (scheme, n) across heads. Rows are :func:`.sample.measure` dicts."""
    groups = {("all", "all"): rows, **{k: v for k, v in sorted(group_by(rows, "scheme", "bits").items())}}
    out = []
    for (scheme, n), rs in groups.items():
        kl = [r["kl_mean"] for r in rs]
        entry = {"scheme": scheme, "bits": n, "samples": len(rs)}
        for m in ERROR_MEASURES:
            t = spearman([r[m] for r in rs], kl)
            entry[f"rho_{m}"], entry[f"p_{m}"] = t.statistic, t.pvalue
        out.append(entry)
    return out


def _damage(q: np.ndarray, k: np.ndarray, k_hat: np.ndarray) -> dict:
    s, s_hat = attention_logits(q, k), attention_logits(q, k_hat)
    return {
        "fisher": float(fisher_score_error(softmax(s), s_hat - s).mean()),
        "kl": float(kl_divergence(s, s_hat).mean()),
        "key_mse": key_mse(k, k_hat),
    }


def softmax_null_head(q: np.ndarray, k: np.ndarray, scheme: str, bits: int, seed: int) -> dict:
    """One head: damage with the shared key mean quantized (``as_is``) and with it removed
    before quantization and restored after (``restored``); ``mean_share`` is
    ``||mu||^2 / mean ||k||^2``, the part of the key energy that softmax ignores."""
    codec = KVCodec(scheme, bits, k.shape[-1], seed=seed)
    mu = k.astype(np.float64).mean(axis=0)
    centred = (k - mu).astype(np.float32)
    as_is = _damage(q, k, codec.decode_keys(codec.encode_keys(k)))
    restored = _damage(q, k, codec.decode_keys(codec.encode_keys(centred)).astype(np.float64) + mu)
    share = float(mu @ mu / np.mean(np.sum(k.astype(np.float64) ** 2, axis=-1)))
    return {
        "scheme": scheme,
        "bits": bits,
        "mean_share": share,
        **{f"{m}_as_is": as_is[m] for m in as_is},
        **{f"{m}_restored": restored[m] for m in restored},
    }


def softmax_null(heads, schemes=NULL_SCHEMES, bits=(2, 3, 4)) -> tuple[list[dict], list[dict]]:
    """Per-head rows of :func:`softmax_null_head` for every head (its index seeds the codec),
    scheme and n, and their summary per (scheme, n): median damage ratios as-is / restored and
    the paired Wilcoxon signed-rank p-value on the Fisher damage."""
    rows = [dict(head=i, **softmax_null_head(h.queries, h.keys, s, n, seed=i)) for i, h in enumerate(heads) for s in schemes for n in bits]
    summary = []
    for (s, n), rs in group_by(rows, "scheme", "bits").items():
        a = np.array([r["fisher_as_is"] for r in rs])
        b = np.array([r["fisher_restored"] for r in rs])
        p = float(stats.wilcoxon(a, b).pvalue) if np.any(a != b) else 1.0
        summary.append(
            {
                "scheme": s,
                "bits": n,
                "heads": len(rs),
                "median_mean_share": float(np.median([r["mean_share"] for r in rs])),
                "fisher_as_is": float(a.mean()),
                "fisher_restored": float(b.mean()),
                "median_fisher_ratio": float(np.median(a / np.maximum(b, 1e-300))),
                "median_kl_ratio": float(np.median([r["kl_as_is"] / max(r["kl_restored"], 1e-300) for r in rs])),
                "median_key_mse_ratio": float(np.median([r["key_mse_as_is"] / max(r["key_mse_restored"], 1e-300) for r in rs])),
                "wilcoxon_p": p,
            }
        )
    return rows, summary
