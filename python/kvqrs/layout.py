"""Stored layouts: the parts a compressed tensor of ``(..., T, head_dim)`` holds, each with its
shape, dtype by name, token axis, token rate and alignment, declared once per row format.

Every coder of :mod:`kvqrs.schemes` declares ``layout(shape) -> {part: Part}`` by composing the
row formats below (and the fused attention rows of :mod:`kvqrs.kernels.attention` declare theirs
with the same functions), and everything that depends on a layout is derived from it:
joining chunks of tokens (:func:`concat`), keeping the first tokens (:func:`take`), the
format's checks of a loaded tensor (:func:`check_parts`), the attention kernel's checks of
its rows (:func:`flat`), the bytes a shape stores (:func:`nbytes`), the token multiple a cache
flushes and cuts at (:func:`align`), whether every token stores its own parts of one size
(:func:`fixed_per_token`: vLLM's paged slots), and the layer store's per-part token rates.
Nothing is learned by encoding a probe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from math import gcd, lcm, prod
from typing import Any, NamedTuple

import numpy as np

from ._arrays import KvqrsError, as_array, as_float_rows
from .kernels.pack import packed_size

DTYPES: Mapping[str, np.dtype] = {"uint8": np.dtype(np.uint8), "scalar": np.dtype(np.float16), "float32": np.dtype(np.float32)}
"""Each declared dtype name and the NumPy dtype a part of it is stored as: ``uint8`` packed
codes (and log codes); ``scalar`` stored norms, scales or zero points, float16, widened to
float32 when some value leaves float16's range (docs/kernels.md, stored scalars; :data:`WIDENED`);
``float32`` full-precision values."""
WIDENED = np.dtype(np.float32)
"""What a ``scalar`` part is stored as when a value leaves float16's range."""


class Part(NamedTuple):
    """One stored array.

    Attributes:
        shape: its shape for the tensor's shape; along ``token_axis``, ``ceil(T * rate)``
            entries (:func:`entries`).
        dtype: a name of :data:`DTYPES`.
        token_axis: the (negative) axis along which tokens are stored.
        align: chunks of tokens join, and a prefix is kept, only at multiples of this many
            tokens (``1`` for one entry per token; a packed token axis needs whole bytes, and
            per-channel groups whole groups).
        rate: entries along ``token_axis`` per token: ``1`` (a row per token), ``bits / 8``
            (a channel's codes packed along tokens), ``1 / group`` (a scale per group of tokens).
    """

    shape: tuple[int, ...]
    dtype: str
    token_axis: int
    align: int = 1
    rate: Fraction = Fraction(1)

    @property
    def outer(self) -> tuple[int, ...]:
        """The axes before the token axis."""
        return self.shape[: len(self.shape) + self.token_axis]

    @property
    def inner(self) -> tuple[int, ...]:
        """The axes after the token axis."""
        return self.shape[len(self.shape) + self.token_axis + 1 :]

    @property
    def stored_dtype(self) -> np.dtype:
        """The NumPy dtype it is stored as (:data:`DTYPES`; a ``scalar`` part may widen to :data:`WIDENED`)."""
        return DTYPES[self.dtype]


Layout = dict[str, Part]


class PartRef:
    """A stored part named in place of its array: what an ``Encoded`` holds when a coder's
    ``attention_rows`` is asked which parts its rows read (the layer store and the paged
    layout bind the rows by part name, :func:`kvqrs.kernels.attention.by_name`).

    It has the array's ``shape``, ``dtype`` and ``ndim``, so that checks of an ``Encoded``'s
    shapes still work, and nothing else of an array: converting it (``np.asarray``,
    ``np.ascontiguousarray``, a ufunc), indexing it or doing arithmetic with it raises
    ``TypeError`` and an array method (``view``, ``astype``) ``AttributeError``. A coder's
    ``attention_rows`` may therefore only place its parts in row objects, never copy or
    compute on them.

    Attributes:
        name: the part's name in its ``Encoded`` (``codes``, ``qjl_signs``, ``base_norms``).
        shape: the part's shape.
        dtype: the part's dtype (a NumPy dtype; a torch dtype for a part held as a tensor).
    """

    __slots__ = ("name", "shape", "dtype")
    __array_ufunc__ = None  # NumPy ufuncs and ndarray operators refuse it (TypeError)

    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any):
        self.name, self.shape, self.dtype = str(name), tuple(int(n) for n in shape), dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            f"part {self.name!r}: a PartRef names a stored part, it holds no data; attention_rows may place it in row "
            "objects but not copy, convert or compute on it"
        )

    def __repr__(self) -> str:
        return f"PartRef({self.name!r}, {self.shape}, {self.dtype})"


def part_refs(parts: Mapping[str, Any]) -> dict[str, PartRef]:
    """``{name: PartRef(name, shape, dtype)}`` of stored arrays (NumPy arrays or tensors)."""
    return {n: PartRef(n, a.shape, a.dtype) for n, a in parts.items()}


