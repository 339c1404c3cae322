"""Real attention tensors from the model: per layer and KV head, the post-RoPE queries, keys and
values of one forward pass (the HeadQ paper's mechanism checks and
``kvqrs study --from-model``).

A captured head is a decode-time situation: the keys and values of the first ``tokens``
positions form the cache, and the queries of the next positions (all query heads of the GQA
group, stacked) attend over it. Scores are ``q k^T / sqrt(head_dim)``, the model's own scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._arrays import KvqrsError
from ..synthetic import Head
from ..torch import to_numpy
from .sample import MODEL_DISTRIBUTION


class Recorder:
    """Attention state that copies each layer's query ``(q_heads, len, d)``, key and value
    ``(kv_heads, len, d)`` (batch 0) and lets attention run unchanged. ``layers`` limits which."""

    def __init__(self, layers: set[int] | None = None) -> None:
        self.layers = layers
        self.tensors: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        if self.layers is None or module.layer_idx in self.layers:
            self.tensors[module.layer_idx] = tuple(
                to_numpy(x[0], name).copy() for x, name in ((query, "query"), (key, "keys"), (value, "values"))
            )
        return None


def record(model, ids: torch.Tensor, layers: set[int] | None = None) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One forward pass of ``ids`` ``(1, len)`` with the ``kvqrs`` attention; returns
    ``{layer: (query, key, value)}`` as float32 NumPy arrays."""
    from ..hf.attention import active

    rec = Recorder(layers)
    with torch.no_grad(), active(rec):
        model(ids)
    if not rec.tensors:
        raise KvqrsError("capture: no attention call was recorded (is the model using attn_implementation='kvqrs'?)")
    return rec.tensors


@dataclass(frozen=True)
class CapturedHeads:
    """Captured heads in order ``index = layer * kv_heads + kv_head``, and for each the
    calibration queries of the same layer and group from a disjoint text."""

    heads: list[Head]
    calibration_queries: list[np.ndarray]
    kv_heads: int
    source: str

    def layer_head(self, index: int) -> tuple[int, int]:
        """``(layer, kv_head)`` of head ``index``."""
        return divmod(index, self.kv_heads)


def _group_queries(q: np.ndarray, kv_heads: int, h: int, positions: slice) -> np.ndarray:
    """Queries of the query heads that read KV head ``h``, ``(g * positions, d)``, position-major."""
    g = q.shape[0] // kv_heads
    return np.ascontiguousarray(q[h * g : (h + 1) * g, positions].transpose(1, 0, 2).reshape(-1, q.shape[-1]))


def capture_heads(model, tokenizer, texts, tokens: int, n_queries: int) -> CapturedHeads:
    """Every layer and KV head of ``model`` on ``texts``: keys and values of the first ``tokens``
    evaluation tokens, and ``n_queries`` queries from the next positions (the group's query
    heads stacked per position); HeadQ calibration queries from the calibration text.

    Raises :class:`KvqrsError` when a text is shorter than the window it needs."""
    g = model.config.num_attention_heads // model.config.num_key_value_heads
    positions = math.ceil(n_queries / g)
    window = tokens + positions
    ids = {}
    for name, text in (("evaluation", texts.evaluation), ("calibration", texts.calibration)):
        t = tokenizer(text, return_tensors="pt").input_ids[:, :window]
        if t.shape[1] < window:
            raise KvqrsError(
                f"capture: the {name} text has {t.shape[1]} tokens, fewer than the {window} needed ({tokens} + {positions} query positions); use smaller --tokens"
            )
        ids[name] = t
    ev, cal = record(model, ids["evaluation"]), record(model, ids["calibration"])
    heads, calib = [], []
    for layer in sorted(ev):
        q, k, v = ev[layer]
        for h in range(k.shape[0]):
            heads.append(
                Head(_group_queries(q, k.shape[0], h, slice(tokens, window))[:n_queries], k[h, :tokens], v[h, :tokens], MODEL_DISTRIBUTION)
            )
            calib.append(_group_queries(cal[layer][0], k.shape[0], h, slice(0, window)))
    return CapturedHeads(heads, calib, model.config.num_key_value_heads, texts.source)
