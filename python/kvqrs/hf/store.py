"""The codes of one :class:`~kvqrs.hf.QuantizedKVCache` layer in a native layer store.

:class:`CodeStore` holds a layer's quantized tokens in ``kvqrs._native.LayerStore``: one
growable buffer per part of the codec's declared layouts (docs/layouts.md; key parts named
``keys.<part>``, value parts ``values.<part>``, or ``values.fp`` for the full-precision values
of a key-only config), tokens along each part's token axis. Appending a chunk copies only its
bytes (the buffers grow by half when full: amortised O(1) per token); keeping a span of tokens,
selecting batch rows and the saved sections are native too. On a decode step the store
attends straight from its buffers (:meth:`CodeStore.attend`: one native call, the GIL
released).

Each part's token rate (entries along its token axis per token) is the layout's declared
:attr:`~kvqrs.layout.Part.rate`: one per token, packed bits of a channel's tokens, one per
group of tokens (``ceil(T * num / den)`` entries for ``T`` tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import _native
from .._arrays import KvqrsError
from ..kernels.attention import DenseRows, SideRows, binding_rows, binding_side, by_name, reads_natively
from ..layout import PartRef
from ..schemes import Encoded
from ..schemes.backend import CPU
from ..schemes.mse import MSECoder, MSEQJLCoder

TORCH_CODES = {getattr(torch, name): _native.DTYPES[name][0] for name in ("float32", "float16", "float64", "bfloat16")}
"""Container dtype codes of full-precision tensors (docs/format.md), from the core's one dtype
table (``kvqrs._native.DTYPES``)."""
_NP_PARTS = ("uint8", "float16", "float32", "float64")
"""The NumPy dtypes of the parts a store takes (dtypes cross the binding by name)."""
_LAYOUT_DTYPES = {"uint8": ("uint8", False), "scalar": ("float16", True), "float32": ("float32", False)}
"""Per layout dtype: the store's dtype and whether it widens to float32 (stored scalars)."""


class StorePart(NamedTuple):
    """One declared part of a native ``LayerStore`` (read by attribute).

    Attributes:
        name: ``keys.<part>`` or ``values.<part>``.
        dtype: the part's dtype name (``uint8``, ``float16``, ``float32``, ``float64``, ``bfloat16``).
        widen: whether a float16 part becomes float32 when a value does not fit float16.
        outer: the axes before the token axis (batch first).
        inner: the axes after it.
        num: with ``den``, ``ceil(tokens * num / den)`` entries along the token axis.
        den: see ``num``.
    """

    name: str
    dtype: str
    widen: bool
    outer: list[int]
    inner: list[int]
    num: int
    den: int


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _part_specs(codec, kind: str, lead: tuple[int, ...], d: int) -> list[StorePart]:
    """The :class:`StorePart` of each part of ``kind``, as its declared layout states them
    (:class:`~kvqrs.layout.Part`: the axes around the token axis, the dtype by name, the token
    rate ``num / den``)."""
    specs = []
    for name, part in codec.layout(kind, (*lead, 0, d)).items():
        dtype, widen = _LAYOUT_DTYPES[part.dtype]
        specs.append(
            StorePart(f"{kind}.{name}", dtype, widen, list(part.outer), list(part.inner), part.rate.numerator, part.rate.denominator)
        )
    return specs


