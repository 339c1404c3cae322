"""The ``kvqrs`` attention function for transformers' attention interface.

It computes eager attention (scores, mask, softmax, weighted values), taking the keys and values
from kvqrs when a quantization state is active for the layer:

- the real cache path: :class:`kvqrs.hf.QuantizedKVCache` hands back decoded (base) keys and
  values; HeadQ's correction is added to the logits of the quantized positions with the live
  query, never by rebuilding keys;
- the fast evaluation path (:func:`fake_quant`): one forward pass per window in which query
  ``t`` sees key ``j`` quantized exactly when the cache would hold it quantized at step ``t``.

A state is an :class:`AttentionState`. It is in effect for a scope only: inside ``with
active(state):`` (reset on exit, an exception included), or, for a cache, the one attention
call that follows its ``update`` (:func:`hand_over`, by weak reference: nothing stays installed).
With no state it is plain eager attention. Every path applies the layer's :class:`LogitRule`:
logit soft-capping (Gemma 2) and learned sink logits (gpt-oss), as transformers' eager attention
of those models does.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from .._arrays import KvqrsError, check_positive_int
from ..schemes.width_classes import IMPORTANCE_QUERIES, IMPORTANCE_WINDOW
from ..torch import check_finite, from_numpy, to_numpy
from .config import QuantConfig

NAME = "kvqrs"


@runtime_checkable
class AttentionState(Protocol):
    """What the ``kvqrs`` attention function consults for a layer's attention (a
    :class:`~kvqrs.hf.QuantizedKVCache`, the fast path's :class:`FakeQuant`, the calibration and
    capture recorders): :func:`active` makes one the state for a scope, and a cache hands
    itself to the attention call after its ``update`` (:func:`hand_over`)."""

    def attend(
        self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The attention of ``module`` (its ``layer_idx``) for ``query`` ``(batch, heads, q_len,
        d)`` over ``key`` / ``value`` ``(batch, kv_heads, kv_len, d)`` under ``attention_mask``
        (additive or boolean, or None) and logit scale ``scaling``: ``(out (batch, q_len,
        heads, d), probs or None)`` as transformers' attention functions return, or None to
        leave the layer to the next state or eager attention (a recorder that only records,
        a cache whose layer did not return these keys)."""
        ...


_STATE: contextvars.ContextVar[AttentionState | None] = contextvars.ContextVar("kvqrs_attention_state", default=None)
# The cache whose update ran last, by weak reference, for the attention call that follows it
# (taken by that call: hand_over).
_HANDED: contextvars.ContextVar[weakref.ref | None] = contextvars.ContextVar("kvqrs_handed_state", default=None)
_SDPA_PREFILL: contextvars.ContextVar[bool] = contextvars.ContextVar("kvqrs_sdpa_prefill", default=False)
# The logit rule of the layer whose attention a state is serving (None: plain softmax), set by
# the attention function around the state's ``attend`` call only when the layer has one.
_RULE: contextvars.ContextVar[LogitRule | None] = contextvars.ContextVar("kvqrs_logit_rule", default=None)

SDPA_MIN_QUERY = 5
"""Forwards with at least this many queries take the SDPA path inside :func:`sdpa_prefill`
(decode steps keep theirs: the fused path, or eager attention over one query)."""
SDPA_BLOCK = 256
"""Queries per SDPA call of the blocked prefill: each block reads only the key columns its
mask lets some query see (causal: up to its last query), so about half of the masked
quadrant is never computed, and no ``heads x queries x keys`` logits tensor is built."""