def layout_refs(layout: Layout) -> dict[str, PartRef]:
    """``{name: PartRef(name, shape, stored dtype)}`` of a declared layout: the parts by name,
    as an encode of that shape stores them (scalars float16), without encoding anything."""
    return {n: PartRef(n, p.shape, p.stored_dtype) for n, p in layout.items()}


def entries(t: int, rate: Fraction) -> int:
    """Entries along a part's token axis for ``t`` tokens at ``rate`` entries per token: ``ceil(t * rate)``."""
    return -(-t * rate.numerator // rate.denominator)


def per_token(lead: tuple[int, ...], t: int, inner: tuple[int, ...], dtype: str) -> Part:
    """A part of one entry ``inner`` per token: ``(..., T, *inner)``."""
    return Part((*lead, t, *inner), dtype, -1 - len(inner))


def along_tokens(lead: tuple[int, ...], t: int, rate: Fraction, align: int, dtype: str) -> Part:
    """A part stored along the tokens at ``rate`` entries per token, cut at multiples of
    ``align`` tokens: ``(..., ceil(T * rate))``."""
    return Part((*lead, entries(t, rate)), dtype, -1, align, rate)


def mse(lead: tuple[int, ...], t: int, code_dim: int, bits: int) -> Layout:
    """Norm-and-direction rows: packed codes ``(..., T, packed(d', b))`` and norms ``(..., T)``."""
    return {"codes": per_token(lead, t, (packed_size(code_dim, bits),), "uint8"), "norms": per_token(lead, t, (), "scalar")}


def log_norms(lead: tuple[int, ...], t: int, group: int) -> Layout:
    """Log-coded norms (docs/kernels.md section 13): an 8-bit code per token ``(..., T)`` and an
    exponent byte per group of ``group`` tokens ``(..., ceil(T / group))``; codes are relative
    to their group's exponent, so chunks join at whole groups."""
    return {
        "norms": along_tokens(lead, t, Fraction(1), group, "uint8"),
        "norm_exps": along_tokens(lead, t, Fraction(1, group), group, "uint8"),
    }


def qjl(lead: tuple[int, ...], t: int, code_dim: int) -> Layout:
    """The QJL sketch of a rotated residual (m = d'): sign bits and ``||r||`` per token."""
    return {"signs": per_token(lead, t, (packed_size(code_dim, 1),), "uint8"), "norms": per_token(lead, t, (), "scalar")}


def uniform_tokens(lead: tuple[int, ...], t: int, n: int, bits: int, group: int) -> Layout:
    """Uniform groups of ``group`` of a token's ``n`` coordinates: codes, scales, zero points."""
    groups = -(-n // group)
    return {
        "codes": per_token(lead, t, (packed_size(n, bits),), "uint8"),
        "scales": per_token(lead, t, (groups,), "scalar"),
        "zeros": per_token(lead, t, (groups,), "scalar"),
    }


def uniform_channels(lead: tuple[int, ...], t: int, d: int, bits: int, group: int) -> Layout:
    """Uniform groups of ``group`` tokens per channel (KIVI keys): each channel's tokens packed
    along the last axis (``bits / 8`` bytes per token, whole bytes at multiples of ``8 / gcd(8,
    bits)`` tokens), one scale and zero point per group."""
    per_group = Fraction(1, group)
    return {
        "codes": along_tokens((*lead, d), t, Fraction(bits, 8), 8 // gcd(8, bits), "uint8"),
        "scales": along_tokens((*lead, d), t, per_group, group, "scalar"),
        "zeros": along_tokens((*lead, d), t, per_group, group, "scalar"),
    }


def token_runs(lead: tuple[int, ...], t: int, runs: Sequence[tuple[int, int]]) -> Layout:
    """Symmetric codes per token in runs of basis columns with one scale per token (the
    fixed-size ``matched`` keys): ``runs[i].codes`` uint8 ``(..., T, packed_size(width, bits))``
    for each run's ``(width, bits)``, ``scales`` ``(..., T)``."""
    parts = {f"runs[{i}].codes": per_token(lead, t, (packed_size(w, b),), "uint8") for i, (w, b) in enumerate(runs)}
    parts["scales"] = per_token(lead, t, (), "scalar")
    return parts


def dense(lead: tuple[int, ...], t: int, d: int) -> Layout:
    """Full-precision rows ``(..., T, d)``."""
    return {"values": per_token(lead, t, (d,), "float32")}


def side(lead: tuple[int, ...], t: int, rank: int, bits: int) -> Layout:
    """HeadQ's side code: packed ``rank``-dimensional codes and a scale per token."""
    return {"codes": per_token(lead, t, (packed_size(rank, bits),), "uint8"), "scales": per_token(lead, t, (), "scalar")}


def nbytes(layout: Layout) -> int:
    """Bytes the parts of ``layout`` store (scalars as float16: an encode stores this many
    unless a value leaves float16's range and its scalars widen to float32)."""
    return sum(prod(p.shape) * p.stored_dtype.itemsize for p in layout.values())


def align(layout: Layout) -> int:
    """The fewest tokens at whose multiples every part of ``layout`` can be cut and joined (the
    least common multiple of their :attr:`Part.align`; 1 for an empty layout)."""
    return lcm(1, *(p.align for p in layout.values()))


def fixed_per_token(layout: Layout) -> bool:
    """Whether every token stores its own parts of one size: each part one entry per token,
    cut anywhere (what vLLM's paged slots hold)."""
    return all(p.rate == 1 and p.align == 1 for p in layout.values())


def prefixed(prefix: str, layout: Layout) -> Layout:
    """``layout`` with every part name prefixed (composite coders: ``base_``, ``side_``, ``qjl_``)."""
    return {prefix + k: v for k, v in layout.items()}


def _dtype_ok(a: np.ndarray, dtype: str) -> bool:
    if dtype == "scalar":
        return a.dtype in (DTYPES[dtype], WIDENED)
    if dtype == "float32":
        return a.dtype.kind == "f"
    return a.dtype == DTYPES[dtype]


def check_parts(parts: Mapping[str, Any], layout: Layout, what: str) -> None:
    """Raise :class:`KvqrsError` unless ``parts`` holds exactly the parts of ``layout``, each of
    its shape and dtype (``what`` names the tensor in the message)."""
    if set(parts) != set(layout):
        raise KvqrsError(f"{what}: parts {sorted(parts)}, the layout has {sorted(layout)}")
    for name, part in layout.items():
        a = np.asarray(parts[name])
        if a.shape != part.shape or not _dtype_ok(a, part.dtype):
            raise KvqrsError(f"{what}: part {name!r} should be {part.shape} of dtype {part.dtype}, got {a.shape} {a.dtype}")


def flat(x: Any, arg: str, part: Part) -> np.ndarray:
    """``x`` checked against ``part`` (dtype and exact shape), as a flat C-contiguous array (what
    the native kernels borrow)."""
    a = as_array(x, arg)
    if part.dtype == "uint8" and a.dtype != np.uint8:
        raise KvqrsError(f"{arg}: expected uint8 packed codes, got dtype {a.dtype}")
    if part.dtype == "scalar" and a.dtype not in (np.float16, np.float32):
        raise KvqrsError(f"{arg}: expected float16 or float32 stored scalars, got dtype {a.dtype}")
    if part.dtype == "float32":
        a = as_float_rows(a, arg)[0].reshape(a.shape) if a.ndim else a
    if a.shape != part.shape:
        raise KvqrsError(f"{arg}: expected shape {part.shape}, got {a.shape}")
    return np.ascontiguousarray(a).reshape(-1)


def _aligned(layout: Layout, tokens: int) -> list[str]:
    """Parts that cannot be cut after ``tokens`` tokens."""
    return [f"{k} whole groups of {p.align} tokens" for k, p in layout.items() if tokens % p.align]


def concat(chunks: list[Mapping[str, Any]], tokens: list[int], layout: Layout) -> dict[str, np.ndarray]:
    """The parts of consecutive chunks of tokens joined along each part's token axis;
    ``layout`` is the joined tensor's. Every chunk but the last must end where each part can be
    cut (:attr:`Part.align`)."""
    for n in tokens[:-1]:
        bad = _aligned(layout, n)
        if bad:
            raise KvqrsError(f"encoded: chunks of {tokens} tokens cannot be joined: every chunk but the last must hold {', '.join(bad)}")
    out = {k: np.concatenate([np.asarray(c[k]) for c in chunks], axis=p.token_axis) for k, p in layout.items()}
    check_parts(out, layout, "encoded")
    return out


def take(parts: Mapping[str, Any], layouts: tuple[Layout, Layout], span: tuple[int, int], to_end: bool = False) -> dict[str, np.ndarray]:
    """The parts of tokens ``start .. n - 1`` (``span``), given the layouts of ``start`` and of
    ``n`` tokens. Raises unless every part can be cut after ``start`` tokens, and after ``n``
    unless ``to_end`` (``n`` is the last token held)."""
    (at_start, at_n), (start, n) = layouts, span
    for m, name, layout in ((start, "start", at_start), (n, "n", at_n)):
        bad = [] if name == "n" and to_end else _aligned(layout, m)
        if bad:
            raise KvqrsError(f"{name}: cannot cut after {m} tokens: a prefix must hold {', '.join(bad)}")
    out = {}
    for k, p in at_n.items():
        a = np.asarray(parts[k])
        out[k] = np.take(a, np.arange(at_start[k].shape[p.token_axis], p.shape[p.token_axis]), axis=p.token_axis)
    return out