def _as_part(a: Any) -> tuple[str, list[int], np.ndarray]:
    """An array (NumPy, or a torch tensor of any float dtype) as ``(dtype name, shape, flat uint8 bytes)``."""
    if isinstance(a, torch.Tensor):
        t = a.detach().contiguous()
        return _torch_name(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy()
    arr = np.ascontiguousarray(a)
    if arr.dtype.name not in _NP_PARTS:
        raise KvqrsError(f"chunk: parts of dtype uint8, float16, float32 or float64, got {arr.dtype}")
    return arr.dtype.name, list(arr.shape), arr.reshape(-1).view(np.uint8)


class NativeEncoder(NamedTuple):
    """One side's native encoder (``LayerStore.set_encoders``), the kernel composition of a
    Python coder on the Rust path, giving its bytes. ``kind``:

    - ``"mse"``: the MSE stage of ``bits`` bits (``seed`` None: no rotation), storing the
      ``scale`` mode's scalar, 8-bit log coded per ``norm_group`` tokens when that is set,
      around the per-head ``mean`` when one is given (``matched`` values);
    - ``"mse_qjl"``: the MSE stage of ``bits - 1`` bits and the 1-bit QJL sketch of its residual;
    - ``"tokens"``: uniform groups of ``group`` coordinates per token (KIVI values);
    - ``"channels"``: uniform groups of ``group`` tokens per coordinate, for each run ``(bits,
      lo, hi, suffix)`` of coordinates ``lo .. hi - 1`` (parts ``codes<suffix>``, ...), of the
      channels (KIVI keys) or of ``(x - mean) basis`` (``matched``);
    - ``"token_runs"``: ``matched`` keys with per-token scales: ``(x - mean) basis`` over the
      calibrated ``deviations``, one float16 absmax scale per token (part ``scales``) over the
      coordinates of the runs ``(bits, lo, hi, suffix)`` (width 0 elsewhere), each run's codes
      packed per token (parts ``codes<suffix>``).

    ``mean`` and ``deviations`` (``kv_heads * d``) and ``basis`` (``kv_heads * d * d``,
    row-major) are flat float32 lists."""

    kind: str
    head_dim: int
    bits: int = 0
    seed: int | None = None
    qjl_seed: int | None = None
    scale: str = "norm"
    norm_group: int | None = None
    mean: list[float] | None = None
    basis: list[float] | None = None
    deviations: list[float] | None = None
    runs: tuple[tuple[int, int, int, str], ...] = ()
    group: int = 0


def _flat(a: np.ndarray) -> list[float]:
    return np.ascontiguousarray(a, dtype=np.float32).ravel().tolist()


def _native_encoder(coder: Any, kv_heads: int) -> NativeEncoder | None:
    """The native encoder that gives a coder's bytes, or None (the coder encodes in Python):
    ``kv`` / ``kqv`` / ``qkqv`` (MSE, MSE + QJL with stored norms), KIVI, ``matched`` keys (in
    groups or with per-token scales) and values on the Rust backend; a calibration must have
    one head or ``kv_heads``."""
    from ..schemes.kivi import KIVICoder
    from ..schemes.matched import MatchedCoder, MatchedValueCoder
    from ..schemes.matched_tokens import MatchedTokenCoder

    if coder is None or coder.k is not CPU:
        return None
    kind = type(coder)
    if kind is MSECoder:
        return NativeEncoder("mse", coder.head_dim, coder.bits, coder.seed, scale=coder.scale, norm_group=coder.norm_group)
    if kind is MSEQJLCoder and coder.mse.scale == "norm":
        return NativeEncoder("mse_qjl", coder.head_dim, coder.bits, coder.seed, coder.qjl_seed)
    if kind is KIVICoder and coder.per_channel:
        return NativeEncoder("channels", coder.head_dim, runs=((coder.bits, 0, coder.head_dim, ""),), group=coder.group)
    if kind is KIVICoder:
        return NativeEncoder("tokens", coder.head_dim, coder.bits, group=coder.group)
    if kind is MatchedValueCoder and coder.mean.shape[0] in (1, kv_heads):
        m = coder.mse
        return NativeEncoder("mse", m.head_dim, m.bits, m.seed, scale=m.scale, norm_group=m.norm_group, mean=_flat(coder.mean))
    if kind in (MatchedCoder, MatchedTokenCoder) and coder.cal.kv_heads in (1, kv_heads):
        cal, runs = coder.cal, tuple((b, lo, hi, str(b)) for b, lo, hi in coder.runs)
        if kind is MatchedTokenCoder:
            return NativeEncoder(
                "token_runs", coder.head_dim, mean=_flat(cal.mean), basis=_flat(cal.basis), deviations=_flat(cal.deviations), runs=runs
            )
        return NativeEncoder("channels", coder.head_dim, mean=_flat(cal.mean), basis=_flat(cal.basis), runs=runs, group=coder.group)
    return None


class WindowRows(NamedTuple):
    """Full-precision tokens read in place by :meth:`CodeStore.attend`: flat float32 buffers of
    batch x kv_heads rows of ``room`` tokens (keys, values), of which ``start .. start +
    tokens - 1`` are read."""

    keys: np.ndarray
    values: np.ndarray
    room: int
    start: int
    tokens: int


_NO_TOKENS = np.zeros(0, np.float32)


def _flat_f32(t: torch.Tensor) -> np.ndarray:
    """A tensor as flat float32 NumPy: itself when float32, contiguous and on the CPU."""
    if t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous():
        return t.detach().numpy().reshape(-1)
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1).numpy()


