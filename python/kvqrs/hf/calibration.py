"""HeadQ calibration: per layer and KV head, the rank-r PCA basis (top eigenvectors of the
uncentred second moment) of the post-RoPE queries of the heads in that group, from a
calibration text disjoint from the evaluation text (docs/kernels.md section 7). Saved and loaded as ``.npz``."""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

import numpy as np
import torch

from .._arrays import KvqrsError
from ..kernels import headq_basis
from ..torch import to_numpy
from .attention import active, register

FORMAT = "kvqrs-headq-bases-v1"


class _QueryRecorder:
    """Attention state that records queries and lets attention run unchanged."""

    def __init__(self) -> None:
        self.queries: dict[int, list[np.ndarray]] = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        q = to_numpy(query, "query")  # (batch, q_heads, len, d)
        kv_heads = key.shape[1]
        g = q.shape[1] // kv_heads
        # Heads h*g .. h*g+g-1 read KV head h: stack their queries per group.
        grouped = q.reshape(q.shape[0], kv_heads, g, q.shape[2], q.shape[3]).transpose(1, 0, 2, 3, 4)
        self.queries.setdefault(module.layer_idx, []).append(grouped.reshape(kv_heads, -1, q.shape[3]).copy())
        return None


def calibrate(model: torch.nn.Module, windows: Iterable[torch.Tensor], rank: int = 4) -> dict[int, np.ndarray]:
    """Run ``model`` (``attn_implementation="kvqrs"``) over calibration token windows and fit
    the bases. Returns ``{layer: float32 (kv_heads, head_dim, rank)}``."""
    register()
    rec = _QueryRecorder()
    with torch.no_grad(), active(rec):
        for ids in windows:
            model(ids)
    if not rec.queries:
        raise KvqrsError("calibration: no queries were recorded (is the model using attn_implementation='kvqrs'?)")
    return {
        layer: np.stack([headq_basis(h, rank) for h in np.concatenate(chunks, axis=1)]) for layer, chunks in sorted(rec.queries.items())
    }


