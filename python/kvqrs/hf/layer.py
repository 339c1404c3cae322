"""One layer of :class:`~kvqrs.hf.cache.QuantizedKVCache` (:class:`CompressedLayer`): its
bookkeeping. A layer holds full-precision sinks, the codes in a layer store
(:class:`~kvqrs.hf.store.CodeStore`: one growable native buffer per stored part, appended in
place) and a full-precision window in a preallocated buffer. At each update the window grows;
whole chunks beyond ``residual_length`` are encoded (chunks of one token, or of ``group`` tokens
when KIVI keys need whole groups) and appended to the store. A sliding-window layer holds only
its window. ``crop`` returns exactly to the state of a layer fed only the kept tokens; past
recording (``activate_past_recording``, set by transformers' assisted generation) keeps the
originals that a rollback needs until the next ``crop``.

How a forward reads the layer (the per-query schedule, the decode step from the codes) is
:class:`~kvqrs.hf.layer_attention.LayerAttention`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from .. import _native
from .._arrays import KvqrsError
from ..schemes import Encoded
from ..torch import check_storable, from_numpy, to_numpy
from .config import QuantConfig
from .heap import release_freed
from .layer_attention import LayerAttention
from .store import CodeStore, WindowRows

FUSED_MAX_QUERY = 4
"""Decode steps with at most this many new query tokens attend from the codes."""


def _tokens(t: torch.Tensor, lo: int, hi: int | None = None) -> torch.Tensor:
    """Tokens ``lo .. hi - 1`` of a ``(batch, heads, tokens, d)`` tensor (``t`` itself for all
    of them; ``lo``, ``hi`` >= 0, clamped to the tokens as a slice is). A view by ``narrow``,
    which costs a decode step less than half of indexing."""
    if lo == 0 and hi is None:
        return t
    n = t.shape[-2]
    hi = n if hi is None else min(hi, n)
    lo = min(lo, hi)
    return t.narrow(-2, lo, hi - lo)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (itself when it is already: no dispatch)."""
    return t if t.dtype is dtype else t.to(dtype)


LONG_APPEND = 1024
"""Tokens from which an append to an empty window takes the caller's float32 tensors as the
window instead of copying them into a buffer (:meth:`CompressedLayer._append`)."""

DECODE_CHUNK = 2048
"""Tokens decoded per call when a view is decoded whole (a prefill's attention): the decode's
temporaries stay a few MiB at any context, and the tokens land in the returned tensor."""


