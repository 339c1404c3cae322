"""The slot layout of a paged kvqrs cache: every KV head's token as kvqrs codes of one fixed byte
size, in pages of ``block_size`` slots (one page per block and KV head, vLLM's paged layout).

A page stores its slots part by part (a structure of arrays): each stored part of a token
(packed codes, norms, QJL signs and norms, block scales and zero points; keys first, then
values) fills ``block_size * row_bytes`` bytes at ``block_size`` times the part's offset within
the slot. The rows of one page are then exactly the per-head arrays of kvqrs' fused decode
attention, which the Rust entry point ``_native.paged_decode_attention`` reads in place through
the block table (:meth:`SlotLayout.attend`); a calibrated layout's tables (a ``matched`` basis
and means, one or one per KV head) travel with the rows by value. This module needs NumPy only
(no vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _native
from .._arrays import KvqrsError, check_positive_int
from ..hf.config import QuantConfig
from ..hf.store import _native_encoder
from ..kernels.attention import CentredRows, MSERows, TokenRunRows, UniformRows, binding_rows, by_name, map_parts
from ..schemes import KVCodec
from ..schemes.matched import MatchedCalibration
from ..schemes.registry import REGISTRY, names


def __getattr__(name: str) -> tuple[str, ...]:
    # PAGED_SCHEMES: the registry's, derived when read.
    if name == "PAGED_SCHEMES":
        return names(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Part:
    """One stored part of a slot: ``row_bytes`` bytes per token at ``offset`` bytes into the slot
    (``block_size * offset`` into a page), ``dtype`` its NumPy storage type."""

    side: str
    name: str
    offset: int
    row_bytes: int
    dtype: np.dtype
    per_token: tuple[int, ...]


def _unpaged(config: QuantConfig, kind: str) -> str | None:
    """Why ``config``'s ``kind`` cannot be stored in fixed-size slots (its registry entry's
    words, for a side paged by its calibration those of :attr:`SideSpec.paged_with
    <kvqrs.schemes.registry.SideSpec.paged_with>`), or None when it can."""
    scheme = config.key_scheme if kind == "keys" else config.value_scheme
    if scheme is None:
        return "the keys must be quantized" if kind == "keys" else "values kept in full precision"
    spec = REGISTRY.get(scheme)
    side = None if spec is None else spec.side(kind)
    if side is None:
        return "an unknown scheme"
    if side.unpaged is None or side.paged_with is None:
        return side.unpaged
    return side.paged_with(config.calibration)


def _served() -> str:
    """The schemes a paged cache stores: with any settings, then those a calibration fixes."""
    calibrated = [n for n, s in REGISTRY.items() if not s.paged and s.paged_calibrated]
    return ", ".join(names("PAGED_SCHEMES")) + "".join(f"; {n} calibrated with per-token key scales" for n in calibrated)


def refuse_reason(config: QuantConfig) -> str | None:
    """Why ``config`` cannot be stored in fixed-size slots, or None when it can: the schemes of
    :data:`PAGED_SCHEMES`, and ``matched`` with a calibration ``{layer: MatchedCalibration}``
    whose keys carry per-token scales (``deviations``) and whose values are the per-token MSE
    stage; every token coded (no sinks, no full-precision window), float norms."""
    why = _unpaged(config, "keys")
    if why is not None:
        return f"key scheme {config.key_scheme!r}: {why}; a paged cache needs a fixed size per token ({_served()})"
    why = _unpaged(config, "values")
    if why is not None:
        return f"value scheme {config.value_scheme!r}: {why}; choose one of {_served()}"
    if config.residual_length:
        return f"residual_length {config.residual_length}: a paged cache stores every token as codes (use 0)"
    if config.sink_tokens:
        return f"sink_tokens {config.sink_tokens}: sink tokens are kept in full precision, which paged slots do not hold: use sink_tokens=0"
    if config.value_norms != "float":
        return f"value_norms {config.value_norms!r}: log-coded norms share an exponent per group of tokens; a paged cache needs a fixed size per token (use 'float')"
    return None


def paged_slot_bytes(config: QuantConfig, head_dim: int) -> int:
    """Bytes of one slot that hold any layer's codes: the largest layer's slot (a ``matched``
    calibration gives each layer its own key and value widths), the same for every layer of a
    vLLM cache. Raises :class:`KvqrsError` as :class:`SlotLayout` does."""
    layers = sorted(config.calibration) if isinstance(config.calibration, dict) and config.calibration else [0]
    return max(SlotLayout(config, layer, head_dim).slot_bytes for layer in layers)


def _table_heads(config: QuantConfig, layer: int) -> int:
    """KV heads of the layer's calibrated tables (a ``matched`` basis and means): 1 when shared
    by every KV head or without any."""
    cal = config.calibration.get(layer) if isinstance(config.calibration, dict) else None
    return int(cal.keys.kv_heads) if isinstance(cal, MatchedCalibration) else 1


class SlotLayout:
    """Fixed-size slots of one layer's kvqrs codes.

    Args:
        config: the quantization settings (:class:`~kvqrs.hf.QuantConfig`; the same settings
            give the same codes as :class:`~kvqrs.hf.QuantizedKVCache`).
        layer: layer index (each layer's rotations and sketches are its codec's).
        head_dim: d.
        slot_bytes: the bytes of a slot in the cache, when the cache holds every layer at the
            size of its largest (:func:`paged_slot_bytes`: a calibration's layers can have other
            widths); None: this layer's own size. The bytes past this layer's parts stay unused.

    Raises:
        KvqrsError: a scheme without a fixed size per token (:func:`refuse_reason`),
            ``slot_bytes`` smaller than the layer's slot, a ``layer`` that is not an integer
            >= 0 or a ``head_dim`` that is not one >= 1.
    """

    def __init__(self, config: QuantConfig, layer: int, head_dim: int, slot_bytes: int | None = None):
        reason = refuse_reason(config)
        if reason is not None:
            raise KvqrsError(f"kvqrs paged cache: {reason}")
        layer, head_dim = check_positive_int(layer, "layer", 0), check_positive_int(head_dim, "head_dim")
        self.config, self.layer, self.head_dim = config, layer, head_dim
        self.codec: KVCodec = config.codec(layer, head_dim)
        for kind in ("keys", "values"):
            if not self.codec.fixed_per_token(kind):
                raise KvqrsError(f"kvqrs paged cache: {kind}: the declared layout stores parts shared by several tokens")
        # Calibrated per-head tables (a matched basis and means) serve 1 or this many KV heads.
        self.table_heads = _table_heads(config, layer)
        # One token of each table's KV head, by the declared layouts (PartRefs: nothing encoded).
        shape = (self.table_heads, 1, head_dim)
        ck, cv = (self.codec.named(kind, shape) for kind in ("keys", "values"))
        krows, vrows, side = self.codec.fused_rows(ck, cv)
        if side is not None:
            raise KvqrsError("kvqrs paged cache: HeadQ side codes are not stored in paged slots")
        self.parts: list[Part] = []
        self.rows = {"keys": self._side("keys", ck, krows), "values": self._side("values", cv, vrows)}
        self.slot_bytes = sum(p.row_bytes for p in self.parts)
        if slot_bytes is not None:
            if slot_bytes < self.slot_bytes:
                raise KvqrsError(f"slot_bytes: layer {layer} needs {self.slot_bytes} bytes per slot, got {slot_bytes}")
            self.slot_bytes = int(slot_bytes)
        self._pages: dict[int, _native.PageRows] = {}
        self._page_rows(1)  # the tables checked now
        self._writer = self._native_writer()

    def _native_writer(self) -> _native.SlotWriter | None:
        """The native slot writer (encode and scatter in one call, GIL released) when both
        coders have native encoders giving their bytes (:func:`~kvqrs.hf.store._native_encoder`),
        else None: :meth:`write` then encodes in Python."""
        sides = [_native_encoder(self.codec._key_coder(), self.table_heads), _native_encoder(self.codec.values, self.table_heads)]
        if None in sides:
            return None
        parts = [(("keys", "values").index(p.side), p.name, p.offset, p.row_bytes, np.dtype(p.dtype).name) for p in self.parts]
        return _native.SlotWriter(*sides, parts, self.head_dim)

    def _side(self, side: str, enc, rows) -> Any:
        """Append this side's parts; return its rows with each part (a
        :class:`~kvqrs.layout.PartRef` of ``enc``'s, resolved by name) replaced by
        ``(offset, row_bytes[, dtype])`` within a slot and its tables (a basis, a mean) as they
        are (:meth:`_binding_rows` scales the places to a page and flattens the tables for the
        Rust entry point), each part's size and dtype those its declared layout gives one token
        (stored scalars float16: a norm or scale beyond it is refused when written). Per-token
        layouts only: MSE and per-token uniform rows, token runs as keys, alone or around a
        mean."""
        inner = rows.rows if isinstance(rows, CentredRows) else rows
        per_token = isinstance(inner, MSERows) or (isinstance(inner, UniformRows) and not inner.per_channel)
        if not (per_token or (side == "keys" and isinstance(inner, TokenRunRows))):
            what = type(rows).__name__ + (f" of {type(inner).__name__}" if inner is not rows else "")
            raise KvqrsError(f"kvqrs paged cache: {side} as {what} have no fixed per-token layout")

        def place(name: str) -> tuple:
            ref = enc.parts[name]
            dtype, per_token = np.dtype(ref.dtype), ref.shape[2:]
            row_bytes = int(np.prod(per_token, dtype=np.int64)) * dtype.itemsize
            offset = sum(p.row_bytes for p in self.parts)
            self.parts.append(Part(side, name, offset, row_bytes, dtype, per_token))
            return (offset, row_bytes) if dtype == np.uint8 else (offset, row_bytes, dtype.name)

        out = map_parts(rows, by_name(enc.parts, side, place), side)
        if sorted(p.name for p in self.parts if p.side == side) != sorted(enc.parts):
            raise KvqrsError(f"kvqrs paged cache: {side} rows do not read every stored part once")
        return out

    def _binding_rows(self, block_size: int) -> tuple:
        """Both sides' rows as the Rust entry point reads them, each part at its offset in a page
        of ``block_size`` slots, its tables flat float32 with their count (1, or
        :attr:`table_heads`)."""
        lead, d = (self.table_heads,), self.head_dim
        scaled = lambda at, _: (block_size * at[0], *at[1:])  # noqa: E731
        return tuple(binding_rows(self.rows[k], k, lead, d, scaled) for k in ("keys", "values"))

    def _page_rows(self, block_size: int) -> _native.PageRows:
        """:meth:`_binding_rows` read by the binding, once per block size."""
        if block_size not in self._pages:
            self._pages[block_size] = _native.PageRows(*self._binding_rows(block_size))
        return self._pages[block_size]

    def check_heads(self, kv_heads: int) -> None:
        """Raises :class:`KvqrsError` unless the calibrated tables serve ``kv_heads`` KV heads
        (one table, or one per KV head)."""
        if self.table_heads not in (1, kv_heads):
            raise KvqrsError(
                f"calibration: layer {self.layer}'s tables are per KV head of {self.table_heads} heads, the cache holds {kv_heads}; "
                "expected 1 or the layer's KV heads"
            )

    def bits_per_element(self) -> float:
        """Stored bits per key and value element (every byte of the slot counted)."""
        return 8.0 * self.slot_bytes / (2 * self.head_dim)

    # -- the cache array ----------------------------------------------------------------------
    def check_cache(self, cache: np.ndarray) -> tuple[int, int, int]:
        """``(blocks, kv_heads, block_size)`` of a uint8 cache ``(blocks, kv_heads, block_size,
        slot_bytes)`` whose pages are contiguous, for KV heads the calibrated tables serve
        (:meth:`check_heads`); raises KvqrsError otherwise."""
        if cache.dtype != np.uint8 or cache.ndim != 4 or cache.shape[3] != self.slot_bytes:
            raise KvqrsError(f"cache: expected uint8 (blocks, kv_heads, block_size, {self.slot_bytes}), got {cache.dtype} {cache.shape}")
        b, h, n, c = cache.shape
        if cache.strides[2:] != (c, 1) or (h > 1 and cache.strides[1] < n * c) or (b > 1 and cache.strides[0] < h * n * c):
            raise KvqrsError(f"cache: expected every (block, KV head) page contiguous, got strides {cache.strides}")
        self.check_heads(h)
        return b, h, n

    @staticmethod
    def _span(cache: np.ndarray) -> np.ndarray:
        """Every byte from the first page to the end of the last, as a flat view (no copy)."""
        b, h, n, c = cache.shape
        span = (b - 1) * cache.strides[0] + (h - 1) * cache.strides[1] + n * c
        return np.lib.stride_tricks.as_strided(cache, shape=(span,), strides=(1,))

    def write(self, cache: np.ndarray, keys: np.ndarray, values: np.ndarray, slots: np.ndarray) -> None:
        """Encode ``keys`` and ``values`` float ``(tokens, kv_heads, head_dim)`` and store token
        ``i`` in slot ``slots[i]`` (block ``slot // block_size``, position ``slot % block_size``;
        negative slots are padding and skipped), in place.

        Raises:
            KvqrsError: keys or values that are not float arrays, shapes that do not match the
                cache, a slot beyond it, NaN/Inf inputs.
        """
        b, h, n = self.check_cache(cache)
        if self._writer is not None:
            new, slots = self._new_tokens(keys, values, slots, b, h, n)
            self._writer.write(self._span(cache), b, h, n, cache.strides[0], cache.strides[1], *new, slots)
            return
        (keys, values), slots = self._new_tokens(keys, values, slots, b, h, n, flat=False)
        keep = slots >= 0
        if not keep.all():
            keys, values, slots = keys[keep], values[keep], slots[keep]
        if slots.size == 0:
            return
        # (kv_heads, tokens, d): each KV head's tokens, as a calibration's per-head tables read them
        heads_first = lambda x: np.ascontiguousarray(np.swapaxes(np.asarray(x, dtype=np.float32), 0, 1))  # noqa: E731
        encoded = {"keys": self.codec.encode_keys(heads_first(keys)), "values": self.codec.encode_values(heads_first(values))}
        stored = []
        for p in self.parts:  # every part checked before any is written
            part = np.asarray(encoded[p.side].parts[p.name])
            if part.dtype != p.dtype:
                raise KvqrsError(f"{p.side}.{p.name}: encoded as {part.dtype}, the slot stores {p.dtype} (a value beyond its range)")
            stored.append(np.ascontiguousarray(np.swapaxes(part, 0, 1)).view(np.uint8).reshape(len(slots), h, p.row_bytes))
        span = self._span(cache)
        blocks, pos = slots // n, slots % n
        for p, data in zip(self.parts, stored):
            region = np.lib.stride_tricks.as_strided(
                span[n * p.offset :],
                shape=(b, h, n, p.row_bytes),
                strides=(cache.strides[0], cache.strides[1], p.row_bytes, 1),
                writeable=True,
            )
            region[blocks, :, pos, :] = data

    def _new_tokens(self, keys, values, slots, blocks: int, heads: int, n: int, flat: bool = True) -> tuple[list, np.ndarray]:
        """The checked new tokens (flat float32 keys and values when ``flat``, else the float
        arrays as given) and their int64 slots. Raises :class:`KvqrsError` for keys or values
        that are not float arrays, shapes that do not match or a slot beyond the cache."""
        slots = _integers(slots, "slots", np.int64).reshape(-1)
        keys, values = _floats(keys, "keys"), _floats(values, "values")
        if keys.shape != values.shape or keys.shape[1:] != (heads, self.head_dim) or keys.shape[0] != slots.shape[0]:
            raise KvqrsError(
                f"keys, values: expected (tokens={slots.shape[0]}, kv_heads={heads}, head_dim={self.head_dim}), got {keys.shape} and {values.shape}"
            )
        if flat:  # the native writer checks the slots (the same message)
            return [np.ascontiguousarray(x, dtype=np.float32).reshape(-1) for x in (keys, values)], slots
        if slots.size and slots.max() >= blocks * n:
            raise KvqrsError(f"slots: expected slots below {blocks * n} ({blocks} blocks of {n}), got {int(slots.max())}")
        return [keys, values], slots

    def attend(
        self,
        cache: np.ndarray,
        queries: np.ndarray,
        seq: np.ndarray,
        lengths: np.ndarray,
        block_table: np.ndarray,
        scale: float,
    ) -> np.ndarray:
        """Attention of each query token over the first ``lengths[t]`` tokens of sequence
        ``seq[t]`` (its block-table row), computed from the codes (docs/kernels.md section 11):
        the sequence's slots gathered from its pages and read in one fused-kernel call per
        query token and KV head.

        Args:
            cache: the uint8 cache of :meth:`check_cache`.
            queries: float ``(tokens, q_heads, head_dim)``; query head ``i`` reads KV head
                ``i // (q_heads // kv_heads)``.
            seq, lengths: int ``(tokens,)``.
            block_table: int ``(sequences, width)`` block ids.
            scale: logit scale.

        Returns:
            float32 ``(tokens, q_heads, head_dim)``.

        Raises:
            KvqrsError: shapes or indices out of range (named), non-finite queries or logits.
        """
        b, h, n = self.check_cache(cache)
        q, reads = self._reads(cache, queries, seq, lengths, block_table, scale)
        out = _native.paged_decode_attention(self._span(cache), b, h, n, n * self.slot_bytes, cache.strides[0], cache.strides[1], *reads)
        return out.reshape(q.shape)

    def reconstruct(
        self, cache: np.ndarray, seq: np.ndarray, lengths: np.ndarray, block_table: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The first ``lengths[i]`` keys and values of sequence ``seq[i]`` (its block-table row)
        decoded from the codes to the head domain, for dense attention over many query tokens
        (a prefill): the rows the fused kernel reads, up to float32 rounding.

        Args:
            cache: the uint8 cache of :meth:`check_cache`.
            seq, lengths: int ``(sequences,)``.
            block_table: int ``(rows, width)`` block ids.

        Returns:
            per sequence, ``(keys, values)`` float32 ``(kv_heads, lengths[i], head_dim)``.

        Raises:
            KvqrsError: shapes or indices out of range (named), non-finite decoded rows.
        """
        b, h, n = self.check_cache(cache)
        table = _int32(block_table, "block_table")
        if table.ndim != 2 or table.shape[1] == 0:
            raise KvqrsError(f"block_table: expected (sequences, width >= 1), got {table.shape}")
        lengths = _int32(lengths, "lengths").reshape(-1)
        seq = _int32(seq, "seq").reshape(-1)
        k, v = _native.paged_reconstruct(
            self._span(cache),
            b,
            h,
            n,
            n * self.slot_bytes,
            cache.strides[0],
            cache.strides[1],
            self._page_rows(n),
            self.head_dim,
            seq,
            lengths,
            table.reshape(-1),
            table.shape[1],
        )
        at = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * h * self.head_dim)])
        shape = lambda i: (h, int(lengths[i]), self.head_dim)  # noqa: E731
        return [(k[at[i] : at[i + 1]].reshape(shape(i)), v[at[i] : at[i + 1]].reshape(shape(i))) for i in range(len(lengths))]

    def _reads(self, cache: np.ndarray, queries, seq, lengths, block_table, scale: float) -> tuple[np.ndarray, tuple]:
        """The checked queries and the arguments of the paged attention after the cache's
        geometry: ``(page rows, flat queries, q_heads, head_dim, scale, seq,
        lengths, flat block table, its width)``."""
        n = cache.shape[2]
        q = np.ascontiguousarray(_floats(queries, "queries"), dtype=np.float32)
        if q.ndim != 3 or q.shape[2] != self.head_dim:
            raise KvqrsError(f"queries: expected (tokens, q_heads, {self.head_dim}), got {q.shape}")
        table = _int32(block_table, "block_table")
        if table.ndim != 2 or table.shape[1] == 0:
            raise KvqrsError(f"block_table: expected (sequences, width >= 1), got {table.shape}")
        return q, (
            self._page_rows(n),
            q.reshape(-1),
            q.shape[1],
            self.head_dim,
            float(scale),
            _int32(seq, "seq").reshape(-1),
            _int32(lengths, "lengths").reshape(-1),
            table.reshape(-1),
            table.shape[1],
        )

    def step(
        self,
        cache: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        slots: np.ndarray,
        queries: np.ndarray,
        seq: np.ndarray,
        lengths: np.ndarray,
        block_table: np.ndarray,
        scale: float,
    ) -> np.ndarray:
        """:meth:`write` of a step's new ``keys``, ``values`` into ``slots``, then :meth:`attend`
        of its ``queries`` (the new tokens included): one native call (GIL released) where the
        coders encode natively, else the two. Arguments, result and errors as theirs. An error
        of the new tokens (a shape, a slot, a value not finite) writes nothing. The new tokens
        are stored before the attention reads the cache, so an error found there (a length
        beyond the block table, a query not finite) leaves them written, as a :meth:`write`
        followed by a failing :meth:`attend` would; a query or block table of the wrong shape
        or dtype writes nothing where the coders encode natively (checked first) and leaves
        the tokens written where they do not."""
        if self._writer is None:
            self.write(cache, keys, values, slots)
            return self.attend(cache, queries, seq, lengths, block_table, scale)
        b, h, n = self.check_cache(cache)
        new, slots = self._new_tokens(keys, values, slots, b, h, n)
        q, reads = self._reads(cache, queries, seq, lengths, block_table, scale)
        out = self._writer.step(self._span(cache), b, h, n, cache.strides[0], cache.strides[1], *new, slots, *reads)
        return out.reshape(q.shape)


