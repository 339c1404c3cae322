"""Dense attention of a prompt's query tokens over its keys and values decoded from the codes
(:meth:`.layout.SlotLayout.reconstruct`), by PyTorch's ``scaled_dot_product_attention`` in the
model's dtype. A prefill of ``m`` tokens then decodes each stored token once, where the fused
kernel would read every token's codes once per query token (``m`` passes over the context).

Needs PyTorch only (no vLLM).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .._arrays import KvqrsError

PREFILL_QUERIES = 16
"""Query tokens of one request from which its attention is dense: decoding a token costs about
``2 * head_dim`` multiply-adds per KV head and coordinate, the fused read ``2 * q_heads / kv_heads``
per query token."""


def prefill_attention(query: torch.Tensor, keys: np.ndarray, values: np.ndarray, scale: float) -> torch.Tensor:
    """Causal attention of a request's last ``m`` query tokens over its ``L`` decoded tokens:
    query token ``i`` reads the first ``L - m + i + 1`` (``out = softmax(scale * q k^T) v``).

    Args:
        query: ``(m, q_heads, head_dim)``, any float dtype (the computation's).
        keys, values: float32 ``(kv_heads, L, head_dim)`` with ``L >= m`` and ``q_heads`` a
            multiple of ``kv_heads`` (query head ``i`` reads KV head ``i // (q_heads // kv_heads)``).
        scale: logit scale.

    Returns:
        ``(m, q_heads, head_dim)`` in ``query``'s dtype.

    Raises:
        KvqrsError: shapes that do not match (named).
    """
    shapes = f"query {tuple(query.shape)}, keys {getattr(keys, 'shape', None)}, values {getattr(values, 'shape', None)}"
    ok = isinstance(keys, np.ndarray) and isinstance(values, np.ndarray) and query.ndim == keys.ndim == 3
    if not ok or values.shape != keys.shape or keys.shape[2] != query.shape[2] or keys.shape[0] == 0:
        raise KvqrsError(f"prefill: expected query (m, q_heads, d) and keys, values (kv_heads, L, d) arrays; got {shapes}")
    m, heads, _ = query.shape
    kv_heads, length, _ = keys.shape
    if length < m or heads % kv_heads:
        raise KvqrsError(f"prefill: expected L >= m and q_heads a multiple of kv_heads; got {shapes}")
    q = query.transpose(0, 1).unsqueeze(0)  # (1, q_heads, m, d)
    k, v = (torch.from_numpy(x).to(query.dtype).unsqueeze(0) for x in (keys, values))
    if length == m:  # the whole sequence is new: causal from the first token (no mask to read)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # after a cached prefix: query i reads tokens up to L - m + i
        mask = torch.ones(m, length, dtype=torch.bool).tril(length - m)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
