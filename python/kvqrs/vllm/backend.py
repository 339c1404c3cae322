"""kvqrs' attention backend for vLLM (CPU platform): every KV head's tokens stored as kvqrs codes
of a fixed byte size in vLLM's paged cache (:mod:`.layout`), attention computed from the codes
through the block table by the Rust paged kernel, for decode and prefill tokens alike.

- ``customize_spec`` turns the layer's cache into uint8 pages of ``slot_bytes`` per (token,
  KV head), head-major (``LBHNC``), so a page is one block of one KV head;
- ``forward`` is a layer's step in one native call (:meth:`.layout.SlotLayout.step`, GIL
  released): it encodes the new keys and values (the layer's codec, the same bytes as
  :class:`~kvqrs.hf.QuantizedKVCache`), writes them through the batch's ``slot_mapping``, then
  attends the query tokens causally over their sequences' codes by the fused kernel;
- a request with :data:`~.prefill.PREFILL_QUERIES` query tokens or more (a prompt, a chunk of
  one, the tokens after a cached prefix) is attended densely instead: its sequence's keys and
  values are decoded from the codes once (:meth:`.layout.SlotLayout.reconstruct`, a second
  native call) and read by PyTorch's SDPA in the model's dtype (:mod:`.prefill`).

Either way a prefill sees its own tokens quantized, as ``QuantizedKVCache`` does with
``residual_length=0``.

Imported by vLLM only (it imports vllm); selected by :func:`kvqrs.vllm.register`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .._arrays import KvqrsError
from .layout import SlotLayout, paged_slot_bytes, query_positions
from .prefill import PREFILL_QUERIES, prefill_attention
from .settings import config_from_env

BLOCK_MULTIPLE = 16
"""Block sizes the backend takes: any multiple of this (pages are never split)."""


class KvqrsAttentionBackend(AttentionBackend):
    """Paged attention over kvqrs codes (registered in place of ``CPU_ATTN``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True  # the write and the attention are one native call
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(BLOCK_MULTIPLE)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # one contiguous page per (block, KV head)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """uint8 slots of the kvqrs layout's size: the largest layer's (one size for every layer)."""
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size_v != spec.head_size:
            raise KvqrsError(f"kvqrs vLLM backend: keys and values of one head_dim expected, got {spec.head_size} and {spec.head_size_v}")
        return replace(spec, dtype=torch.uint8, state_content_bytes=paged_slot_bytes(config_from_env(), spec.head_size))

    @staticmethod
    def get_impl_cls() -> type[KvqrsAttentionImpl]:
        return KvqrsAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvqrsMetadataBuilder]:
        return KvqrsMetadataBuilder


@dataclass
class KvqrsMetadata:
    """Per-batch inputs of the paged kernel: each query token's sequence (block-table row), the
    number of tokens it attends to, and the slot its key and value go to; the requests attended
    densely (:data:`PREFILL_QUERIES` query tokens or more: block-table rows, their first query
    token and query tokens, their sequence lengths) and the query tokens of the others."""

    num_actual_tokens: int
    seq: np.ndarray
    lengths: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray
    prefill: np.ndarray
    prefill_start: np.ndarray
    prefill_queries: np.ndarray
    prefill_lengths: np.ndarray
    fused: np.ndarray


class KvqrsMetadataBuilder(AttentionMetadataBuilder[KvqrsMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False) -> KvqrsMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise KvqrsError("kvqrs vLLM backend: only causal decoder attention is supported")
        n = m.num_reqs
        starts, seq_lens = m.query_start_loc_cpu[: n + 1].numpy(), m.seq_lens[:n].cpu().numpy()
        seq, lengths = query_positions(starts, seq_lens)
        slots = m.slot_mapping[: m.num_actual_tokens].cpu().numpy()
        queries = np.diff(starts)
        prefill = np.flatnonzero(queries >= PREFILL_QUERIES).astype(np.int32)
        fused = np.flatnonzero(queries[seq] < PREFILL_QUERIES)
        table = m.block_table_tensor[:n].cpu().numpy()
        return KvqrsMetadata(
            m.num_actual_tokens, seq, lengths, table, slots, prefill, starts[prefill], queries[prefill], seq_lens[prefill], fused
        )


class KvqrsAttentionImpl(AttentionImpl[KvqrsMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs,
    ) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "a logit soft cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            f"kv_cache_dtype {kv_cache_dtype!r} (kvqrs chooses the cache's bytes; use 'auto')": kv_cache_dtype != "auto",
            "a KV cache shared with another layer": kv_sharing_target_layer_name is not None,
        }
        refused = [k for k, v in unsupported.items() if v]
        if refused:
            raise KvqrsError(f"kvqrs vLLM backend: {', '.join(refused)} not supported")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_sharing_target_layer_name = None
        self.config = config_from_env()
        self._layouts: dict[str, SlotLayout] = {}

    def _layout(self, layer, slot_bytes: int) -> SlotLayout:
        """The layer's slot layout (its codec is seeded per layer index, as in QuantizedKVCache)
        in slots of the cache's ``slot_bytes`` (the largest layer's)."""
        name = layer.layer_name
        if name not in self._layouts:
            self._layouts[name] = SlotLayout(self.config, extract_layer_index(name), self.head_size, slot_bytes)
        return self._layouts[name]

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: KvqrsMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise KvqrsError("kvqrs vLLM backend: fused output quantization is not supported")
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output.zero_()
        m = attn_metadata
        n = m.num_actual_tokens
        if n == 0:
            return output
        layout, cache = self._layout(layer, kv_cache.shape[-1]), kv_cache.numpy()
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(query.shape)
        f = m.fused if m.prefill.size else slice(None)  # the fused kernel's query tokens
        tf = torch.from_numpy(f) if m.prefill.size else f
        q = query[tf].float().numpy()
        fused = None
        if key is None or value is None:  # nothing new to store (not a layer kvqrs serves today)
            if len(q):
                fused = layout.attend(cache, q, m.seq[f], m.lengths[f], m.block_table, self.scale)
        else:
            k, v = (t[:n].view(n, self.num_kv_heads, self.head_size).float().numpy() for t in (key, value))
            if len(q):
                fused = layout.step(cache, k, v, m.slot_mapping, q, m.seq[f], m.lengths[f], m.block_table, self.scale)
            else:  # every query token is a prefill's: store only
                layout.write(cache, k, v, m.slot_mapping)
        if fused is not None and m.prefill.size:
            out[tf] = torch.from_numpy(fused).to(output.dtype)
        elif fused is not None:  # every query token's: converted in place, no temporary
            out.copy_(torch.from_numpy(fused).view(out.shape))
        if m.prefill.size:
            decoded = layout.reconstruct(cache, m.prefill, m.prefill_lengths, m.block_table)
            for (k, v), start, count in zip(decoded, m.prefill_start, m.prefill_queries):
                out[start : start + count] = prefill_attention(query[start : start + count], k, v, self.scale).to(output.dtype)
        return output