def save_bases(path: str | pathlib.Path, bases: dict[int, np.ndarray], meta: dict | None = None) -> pathlib.Path:
    """Write bases to ``path`` (.npz) with a format tag and optional metadata strings."""
    p = pathlib.Path(path)
    arrays = {f"layer_{k}": np.asarray(v, dtype=np.float32) for k, v in bases.items()}
    extra = {f"meta_{k}": np.array(str(v)) for k, v in (meta or {}).items()}
    np.savez(p, format=np.array(FORMAT), **arrays, **extra)
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def load_bases(path: str | pathlib.Path) -> dict[int, np.ndarray]:
    """Read bases written by :func:`save_bases`; raises :class:`KvqrsError` on another file."""
    try:
        with np.load(pathlib.Path(path), allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != FORMAT:
                raise KvqrsError(f"bases: {str(path)!r} is not a kvqrs HeadQ basis file ({FORMAT})")
            return {int(k[6:]): z[k] for k in z.files if k.startswith("layer_")}
    except (OSError, ValueError) as e:
        raise KvqrsError(f"bases: cannot read {str(path)!r}: {e}") from None


class _KVQRecorder:
    """Attention state that records per layer the queries grouped per KV head, the keys and the
    values of every window (positions ``skip..``), and lets attention run unchanged."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.q: dict[int, list[np.ndarray]] = {}
        self.k: dict[int, list[np.ndarray]] = {}
        self.v: dict[int, list[np.ndarray]] = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        s = self.skip
        kv_heads, d = key.shape[1], key.shape[3]
        q = to_numpy(query, "query")[0, :, s:]  # (q_heads, len, d)
        g = q.shape[0] // kv_heads
        self.q.setdefault(module.layer_idx, []).append(q.reshape(kv_heads, g * q.shape[1], d).copy())
        self.k.setdefault(module.layer_idx, []).append(to_numpy(key, "keys")[0, :, s:].copy())
        self.v.setdefault(module.layer_idx, []).append(to_numpy(value, "values")[0, :, s:].copy())
        return None


def record_matched(model, windows: Iterable[torch.Tensor], skip: int = 0) -> dict:
    """Run ``model`` over calibration windows and collect what the ``matched`` calibration
    needs, per layer: ``(query second moment (kv_heads, d, d), keys (kv_heads, n, d), values
    (kv_heads, n, d))``, positions ``skip..`` of each window (the sink tokens a cache keeps in
    full precision are never coded, so they are left out of the statistics)."""
    register()
    rec = _KVQRecorder(int(skip))
    with torch.no_grad(), active(rec):
        for ids in windows:
            if ids.shape[-1] < skip + 2:
                raise KvqrsError(f"windows: expected windows of at least skip + 2 = {skip + 2} tokens, got {ids.shape[-1]}")
            model(ids)
    if not rec.k:
        raise KvqrsError("calibration: no attention call was recorded (is the model using attn_implementation='kvqrs'?)")
    out = {}
    for layer in sorted(rec.k):
        q = np.concatenate(rec.q[layer], axis=1).astype(np.float64)
        out[layer] = (
            np.einsum("hnd,hne->hde", q, q) / q.shape[1],
            np.concatenate(rec.k[layer], axis=1),
            np.concatenate(rec.v[layer], axis=1),
        )
    return out


def fit_matched(stats: dict, key_bits: float, group: int) -> dict:
    """``{layer: MatchedCalibration}`` from :func:`record_matched`'s statistics: keys by
    :func:`kvqrs.schemes.matched.fit_basis` weighted by the queries' second moment (the
    score-space error weight) at ``key_bits`` average code bits and scale groups of ``group``
    tokens; values by their mean per KV head."""
    from ..schemes.matched import MatchedCalibration, fit_basis

    return {layer: MatchedCalibration(fit_basis(k, key_bits, group, w), v.mean(axis=1)) for layer, (w, k, v) in stats.items()}


def calibrate_matched(model, windows: Iterable[torch.Tensor], key_bits: float, group: int = 128, skip: int = 0) -> dict:
    """Fit the ``matched`` scheme's per-layer calibration on calibration token windows
    (:func:`record_matched` then :func:`fit_matched`).

    Args:
        model: a transformers model loaded with ``attn_implementation="kvqrs"``.
        windows: ``(1, len)`` token tensors from a calibration text (never the evaluation text).
        key_bits: average key code bits per coordinate (0 < key_bits <= 8).
        group: tokens per key scale group.
        skip: leading positions of each window left out (the attention sinks).

    Returns:
        ``{layer: MatchedCalibration}``.

    Raises:
        KvqrsError: no attention call was recorded, or a window shorter than ``skip + 2``.
    """
    return fit_matched(record_matched(model, windows, skip), key_bits, group)


MATCHED_FORMAT = "kvqrs-matched-calibration-v1"


def save_matched(path: str | pathlib.Path, calibration: dict, meta: dict | None = None) -> pathlib.Path:
    """Write a ``matched`` calibration (``{layer: MatchedCalibration}``) to ``path`` (.npz)."""
    p = pathlib.Path(path)
    arrays = {}
    for layer, c in calibration.items():
        arrays.update(
            {f"mean_{layer}": c.keys.mean, f"basis_{layer}": c.keys.basis, f"widths_{layer}": c.keys.widths, f"vmean_{layer}": c.value_mean}
        )
    extra = {f"meta_{k}": np.array(str(v)) for k, v in (meta or {}).items()}
    np.savez(p, format=np.array(MATCHED_FORMAT), **arrays, **extra)
    return p if p.suffix == ".npz" else p.with_name(p.name + ".npz")


def matched_settings(path: str | pathlib.Path) -> tuple[float, int]:
    """``(key code bits, group)`` that ``kvqrs calibrate`` recorded in a calibration file.
    Raises :class:`KvqrsError` for a file without them (saved without that metadata)."""
    try:
        with np.load(pathlib.Path(path), allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != MATCHED_FORMAT:
                raise KvqrsError(f"calibration: {str(path)!r} is not a kvqrs matched calibration file ({MATCHED_FORMAT})")
            if "meta_bits" not in z or "meta_group" not in z:
                raise KvqrsError(f"calibration: {str(path)!r} records no key bits and group (write it with `kvqrs calibrate`)")
            return float(str(z["meta_bits"])), int(str(z["meta_group"]))
    except (OSError, ValueError, KeyError) as e:
        raise KvqrsError(f"calibration: cannot read {str(path)!r}: {e}") from None


def load_matched(path: str | pathlib.Path) -> dict:
    """Read a calibration written by :func:`save_matched`; raises :class:`KvqrsError` on another
    or a damaged file."""
    from ..schemes.matched import MatchedBasis, MatchedCalibration

    try:
        with np.load(pathlib.Path(path), allow_pickle=False) as z:
            if "format" not in z or str(z["format"]) != MATCHED_FORMAT:
                raise KvqrsError(f"calibration: {str(path)!r} is not a kvqrs matched calibration file ({MATCHED_FORMAT})")
            layers = sorted(int(k[6:]) for k in z.files if k.startswith("basis_"))
            return {i: MatchedCalibration(MatchedBasis(z[f"mean_{i}"], z[f"basis_{i}"], z[f"widths_{i}"]), z[f"vmean_{i}"]) for i in layers}
    except (OSError, ValueError, KeyError) as e:
        raise KvqrsError(f"calibration: cannot read {str(path)!r}: {e}") from None