def token_rows(t: torch.Tensor) -> tuple[np.ndarray, int, int] | None:
    """A ``(batch, heads, n, d)`` tensor as ``(flat float32 buffer, room, start)`` when it is a
    float32 CPU token span of one buffer's rows (the cache's window, narrowed from its buffer:
    each batch x heads row holds ``room`` tokens, ``start .. start + n - 1`` of them ``t``'s),
    else None."""
    b, h, n, d = t.shape
    if t.dtype is not torch.float32 or t.device.type != "cpu" or not n or not d:
        return None
    sb, sh, sn, sd = t.stride()
    off = t.storage_offset()
    if sd == 1 and sn == d and sh % d == 0 and (b == 1 or sb == h * sh) and off % d == 0:
        room, start = sh // d, off // d
        if start + n <= room and t.untyped_storage().nbytes() >= b * h * sh * 4:
            return torch.as_strided(t.detach(), (b * h * sh,), (1,), 0).numpy(), room, start
    return None


def _window_rows(k: torch.Tensor, v: torch.Tensor) -> WindowRows:
    """Keys and values ``(batch, kv_heads, n, d)`` as :class:`WindowRows`: in place when both
    are spans of buffers of one shape, else contiguous float32 copies."""
    n = k.shape[-2]
    rk, rv = token_rows(k), token_rows(v)
    if rk is not None and rv is not None and rk[1:] == rv[1:]:
        return WindowRows(rk[0], rv[0], rk[1], rk[2], n)
    return WindowRows(_flat_f32(k), _flat_f32(v), n, 0, n)


def _additive_mask(mask: torch.Tensor | None, batch: int, nq: int, columns: int) -> np.ndarray | None:
    """A boolean or additive ``(batch, 1, nq, columns)`` mask (broadcastable) as flat float32
    additive NumPy, or None (no mask, or no columns)."""
    if mask is None or not columns:
        return None
    mm = mask if mask.dtype != torch.bool else torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    return mm.to(torch.float32).expand(batch, 1, nq, columns).contiguous().reshape(-1).numpy()


def _window_f32(t: torch.Tensor | np.ndarray, start: int, tokens: int) -> tuple[np.ndarray, int]:
    """Tokens ``start .. start + tokens - 1`` of a ``(batch, heads, window, d)`` tensor as
    float32 NumPy and their first token there: the tensor itself, strides and all, when it is
    float32 on the CPU or already float32 NumPy (no copy: the native call reads the tokens it
    needs), else a float32 copy of those tokens."""
    if isinstance(t, np.ndarray):
        return (t, start) if t.dtype == np.float32 else (t[..., start : start + tokens, :].astype(np.float32), 0)
    if t.requires_grad:
        t = t.detach()
    if t.dtype is torch.float32 and t.device.type == "cpu":
        return t.numpy(), start
    return t[..., start : start + tokens, :].to(device="cpu", dtype=torch.float32).numpy(), 0


def _from_part(dtype: str, shape: list[int], raw: np.ndarray, torch_out: bool = False):
    if torch_out:
        return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
    return raw.view(np.dtype(dtype)).reshape(shape)