def _decoded(codec: Any, parts: tuple[torch.Tensor, Encoded, torch.Tensor], like: torch.Tensor, skip: int, decode: Any) -> torch.Tensor:
    """``cat([sinks, decode(codes)[skip:], window])`` along the tokens, the codes decoded in
    ``like``'s dtype :data:`DECODE_CHUNK` tokens at a time (whole groups: chunks start at
    multiples of the codec's alignment) into one tensor; a reconstruction a rounding past that
    dtype saturates to its largest value."""
    sinks, enc, window = parts
    total = enc.shape[-2]
    coded, ns = total - skip, sinks.shape[-2]
    dtype = functools.reduce(torch.promote_types, [sinks.dtype, like.dtype, window.dtype])
    shape = (*window.shape[:-2], ns + coded + window.shape[-2], window.shape[-1])
    out = torch.empty(shape, dtype=dtype, device=window.device)
    out[..., :ns, :] = sinks
    out[..., ns + coded :, :] = window
    align = codec.align() if codec.has_layout(enc.kind) else total
    step = max(align, DECODE_CHUNK // align * align) if total > DECODE_CHUNK else total
    for s in range(skip // align * align if step < total else 0, total, step):
        e = min(s + step, total)
        chunk = enc if (s, e) == (0, total) else codec.slice_tokens(enc, e, s)
        got = from_numpy(decode(chunk), like, saturate=True)
        lo = max(s, skip)
        out[..., ns + lo - skip : ns + e - skip, :] = got[..., lo - s :, :]
    return out


@dataclass
class _Window:
    """A layer's full-precision window in preallocated float32 CPU buffers ``keys`` /
    ``values`` ``(batch, kv_heads, cap, d)``: tokens ``lo .. hi - 1`` of each row are the
    window, and the layer's ``keys`` / ``values`` are views of that span (``k_view`` /
    ``v_view``, the tensors it last set). New tokens are written in place at ``hi`` by one
    native call that also checks them finite, so a decode step copies its tokens, not the
    window. Tokens below ``hi`` are never written again (a view handed out stays valid): the
    window moves on to a fresh buffer when the room runs out, or when the layer set its window
    any other way (a crop, a batch selection, a load)."""

    keys: torch.Tensor
    values: torch.Tensor
    lo: int
    hi: int
    # NumPy views of the buffers (flat: written by the native append; 4-d: read by a flush),
    # and their capacity in tokens.
    flat_k: np.ndarray = dataclasses.field(init=False)
    flat_v: np.ndarray = dataclasses.field(init=False)
    np_k: np.ndarray = dataclasses.field(init=False)
    np_v: np.ndarray = dataclasses.field(init=False)
    cap: int = dataclasses.field(init=False)
    k_view: torch.Tensor | None = None
    v_view: torch.Tensor | None = None
    # Whether k_view / v_view show lo .. hi - 1 (an append leaves them behind until the
    # layer next reads its window: a flush right after moves lo, so it shows once).
    shown: bool = True

    def __post_init__(self) -> None:
        self.np_k, self.np_v = self.keys.numpy(), self.values.numpy()
        self.flat_k, self.flat_v = self.np_k.reshape(-1), self.np_v.reshape(-1)
        self.cap = self.keys.shape[-2]
        # The views' geometry, so that showing a span is one as_strided per buffer (a narrow
        # costs more on a decode step).
        (b, h, _, dk), dv = self.keys.shape, self.values.shape[-1]
        self._geom = (
            ((b, h, dk), self.keys.stride(), self.keys.storage_offset(), dk),
            ((b, h, dv), self.values.stride(), self.values.storage_offset(), dv),
        )

    def span(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of tokens ``lo .. hi - 1`` of the two buffers (as ``narrow`` gives them)."""
        n, lo = self.hi - self.lo, self.lo
        ((bh, ks, ko, dk), (vbh, vs, vo, dv)) = self._geom
        k = self.keys.as_strided((bh[0], bh[1], n, dk), ks, ko + lo * ks[2])
        v = self.values.as_strided((vbh[0], vbh[1], n, dv), vs, vo + lo * vs[2])
        return k, v

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, room: int) -> _Window:
        """A buffer holding a copy of the window ``keys``, ``values``, the ``room`` tokens
        about to be appended and as many again as it holds plus 64 (a window moves on to a
        fresh buffer every ~window tokens: O(1) copied per token; a long prompt gets no more
        than its own length of room)."""
        held = keys.shape[-2]
        cap = 2 * held + room + 64
        kb = keys.new_empty((*keys.shape[:2], cap, keys.shape[-1]))
        vb = values.new_empty((*values.shape[:2], cap, values.shape[-1]))
        kb[:, :, :held].copy_(keys)
        vb[:, :, :held].copy_(values)
        return cls(kb, vb, 0, held)


def _plain_f32(t: torch.Tensor) -> bool:
    """Whether a tensor is float32 on the CPU outside autograd (what the window buffer holds)."""
    return t.dtype is torch.float32 and t.device.type == "cpu" and not t.requires_grad


@dataclass
class _View:
    """What one forward reads: positions ``start .. start + columns - 1``, oldest first, as
    full-precision sinks, codes, full-precision window. The codes hold positions ``q_start ..``
    and may begin before ``start`` (a sliding layer drops whole KIVI groups only, and keeps
    every token while recording the past): the view then skips their first tokens.

    The codes are the layer's store as it held ``held`` tokens: read (copied) only when a
    path needs them as arrays (:attr:`codes_k`, :attr:`codes_v`); a decode step that attends
    from the store reads its buffers in the native call instead. :meth:`CompressedLayer.update`
    reads them before a sliding layer drops any. Not changed once made (not frozen: a decode
    step makes one, and a frozen dataclass costs several microseconds to build)."""

    start: int
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    store: CodeStore | None
    held: int
    q_start: int
    window_k: torch.Tensor
    window_v: torch.Tensor
    # The forward's first query position, and the full-precision originals of the codes it
    # flushed (the newest code tokens): query t reads them quantized only from the step that
    # quantizes them (QuantConfig.quantized_span(t + 1)), as one token at a time would. They
    # are tokens of the window before the flush: ``flushed`` holds the tensors they are in,
    # their first token there and their count (``fresh_k`` / ``fresh_v`` cut them only when read).
    first_query: int = 0
    flushed: tuple[torch.Tensor, torch.Tensor, int, int] | None = None
    # The window where it lies in the layer's window buffer (None: not buffered), for the
    # native decode step to read in place.
    window_rows: WindowRows | None = None

    @functools.cached_property
    def fresh_k(self) -> torch.Tensor | None:
        """The originals of the keys this forward flushed, None when it flushed none."""
        return None if self.flushed is None else self._fresh(self.flushed[0])

    @functools.cached_property
    def fresh_v(self) -> torch.Tensor | None:
        """The originals of the values this forward flushed, None when it flushed none."""
        return None if self.flushed is None else self._fresh(self.flushed[1])

    def _fresh(self, src: torch.Tensor) -> torch.Tensor:
        start, n = self.flushed[2], self.flushed[3]
        return _tokens(src, start, start + n)

    @functools.cached_property
    def codes_k(self) -> Encoded | None:
        """The keys' codes (a copy of the store's parts), None when the view reads none."""
        return None if self.store is None else self.store.keys()

    @functools.cached_property
    def codes_v(self) -> Encoded | torch.Tensor | None:
        """The values' codes, or the full-precision values of a key-only config."""
        return None if self.store is None else self.store.values()

    def snapshot(self) -> None:
        """Read the codes now (before the layer drops or changes any)."""
        _ = self.codes_k, self.codes_v

    @property
    def live(self) -> bool:
        """Whether the store still holds exactly the codes of this view."""
        return self.store is not None and self.store.tokens == self.held

    @property
    def skip(self) -> int:
        """Leading code tokens outside the view."""
        return max(0, self.start - self.q_start)

    @property
    def coded(self) -> int:
        """Code tokens inside the view."""
        return 0 if self.store is None else self.held - self.skip

    def fp_columns(self) -> torch.Tensor:
        """Mask columns of the full-precision tokens (sinks, then window)."""
        ns = self.sink_k.shape[-2]
        lead = torch.arange(ns)
        return torch.cat([lead, torch.arange(ns + self.coded, ns + self.coded + self.window_k.shape[-2])])


@dataclass(slots=True)
class _Steady:
    """A layer's steady decode state (:meth:`CompressedLayer._steady_state`): the shapes of a
    decode token's keys and values, and the last view (its sinks, store and code start are
    those of every step until the general path runs again). Each steady update moves it on in
    place."""

    k_shape: torch.Size
    v_shape: torch.Size
    view: _View
    # What the layer held after that update: a later update takes the steady path only while
    # nothing else changed it.
    seen: int
    quantized: int
    window: _Window
    hi: int
    # The largest buffer the general path keeps for the next token's window, and the schedule
    # (QuantConfig.quantized_span's sinks, residual window and chunk).
    max_cap: int
    sinks: int
    residual: int
    chunk: int


class _Deferred(NamedTuple):
    """A steady decode step's flush, made by the native call that attends
    (:meth:`CompressedLayer._attend_step`) or, when no attention follows, by
    :meth:`CompressedLayer._catch_up`: the window's ``flush`` oldest tokens, from ``lo``, go
    into the store (the new tokens ``keys``, ``values`` are already in the window buffer at
    ``hi``: the step writes them again, the same bytes). ``undo``: the layer before the update,
    restored when the encode refuses the flushed tokens."""

    keys: torch.Tensor
    values: torch.Tensor
    lo: int
    hi: int
    flush: int
    undo: tuple


class CompressedLayer(LayerAttention, CacheLayerMixin):
    """One layer of :class:`QuantizedKVCache`: a full-attention layer, or, with
    ``sliding_window`` W, a sliding-window layer holding the newest W - 1 tokens as
    transformers' ``DynamicSlidingWindowLayer`` does.

    It holds absolute token positions ``start .. seen - 1``, oldest first:

    - ``sink_k`` / ``sink_v``: the attention sinks still held (positions below
      ``QuantConfig.sink_tokens``), full precision;
    - ``store``: the codes of positions ``q_start .. q_start + quantized - 1``, a
      :class:`~kvqrs.hf.store.CodeStore` (a key-only config keeps those values there in full
      precision); ``chunks_k`` / ``chunks_v`` give them as :class:`~kvqrs.schemes.Encoded`;
    - ``keys`` / ``values``: the full-precision window, the rest.

    A sliding layer drops its oldest tokens after each update, KIVI key groups only whole (a
    group partly inside the window is kept until its last token leaves, masked out), so it
    may hold up to ``QuantConfig.chunk - 1`` tokens more than W - 1.

    Rolling back (``crop``) must leave the layer exactly as a fresh layer fed only the kept
    tokens, whose newest tokens are in full precision. After ``activate_past_recording`` (which
    transformers' assisted decoding and deferred stop checks call) the layer keeps the
    full-precision originals of the tokens it quantizes (``pending_k`` / ``pending_v``), and a
    sliding layer every token, until the next ``crop``, which restores what it needs, then
    drops them. Only the originals a crop back to the start of the latest update can need are
    kept, or back ``recurrent_states_to_keep`` tokens when that was given and reaches further:
    transformers crops at most the tokens of its last forward (the rejected candidates of an
    assisted step, a deferred stop's one token). That is at most the update's tokens (or
    ``recurrent_states_to_keep``) plus ``QuantConfig.chunk - 1``, however long the layer records
    without a crop. A crop that would need originals the layer no longer holds raises.
    """

    is_croppable = True

    def __init__(self, config: QuantConfig, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
            raise KvqrsError(f"sliding_window: expected a positive integer or None, got {sliding_window!r}")
        self.config, self.layer_idx, self.sliding_window = config, layer_idx, sliding_window
        self.record_past = False
        self.record_depth = 0  # tokens a crop may reach back beyond the latest update
        self._clear()

    def _clear(self) -> None:
        self.store: CodeStore | None = None
        self.quantized = 0
        self.seen = self.start = self.q_start = 0
        self.sink_k = self.sink_v = self.pending_k = self.pending_v = None
        self._view: _View | None = None
        self._window: _Window | None = None
        # A weak reference: recognising this layer's forward must not keep the decoded keys alive.
        self._returned: weakref.ref | None = None
        # Set once the kvqrs attention function has served this layer: only then may update()
        # hand back the full-precision tokens alone (another attention function would miss the codes).
        self._attended = False
        self._fused = False
        self._steady: _Steady | None = None
        # A steady update's writes not made yet (made with its attention, in one native call),
        # and a sliding layer's eviction, made once the forward has read its codes.
        self._deferred: _Deferred | None = None
        self._evict_due = False
        # calibration="prefill": the layer's own matched calibration, fitted on the first
        # forward the kvqrs attention serves (its codec kept here), and how many tokens it saw.
        self.fitted = None
        self.fitted_tokens = 0
        self._fitted_codec = None

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def chunks_k(self) -> list[Encoded]:
        """The keys' codes as one :class:`~kvqrs.schemes.Encoded` (a copy), or ``[]`` when none."""
        self._catch_up()
        return [self.store.keys()] if self.quantized else []

    @property
    def chunks_v(self) -> list[Encoded]:
        """The values' codes as one :class:`~kvqrs.schemes.Encoded` (a copy); ``[]`` when none
        or when values are kept in full precision (``fp_values_quantized``)."""
        self._catch_up()
        return [self.store.values()] if self.quantized and not self.store.key_only else []

    @property
    def fp_values_quantized(self) -> torch.Tensor | None:
        """A key-only config's full-precision values of the quantized tokens (a copy), else None."""
        self._catch_up()
        return self.store.values() if self.quantized and self.store.key_only else None

    # -- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.head_dim = key_states.shape[-1]
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.sink_k, self.sink_v = self.config.store_sinks(key_states[..., :0, :]), self.config.store_sinks(value_states[..., :0, :])
        self.is_initialized = True

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep what a rollback needs until the next :meth:`crop` (see the class docstring).
        Keyword arguments (transformers >= 5.25 passes ``recurrent_states_to_keep``, for
        linear-attention layers' recurrent states): how many of the newest tokens a crop may remove
        beyond the latest update's (default: none beyond them)."""
        self._catch_up()
        depth = kwargs.get("recurrent_states_to_keep")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
            raise KvqrsError(f"recurrent_states_to_keep: expected None or an integer >= 0, got {depth!r}")
        self.record_past, self.record_depth = True, depth or 0

    def codec(self):
        if self.fitted is not None:
            if self._fitted_codec is None:
                self._fitted_codec = self.config.codec(self.layer_idx, self.head_dim, self.fitted)
            return self._fitted_codec
        return self.config.codec(self.layer_idx, self.head_dim)

    @property
    def awaits_calibration(self) -> bool:
        """``calibration="prefill"`` and not fitted yet: tokens wait in full precision."""
        return self.config.calibration == "prefill" and self.fitted is None

    def set_calibration(self, calibration, tokens: int) -> None:
        """Use ``calibration`` (a fitted :class:`~kvqrs.schemes.matched.MatchedCalibration`,
        or None) for this layer's codes; ``tokens``: how many tokens it was fitted on."""
        self.fitted, self.fitted_tokens, self._fitted_codec = calibration, int(tokens), None

    def _fit_on_prefill(self, query: torch.Tensor) -> None:
        """Fit the layer's calibration on the forward being served: its queries, and the tokens
        held after the sinks (the whole prompt)."""
        from .calibration import prefill_calibration

        self.set_calibration(prefill_calibration(self.config, query, self.keys, self.values), self.seen)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, fused: bool = False, **kwargs: Any):
        """Append the new tokens, flush whole chunks out of the window, and return the keys and
        values attention reads (a sliding layer: the previous W - 1 tokens and the new ones):
        decoded codes between the full-precision tokens, or, on a fused decode step
        (``fused=True``, passed by :class:`QuantizedKVCache` when ``QuantConfig.fused``), the
        full-precision window alone, the sinks and codes being read by :meth:`attend`."""
        self._catch_up()
        if fused and self._steady is not None:
            out = self._steady_update(key_states, value_states)
            if out is not None:
                return out
        self._steady = None
        self._check_states(key_states, value_states)
        if self.awaits_calibration and self.seen:
            raise KvqrsError(
                f"calibration='prefill': layer {self.layer_idx} saw a forward that the kvqrs attention did not serve, so it could "
                "not fit its calibration; load the model with attn_implementation='kvqrs' (after kvqrs.hf.register())"
            )
        if self.awaits_calibration and self.record_past:
            raise KvqrsError(
                f"calibration='prefill': layer {self.layer_idx} would fit its calibration on a first forward that a crop may "
                "partly roll back (past recording is on before the prompt, as in assisted decoding, whose first forward holds "
                "the prompt and draft tokens together); for assisted decoding give the config a calibration (a `kvqrs "
                "calibrate` file: QuantConfig.preset(name, file)) or use a scheme that needs none"
            )
        if self.seen == 0 and key_states.shape[-2] < self.config.sink_tokens:
            raise KvqrsError(
                f"sink_tokens: {self.config.sink_tokens} sink tokens, but the prompt of layer {self.layer_idx} has {key_states.shape[-2]} tokens"
            )
        undo = self._undo_point()
        view_start = self._view_start(self.seen)
        try:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.seen == 0 and not self.awaits_calibration:
                self.codec()  # a config the codec refuses (for this head_dim)
            sinks = min(self.config.sink_tokens, self.seen + key_states.shape[-2]) - self.seen
            for states in (key_states, value_states) if sinks > 0 else ():
                self.config.store_sinks(states[..., :sinks, :])  # beyond sink_dtype's range
            self._append(key_states, value_states)
            self.seen += key_states.shape[-2]
            self._absorb_sinks()
            fresh = self._flush()
            self._own_window(key_states, value_states)
            self._trim_pending(self.seen - key_states.shape[-2])
        except KvqrsError:  # e.g. a group's range beyond float32, found when the chunk is encoded
            self._undo(undo)
            raise
        self._view = self.view(view_start, first_query=self.seen - key_states.shape[-2], **fresh)
        if not self.awaits_calibration:  # else the prompt stays whole until attend fits on it
            self._drop_unread(self._view)
        self._fused = fused and self._can_fuse(key_states.shape[-2])
        if self._fused:  # the window as it lies in its buffer; attend reads the sinks and codes
            k, v = self._view.window_k, self._view.window_v
            self._steady = self._steady_state(key_states)
        else:
            k, v = self.materialize(self._view)
        self._returned = weakref.ref(k)
        return k, v

    # -- the steady decode step -----------------------------------------------------------------
    def _steady_state(self, key_states: torch.Tensor) -> _Steady | None:
        """What a following one-token update may skip, after a fused update: the state of a
        full-attention float32 layer whose window lies in its buffer, with no sinks still to
        absorb, no calibration to fit and no past to record. None when a later update must take
        the general path."""
        win = self._buffered()
        if win is None or self.is_sliding or self.record_past or self.awaits_calibration or self.seen < self.config.sink_tokens:
            return None
        if not (_plain_f32(key_states) and self.dtype is torch.float32):
            return None
        b, h, _, d = self.keys.shape
        cfg = self.config
        shapes = torch.Size((b, h, 1, d)), torch.Size((b, h, 1, self.values.shape[-1]))
        room = 4 * (win.hi - win.lo + 1) + 64
        return _Steady(*shapes, self._view, self.seen, self.quantized, win, win.hi, room, cfg.sink_tokens, cfg.residual_length, cfg.chunk)

    def _steady_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """:meth:`update` of one decode token in the state :meth:`_steady_state` recorded, when
        nothing else changed since: the token is written into the window's buffer (one native
        call), the layer's positions and view move as the general path moves them, and the
        window, the new token included, is handed back; a chunk that leaves the window is
        encoded natively from the buffer by the attention's one native call
        (:class:`_Deferred`). None (nothing changed) when the general path must run: another
        shape or dtype, no room in the buffer, a codec without a native encoder, a value not
        finite or beyond the storable range (the general path names it), a layer changed by
        anything but such updates since."""
        st, win = self._steady, self._window
        if not self._fused or self.record_past or self.keys is not win.k_view or not win.shown:
            return None
        if self.seen != st.seen or self.quantized != st.quantized or win is not st.window or win.hi != st.hi:
            return None  # the layer changed since (a crop, a batch selection, a restore)
        if key_states.shape != st.k_shape or value_states.shape != st.v_shape or not win.hi + 1 <= win.cap <= st.max_cap:
            return None  # the general path moves the window to a fresh buffer when it is mostly spare room
        if key_states.dtype is not torch.float32 or value_states.dtype is not torch.float32:
            return None
        if not (key_states.is_cpu and value_states.is_cpu) or key_states.requires_grad or value_states.requires_grad:
            return None
        seen = self.seen + 1
        n = st.sinks + max(0, (seen - st.sinks - st.residual) // st.chunk * st.chunk) - (self.q_start + self.quantized)
        if n > 0 and (win.lo + n > win.hi or self.store is None or not self.store.encodes_natively()):
            return None  # the general path makes the store, or encodes in Python
        # The token goes into its slot now, so the window handed back is whole; a value not
        # finite or beyond the storable range is left to the general path, which names it.
        if not _native.window_append(win.flat_k, win.flat_v, win.cap, win.hi, key_states.numpy(), value_states.numpy()):
            return None
        # The flush is deferred to the attention's native call; the layer's positions move now.
        undo = (self._undo_point(), self._view, self._returned)
        self._deferred = _Deferred(key_states, value_states, win.lo, win.hi, max(n, 0), undo)
        flushed = None
        if n > 0:  # the oldest window tokens leave it as codes
            flushed = (win.keys, win.values, win.lo, n)
            win.lo += n
            self.quantized += n
        win.hi += 1
        self.seen = seen
        self._show(win)
        last = st.view
        rows = WindowRows(win.flat_k, win.flat_v, win.cap, win.lo, win.hi - win.lo)
        self._view = _View(
            last.start, last.sink_k, last.sink_v, last.store, self.quantized, last.q_start, self.keys, self.values, seen - 1, flushed, rows
        )
        st.view, st.seen, st.quantized, st.hi, st.max_cap = self._view, seen, self.quantized, win.hi, 4 * (win.hi - win.lo + 1) + 64
        self._returned = weakref.ref(self.keys)
        return self.keys, self.values

    def _catch_up(self) -> None:
        """Make the writes and the eviction a forward left for its attention (when none came):
        every method that reads or changes the layer's state calls this first."""
        if self._deferred is not None:
            self._write_deferred()
        if self._evict_due:
            self._evict_due = False
            self._evict()

    def _write_deferred(self) -> None:
        """The deferred step's flush without attention (one native call)."""
        d, self._deferred = self._deferred, None
        win = self._window
        if d.flush and not self.store.encode_window(win.np_k, win.np_v, d.flush, d.lo, d.lo):
            self._refuse_deferred(d)
        self._after_write(d)

    def _refuse_deferred(self, d: _Deferred) -> None:
        """A deferred step whose writes were refused: the layer goes back to its state before
        that update, which then takes the general path (it names the refused value, or codes
        the tokens in Python where the native encode refused them)."""
        point, self._view, self._returned = d.undo
        self._undo(point)
        self._steady = None
        self.update(d.keys, d.values)

    def _after_write(self, d: _Deferred) -> None:
        """After a deferred step's writes: the window moves to a buffer of its size when a
        flush left the current one mostly spare room (as the general path's flush does)."""
        if d.flush and self._steady is not None:
            win = self._window
            self._compact()
            if self._window is not win:
                win = self._window
                st = self._steady
                st.window, st.hi, st.max_cap = win, win.hi, 4 * (win.hi - win.lo + 1) + 64

    def _undo_point(self) -> tuple:
        """What :meth:`_undo` restores: the state an append, a sink move or a flush changes
        (the window buffer is only written past ``hi``, so its bounds restore its content)."""
        win = self._window
        bounds = None if win is None else (win.lo, win.hi, win.k_view, win.v_view, win.shown)
        fp = (self.keys, self.values, self.sink_k, self.sink_v)
        return (self.is_initialized, fp, self.seen, self.q_start, self.store, self.quantized, win, bounds)

    def _undo(self, point: tuple) -> None:
        """Return to :meth:`_undo_point`'s state: an update that raises stores nothing. A
        flush that raises has appended no codes (the store's native encode refuses whole)."""
        (self.is_initialized, fp, self.seen, self.q_start, self.store, self.quantized, win, bounds) = point
        self.keys, self.values, self.sink_k, self.sink_v = fp  # a first update's dtype, batch and heads forgotten too
        self._window = win
        if win is not None:
            win.lo, win.hi, win.k_view, win.v_view, win.shown = bounds

    def _drop_unread(self, view: _View) -> None:
        """A sliding layer without past recording: drop the tokens no later forward reads, once
        the forward has read ``view`` (the codes stay in the store until then, so that the
        native step reads them in place)."""
        if not self.record_past and self.is_sliding:
            self._evict_due = True

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse states that cannot join this layer, before anything is stored: keys and values
        of different batch, heads or tokens, or a batch, head count or head_dim other than the
        layer holds (after ``batch_select_indices`` the batch is the selected one)."""
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise KvqrsError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if not t.dtype.is_floating_point:
                raise KvqrsError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
        if key_states.dtype != value_states.dtype:
            raise KvqrsError(f"value_states: expected the dtype of key_states ({key_states.dtype}), got {value_states.dtype}")
        if self.is_initialized and self.seen > 0 and key_states.dtype != self.dtype:  # emptied by crop: as a fresh layer
            raise KvqrsError(f"key_states: layer {self.layer_idx} holds {self.dtype}, got {key_states.dtype}")
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
        view = self._view
        if not (self._attended and not view.skip and new_tokens <= FUSED_MAX_QUERY and self.dtype != torch.float64):
            return False
        if not view.coded:  # nothing coded yet: the sinks and the float32 window, natively
            return view.store is None and self.dtype is torch.float32 and not self.awaits_calibration
        if view.flushed is not None and self.config.quantized_span(view.first_query + 1)[1] < self.window_start:
            return False  # an early query still reads some new codes in full precision
        return self.codec().has_fused_path()

    # -- positions --------------------------------------------------------------------------------
    @property
    def window_start(self) -> int:
        """Position of the first full-precision window token (the codes end there)."""
        return self.q_start + self.quantized

    def _view_start(self, seen: int) -> int:
        """The oldest position a forward after ``seen`` tokens reads (DynamicSlidingWindowLayer's)."""
        return 0 if self.sliding_window is None else max(0, seen - self.sliding_window + 1)

    def _keep_from(self, seen: int) -> int:
        """The oldest position a layer that has seen ``seen`` tokens holds: the view of the
        next forward, moved back to the start of its chunk past the sinks (a KIVI key group
        is encoded from all of its tokens and kept whole)."""
        lo, sink = self._view_start(seen), self.config.sink_tokens
        if lo <= sink:
            return lo
        return sink + (lo - sink) // self.config.chunk * self.config.chunk

    # -- state changes ----------------------------------------------------------------------------
    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append new tokens to the window, refusing a NaN or infinity (named by its index)
        before anything is stored: written in place into the window's buffer (:class:`_Window`)
        where the layer is float32 on the CPU, else joined to the window. A long prompt on an
        empty window becomes the window as it is (no copy) when its flush codes most of it: the
        flush codes it in place and :meth:`_own_window` then moves what stays to a buffer of its
        size."""
        n = key_states.shape[-2]
        plain = _plain_f32(key_states) and _plain_f32(value_states)
        if plain and n >= LONG_APPEND and self.keys.shape[-2] == 0 and self._flushes_most(n):
            if _native.storable(key_states.numpy()) and _native.storable(value_states.numpy()):
                self.keys, self.values = key_states.contiguous(), value_states.contiguous()
                return
            check_storable(key_states, "key_states")  # names the culprit
            check_storable(value_states, "value_states")
        win = self._buffer(n) if plain else None
        if win is not None and _native.window_append(win.flat_k, win.flat_v, win.cap, win.hi, key_states.numpy(), value_states.numpy()):
            win.hi += n
            win.shown = False  # shown by the next read of the window (_settle)
            return
        check_storable(key_states, "key_states")  # names the culprit (the native check only finds one)
        check_storable(value_states, "value_states")
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)

    def _flushes_most(self, n: int) -> bool:
        """Whether the flush after appending ``n`` tokens to an empty window codes at least three
        quarters of them (what stays is then copied to a buffer of its size by :meth:`_own_window`)."""
        if self.awaits_calibration or self.record_past:  # the prompt stays whole until the attention
            return False  # fits on it; recorded originals must not be the caller's tensors
        coded = self.config.quantized_span(self.seen + n)[1] - self.window_start
        return 4 * coded >= 3 * n

    def _own_window(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Copy the window to a buffer of its own while it still shares storage with the
        tensors an update was given (so that a caller writing to them later changes nothing)."""
        if self.keys is None or self._buffered() is not None:
            return
        shared = {t.untyped_storage().data_ptr() for t in (key_states, value_states)}
        if any(t.untyped_storage().data_ptr() in shared for t in (self.keys, self.values)):
            self._window = win = _Window.holding(self.keys, self.values, 1)
            self._show(win)

    def _buffered(self) -> _Window | None:
        """The window's buffer while the layer's window is still its view, else None."""
        win = self._window
        return win if win is not None and self.keys is win.k_view and self.values is win.v_view else None

    def _buffer(self, n: int) -> _Window | None:
        """The window's buffer with room for ``n`` more tokens: the current one while it holds
        the window and is not mostly spare room (a long prompt's buffer, once the prompt is
        flushed), else a fresh one holding a copy of the window; None when the window is not
        float32 on the CPU."""
        win = self._buffered()
        if win is not None and win.hi + n <= win.cap <= 4 * (win.hi - win.lo + n) + 64:
            return win
        if not (_plain_f32(self.keys) and _plain_f32(self.values)):
            return None
        self._window = win = _Window.holding(self.keys, self.values, n)
        self._show(win)  # the layer's window is now the buffer's
        return win

    def _settle(self) -> None:
        """Show the window appended to the buffer (see :attr:`_Window.shown`): every method
        that reads ``keys`` / ``values`` during an update calls this first."""
        if self._deferred is not None:
            self._write_deferred()
        win = self._buffered()
        if win is not None and not win.shown:
            self._show(win)

    def _show(self, win: _Window) -> None:
        """Set the layer's window to the buffer's span."""
        self.keys, self.values = win.span()
        win.k_view, win.v_view, win.shown = self.keys, self.values, True

    def _drop_window(self, n: int) -> None:
        """Drop the window's oldest ``n`` tokens (a view: nothing is copied)."""
        win = self._buffered()
        if win is not None:
            win.lo += n
            self._show(win)
        else:
            self.keys, self.values = _tokens(self.keys, n), _tokens(self.values, n)

    def _absorb_sinks(self) -> None:
        """Move window tokens at sink positions into the sinks (they never get quantized)."""
        n = min(self.config.sink_tokens, self.seen) - self.window_start
        if n <= 0:
            return
        self._settle()
        self.sink_k = torch.cat([self.sink_k, self.config.store_sinks(_tokens(self.keys, 0, n))], dim=-2)
        self.sink_v = torch.cat([self.sink_v, self.config.store_sinks(_tokens(self.values, 0, n))], dim=-2)
        self._drop_window(n)
        self.q_start += n

    def _flush(self) -> dict:
        """Encode whole chunks that have left the full-precision window; returns their
        originals as :class:`_View` takes them (``flushed``; empty when none)."""
        n = self.config.quantized_span(self.seen)[1] - self.window_start
        if n <= 0 or self.awaits_calibration:
            return {}
        codec = self.codec()
        if self.store is None:
            self.store = CodeStore(codec, self.keys.shape[0], self.keys.shape[1], self.head_dim, self.dtype)
        # Appended along the token axis of every part of the store (amortised O(1) per token):
        # encoded natively in one call, straight from the window, where the codec has a native
        # encoder, else in Python.
        win = self._buffered()
        if win is None:
            flushed = (self.keys, self.values, 0, n)
            native = self.store.encode_append(self.keys, self.values, n)
        else:  # read from the buffer (no conversion; the window need not be shown yet)
            flushed = (win.keys, win.values, win.lo, n)
            native = self.store.encode_append(win.np_k, win.np_v, n, win.lo)
        if not native or self.record_past:
            self._settle()
            k, v = _tokens(self.keys, 0, n), _tokens(self.values, 0, n)
        if not native:
            ck = codec.encode_keys(to_numpy(k, "keys"))
            cv = v if codec.values is None else codec.encode_values(to_numpy(v, "values"))
            self.store.append(ck, cv)
        if self.record_past:
            self.pending_k = k if self.pending_k is None else torch.cat([self.pending_k, k], dim=-2)
            self.pending_v = v if self.pending_v is None else torch.cat([self.pending_v, v], dim=-2)
        self._drop_window(n)
        self._compact()
        self.quantized += n
        # A long prompt's temporaries (and the previous layer's prompt buffer, freed by now).
        release_freed(2 * self.keys.shape[0] * self.keys.shape[1] * n * self.head_dim * 4)
        return {"flushed": flushed}

    def _trim_pending(self, update_from: int) -> None:
        """Drop the originals no crop back to ``update_from`` (the latest update's first
        position) or back ``record_depth`` tokens needs: a fresh layer of that many tokens codes
        every token before ``quantized_span(floor)[1]``, so their originals are never restored."""
        if self.pending_k is None:
            return
        floor = max(0, min(update_from, self.seen - self.record_depth))
        drop = self.config.quantized_span(floor)[1] - (self.window_start - self.pending_k.shape[-2])
        if drop > 0:  # copies: a slice would keep the whole buffer alive
            self.pending_k, self.pending_v = _tokens(self.pending_k, drop).clone(), _tokens(self.pending_v, drop).clone()

    def _compact(self) -> None:
        """Move the window to a buffer of its size when the current one is mostly flushed
        tokens (a long prompt's): the prompt's originals are then freed as soon as the forward
        that flushed them has read them (the view's ``flushed``), not at the layer's next update."""
        win = self._buffered()
        if win is not None and win.cap > 4 * (win.hi - win.lo) + 64:
            self._window = win = _Window.holding(self.keys, self.values, 1)
            self._show(win)

    def _slice_codes(self, lo: int, hi: int) -> None:
        """Keep code tokens ``lo .. hi - 1`` (offsets into the codes, chunk-aligned)."""
        if (lo, hi) == (0, self.quantized):
            return
        if hi > lo:
            self.store.keep(lo, hi)
        elif self.store is not None:
            self.store.clear()
        self.q_start += lo
        self.quantized = max(0, hi - lo)

    def _evict(self) -> None:
        """Drop what a sliding layer no longer needs (see :meth:`_keep_from`)."""
        if self.sliding_window is None:
            return
        keep = self._keep_from(self.seen)
        if keep <= self.start:
            return
        ns = self.sink_k.shape[-2]
        drop = min(keep - self.start, ns)
        self.sink_k, self.sink_v = _tokens(self.sink_k, drop), _tokens(self.sink_v, drop)
        if keep > self.q_start:
            # Codes end where the window starts: drop codes first, then window tokens.
            q_drop = min(keep, self.window_start) - self.q_start
            w_drop = max(0, keep - self.window_start)
            self._slice_codes(q_drop, self.quantized)
            self._drop_window(w_drop)
            self.q_start += w_drop
        self.start = keep

    def _commit(self) -> None:
        """Forget the originals kept for a rollback, and let a sliding layer shrink back."""
        self.pending_k = self.pending_v = None
        self._evict()

    def _rollback(self, keep: int) -> None:
        """Return to the state of a layer fed only tokens ``0 .. keep - 1``."""
        need_from, hi = self._keep_from(keep), self.config.quantized_span(keep)[1]
        n_codes = min(self.quantized, max(0, hi - self.q_start))  # codes a fresh layer holds too
        restore_lo, restore_hi = self.q_start + n_codes, min(keep, self.window_start)
        pending = 0 if self.pending_k is None else self.pending_k.shape[-2]
        missing = need_from < self.start or (restore_hi > restore_lo and restore_lo < self.window_start - pending)
        if missing:
            raise KvqrsError(
                f"crop: keeping {keep} of {self.seen} tokens needs full-precision originals that layer {self.layer_idx} no longer "
                "holds; call cache.activate_past_recording() before the forward you may roll back (transformers' assisted "
                "generation does)"
            )
        restored = []
        if restore_hi > restore_lo:
            off = restore_lo - (self.window_start - pending)
            restored = [
                (_tokens(self.pending_k, off, off + restore_hi - restore_lo), _tokens(self.pending_v, off, off + restore_hi - restore_lo))
            ]
        w_keep = max(0, keep - self.window_start)
        self.keys = torch.cat([*(k for k, _ in restored), _tokens(self.keys, 0, w_keep)], dim=-2)
        self.values = torch.cat([*(v for _, v in restored), _tokens(self.values, 0, w_keep)], dim=-2)
        self._slice_codes(0, n_codes)
        ns = max(0, min(self.sink_k.shape[-2], keep - self.start))
        self.sink_k, self.sink_v = _tokens(self.sink_k, 0, ns), _tokens(self.sink_v, 0, ns)
        if not self.quantized and not self.keys.shape[-2]:
            self.q_start = self.start + ns  # nothing after the sinks: the window starts there
        self.seen = keep

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers' convention: a negative
        count), leaving the layer exactly as a fresh one fed only the kept tokens; then forget
        the originals kept for a rollback (``crop(0)`` does only that). Raises
        :class:`KvqrsError` when asked to drop more tokens than the layer has seen, or when the
        kept state needs originals it no longer holds (see the class docstring: with past
        recording, a crop may reach back to the previous crop, as in assisted generation)."""
        self._catch_up()
        if tokens_to_remove > 0:
            raise ValueError(f"crop: expected a negative number of tokens to remove, got {tokens_to_remove}")
        if not self.is_initialized:
            return
        if -tokens_to_remove > self.seen:
            raise KvqrsError(f"crop: cannot remove {-tokens_to_remove} tokens, layer {self.layer_idx} has seen {self.seen}")
        keep = self.seen + tokens_to_remove
        if 0 < keep < self.fitted_tokens:
            raise KvqrsError(
                f"crop: layer {self.layer_idx} fitted its calibration on its first {self.fitted_tokens} tokens (calibration='prefill'); "
                f"it cannot go back to {keep} of them (crop to 0 and start again)"
            )
        if tokens_to_remove:
            self._rollback(self.seen + tokens_to_remove)
        if self.seen == 0:  # a fresh start: the next prompt fits anew, and a new store takes its layout
            self.set_calibration(None, 0)
            self.store = None
        self._commit()
        self._view = None

    # -- reading --------------------------------------------------------------------------------
    def view(self, start: int | None = None, **forward: Any) -> _View:
        """The held tokens from position ``start`` on (default: all of them); ``forward``: the
        forward's ``first_query`` and the originals it flushed, ``flushed`` (see :class:`_View`)."""
        self._settle()
        start = self.start if start is None else start
        ns = self.sink_k.shape[-2]
        s_off = min(ns, max(0, start - self.start))
        w_off = max(0, start - self.window_start)
        coded = self.quantized > 0 and start < self.window_start
        win = self._buffered()
        if win is not None:
            shown = max(0, win.hi - win.lo - w_off)
            forward["window_rows"] = WindowRows(win.flat_k, win.flat_v, win.cap, min(win.lo + w_off, win.hi), shown)
        return _View(
            start,
            _as_dtype(_tokens(self.sink_k, s_off), self.dtype),  # stored in sink_dtype, read in the layer's
            _as_dtype(_tokens(self.sink_v, s_off), self.dtype),
            self.store if coded else None,
            self.quantized if coded else 0,
            self.q_start,
            _tokens(self.keys, w_off),
            _tokens(self.values, w_off),
            **forward,
        )

    def materialize(self, view: _View | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded (base) keys and values of a view (default: everything held), oldest first."""
        view = self.view() if view is None else view
        if view.codes_k is None:
            return torch.cat([view.sink_k, view.window_k], dim=-2), torch.cat([view.sink_v, view.window_v], dim=-2)
        codec = self.codec()
        keys = _decoded(
            codec, (view.sink_k, view.codes_k, view.window_k), self.keys, view.skip, functools.partial(codec.decode_keys, base_only=True)
        )
        cv = view.codes_v
        if isinstance(cv, torch.Tensor):
            values = torch.cat([view.sink_v, _tokens(cv, view.skip), view.window_v], dim=-2)
        else:
            values = _decoded(codec, (view.sink_v, cv, view.window_v), self.values, view.skip, codec.decode_values)
        return keys, values

    def correction(self, query: torch.Tensor, view: _View | None = None) -> torch.Tensor | None:
        """HeadQ logit correction for the coded positions of a view (default: everything
        held), ``(b, q_heads, q_len, coded)``."""
        view = self.view() if view is None else view
        codec = self.codec()
        if codec.scheme != "headq" or view.codes_k is None:
            return None
        corr = torch.from_numpy(codec.score_correction(to_numpy(query, "query"), view.codes_k))
        return corr[..., view.skip :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the next forward's keys, as transformers' layers give them."""
        start = self._view_start(self.seen)
        return self.seen - start + query_length, start

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self._clear()
        self.keys = self.values = None
        self.is_initialized = False

    # -- state, for the saved format (kvqrs.hf.persist) ------------------------------------------
    def positions(self) -> dict[str, int]:
        """Positions held: ``seen`` (tokens fed), ``start`` (first held), ``q_start`` (first
        coded) and ``quantized`` (coded tokens)."""
        self._catch_up()
        return {"seen": self.seen, "start": self.start, "q_start": self.q_start, "quantized": self.quantized}

    def fp_tensors(self) -> dict[str, torch.Tensor]:
        """The full-precision tensors held, ``(batch, kv_heads, tokens, head_dim)`` in the
        layer's dtype (the sinks in ``QuantConfig.sink_dtype`` when set): ``window_keys``,
        ``window_values``, ``sink_keys``, ``sink_values``, and
        ``pending_keys``, ``pending_values`` (originals kept for a rollback) while recording."""
        self._catch_up()
        out = {"window_keys": self.keys, "window_values": self.values, "sink_keys": self.sink_k, "sink_values": self.sink_v}
        if self.pending_k is not None:
            out.update(pending_keys=self.pending_k, pending_values=self.pending_v)
        return out

    def restore(self, fp: dict[str, torch.Tensor], store: CodeStore | None, positions: dict[str, int]) -> None:
        """Set the state of an initialized layer (a loaded cache): ``fp`` as :meth:`fp_tensors`
        gives it, ``store`` the codes (None: none), ``positions`` as :meth:`positions` gives
        them. Raises :class:`KvqrsError` (the layer unchanged) unless the store holds
        ``quantized`` tokens and sinks, codes and window are consecutive positions."""
        self._catch_up()
        seen, start, q_start, quantized = (int(positions[k]) for k in ("seen", "start", "q_start", "quantized"))
        held = 0 if store is None else store.tokens
        keys, values = fp["window_keys"], fp["window_values"]
        if held != quantized or keys.shape != values.shape:
            raise KvqrsError(f"compressed cache: layer {self.layer_idx} holds {held} quantized tokens, its meta says {quantized}")
        ns, nw = fp["sink_keys"].shape[-2], keys.shape[-2]
        pending = fp.get("pending_keys")
        n_pending = 0 if pending is None else pending.shape[-2]
        if not (0 <= start and start + ns == q_start and q_start + quantized + nw == seen and n_pending <= quantized):
            raise KvqrsError(
                f"compressed cache: layer {self.layer_idx} positions (seen {seen}, start {start}, first coded {q_start}) do not match its "
                f"{ns} sink, {quantized} coded and {nw} window tokens"
            )
        self.keys, self.values, self.sink_k, self.sink_v = keys, values, fp["sink_keys"], fp["sink_values"]
        self.pending_k, self.pending_v = pending, fp.get("pending_values")
        self.store = store
        self.seen, self.start, self.q_start, self.quantized = seen, start, q_start, quantized
        self._view = None

    def _tensors(self) -> dict[str, torch.Tensor]:
        """Every full-precision tensor held, by attribute name."""
        names = ("keys", "values", "sink_k", "sink_v", "pending_k", "pending_v")
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._catch_up()
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
        if self.store is not None:
            self.store.select(idx.tolist())
        for name, t in self._tensors().items():
            setattr(self, name, t.index_select(0, idx))
        self._view = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.is_initialized:
            return
        idx = torch.arange(self.keys.shape[0]).repeat_interleave(repeats)
        self.batch_select_indices(idx)

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: every encoded part plus the full-precision tensors (sinks, window,
        key-only values, originals kept for a rollback) and a self-calibrated layer's calibration.
        The window counts its tokens, not the spare room of its buffer (:class:`_Window`: at
        most three times the window plus 64 tokens), as the store's room is not counted either."""
        self._catch_up()
        if not self.is_initialized:
            return 0
        total = 0 if self.store is None else self.store.nbytes()
        total += 0 if self.fitted is None else self.fitted.nbytes  # a self-calibrated layer's own side information
        return int(total + sum(t.numel() * t.element_size() for t in self._tensors().values()))