def _integers(a: Any, arg: str, dtype: type[np.signedinteger]) -> np.ndarray:
    """``a`` as contiguous ``dtype``; raises :class:`KvqrsError` naming ``arg`` for values that
    are not integers or lie outside ``dtype`` (a cast would truncate or wrap them: a NaN slot
    would become a negative one, padding)."""
    x = np.asarray(a)
    if x.dtype == dtype:  # vLLM's block tables, slot mapping and the metadata's rows: nothing to check
        return np.ascontiguousarray(x)
    if x.dtype.kind not in "iu":
        raise KvqrsError(f"{arg}: expected integers, got dtype {x.dtype}")
    info = np.iinfo(dtype)
    if x.size and (int(x.min()) < info.min or int(x.max()) > info.max):
        raise KvqrsError(f"{arg}: expected values within {info.dtype}, got {int(x.min())}..{int(x.max())}")
    return np.ascontiguousarray(x, dtype=dtype)


def _floats(a: Any, arg: str) -> np.ndarray:
    """``a`` as a NumPy array of real floats (any float dtype, as given); raises
    :class:`KvqrsError` naming ``arg`` for anything else (a complex array would lose its
    imaginary part in the float32 cast, None or a string is no array of numbers)."""
    x = np.asarray(a)
    if x.dtype.kind != "f":
        raise KvqrsError(f"{arg}: expected a float array, got dtype {x.dtype}")
    return x


def _int32(a: Any, arg: str) -> np.ndarray:
    """:func:`_integers` as int32."""
    return _integers(a, arg, np.int32)


def query_positions(query_start: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(seq, lengths)`` of every query token of a batch: request ``r``'s query tokens are rows
    ``query_start[r] .. query_start[r + 1]`` and the last ``q_len`` of its ``seq_lens[r]`` tokens,
    so query token ``i`` of it attends causally to its first ``seq_lens[r] - q_len + i + 1``.
    Raises :class:`KvqrsError` for offsets or lengths that are not integers within int64, or no
    offsets at all."""
    qs = _integers(query_start, "query_start", np.int64).reshape(-1)
    if qs.size == 0:
        raise KvqrsError("query_start: expected the batch's query offsets (one more than its requests), got none")
    q_lens = np.diff(qs)
    sl = _integers(seq_lens, "seq_lens", np.int64).reshape(-1)[: len(q_lens)]
    seq = np.repeat(np.arange(len(q_lens), dtype=np.int32), q_lens)
    first = np.repeat(sl - q_lens + 1, q_lens)
    within = np.arange(int(qs[-1] - qs[0])) - np.repeat(qs[:-1] - qs[0], q_lens)
    return seq, (first + within).astype(np.int32)