def attend_full_precision(
    query: torch.Tensor, sinks: tuple, window: tuple, mask: torch.Tensor | None, scale: float, with_lse: bool = False
):
    """:meth:`CodeStore.attend` for a layer that has coded nothing yet: the same native
    arithmetic over the sinks and the window alone (one native call, GIL released; torch's
    SDPA here would wake its OpenMP threads for a few microseconds of work). Arguments and
    return as :meth:`CodeStore.attend`; the KV heads are those of ``sinks`` (their tensors,
    ``(batch, kv_heads, tokens, d)``, may hold no token). Raises :class:`KvqrsError` when
    there is no full-precision token, on non-finite logits or shapes that do not fit."""
    b, hq, nq, d = query.shape
    kv_heads = sinks[0].shape[1]
    rows = window if isinstance(window, WindowRows) else _window_rows(*window)
    sk, sv, ns = CodeStore._sink_args(sinks)
    m = _additive_mask(mask, b, nq, ns + rows.tokens)
    head = (_flat_f32(query), b * kv_heads, hq // kv_heads * nq, d, float(scale), nq)
    res = _native.attend_full_precision(*head, sk, sv, ns, rows.keys, rows.values, rows.room, rows.start, rows.tokens, m, b)
    return CodeStore._shaped(res, query, with_lse)


class CodeStore:
    """The quantized tokens of one cache layer (see the module docstring).

    Args:
        codec: the layer's :class:`~kvqrs.schemes.KVCodec` (keys and values with a declared
            layout, or values ``none``).
        batch, kv_heads, head_dim: the layer's ``(batch, kv_heads, ..., head_dim)``.
        fp_dtype: torch dtype of the full-precision values of a key-only codec.

    Raises:
        KvqrsError: a codec side without a layout the store can hold (``a2`` values).
    """

    def __init__(self, codec, batch: int, kv_heads: int, head_dim: int, fp_dtype: torch.dtype, native=None):
        self.codec, self.head_dim, self.kv_heads, self.fp_dtype = codec, head_dim, kv_heads, fp_dtype
        self.key_only = codec.values is None
        self._native = native if native is not None else _native.LayerStore(self.specs(codec, batch, kv_heads, head_dim, fp_dtype))
        self._templates: dict[str, Encoded] = {}
        self._names: list[str] = self._native.names()
        self._attends: bool | None = None
        self._encodes: bool | None = None
        self._order = {n: i for i, n in enumerate(self._names)}

    @staticmethod
    def specs(codec, batch: int, kv_heads: int, head_dim: int, fp_dtype: torch.dtype) -> list[StorePart]:
        """The declared parts of a store for this codec and shape (see :class:`CodeStore`)."""
        lead = (batch, kv_heads)
        specs = _part_specs(codec, "keys", lead, head_dim)
        if codec.values is None:
            specs.append(StorePart("values.fp", _torch_name(fp_dtype), False, [batch, kv_heads], [head_dim], 1, 1))
        else:
            specs += _part_specs(codec, "values", lead, head_dim)
        return specs

    @property
    def tokens(self) -> int:
        """Tokens held."""
        return self._native.tokens

    @property
    def batch(self) -> int:
        return self._native.batch

    def nbytes(self) -> int:
        """Bytes of the tokens held (every part; not the room reserved for appends)."""
        return int(self._native.nbytes())

    def capacity_nbytes(self) -> int:
        """Bytes reserved: held plus room for appends."""
        return int(self._native.capacity_nbytes())

    # -- changes --------------------------------------------------------------------------------
    def append(self, ck: Encoded, cv: Encoded | torch.Tensor) -> None:
        """Append a chunk: keys ``ck`` and values ``cv`` (encoded, or a full-precision tensor
        for a key-only codec) of the same ``(batch, kv_heads, tokens, head_dim)``. Raises
        :class:`KvqrsError` (nothing stored) for parts of another shape or dtype, or a join
        where a part cannot be joined (a chunk of a partial KIVI group before it)."""
        if self.key_only != isinstance(cv, torch.Tensor):
            raise KvqrsError("values: expected full-precision values for a key-only codec, encoded values otherwise")
        chunk = [_as_part(a) for a in ck.parts.values()]
        names = [f"keys.{n}" for n in ck.parts]
        if self.key_only:
            chunk.append(_as_part(cv))
            names.append("values.fp")
        else:
            chunk += [_as_part(a) for a in cv.parts.values()]
            names += [f"values.{n}" for n in cv.parts]
        if len(names) != len(self._names) or any(n not in self._order for n in names):
            raise KvqrsError(f"chunk: parts {names}, the store holds {self._names}")
        ordered: list[Any] = [None] * len(names)
        for n, c in zip(names, chunk):
            ordered[self._order[n]] = c
        self._native.append(ordered, int(ck.shape[-2]))

    def encodes_natively(self) -> bool:
        """Whether the codec's keys and values have native encoders (:func:`_native_encoder`),
        declared to the native store on the first call."""
        if self._encodes is None:
            sides = [
                _native_encoder(self.codec._key_coder(), self.kv_heads),
                None if self.key_only else _native_encoder(self.codec.values, self.kv_heads),
            ]
            self._encodes = None not in sides
            if self._encodes:
                self._native.set_encoders(*sides)
        return self._encodes

    def encode_append(self, k: torch.Tensor | np.ndarray, v: torch.Tensor | np.ndarray, tokens: int | None = None, start: int = 0) -> bool:
        """Encode tokens ``start .. start + tokens - 1`` (default: all) of keys ``k`` and values
        ``v`` ``(batch, kv_heads, window, head_dim)`` (tensors or NumPy arrays of any float
        dtype, as float32; any strides) and append their codes in one native call: the bytes
        :meth:`append` stores for ``codec.encode_keys``, ``codec.encode_values`` of those tokens.
        Returns False, nothing stored, when the codec has no native encoder (see
        :func:`_native_encoder`) or the native encode refuses the tokens (a norm beyond
        float32, a per-token absmax scale beyond float16): the caller then takes the Python
        path, whose error names the token."""
        if not self.encodes_natively():
            return False
        n = int(k.shape[-2]) - start if tokens is None else int(tokens)
        (ka, k0), (va, v0) = _window_f32(k, start, n), _window_f32(v, start, n)
        return self.encode_window(ka, va, n, k0, v0)

    def encode_window(self, k: np.ndarray, v: np.ndarray, tokens: int, k_start: int, v_start: int) -> bool:
        """:meth:`encode_append` of float32 NumPy keys and values ``(batch, kv_heads, window,
        head_dim)``, tokens ``k_start ..`` of ``k`` and ``v_start ..`` of ``v``, for a codec
        that :meth:`encodes_natively` (a decode step's flush from the window buffer)."""
        try:
            self._native.encode_append(k, v, tokens, k_start, v_start)
        except KvqrsError:
            return False
        return True

    def keep(self, lo: int, hi: int) -> None:
        """Keep tokens ``lo .. hi - 1`` (raises unless every part can be cut there)."""
        self._native.keep(int(lo), int(hi))

    def clear(self) -> None:
        self._native.clear()

    def select(self, index) -> None:
        """Keep batch rows ``index`` (0 <= i < batch; rows may repeat), in that order."""
        self._native.select([int(i) for i in index])

    # -- reading --------------------------------------------------------------------------------
    def _template(self, kind: str) -> Encoded:
        """An encoded tensor of no tokens: the metadata (scheme, params, seed) of ``kind``."""
        if kind not in self._templates:
            empty = np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32)
            enc = self.codec.encode_keys(empty) if kind == "keys" else self.codec.encode_values(empty)
            self._templates[kind] = enc
        return self._templates[kind]

    def _parts(self, kind: str) -> dict[str, np.ndarray]:
        prefix = kind + "."
        return {n[len(prefix) :]: _from_part(*self._native.part(n)) for n in self._names if n.startswith(prefix)}

    def keys(self) -> Encoded:
        """The keys held as one :class:`~kvqrs.schemes.Encoded` ``(batch, kv_heads, tokens, head_dim)`` (a copy)."""
        return dataclasses.replace(self._template("keys"), shape=self._shape(), parts=self._parts("keys"))

    def values(self) -> Encoded | torch.Tensor:
        """The values held: encoded, or the full-precision tensor of a key-only codec (copies)."""
        if self.key_only:
            return _from_part(*self._native.part("values.fp"), torch_out=True)
        return dataclasses.replace(self._template("values"), shape=self._shape(), parts=self._parts("values"))

    def _shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.tokens, self.head_dim)

    # -- the saved format -----------------------------------------------------------------------
    def sections(self, prefix: str) -> list[tuple]:
        """Every part as a container section ``(prefix + name, dtype code, shape, bytes)``."""
        return self._native.sections(prefix)

    @classmethod
    def from_sections(cls, codec, shape: tuple[int, int, int, int], fp_dtype: torch.dtype, sections: list[tuple], prefix: str) -> CodeStore:
        """A store of ``shape`` ``(batch, kv_heads, tokens, head_dim)`` read from the sections
        ``prefix + name`` (as :meth:`sections` wrote them). Raises :class:`KvqrsError` for a
        missing section or one of another shape or dtype than the codec stores."""
        b, h, t, d = shape
        native = _native.LayerStore.from_sections(cls.specs(codec, b, h, d, fp_dtype), sections, prefix, t)
        return cls(codec, b, h, d, fp_dtype, native=native)

    # -- the decode step ------------------------------------------------------------------------
    def can_attend(self) -> bool:
        """Whether :meth:`attend` can read this codec's rows from the store, decided once and
        from the row classes alone: False when the codec has no fused rows
        (``codec.fused_rows`` is None: another backend, ``a2`` or width-class values) or a row
        class the native step does not read (:func:`~kvqrs.kernels.attention.reads_natively`);
        the caller then takes its other path. Otherwise True, the rows declared to the native
        store: each part a field reads named by the store's name for it (``keys.codes``), never
        found by what array it is (:meth:`_named_rows`, :meth:`_bound_rows`).

        Raises:
            KvqrsError: rows that do not bind to the store's parts (a field holding something
                other than a part, a part the store does not hold, a bad basis or mean).
            TypeError: a coder's ``attention_rows`` that computes on or copies a part
                (:class:`~kvqrs.layout.PartRef`), or rows the binding cannot read.
        """
        if self._attends is None:
            kparts, vparts, rows = self._named_rows()
            known = rows is not None and self._known(rows)
            if known:
                self._native.set_rows(*self._bound_rows(kparts, vparts, rows))
            self._attends = known
        return self._attends

    def _named_rows(self) -> tuple[dict[str, PartRef], dict[str, PartRef], tuple[Any, Any, Any] | None]:
        """``codec.fused_rows`` over the store's parts by name. Returns ``(key refs, value
        refs, rows)``: the refs (:class:`~kvqrs.layout.PartRef`) of the codec's layouts of
        ``(batch, kv_heads, tokens, head_dim)`` by part name (each ref's dtype as the store
        declares the part: scalars float16, widened to float32 when a chunk needs it; a
        key-only codec's values the one ref ``fp``, ``values.fp``, read as :class:`DenseRows`),
        and ``(key rows, value rows, side rows or None)`` that the codec's coders built from
        :class:`~kvqrs.schemes.Encoded` s of those refs, or None when the codec has no fused
        rows."""
        ck = self._refs("keys")
        if self.key_only:
            fp = PartRef("fp", self._shape(), self.fp_dtype)
            cv, vparts = DenseRows(fp), {"fp": fp}
        else:
            cv = self._refs("values")
            vparts = cv.parts
        return ck.parts, vparts, self.codec.fused_rows(ck, cv)

    def _refs(self, kind: str) -> Encoded:
        """The store's ``kind`` parts as an :class:`~kvqrs.schemes.Encoded` of refs (see
        :meth:`_named_rows`), with the scheme and parameters of the codec's coder, which its
        ``attention_rows`` checks (nothing is encoded: a coder that needs more than the tokens to
        encode, such as width-class values, is asked too)."""
        return self.codec.named(kind, self._shape())

    @staticmethod
    def _known(rows: tuple[Any, Any, Any]) -> bool:
        """Whether the native step has a row type for each of ``(keys, values, side)``."""
        return reads_natively(rows[0]) and reads_natively(rows[1]) and (rows[2] is None or isinstance(rows[2], SideRows))

    def _bound_rows(self, kparts: dict[str, PartRef], vparts: dict[str, PartRef], rows: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        """``rows`` of :meth:`_named_rows` as ``LayerStore.set_rows`` takes them: each ref
        replaced by the store's name of its part, ``keys.`` or ``values.`` and the ref's name
        (:func:`~kvqrs.kernels.attention.by_name`; the side reads key parts). Raises as
        :meth:`can_attend`."""
        lead, d = (self.batch, self.kv_heads), self.head_dim
        keys = binding_rows(rows[0], "keys", lead, d, by_name(kparts, "keys", lambda n: f"keys.{n}"))
        values = binding_rows(rows[1], "values", lead, d, by_name(vparts, "values", lambda n: f"values.{n}"))
        side = None if rows[2] is None else binding_side(rows[2], lead, d, by_name(kparts, "side", lambda n: f"keys.{n}"))
        return keys, values, side

    def _declare_rows(self) -> None:
        """Declare the rows to the native store for :meth:`attend` and :meth:`step` (as
        :meth:`can_attend`, on its first call). Raises :class:`KvqrsError` when the native step
        cannot read this codec's rows (:meth:`can_attend` is False), and what
        :meth:`can_attend` raises."""
        if not self.can_attend():
            raise KvqrsError(
                f"fused: no native decode step for {self.codec.scheme} keys with {self.codec.value_scheme} values "
                "(no fused rows, or rows of a class the native step does not read)"
            )

    def attend(self, query: torch.Tensor, sinks: tuple, window: tuple, mask: torch.Tensor | None, scale: float, with_lse: bool = False):
        """Attention of ``query`` ``(batch, q_heads, nq, d)`` over the coded tokens and the
        full-precision ones, merged by log-sum-exp in one native call: ``sinks``, a ``(keys,
        values)`` pair of ``(batch, kv_heads, tokens, d)`` tensors, then ``window``, such a pair
        or, read in place, a :class:`WindowRows` (:func:`token_rows` finds one in a tensor that
        is a float32 span of a token buffer, as the cache's window is). ``mask``: None, or a
        boolean or additive ``(batch, 1, nq, sinks + window)`` mask of the full-precision
        columns. Returns float32 ``(batch, q_heads, nq, d)``, and with ``with_lse`` also the
        log-sum-exp of the whole softmax's logits, float32 ``(batch, q_heads, nq, 1)`` (to merge
        another softmax term exactly). Raises :class:`KvqrsError` on non-finite logits or shapes
        that do not fit."""
        rows = window if isinstance(window, WindowRows) else _window_rows(*window)
        head, (sk, sv, ns) = self._query_args(query, scale), self._sink_args(sinks)
        m = _additive_mask(mask, query.shape[0], query.shape[2], ns + rows.tokens)
        args = (sk, sv, ns, rows.keys, rows.values, rows.room, rows.start, rows.tokens, m, query.shape[0])
        return self._shaped(self._native.attend(*head, *args), query, with_lse)

    def _query_args(self, query: torch.Tensor, scale: float) -> tuple:
        """The native step's query arguments (declaring the rows on the first step):
        ``(flat query, batch x kv_heads, groups x nq, head_dim, scale, nq)``."""
        if not self._native.has_rows:
            self._declare_rows()
        b, hq, nq, d = query.shape
        return (_flat_f32(query), b * self.kv_heads, hq // self.kv_heads * nq, d, float(scale), nq)

    @staticmethod
    def _sink_args(sinks: tuple) -> tuple:
        """The sinks ``(keys, values)`` as the native step reads them: ``(flat keys, flat values, tokens)``."""
        ns = sinks[0].shape[-2]
        return (*((_flat_f32(t) for t in sinks) if ns else (_NO_TOKENS, _NO_TOKENS)), ns)

    @staticmethod
    def _shaped(res: tuple, query: torch.Tensor, with_lse: bool):
        """The native step's flat ``(out, lse)`` as ``(batch, q_heads, nq, d)`` (and ``(batch,
        q_heads, nq, 1)`` with ``with_lse``)."""
        b, hq, nq, d = query.shape
        out = torch.from_numpy(res[0]).view(b, hq, nq, d)
        return (out, torch.from_numpy(res[1]).view(b, hq, nq, 1)) if with_lse else out

    def step(
        self, query: torch.Tensor, sinks: tuple, window: WindowRows, new: tuple, flush: int, mask, scale: float, with_lse: bool = False
    ):
        """A whole decode step in one native call: the new tokens ``new`` (keys, values:
        float32 CPU ``(batch, kv_heads, n, d)``) written into the window buffer after its
        tokens (at ``window.start + window.tokens``), the window's ``flush`` oldest tokens
        encoded and appended to the store (:meth:`encode_append`; the codec must
        :meth:`encodes_natively`), then :meth:`attend` over the codes, ``sinks`` and the window's
        tokens from ``window.start + flush`` on, the new ones included. ``mask``: None, or a
        boolean or additive ``(batch, 1, nq, sinks + window after the step)`` mask. Returns
        :meth:`attend`'s result, or None when a new value is not finite or beyond the storable
        range (nothing written) or the encode refuses the flushed tokens (a per-token absmax
        scale beyond float16; the store unchanged, the buffer written only past the window's
        tokens): the caller takes the general path, which names the value or encodes the
        tokens in Python (naming the error)."""
        head, (sk, sv, ns) = self._query_args(query, scale), self._sink_args(sinks)
        k, v = new
        m = _additive_mask(mask, query.shape[0], query.shape[2], ns + window.tokens + k.shape[-2] - flush)
        hi = window.start + window.tokens
        args = (sk, sv, ns, window.keys, window.values, window.room, window.start, hi, k.numpy(), v.numpy(), flush, m, query.shape[0])
        res = self._native.step(*head, *args)
        return None if res is None else self._shaped(res, query, with_lse)
