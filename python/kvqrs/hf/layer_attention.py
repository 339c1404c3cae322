"""How a forward reads one cache layer (:class:`LayerAttention`, a part of
:class:`~kvqrs.hf.layer.CompressedLayer`): the per-query schedule and the attention paths.

A forward over several new tokens (prefill, drafted tokens) reads, for each query, the keys as
one token at a time would: a code flushed by this forward is read in full precision by the
queries that precede its step (:func:`kvqrs.hf.fake_quant` applies the same schedule). Prefill
(and any step with more than ``FUSED_MAX_QUERY`` new tokens) attends over the decoded (base)
keys and values; HeadQ's side code enters the logits with the live query. Decode steps attend
straight from the codes in one native call per layer over the store's buffers (no key or value
is decoded; the full-precision tokens' softmax part merged by log-sum-exp, GIL released);
learned sink logits (gpt-oss) join that softmax through its log-sum-exp. A layer with logit
soft-capping (Gemma 2), a mask that hides codes or differs between heads, or rows the native
step does not read attend over the decoded keys instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..torch import check_finite, from_numpy
from .attention import SDPA_MIN_QUERY, LogitRule, _softmax_out, blocked_sdpa, current_rule, gqa_matmul, sdpa_prefill_active
from .heap import release_freed
from .store import WindowRows, attend_full_precision

if TYPE_CHECKING:
    from .layer import _View


class LayerAttention:
    """The attention half of :class:`~kvqrs.hf.layer.CompressedLayer` (it reads the layer's
    state: ``_view``, ``_deferred``, ``_fused``, ``_returned``, the window and the store)."""

    def _codes_visible(self, view: _View, attention_mask, nq: int) -> bool:
        """Every query sees every coded position (true for causal decoding unless a new token
        was itself quantized at once, or a mask hides old positions: padding, a sliding window)."""
        ns = view.sink_k.shape[-2]
        if attention_mask is None:
            return view.q_start + view.coded <= self.seen - nq
        m = attention_mask[..., ns : ns + view.coded]
        return bool(m.all()) if m.dtype == torch.bool else bool((m == 0).all())

    def _native_mask(self, view: _View, attention_mask, nq: int, rule: LogitRule | None) -> tuple[bool, torch.Tensor | None]:
        """Whether a fused step's attention can be read from the codes in the native call, and
        the mask of its full-precision columns it then takes. It cannot when a mask hides some
        codes, a mask differs between heads, the layer caps its logits (the fused kernel's
        softmax reads uncapped logits) or the store's rows are not read natively: attention
        then reads the decoded keys."""
        if rule is not None and rule.softcap is not None:
            return False, None
        readable = view.store.can_attend() if view.coded else view.store is None  # nothing coded: sinks and window alone
        if not readable:
            return False, None
        # An explicit mask that hides nothing (one NumPy reduction: a decode step without
        # padding) shows every code and is not passed on; None means causal, checked as such.
        if attention_mask is None or _hides_nothing(attention_mask) is None:
            return True, None
        if attention_mask.shape[1] != 1 or not self._codes_visible(view, attention_mask, nq):
            return False, None
        return True, attention_mask.index_select(-1, view.fp_columns().to(attention_mask.device))

    @staticmethod
    def _fused_out(out: torch.Tensor, query: torch.Tensor, rule: LogitRule | None):
        """The native step's ``out`` (or ``(out, lse)`` with ``rule``: learned sinks join its
        denominator, :meth:`~kvqrs.hf.attention.LogitRule.rescale`) as the attention returns it."""
        out = out if rule is None else rule.rescale(*out)
        if query.dtype is not torch.float32 or query.device.type != "cpu":  # cast: an error, not inf, past the dtype
            out = from_numpy(out.numpy(), query)
        return out.transpose(1, 2).contiguous(), None

    def _attend_codes(self, view: _View, query, attention_mask, scaling, rule: LogitRule | None):
        """A fused decode step's attention straight from the codes in one native call (GIL
        released): the fused kernel over the store's buffers and the softmax over the sinks
        and the window (read in place from its buffer), merged by log-sum-exp. None when it
        must read the decoded keys (:meth:`_native_mask`), or the store no longer holds
        exactly the view's codes."""
        native, mask = self._native_mask(view, attention_mask, query.shape[-2], rule)
        if not (native and (view.live or view.store is None)):
            return None
        sinks, window = (view.sink_k, view.sink_v), view.window_rows or (view.window_k, view.window_v)
        if view.store is None:  # nothing coded yet
            out = attend_full_precision(query, sinks, window, mask, float(scaling), with_lse=rule is not None)
        else:
            out = view.store.attend(query, sinks, window, mask, float(scaling), with_lse=rule is not None)
        return self._fused_out(out, query, rule)

    def _attend_step(self, query, attention_mask, scaling, rule: LogitRule | None):
        """A steady decode step (:meth:`_steady_update`) in one native call: its deferred
        writes (the new token into the window buffer, a chunk leaving the window into the
        store), then :meth:`_attend_codes`' attention. None when the attention must take
        another path: the writes are then made (or refused, and the update redone by the
        general path) and ``self._view`` is the forward's."""
        d, view = self._deferred, self._view
        native, mask = self._native_mask(view, attention_mask, query.shape[-2], rule)
        if not native:
            self._write_deferred()
            return None
        self._deferred = None
        win = self._window
        sinks = (view.sink_k, view.sink_v)
        if view.store is None:  # nothing coded, nothing to flush: the new tokens are in the buffer
            rows = WindowRows(win.flat_k, win.flat_v, win.cap, d.lo, d.hi + d.keys.shape[-2] - d.lo)
            out = attend_full_precision(query, sinks, rows, mask, float(scaling), with_lse=rule is not None)
            return self._fused_out(out, query, rule)
        rows = WindowRows(win.flat_k, win.flat_v, win.cap, d.lo, d.hi - d.lo)
        out = view.store.step(query, sinks, rows, (d.keys, d.values), d.flush, mask, float(scaling), with_lse=rule is not None)
        if out is None:  # a refused value or encode: named by the general path
            self._refuse_deferred(d)
            return None
        self._after_write(d)
        return self._fused_out(out, query, rule)

    def attend(self, module, query, key, value, attention_mask, scaling):
        if self._returned is None or key is not self._returned() or self._view is None:
            return None
        freed = self._freed_by_read()
        try:
            return self._attend(module, query, key, value, attention_mask, scaling)
        finally:
            if self._evict_due:  # the forward has read its codes
                self._evict_due = False
                self._evict()
            if freed:
                release_freed(freed)

    def _freed_by_read(self) -> int:
        """Bytes of the originals a general update flushed from a buffer the window has left
        (a long prompt's): they are freed once this forward has read them."""
        flushed = self._view.flushed
        if flushed is None or self._deferred is not None:
            return 0
        win = self._window
        if win is not None and flushed[0] is win.keys:
            return 0
        return flushed[0].untyped_storage().nbytes() + flushed[1].untyped_storage().nbytes()

    def _attend(self, module, query, key, value, attention_mask, scaling):
        check_finite(query, "query")  # the fused and decoded paths alike: an error, not NaN rows
        self._attended = True
        rule = current_rule()
        redone = False
        if self._deferred is not None:
            out = self._attend_step(query, attention_mask, scaling, rule)
            if out is not None:
                return out
            redone = self._returned is None or key is not self._returned()  # refused writes: the update was redone
        view, self._view = self._view, None  # read once: the view may hold tokens the layer has since dropped
        if self.awaits_calibration:  # the prefill: fit on its queries, then code what the schedule codes
            self._fit_on_prefill(query)
            fresh = self._flush()
            view = self.view(view.start, first_query=view.first_query, **fresh)
            self._drop_unread(view)
            key, value = self.materialize(view)
        if self._fused:
            out = self._attend_codes(view, query, attention_mask, scaling, rule)
            if out is not None:
                return out
            key, value = self.materialize(view)  # the decoded path: the codes are not read natively
        elif redone:
            key, value = self.materialize(view)
        if rule is None and not view.coded and query.shape[-2] < SDPA_MIN_QUERY and query.dtype is torch.float32:
            # Sinks and window alone, all full precision: one SDPA call. The eager path's four
            # small torch calls each wake torch's sleeping OpenMP threads (tens of microseconds
            # apiece under passive waits), which made short-context decoding slower than dense.
            return blocked_sdpa(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
        sdpa = rule is None and sdpa_prefill_active() and query.shape[-2] >= SDPA_MIN_QUERY
        if sdpa and (view.codes_k is None or self.codec().scheme != "headq"):
            out = self._attend_sdpa(view, query, key, value, attention_mask, scaling)
            if out is not None:
                return out.transpose(1, 2).contiguous(), None
        logits = gqa_matmul(query, key.transpose(2, 3)) * scaling
        corr = self.correction(query, view)
        if corr is not None:
            ns = view.sink_k.shape[-2]
            logits[..., ns : ns + corr.shape[-1]] += corr.to(logits.dtype)
        held = self._fresh_held(view, query.shape[-2], key.shape[-2])
        if held is None:
            return _softmax_out(module, query, logits, attention_mask, [(None, value)], rule)
        # Queries that precede a new code's step read its original: the fast path's mixing.
        # The originals are read where they are (no copy of the keys and values with them
        # swapped in): every other column takes its decoded logit and value alone.
        cols, m = held
        a, b = int(cols[0]), int(cols[-1]) + 1
        fresh_k, fresh_v = view.fresh_k[..., -len(cols) :, :], view.fresh_v[..., -len(cols) :, :]
        mf = m.to(logits.dtype)
        mc = mf[..., a:b]
        s_fp = gqa_matmul(query, fresh_k.transpose(2, 3)) * scaling
        logits[..., a:b] = mc * logits[..., a:b] + (1 - mc) * s_fp
        return _softmax_out(module, query, logits, attention_mask, [(mf, value), (1 - mc, fresh_v, (a, b))], rule)

    def _attend_sdpa(self, view: _View, query, key, value, attention_mask, scaling) -> torch.Tensor | None:
        """The prefill path of :func:`kvqrs.hf.sdpa_prefill`: the same reads as the eager path
        below, by SDPA. Every query reads old codes decoded and the window in full precision;
        a code this forward flushed is read decoded by the queries at or after its step and as
        its original by earlier ones. Queries are taken in runs that read the new codes alike
        (a run ends where the quantized end moves while some query of the run still reads a new
        code in full precision: once per KIVI group, never when every new code a query can see
        is already quantized at its step); each run attends over one key tensor in which new
        codes below the run's quantized end are decoded and the others original. Returns
        ``(b, heads, q_len, d)``, or None (the eager path) when runs average under 4 queries."""
        nq = query.shape[-2]
        fresh = self._fresh_reads(view, nq)
        if fresh is None:
            return blocked_sdpa(query, key, value, attention_mask, scaling)
        lo, q_end, his, reads_fp = fresh
        runs, start = [], 0
        for i in range(1, nq):
            if his[i] > his[i - 1] and reads_fp[start:i].any():
                runs.append((start, i))
                start = i
        runs.append((start, nq))
        if len(runs) > max(1, nq // 4):
            return None
        c_lo, c_end = lo - view.start, q_end - view.start
        n = c_end - c_lo
        key_run, value_run = key.clone(), value.clone()
        key_run[..., c_lo:c_end, :], value_run[..., c_lo:c_end, :] = view.fresh_k[..., -n:, :], view.fresh_v[..., -n:, :]
        decoded_to = lo
        outs = []
        for a, b in runs:
            hi = min(int(his[a:b].max()), q_end)
            if hi > decoded_to:
                c0, c1 = decoded_to - view.start, hi - view.start
                key_run[..., c0:c1, :], value_run[..., c0:c1, :] = key[..., c0:c1, :], value[..., c0:c1, :]
                decoded_to = hi
            outs.append(blocked_sdpa(query, key_run, value_run, attention_mask, scaling, rows=(a, b)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)

    def _fresh_reads(self, view: _View, nq: int) -> tuple[int, int, np.ndarray, np.ndarray] | None:
        """For the codes this forward flushed (positions ``lo .. q_end - 1``): ``(lo, q_end,
        his, reads_fp)``, ``his[i]`` the quantized end at query ``i``'s step and ``reads_fp[i]``
        whether query ``i`` reads some new code it can see (causally) in full precision. None
        when no query does."""
        if view.fresh_k is None:
            return None
        q_end = view.q_start + view.coded + view.skip
        lo = max(view.start, q_end - view.fresh_k.shape[-2])
        if lo >= q_end:
            return None
        first = view.first_query
        his = self.config.quantized_ends(first + np.arange(1, nq + 1))
        visible_end = np.minimum(q_end, first + np.arange(nq) + 1)  # a causal query sees positions <= its own
        reads_fp = visible_end > np.maximum(lo, his)
        if not reads_fp.any():
            return None
        return lo, q_end, his, reads_fp

    def _fresh_held(self, view: _View, nq: int, columns: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the codes this forward flushed: their columns in the view, and ``m``
        ``(nq, columns)``, True where query ``i`` reads column ``c`` quantized (its position
        lies in ``quantized_span`` of query ``i``'s step) or the column is not new. None when
        every query reads every new code quantized."""
        if view.fresh_k is None:
            return None
        q_end = view.q_start + view.coded + view.skip
        lo = max(view.start, q_end - view.fresh_k.shape[-2])
        his = torch.tensor([self.config.quantized_span(view.first_query + i + 1)[1] for i in range(nq)])
        if lo >= q_end or not bool((his < q_end).any()):
            return None
        pos = torch.arange(view.start, view.start + columns)
        m = (pos[None, :] < his[:, None]) | (pos[None, :] < lo) | (pos[None, :] >= q_end)
        return torch.arange(lo - view.start, q_end - view.start), m


def _hides_nothing(mask: torch.Tensor | None) -> torch.Tensor | None:
    """None for an explicit mask that hides nothing (an additive mask of zeros, a boolean mask
    of all True: a decode step without padding), else the mask. One NumPy reduction over a CPU
    mask costs a decode step less than the torch comparisons and column selections it saves.
    (Not for a mask that may be None: transformers' None means causal, not "nothing hidden".)"""
    if mask is None or mask.device.type != "cpu" or mask.requires_grad or mask.dtype not in (torch.float32, torch.bool):
        return mask
    m = mask.numpy()
    return None if (m.all() if m.dtype == np.bool_ else not m.any()) else mask
