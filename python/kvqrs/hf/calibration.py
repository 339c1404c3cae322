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