@dataclass(frozen=True)
class LogitRule:
    """What a layer's attention does beyond ``softmax(q k^T * scaling + mask) v``, as
    transformers' eager attention of the model computes it:

    - ``softcap`` (Gemma 2: ``config.attn_logit_softcapping``, passed as ``softcap=``): each
      logit ``s`` becomes ``softcap * tanh(s / softcap)`` before the mask is added (Gemma Team,
      "Gemma 2: Improving Open Language Models at a Practical Size", 2024, section 2);
    - ``sinks`` (gpt-oss: ``module.sinks``, passed as ``s_aux=``): one learned logit per query
      head, ``(q_heads,)``, that joins each query's softmax denominator and reads no value:
      ``p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i))`` (OpenAI, "gpt-oss-120b & gpt-oss-20b
      model card", 2025; transformers' ``models/gpt_oss`` ``eager_attention_forward``). A
      softmax part already normalised with log-sum-exp ``lse`` takes the sink exactly by
      :meth:`rescale`: ``out * exp(lse - logaddexp(lse, sink))``.
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """``softcap * tanh(logits / softcap)`` (a new tensor), or ``logits`` without a cap."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def sink_logits(self, like: torch.Tensor) -> torch.Tensor | None:
        """The sinks as ``(1, q_heads, 1, 1)`` in ``like``'s dtype and device, or None."""
        return None if self.sinks is None else self.sinks.detach().to(like.device, like.dtype).view(1, -1, 1, 1)

    def rescale(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Add the sinks to an attention output normalised without them: ``out`` ``(b, q_heads,
        nq, d)``, ``lse`` its log-sum-exp ``(b, q_heads, nq, 1)`` (-inf: no token read, output
        0). Returns ``out * exp(lse - logaddexp(lse, sink))`` (``out`` itself without sinks)."""
        sink = self.sink_logits(lse)
        if sink is None:
            return out
        return out * (lse - torch.logaddexp(lse, sink)).exp().to(out.dtype)


def layer_rule(module, kwargs: dict) -> LogitRule | None:
    """The :class:`LogitRule` of one attention call from the arguments transformers passes
    (``softcap=``, ``s_aux=``; a module's ``sinks`` tensor when ``s_aux`` is absent, as
    transformers' gpt-oss eager attention reads it), or None for plain softmax attention.
    Raises :class:`KvqrsError` for a cap that is not a positive finite number or sinks that
    are not one finite logit per query head."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    if softcap is None and sinks is None:
        return None
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (math.isfinite(softcap) and softcap > 0):
            raise KvqrsError(f"softcap: expected a positive finite logit cap, got {softcap!r}")
        softcap = float(softcap)
    if sinks is not None:
        heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
        if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or (heads is not None and sinks.numel() != heads):
            got = f"shape {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise KvqrsError(f"s_aux: expected one learned sink logit per query head ({heads}), got {got}")
        check_finite(sinks.detach(), "s_aux")
    return LogitRule(softcap, sinks)


def current_rule() -> LogitRule | None:
    """The :class:`LogitRule` of the layer a state's ``attend`` is serving (None: plain
    softmax attention); states that compute attention themselves read it."""
    return _RULE.get()


def _probabilities(logits, attention_mask, rule: LogitRule | None) -> torch.Tensor:
    """Softmax weights of raw logits ``(b, heads, q_len, keys)`` under ``rule`` (soft-capped
    before the mask, as Gemma 2's eager attention; sinks in the denominator, their column
    dropped) and ``attention_mask`` (boolean or additive, None: nothing hidden)."""
    if rule is not None:
        logits = rule.cap(logits)
    if attention_mask is not None:
        mask = attention_mask[..., : logits.shape[-1]]
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    sink = None if rule is None else rule.sink_logits(logits)
    if sink is None:
        return torch.softmax(logits, dim=-1)
    return torch.softmax(torch.cat([logits, sink.expand(*logits.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]


def gqa_matmul(x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``x @ repeat_kv(kv, g)`` without the repeat: ``x`` ``(b, heads, n, m)`` and ``kv``
    ``(b, kv_heads, m, p)`` with ``heads = g * kv_heads`` (GQA: query head ``h`` reads KV head
    ``h // g``); the ``g`` query heads of a KV head are one batch of ``g * n`` rows, so no
    copy of the keys or values per query head is made. Returns ``(b, heads, n, p)``."""
    b, heads, n, m = x.shape
    kv_heads = kv.shape[1]
    if heads == kv_heads:
        return x @ kv
    out = x.reshape(b, kv_heads, heads // kv_heads * n, m) @ kv
    return out.reshape(b, heads, n, kv.shape[-1])


def _softmax_out(module, query, logits, attention_mask, value_parts, rule: LogitRule | None = None):
    """Softmax over raw logits (+ mask, under ``rule``), then ``sum_parts (p * m_part) @
    v_part`` (a part ``(m, v, (a, b))`` reads the probabilities of columns ``a .. b - 1``
    alone); returns the layout transformers expects: ``(batch, q_len, heads, d)`` and the
    probabilities."""
    # float32 accumulation, or float64 for a float64 model (so the two evaluation paths can be
    # compared without float32 noise).
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    p = _probabilities(logits.to(acc), attention_mask, rule)
    out = sum(gqa_matmul(_part(p, m, cols, acc), v.to(acc)) for m, v, *cols in value_parts)
    return out.to(query.dtype).transpose(1, 2).contiguous(), p.to(query.dtype)


def _part(p: torch.Tensor, m: torch.Tensor | None, cols: list, acc: torch.dtype) -> torch.Tensor:
    """The probabilities ``p`` (of columns ``cols[0]`` when given) weighted by ``m``."""
    if cols:
        p = p[..., cols[0][0] : cols[0][1]]
    return p if m is None else p * m.to(acc)


def sdpa_prefill_active() -> bool:
    """Whether :func:`sdpa_prefill` is in effect."""
    return _SDPA_PREFILL.get()


@contextlib.contextmanager
def sdpa_prefill(enabled: bool = True) -> Iterator[None]:
    """Inside, forwards of at least :data:`SDPA_MIN_QUERY` queries (a prefill) compute their
    attention with ``torch.nn.functional.scaled_dot_product_attention`` in query blocks
    (:func:`blocked_sdpa`) instead of eager attention: the same softmax over the same keys,
    values and mask (a dense cache's, or what :class:`kvqrs.hf.QuantizedKVCache` hands back,
    with the same per-query schedule of quantized and full-precision tokens), without the
    logits tensor and most of the masked work. Results differ from the eager path only by
    float rounding (none in float64 on CPU). HeadQ side codes (a logit correction) and layers
    with logit soft-capping or learned sinks (:class:`LogitRule`, which SDPA does not compute)
    keep the eager path."""
    token = _SDPA_PREFILL.set(bool(enabled))
    try:
        yield
    finally:
        _SDPA_PREFILL.reset(token)


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Where a mask lets a query read a key (bool mask: True; additive: above its dtype's minimum)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min


def blocked_sdpa(query, key, value, attention_mask, scaling, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Softmax attention of query rows ``rows`` (default: all) over ``key`` / ``value``
    (``(b, kv_heads, columns, d)``, GQA groups read their KV head) under ``attention_mask``
    (additive or boolean, ``(b, 1 or heads, q_len, >= columns)``, or None), by SDPA in blocks
    of :data:`SDPA_BLOCK` queries; returns ``(b, heads, rows, d)`` in the query's dtype. A
    block reads the key columns up to the last one its mask allows (the causal end when every
    column after it is masked for the block, else all of them)."""
    import torch.nn.functional as F

    lo, hi = (0, query.shape[-2]) if rows is None else rows
    columns = key.shape[-2]
    mask = None if attention_mask is None else attention_mask[..., :columns]
    outs = []
    for a in range(lo, hi, SDPA_BLOCK):
        b = min(hi, a + SDPA_BLOCK)
        end = columns
        if mask is not None:
            # Causal layout: the block's last query is column columns - (q_len - b); use that
            # end when the mask hides every later column from the whole block.
            causal_end = columns - (query.shape[-2] - b)
            if 0 < causal_end < columns and not bool(_allowed(mask[..., a:b, causal_end:]).any()):
                end = causal_end
        m = None if mask is None else mask[..., a:b, :end]
        outs.append(
            F.scaled_dot_product_attention(
                query[..., a:b, :], key[..., :end, :], value[..., :end, :], attn_mask=m, scale=scaling, enable_gqa=True
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _serve(state, rule: LogitRule | None, args: tuple):
    """``state.attend(*args)`` with ``rule`` as :func:`current_rule` (set only when there is one)."""
    if rule is None:
        return state.attend(*args)
    token = _RULE.set(rule)
    try:
        return state.attend(*args)
    finally:
        _RULE.reset(token)


def kvqrs_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention interface function (registered as ``"kvqrs"``): eager attention, or the
    attention the active state (a cache, the fast path) computes, with the layer's logit
    soft-capping and learned sink logits (:func:`layer_rule`). Returns ``(out, probs)``:
    ``(batch, q_len, heads, d)`` in the query's dtype, and the probabilities or None."""
    rule = layer_rule(module, kwargs)
    args = (module, query, key, value, attention_mask, scaling)
    handed = _take_handed()
    if handed is not None:  # the cache whose update this layer just called
        if kwargs.get("sliding_window") is not None and hasattr(handed, "note_sliding_window"):
            handed.note_sliding_window(module, kwargs["sliding_window"])  # a cache built with a layer count warns
        handled = _serve(handed, rule, args)
        if handled is not None:
            return handled
    state = _STATE.get()
    if state is not None:
        handled = _serve(state, rule, args)
        if handled is not None:
            return handled
    if rule is None and _SDPA_PREFILL.get() and query.shape[-2] >= SDPA_MIN_QUERY:
        out = blocked_sdpa(query, key, value, attention_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    logits = gqa_matmul(query, key.transpose(2, 3)) * scaling
    return _softmax_out(module, query, logits, attention_mask, [(None, value)], rule)


def register() -> str:
    """Register the function, and transformers' eager (additive, causal) mask builder for it,
    with transformers (idempotent); returns its name."""
    AttentionInterface.register(NAME, kvqrs_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME


@contextlib.contextmanager
def active(state: AttentionState | None) -> Iterator[AttentionState | None]:
    """Make ``state`` (a fake-quant plan, a recorder, a cache; None: no state) the one the
    attention function consults inside the ``with`` block; the state before it is back on exit,
    an exception included."""
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


def current() -> AttentionState | None:
    """The state :func:`active` put in effect here (None outside any)."""
    return _STATE.get()


def hand_over(state: AttentionState) -> None:
    """Hand ``state`` to the next call of the attention function in this context, which takes
    it (transformers calls the attention right after the layer's cache ``update``): it is
    served first, then the :func:`active` state if it declines the layer. Held by weak
    reference, so a cache no one holds is not kept alive, and a state handed but never taken
    (an ``update`` outside a forward) is replaced by the next hand-over."""
    _HANDED.set(weakref.ref(state))


def _take_handed() -> AttentionState | None:
    """The state handed over for this call, taken (None when there is none, or it is gone)."""
    ref = _HANDED.get()
    if ref is None:
        return None
    _HANDED.set(None)
    return ref()


class FakeQuant(AttentionState):
    """The fast path: quantize-dequantize inside one forward pass over a window that starts at
    position 0, with the cache's schedule (``QuantConfig.quantized_span``) applied per query."""

    def __init__(self, config: QuantConfig, one_shot: bool = False, wrap: Callable[[Any], Any] | None = None):
        self.config = config
        self.one_shot = one_shot
        self.wrap = wrap
        self.calls = 0
        self._schedules: dict[int, tuple[torch.Tensor, bool]] = {}

    def _schedule(self, length: int) -> tuple[torch.Tensor, bool]:
        """``(m, all_held)`` for a window: ``m[t, j]`` is True when key ``j`` is held quantized
        after the cache has seen ``t + 1`` tokens; ``all_held`` when every key a query may see
        (``j <= t``) is. The same for every layer, so built once per window length."""
        if length < self.config.sink_tokens:
            raise KvqrsError(f"sink_tokens: {self.config.sink_tokens} sink tokens, but the window holds only {length} tokens")
        if length not in self._schedules:
            if self.one_shot:  # the prefill of a cache that holds the whole window: every token after the sinks coded
                spans = torch.tensor([[self.config.sink_tokens, length]] * length)
            else:
                spans = torch.tensor([self.config.quantized_span(t) for t in range(1, length + 1)])
            j = torch.arange(length)[None, :]
            m = (j >= spans[:, :1]) & (j < spans[:, 1:])
            tril = torch.ones(length, length, dtype=torch.bool).tril()
            self._schedules[length] = (m, bool(torch.equal(m & tril, tril)))
        return self._schedules[length]

    def attend(self, module, query, key, value, attention_mask, scaling):
        self.calls += 1
        cfg, rule = self.config, _RULE.get()
        fitted = None
        if cfg.calibration == "prefill":  # self-calibration: this window is the prefill
            from .calibration import prefill_calibration

            fitted = prefill_calibration(cfg, query, key[..., cfg.sink_tokens :, :], value[..., cfg.sink_tokens :, :])
        codec = cfg.codec(module.layer_idx, query.shape[-1], fitted)
        if self.wrap is not None:
            codec = self.wrap(codec)
        length = key.shape[-2]
        if query.shape[-2] != length:
            raise ValueError("kvqrs fake-quant path: expects a full window starting at position 0 (no cache)")
        held, all_held = self._schedule(length)
        # The sinks as the cache reads them back (rounded to sink_dtype when set).
        key, value = cfg.round_sinks(key), cfg.round_sinks(value)
        # With no full-precision token (no window, no sinks) every key a query may see (j <= t)
        # is quantized: the causal mask hides the rest, so the mixing below reduces to the
        # quantized parts alone.
        all_held = attention_mask is not None and all_held
        s_fp = None
        local_a2 = codec.values is not None and cfg.value_scheme != "a2" and codec.needs_weights
        if not (all_held and cfg.quantizes_keys) or (cfg.value_scheme == "a2" and not cfg.a2_uniform) or local_a2:
            s_fp = gqa_matmul(query, key.transpose(2, 3)) * scaling
        logits = s_fp
        # The sinks are never quantized: codes (and KIVI key groups) start after them, as in the cache.
        sink = cfg.sink_tokens
        if cfg.quantizes_keys:
            ck, k_hat = decoded_keys(codec, key, sink)
            s_q = gqa_matmul(query, k_hat.transpose(2, 3)) * scaling
            corr = codec.score_correction(to_numpy(query, "query"), ck)
            if corr is not None:
                s_q[..., sink:] += torch.from_numpy(corr).to(s_q.dtype)
            m = held.to(s_q.dtype)
            logits = s_q if all_held else m * s_q + (1 - m) * s_fp
        if codec.values is None:
            return _softmax_out(module, query, logits, attention_mask, [(None, value)], rule)
        weights = None
        if cfg.value_scheme == "a2" and not cfg.a2_uniform:
            weights = _a2_importance(module, s_fp, attention_mask, cfg.a2_lookahead, rule)[..., sink:]
        elif local_a2:
            capped = s_fp if rule is None else rule.cap(s_fp)
            weights = causal_importance(capped, sink, module.num_key_value_groups)[..., sink:]
        v_hat = decoded_values(codec, value, sink, weights)
        if all_held:
            return _softmax_out(module, query, logits, attention_mask, [(None, v_hat)], rule)
        m = held.to(logits.dtype)
        return _softmax_out(module, query, logits, attention_mask, [(m, v_hat), (1 - m, value)], rule)


def decoded_keys(codec, key: torch.Tensor, sink: int):
    """``(codes, k_hat)``: ``key`` ``(batch, kv_heads, len, d)`` coded by ``codec`` after its
    first ``sink`` positions and decoded (HeadQ's base keys; its correction is the codes'), the
    sinks kept as given; ``k_hat`` has ``key``'s shape, dtype and device."""
    ck = codec.encode_keys(to_numpy(key[..., sink:, :], "keys"))
    return ck, torch.cat([key[..., :sink, :], from_numpy(codec.decode_keys(ck, base_only=True), key)], dim=-2)


def decoded_values(codec, value: torch.Tensor, sink: int, weights: np.ndarray | None = None) -> torch.Tensor:
    """``value`` ``(batch, kv_heads, len, d)`` coded by ``codec`` after its first ``sink``
    positions and decoded, the sinks kept as given (``weights``: the coded tokens' importances
    ``(batch, kv_heads, len - sink)`` where the values need them)."""
    v_hat = from_numpy(codec.decode_values(codec.encode_values(to_numpy(value[..., sink:, :], "values"), weights)), value)
    return torch.cat([value[..., :sink, :], v_hat], dim=-2)


def _a2_importance(module, s_fp, attention_mask, lookahead, rule: LogitRule | None = None):
    """A^2 importance of each key ``(batch, kv_heads, len)``: sum over queries t (all heads of
    the GQA group) of ``p_tj^2`` under dense attention (HeadQ's A^2 weighting; soft-capping and
    sinks of ``rule`` applied). ``lookahead`` None: every query (future ones too: an oracle);
    else only ``j <= t < j + lookahead``."""
    length = s_fp.shape[-1]
    p = _probabilities(s_fp, attention_mask, rule).double() ** 2
    if lookahead is not None:
        lag = torch.arange(length)[:, None] - torch.arange(length)[None, :]  # t - j
        p = p * ((lag >= 0) & (lag < lookahead))
    g = module.num_key_value_groups
    return p.sum(dim=-2).reshape(p.shape[0], -1, g, length).sum(dim=2).numpy()


def _check_importance_args(logits: Any, sinks: Any, groups: Any, queries: Any, window: Any) -> None:
    """The argument checks of :func:`causal_importance`."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 4 or logits.shape[-1] != logits.shape[-2]:
        got = f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise KvqrsError(f"logits: expected a (batch, q_heads, len, len) torch tensor, got {got}")
    if not logits.dtype.is_floating_point:
        raise KvqrsError(f"logits: expected real floating-point logits, got {logits.dtype}")
    check_finite(logits, "logits")
    g = check_positive_int(groups, "groups")
    if logits.shape[1] % g:
        raise KvqrsError(f"groups: expected a divisor of the {logits.shape[1]} query heads, got {g}")
    check_positive_int(sinks, "sinks", minimum=0)
    check_positive_int(queries, "queries")
    check_positive_int(window, "window")


def causal_importance(
    logits: torch.Tensor, sinks: int, groups: int, queries: int = IMPORTANCE_QUERIES, window: int = IMPORTANCE_WINDOW
) -> np.ndarray:
    """The A^2 importance of each key predicted from the queries up to its own position, so that
    it depends on no later token: ``w_j = sum_t sum_heads p_tj^2`` over the queries ``t = j -
    queries + 1 .. j``. Each query ``t`` has its softmax over the sinks and its ``window`` latest
    keys (full precision, read the same by any cache; normaliser ``Z_t``); for its own key (``t
    = j``) ``p_tj`` is that softmax, for a key it precedes (``t < j``) the share the key would
    take in it, ``exp(s_tj) / (Z_t + exp(s_tj))``. Measured on SmolLM2-135M (docs/evaluation.md,
    "Value width classes"): value width classes ranked by it cut the KL by 34-38% where the
    newest 64 tokens stay in full precision, and raise it where every token is read quantized.

    Args:
        logits: ``(batch, q_heads, len, len)`` scaled full-precision logits of the queries at
            positions ``0 .. len - 1`` against the same positions' keys.
        sinks: leading full-precision tokens every query's softmax keeps.
        groups: query heads per KV head (GQA).
        queries: queries weighing each key (the key's own and the ``queries - 1`` before it).
        window: latest keys in each query's softmax.

    Returns:
        float64 ``(batch, kv_heads, len)``.

    Raises:
        KvqrsError: logits that are not a real ``(batch, q_heads, len, len)`` tensor or hold a
            NaN or infinity; ``groups`` not a positive divisor of ``q_heads``; ``sinks`` < 0;
            ``queries`` or ``window`` < 1.
    """
    _check_importance_args(logits, sinks, groups, queries, window)
    length = logits.shape[-1]
    pos = torch.arange(length)
    lag = pos[:, None] - pos[None, :]  # t - j
    held = (lag >= 0) & ((lag < window) | (pos[None, :] < sinks))
    x = logits.detach().double()
    log_z = torch.logsumexp(x.masked_fill(~held, float("-inf")), dim=-1, keepdim=True)
    log_p = torch.where(held, x - log_z, x - torch.logaddexp(log_z.expand_as(x), x))
    weigh = (lag <= 0) & (lag > -queries)
    w = (log_p.exp() ** 2 * weigh).sum(dim=-2)
    return w.reshape(w.shape[0], -1, groups, length).sum(dim=2).numpy()


@contextlib.contextmanager
def fake_quant(config: QuantConfig, one_shot: bool = False, wrap: Callable[[Any], Any] | None = None) -> Iterator[FakeQuant]:
    """``with fake_quant(cfg): model(ids)`` runs the fast evaluation path (the model must use
    ``attn_implementation="kvqrs"``).

    ``one_shot=True``: every token after the sinks is read quantized, whatever the window and
    chunk settings (a cache prefilled with the whole window in one pass: llama.cpp's perplexity
    protocol, in which KIVI-style groups are coded with the tokens of the whole window).

    ``wrap``: called on each layer's codec, its result used in the codec's place (the same
    methods: ``encode_keys``, ``decode_keys``, ``score_correction``, ``encode_values``,
    ``decode_values``); :func:`kvqrs.evaluation.channel.channel_wrap` makes one."""
    register()
    with active(FakeQuant(config, one_shot, wrap)) as state:
        yield state
    if state.calls == 0:
        # A model with another attention implementation (sdpa, eager) never consults the plan:
        # its output would be the dense model's, reported as if quantized.
        raise KvqrsError(
            "fake_quant: no attention call went through kvqrs; load the model with "
            "attn_implementation='kvqrs' (or model.set_attn_implementation('kvqrs')) after kvqrs.hf.register()"
        )
