"""``QuantizedKVCache``: a transformers ``Cache`` whose layers store keys and values compressed
with any kvqrs scheme, keep the newest ``residual_length`` tokens in full precision (during
prefill too), and report their real memory in bytes.

Each layer holds a list of encoded chunks (``Encoded``, batch on axis 0) plus a full-precision
window. At each update the window grows; whole chunks beyond ``residual_length`` are encoded
(chunks of one token, or of ``group`` tokens when KIVI keys need whole groups).

Prefill (and any step with more than :data:`FUSED_MAX_QUERY` new tokens) attends over the
decoded (base) keys and values; HeadQ's side code enters the logits through the ``kvqrs``
attention function, with the live query. Decode steps attend straight from the codes
(``KVCodec.fused_attention``: no key or value is decoded) and merge the full-precision window's
softmax part by log-sum-exp, exactly; see ``QuantConfig.fused`` for when. Use the model with
``attn_implementation="kvqrs"``.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._arrays import KvqrsError
from ..kernels.attention import DenseRows
from ..schemes import Encoded
from ..torch import check_finite, from_numpy, to_numpy
from .attention import _STATE, _softmax_out, register
from .config import QuantConfig

FUSED_MAX_QUERY = 4
"""Decode steps with at most this many new query tokens attend from the codes."""


def _select(enc: Encoded, index: torch.Tensor) -> Encoded:
    """The encoded chunk restricted to batch rows ``index`` (every part has batch on axis 0)."""
    idx = index.detach().cpu().numpy()
    parts = {k: np.ascontiguousarray(np.asarray(v)[idx]) for k, v in enc.parts.items()}
    return Encoded(enc.scheme, enc.kind, (len(idx), *enc.shape[1:]), enc.dtype, parts, enc.params)


class QuantizedLayer(CacheLayerMixin):
    """One layer of :class:`QuantizedKVCache`."""

    is_sliding = False
    is_croppable = True

    def __init__(self, config: QuantConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.chunks_k: list[Encoded] = []
        self.chunks_v: list[Encoded | None] = []
        self.quantized = 0
        # A weak reference: recognising this layer's forward must not keep the decoded keys alive.
        self._returned: weakref.ref | None = None
        # Set once the kvqrs attention function has served this layer: only then may update()
        # hand back the window alone (another attention function would miss the codes).
        self._attended = False
        self._fused = False

    # -- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.head_dim = key_states.shape[-1]
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def codec(self):
        return self.config.codec(self.layer_idx, self.head_dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, fused: bool = False, **kwargs: Any):
        """Append the new tokens, flush whole chunks out of the window, and return the keys and
        values attention reads: decoded codes then the window, or, on a fused decode step
        (``fused=True``, passed by :class:`QuantizedKVCache` when ``QuantConfig.fused``), the
        window alone, the codes being read by :meth:`attend`."""
        self._check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._flush()
        self._fused = fused and self._can_fuse(key_states.shape[-2])
        if self._fused:
            self._returned = weakref.ref(self.keys)
            return self.keys, self.values
        k, v = self.materialize()
        self._returned = weakref.ref(k)
        return k, v

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse states that cannot join this layer, before anything is stored: keys and values
        of different batch, heads or tokens, or a batch, head count or head_dim other than the
        layer holds (after ``batch_select_indices`` the batch is the selected one)."""
        ks, vs = tuple(key_states.shape), tuple(value_states.shape)
        if len(ks) != 4 or len(vs) != 4:
            raise KvqrsError(f"key_states, value_states: expected (batch, kv_heads, tokens, head_dim) tensors, got shapes {ks} and {vs}")
        if ks[:3] != vs[:3]:
            raise KvqrsError(f"value_states: expected the (batch, kv_heads, tokens) of key_states {ks[:3]}, got {vs[:3]}")
        if self.is_initialized:
            held_k = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])
            if (ks[0], ks[1], ks[3]) != held_k or vs[3] != self.values.shape[3]:
                raise KvqrsError(
                    f"key_states: layer {self.layer_idx} holds (batch, kv_heads, head_dim) {held_k} "
                    f"(value head_dim {self.values.shape[3]}), got keys {ks} and values {vs}"
                )

    def _can_fuse(self, new_tokens: int) -> bool:
        if not (self._attended and self.quantized and new_tokens <= FUSED_MAX_QUERY and self.dtype != torch.float64):
            return False
        return self.codec().has_fused_path()

    def _flush(self) -> None:
        """Encode whole chunks that have left the full-precision window."""
        target = self.config.quantized_count(self.get_seq_length())
        n = target - self.quantized
        if n <= 0:
            return
        codec = self.codec()
        # One Encoded per side: new chunks are appended along the token axis of every part.
        new_k = codec.encode_keys(to_numpy(self.keys[..., :n, :], "keys"))
        self.chunks_k = [codec.concat([*self.chunks_k, new_k])]
        if codec.values is not None:
            new_v = codec.encode_values(to_numpy(self.values[..., :n, :], "values"))
            self.chunks_v = [codec.concat([*self.chunks_v, new_v])]
        else:
            held = getattr(self, "_fp_values_quantized", self.values[..., :0, :])
            self._fp_values_quantized = torch.cat([held, self.values[..., :n, :]], dim=-2)
        self.keys, self.values = self.keys[..., n:, :], self.values[..., n:, :]
        self.quantized = target

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded (base) keys and values of every chunk, then the window."""
        codec = self.codec()
        ks = [from_numpy(codec.decode_keys(c, base_only=True), self.keys) for c in self.chunks_k]
        if codec.values is None:
            vs = [getattr(self, "_fp_values_quantized", self.values[..., :0, :])]
        else:
            vs = [from_numpy(codec.decode_values(c), self.values) for c in self.chunks_v]
        return torch.cat([*ks, self.keys], dim=-2), torch.cat([*vs, self.values], dim=-2)

    def correction(self, query: torch.Tensor) -> torch.Tensor | None:
        """HeadQ logit correction for the quantized positions, ``(b, q_heads, q_len, quantized)``."""
        codec = self.codec()
        if codec.scheme != "headq" or not self.chunks_k:
            return None
        q = to_numpy(query, "query")
        return torch.cat([torch.from_numpy(codec.score_correction(q, c)) for c in self.chunks_k], dim=-1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.quantized + self.keys.shape[-2]

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.chunks_k, self.chunks_v, self.quantized = [], [], 0
        self._fused = self._attended = False
        self.keys = self.values = None
        self.is_initialized = False
        self.__dict__.pop("_fp_values_quantized", None)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers' convention: a negative
        count). Kept quantized tokens keep their codes; only the tokens of a KIVI key group cut
        in two return to the full-precision window (decoded), since a group's scale and zero
        point cover all of its tokens."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop: expected a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(0, self.get_seq_length() + tokens_to_remove)
        if keep >= self.quantized:
            self.keys = self.keys[..., : keep - self.quantized, :]
            self.values = self.values[..., : keep - self.quantized, :]
            return
        codec = self.codec()
        kept_q = keep // self.config.chunk * self.config.chunk
        # Tokens kept_q .. keep-1 sit in a cut group: decoded in full (side code included).
        tail_k = from_numpy(codec.decode_keys(self.chunks_k[0]), self.keys)[..., kept_q:keep, :]
        if codec.values is None:
            held = self._fp_values_quantized
            tail_v = held[..., kept_q:keep, :]
            self._fp_values_quantized = held[..., :kept_q, :]
        else:
            tail_v = from_numpy(codec.decode_values(self.chunks_v[0]), self.values)[..., kept_q:keep, :]
        if kept_q:
            self.chunks_k = [codec.slice_tokens(self.chunks_k[0], kept_q)]
            self.chunks_v = [codec.slice_tokens(c, kept_q) for c in self.chunks_v]
        else:
            self.chunks_k, self.chunks_v = [], []
        self.quantized = kept_q
        self.keys, self.values = tail_k, tail_v

    def _batch(self, fn) -> None:
        self.chunks_k = [fn(c) for c in self.chunks_k]
        self.chunks_v = [None if c is None else fn(c) for c in self.chunks_v]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.as_tensor(indices).to(self.keys.device)
        batch = self.keys.shape[0]
        if idx.dtype == torch.bool and idx.shape == (batch,):
            idx = idx.nonzero().flatten()  # a mask of the rows to keep, as DynamicLayer takes it
        if (
            idx.dtype.is_floating_point
            or idx.dtype == torch.bool
            or idx.ndim != 1
            or (idx.numel() and not (-batch <= int(idx.min()) and int(idx.max()) < batch))
        ):
            raise KvqrsError(
                f"indices: expected a 1-d integer tensor of batch rows in -{batch}..{batch - 1} or a boolean mask of {batch} rows, got {indices!r}"
            )
        idx = idx.remainder(batch)  # negative rows count from the end, as in Python indexing
        self._batch(lambda c: _select(c, idx))
        self.keys, self.values = self.keys.index_select(0, idx), self.values.index_select(0, idx)
        if hasattr(self, "_fp_values_quantized"):
            self._fp_values_quantized = self._fp_values_quantized.index_select(0, idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        idx = torch.arange(self.keys.shape[0]).repeat_interleave(repeats)
        self.batch_select_indices(idx)

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: every encoded part plus the full-precision tensors."""
        if not self.is_initialized:
            return 0
        total = sum(c.nbytes for c in self.chunks_k) + sum(c.nbytes for c in self.chunks_v if c is not None)
        fp = [self.keys, self.values, getattr(self, "_fp_values_quantized", None)]
        return int(total + sum(t.numel() * t.element_size() for t in fp if t is not None))

    def _codes_visible(self, attention_mask, nq: int) -> bool:
        """Every query sees every quantized position (true for causal decoding unless a new
        token was itself quantized at once, or a padding mask hides old positions)."""
        if attention_mask is None:
            return self.quantized <= self.get_seq_length() - nq
        m = attention_mask[..., : self.quantized]
        return bool(m.all()) if m.dtype == torch.bool else bool((m == 0).all())

    def _attend_fused(self, module, query, attention_mask, scaling):
        """Softmax over the codes (fused kernel) and over the window, merged by log-sum-exp:
        ``out = e^(lse_q - lse) out_q + e^(lse_w - lse) out_w``, ``lse = logaddexp(lse_q, lse_w)``."""
        codec = self.codec()
        q = to_numpy(query, "query")
        if codec.values is None:
            cv = DenseRows(to_numpy(self._fp_values_quantized, "values"))
            res = codec.fused_attention(q, self.chunks_k[0], cv, scale=float(scaling))
        else:
            res = codec.fused_attention(q, self.chunks_k[0], self.chunks_v[0], scale=float(scaling))
        out = torch.from_numpy(res.out)
        if self.keys.shape[-2]:
            lse_q = torch.from_numpy(res.lse)[..., None]
            out_w, lse_w = self._window_part(query, module.num_key_value_groups, attention_mask, scaling)
            lse = torch.logaddexp(lse_q, lse_w)
            w_w = (lse_w - lse).exp_()
            # A fully masked window has lse_w = -inf and NaN probabilities: its weight is 0.
            out = out.mul_((lse_q - lse).exp_()).add_(torch.where(w_w > 0, out_w.mul_(w_w), 0.0))
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    def _window_part(self, query, groups: int, attention_mask, scaling) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax attention over the full-precision window in float32: ``(out_w, lse_w)``,
        ``(b, q_heads, nq, d)`` and ``(b, q_heads, nq, 1)``. The query heads of a GQA group are
        stacked against their KV head (no key repeated), and the few tensor operations run in
        place: a decode step pays this once per layer."""
        b, heads, nq, d = query.shape
        kv_heads = heads // groups
        qg = query.float().reshape(b, kv_heads, groups * nq, d)
        logits = torch.matmul(qg, self.keys.float().transpose(2, 3)).mul_(scaling)
        if attention_mask is not None:
            mask = attention_mask[..., self.quantized : self.quantized + logits.shape[-1]].unsqueeze(2)  # (b, 1, 1, nq, w)
            logits = logits.view(b, kv_heads, groups, nq, -1)
            logits = logits.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else logits.add_(mask.float())
            logits = logits.view(b, kv_heads, groups * nq, -1)
        lse_w = torch.logsumexp(logits, dim=-1, keepdim=True)
        out_w = torch.matmul(logits.sub_(lse_w).exp_(), self.values.float())
        return out_w.view(b, heads, nq, d), lse_w.view(b, heads, nq, 1)

    def attend(self, module, query, key, value, attention_mask, scaling):
        if self._returned is None or key is not self._returned():
            return None
        check_finite(query, "query")  # the fused and decoded paths alike: an error, not NaN rows
        self._attended = True
        from transformers.integrations.sdpa_attention import repeat_kv

        if self._fused:
            if self._codes_visible(attention_mask, query.shape[-2]):
                return self._attend_fused(module, query, attention_mask, scaling)
            key, value = self.materialize()  # a mask hides some codes: the decoded path
        logits = (query @ repeat_kv(key, module.num_key_value_groups).transpose(2, 3)) * scaling
        corr = self.correction(query)
        if corr is not None:
            logits[..., : corr.shape[-1]] += corr.to(logits.dtype)
        return _softmax_out(module, query, logits, attention_mask, [(None, value)])


class QuantizedKVCache(Cache):
    """A transformers cache holding keys and values compressed by kvqrs.

    Args:
        config: :class:`QuantConfig` (schemes, bits, ``residual_length``, HeadQ bases, seed).
        num_layers: number of decoder layers (``model.config.num_hidden_layers``).

    Example::

        model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvqrs")
        cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=32), model.config.num_hidden_layers)
        model.generate(ids, past_key_values=cache, max_new_tokens=20)
        cache.nbytes()
    """

    def __init__(self, config: QuantConfig, num_layers: int):
        register()
        if config.key_scheme is None:
            raise KvqrsError("key_scheme: the cache quantizes keys; value-only rows run in the fast evaluation path only")
        if config.value_scheme == "a2":
            raise KvqrsError(
                "value_scheme: the a2 allocation needs each token's future attention; it runs in the fast evaluation path only"
            )
        if num_layers < 1:
            raise KvqrsError(f"num_layers: expected >= 1, got {num_layers}")
        self.config = config
        super().__init__(layers=[QuantizedLayer(config, i) for i in range(num_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise KvqrsError(f"num_layers: this cache has {len(self.layers)} layers, the model updated layer {layer_idx}")
        check_finite(key_states, "key_states")
        check_finite(value_states, "value_states")
        _STATE.set(self)  # the kvqrs attention function of this layer consults this cache
        return super().update(key_states, value_states, layer_idx, *args, fused=self.config.fused, **kwargs)

    def attend(self, module, query, key, value, attention_mask, scaling):
        # This cache stays the attention state after its last update; another forward (another
        # cache, or none) is recognised because its keys are not the ones this layer returned.
        if not 0 <= module.layer_idx < len(self.layers):
            return None
        return self.layers[module.layer_idx].attend(module, query, key, value, attention_mask, scaling)

    def nbytes(self) -> int:
        """Real memory of the cache in bytes (codes, norms, scales, sketches, side codes and
        the full-precision window)."""
        return sum(layer.nbytes() for layer in self.layers)

    # -- the compressed-cache format (docs/format.md; kvqrs.hf.persist) ---------------------------------
    def to_bytes(self) -> bytes:
        """The whole cache (config, codes, full-precision window, HeadQ bases) as checksummed bytes."""
        from .persist import dumps

        return dumps(self)

    @classmethod
    def from_bytes(cls, data: bytes, config: QuantConfig | None = None) -> QuantizedKVCache:
        """A cache from :meth:`to_bytes`; with ``config``, its settings must equal the saved
        ones. Raises :class:`KvqrsError` on altered, truncated or foreign bytes."""
        from .persist import loads

        return loads(data, config)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_bytes` to ``path``."""
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike, config: QuantConfig | None = None) -> QuantizedKVCache:
        """Read a cache written by :meth:`save` (see :meth:`from_bytes`)."""
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), config)
