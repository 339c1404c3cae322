"""Fused decode attention over a compressed KV cache (docs/kernels.md section 11).

For one or a few query rows per KV head, :func:`decode_attention` computes
``softmax(scale * (q . k_hat_j + side_j)) @ v_hat`` straight from the stored codes: the query is
rotated once and turned into a lookup table over the packed codes (MSE keys: centroids times the
rotated query; the QJL residual of ``qkqv`` keys: the sign sketch of the rotated query, Zandieh
et al. 2024; KIVI keys: per-channel scales and zero points times the query; HeadQ: the side code
times ``U^T q``), the softmax is taken in a stable way, and the values are accumulated from their
codes in the code domain and un-rotated once. Keys and values are never reconstructed.

Describe each side of the cache with :class:`MSERows`, :class:`UniformRows`,
:class:`DenseRows`, :class:`ChannelRunRows` (per-channel runs in a calibrated basis, the
``matched`` scheme) or :class:`TokenRunRows` (per-token runs in a basis with one scale per
token, the fixed-size ``matched`` keys), optionally around a per-head mean (:class:`CentredRows`; the scheme coders
of :mod:`kvqrs.schemes` build them from an ``Encoded``), and HeadQ's side code with
:class:`SideRows`; each declares its stored layout
(``layout(lead, T, head_dim)``, the row formats of :mod:`kvqrs.layout` that the scheme coders
compose), against which the arrays are checked before the native kernel borrows them. The
float64 reference is :func:`kvqrs.oracle.decode_attention`, which takes the ``spec()`` dicts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Union

import numpy as np

from .. import _native
from .. import layout as lay
from .._arrays import KvqrsError, as_array, as_float_rows, check_bits, check_positive_int, check_seed
from .hadamard import padded_dim
from .log_scalars import LogScalars


class QJLRows(NamedTuple):
    """The QJL sketch of the rotated residual after an MSE stage (m = d').

    Attributes:
        signs: uint8 ``(..., T, ceil(d'/8))`` packed sign bits.
        norms: float16/float32 ``(..., T)`` stored ``||r||``.
        seed: the sketch seed.
    """

    signs: np.ndarray
    norms: np.ndarray
    seed: int


class MSERows(NamedTuple):
    """Norm-and-direction codes of ``T`` vectors per head (docs/kernels.md section 5).

    Attributes:
        codes: uint8 ``(..., T, packed_size(code_dim, bits))`` packed codes (``code_dim = d'``
            with a rotation, ``head_dim`` without).
        norms: float16/float32 ``(..., T)``, or :class:`~kvqrs.kernels.log_scalars.LogScalars`
            (8-bit log codes ``(..., T)`` with exponent bytes ``(..., ceil(T / group))``,
            docs/kernels.md section 13).
        bits: bits of the MSE stage (1..8).
        seed: rotation seed, or None (the ``kv`` scheme).
        qjl: optional :class:`QJLRows` of the rotated residual (``qkqv`` keys, ``kqv`` values).
    """

    codes: np.ndarray
    norms: np.ndarray | LogScalars
    bits: int
    seed: int | None
    qjl: QJLRows | None = None

    def layout(self, lead: tuple[int, ...], t: int, d: int) -> lay.Layout:
        """Stored parts for ``T`` tokens of ``head_dim`` d (after checking bits and seeds)."""
        b = check_bits(self.bits, "bits")
        seed = check_seed(self.seed, "seed")
        cd = d if seed is None else padded_dim(d)
        parts = lay.mse(lead, t, cd, b)
        if isinstance(self.norms, LogScalars):
            parts.update(lay.log_norms(lead, t, check_positive_int(self.norms.group, "norms.group")))
        if self.qjl is not None:
            if seed is None:
                raise KvqrsError("qjl: a QJL residual follows a rotated MSE stage; seed is None")
            check_seed(self.qjl.seed, "qjl.seed", optional=False)
            parts.update(lay.prefixed("qjl.", lay.qjl(lead, t, cd)))
        return parts

    def spec(self) -> dict[str, Any]:
        norms = self.norms
        if isinstance(norms, LogScalars):
            from .. import oracle

            norms = oracle.log_decode(norms.codes, norms.exps, norms.group)
        d: dict[str, Any] = {"kind": "mse", "codes": self.codes, "norms": norms, "bits": self.bits, "seed": self.seed}
        if self.qjl is not None:
            d.update(qjl_signs=self.qjl.signs, qjl_norms=self.qjl.norms, qjl_seed=self.qjl.seed)
        return d


class UniformRows(NamedTuple):
    """Asymmetric uniform groups (docs/kernels.md section 9).

    Attributes:
        codes: uint8 packed codes: per token ``(..., T, packed_size(n, bits))`` with ``n`` the
            (rotated) head dimension, or per channel ``(..., head_dim, packed_size(T, bits))``.
        scales, zeros: float16/float32 ``(..., T, ceil(n / group))`` per token or
            ``(..., head_dim, ceil(T / group))`` per channel.
        bits: 1..8.
        group: values per group.
        per_channel: True for KIVI keys (groups of tokens per channel).
        seed: rotation seed (the ``block`` scheme) or None; per-token rows only.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    group: int
    per_channel: bool = False
    seed: int | None = None

    def layout(self, lead: tuple[int, ...], t: int, d: int) -> lay.Layout:
        """Stored parts for ``T`` tokens of ``head_dim`` d (after checking bits, group, seed)."""
        b = check_bits(self.bits, "bits")
        g = check_positive_int(self.group, "group")
        seed = check_seed(self.seed, "seed")
        if self.per_channel:
            if seed is not None:
                raise KvqrsError("seed: per-channel uniform rows (KIVI keys) have no rotation")
            return lay.uniform_channels(lead, t, d, b, g)
        return lay.uniform_tokens(lead, t, d if seed is None else padded_dim(d), b, g)

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "uniform_channels" if self.per_channel else "uniform_tokens",
            "codes": self.codes,
            "scales": self.scales,
            "zeros": self.zeros,
            "bits": self.bits,
            "group": self.group,
            "seed": self.seed,
        }


class DenseRows(NamedTuple):
    """Full-precision rows ``(..., T, head_dim)`` (e.g. values kept unquantized)."""

    values: np.ndarray

    def layout(self, lead: tuple[int, ...], t: int, d: int) -> lay.Layout:
        """``values``: float32 ``(..., T, d)``."""
        return lay.dense(lead, t, d)

    def spec(self) -> dict[str, Any]:
        return {"kind": "dense", "values": self.values}


def _run_widths(runs: Any, cls: type, d: int) -> list[tuple[int, int]]:
    """``(stop - start, bits)`` of each run (``cls``) of columns of head_dim ``d``, after
    checking that they are of ``cls``, in increasing order, disjoint, within ``d``, with bits
    1..8 (errors name ``runs[i]``)."""
    out = []
    nxt = 0
    for i, run in enumerate(runs):
        if not isinstance(run, cls):
            raise KvqrsError(f"runs[{i}]: expected a {cls.__name__}, got {type(run).__name__}")
        lo, hi = check_positive_int(run.start, f"runs[{i}].start", minimum=0), check_positive_int(run.stop, f"runs[{i}].stop")
        if lo < nxt or hi <= lo or hi > d:
            raise KvqrsError(
                f"runs[{i}]: expected columns {nxt} <= start < stop <= {d} (runs in increasing order, disjoint), got {lo}..{hi}"
            )
        nxt = hi
        out.append((hi - lo, check_bits(run.bits, f"runs[{i}].bits")))
    return out


class ChannelRun(NamedTuple):
    """One run of basis columns ``start .. stop - 1`` coded at ``bits`` bits per channel along
    tokens (the per-channel KIVI layout, ``stop - start`` channels).

    Attributes:
        codes: uint8 ``(..., stop - start, packed_size(T, bits))``.
        scales, zeros: float16/float32 ``(..., stop - start, ceil(T / group))``.
        bits: 1..8.
        start, stop: the run's columns of the basis.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    bits: int
    start: int
    stop: int


class ChannelRunRows(NamedTuple):
    """Coordinates ``y = x U`` in an orthonormal basis, coded per channel along tokens in runs of
    columns of equal width (the ``matched`` scheme); columns in no run store nothing and decode
    to 0. Decodes to ``x_hat = y_hat U^T``.

    Attributes:
        runs: the :class:`ChannelRun` s, columns in increasing order, disjoint.
        group: tokens per scale group (every run).
        basis: float32 ``(d, d)``, or ``(B, d, d)`` with ``B`` the last leading axis (flattened
            head i uses basis ``i % B``); ``basis[..., i, c]`` is input coordinate i of column c.
        tokens: ``T`` (per-channel codes do not show it).
    """

    runs: tuple[ChannelRun, ...]
    group: int
    basis: np.ndarray
    tokens: int

    def layout(self, lead: tuple[int, ...], t: int, d: int) -> lay.Layout:
        """Parts ``runs[i].codes`` / ``.scales`` / ``.zeros`` of each run (after checking the
        runs, bits and group)."""
        g = check_positive_int(self.group, "group")
        parts: lay.Layout = {}
        for i, (w, b) in enumerate(_run_widths(self.runs, ChannelRun, d)):
            parts.update(lay.prefixed(f"runs[{i}].", lay.uniform_channels(lead, t, w, b, g)))
        return parts

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "channel_runs",
            "runs": [dict(r._asdict()) for r in self.runs],
            "group": self.group,
            "basis": np.asarray(self.basis),
            "tokens": self.tokens,
        }


class TokenRun(NamedTuple):
    """One run of basis columns ``start .. stop - 1`` coded per token at ``bits`` bits
    (symmetric levels, see :class:`TokenRunRows`).

    Attributes:
        codes: uint8 ``(..., T, packed_size(stop - start, bits))``: each token's codes of the
            run packed little-endian (code i at bits ``i * bits .. i * bits + bits - 1``).
        bits: 1..8.
        start, stop: the run's columns of the basis.
    """

    codes: np.ndarray
    bits: int
    start: int
    stop: int


class TokenRunRows(NamedTuple):
    """Coordinates ``z`` in a basis ``B`` (not necessarily orthonormal: ``U diag(sigma)`` with
    per-column scales folded in), each token coded symmetrically in runs of columns with one
    scale per token (the fixed-size ``matched`` keys). Token t decodes to ``x_hat = z_hat B^T``
    with ``z_hat_i = level(bits, code_i) * scales_t``, ``level(b, c) = (2c - L) / L``,
    ``L = 2^b - 1``, and ``z_hat_i = 0`` in the columns of no run. A key layout: the kernel
    scores ``(q B) . z_hat`` (the query projected once per row); refused as values.

    Attributes:
        runs: the :class:`TokenRun` s, columns in increasing order, disjoint.
        scales: float16/float32 ``(..., T)``, finite and not negative.
        basis: float32 ``(d, d)``, or ``(B, d, d)`` with ``B`` the last leading axis (flattened
            head i uses basis ``i % B``); ``basis[..., i, c]`` is input coordinate i of column c.
    """

    runs: tuple[TokenRun, ...]
    scales: np.ndarray
    basis: np.ndarray

    def layout(self, lead: tuple[int, ...], t: int, d: int) -> lay.Layout:
        """Parts ``runs[i].codes`` of each run and ``scales`` (after checking the runs and
        bits)."""
        return lay.token_runs(lead, t, _run_widths(self.runs, TokenRun, d))

    def spec(self) -> dict[str, Any]:
        return {
            "kind": "token_runs",
            "runs": [dict(r._asdict()) for r in self.runs],
            "scales": self.scales,
            "basis": np.asarray(self.basis),
        }


class CentredRows(NamedTuple):
    """Rows around a per-head mean: ``x_hat = rows_hat + mean``.

    As values the mean is added once to the output (the probabilities sum to one). As keys
    ``q . mean`` is the same for every token of a query row, so the kernel leaves it out of the
    logits (the softmax does not see it) and adds it to the log-sum-exp only, which keeps
    ``lse`` the log-sum-exp of the true logits for merging with another softmax part.

    Attributes:
        rows: :class:`MSERows`, :class:`UniformRows`, :class:`DenseRows`,
            :class:`ChannelRunRows` or :class:`TokenRunRows` (keys only).
        mean: float32 ``(d,)``, or ``(B, d)`` with ``B`` the last leading axis (flattened head
            i uses mean ``i % B``).
    """

    rows: Any
    mean: np.ndarray

    def spec(self) -> dict[str, Any]:
        return {"kind": "centred", "rows": self.rows.spec(), "mean": np.asarray(self.mean)}


class SideRows(NamedTuple):
    """HeadQ side code of the keys (docs/kernels.md section 7).

    Attributes:
        codes: uint8 ``(..., T, packed_size(rank, bits))`` packed side codes.
        scales: float16/float32 ``(..., T)``.
        basis: float32 ``(head_dim, rank)``, or ``(B, head_dim, rank)`` with ``B`` the last
            leading axis (one basis per KV head; flattened head i uses basis ``i % B``).
        bits: side bits q.
        sign: +1, or -1 (wrong-sign control).
    """

    codes: np.ndarray
    scales: np.ndarray
    basis: np.ndarray
    bits: int
    sign: int = 1

    def spec(self) -> dict[str, Any]:
        b = np.asarray(self.basis)
        return {
            "codes": self.codes,
            "scales": self.scales,
            "basis": b,
            "bits": self.bits,
            "sign": self.sign,
            "rank": int(b.shape[-1]) if b.ndim else 0,
            "basis_heads": 1 if b.ndim == 2 else int(b.shape[0]) if b.ndim == 3 else 0,
        }


class AttentionResult(NamedTuple):
    """Output of :func:`decode_attention`.

    Attributes:
        out: float32 ``(..., rows, head_dim)``.
        lse: float32 ``(..., rows)``: ``log sum_j exp(logit_j)``, to merge with another softmax
            part exactly (``out = sum_k exp(lse_k - lse) out_k`` with ``lse = logaddexp(lse_k)``).
        probs: float32 ``(..., rows, T)`` when asked for, else None.
    """

    out: np.ndarray
    lse: np.ndarray
    probs: np.ndarray | None


Rows = Union[MSERows, UniformRows, DenseRows, ChannelRunRows, TokenRunRows, CentredRows]

_ROW_CLASSES = "MSERows, UniformRows, DenseRows, ChannelRunRows, TokenRunRows or CentredRows"


def _tokens(rows: Rows, arg: str, lead: tuple[int, ...]) -> int:
    """Number of cached tokens of per-token ``rows`` (after a leading-shape check)."""
    if isinstance(rows, CentredRows):
        return _tokens(rows.rows, f"{arg}.rows", lead)
    if isinstance(rows, ChannelRunRows):
        return check_positive_int(rows.tokens, f"{arg}.tokens", minimum=0)
    if isinstance(rows, MSERows):
        a = as_array(rows.norms.codes if isinstance(rows.norms, LogScalars) else rows.norms, f"{arg}.norms")
    elif isinstance(rows, TokenRunRows):
        a = as_array(rows.scales, f"{arg}.scales")
    elif isinstance(rows, UniformRows):
        a = as_array(rows.scales, f"{arg}.scales")
        a = a[..., 0] if a.ndim else a
    elif isinstance(rows, DenseRows):
        a = as_array(rows.values, f"{arg}.values")
        a = a[..., 0] if a.ndim else a
    else:
        raise KvqrsError(f"{arg}: expected {_ROW_CLASSES}, got {type(rows).__name__}")
    if a.ndim != len(lead) + 1 or a.shape[:-1] != lead:
        raise KvqrsError(f"{arg}: expected leading shape {lead} (the queries') then tokens, got {a.shape}")
    return a.shape[-1]


class _FlatRuns(NamedTuple):
    """:class:`ChannelRunRows` checked and flattened, with the basis count."""

    runs: list[ChannelRun]
    group: int
    basis: np.ndarray
    basis_heads: int


class _FlatTokenRuns(NamedTuple):
    """:class:`TokenRunRows` checked and flattened, with the basis count."""

    runs: list[TokenRun]
    scales: Any
    basis: np.ndarray
    basis_heads: int


class _FlatCentred(NamedTuple):
    """:class:`CentredRows` checked and flattened, with the mean count."""

    rows: Any
    mean: np.ndarray
    mean_heads: int


def per_head_table(x: Any, arg: str, lead: tuple[int, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """A per-head table (``shape``, or ``(B, *shape)`` with ``B`` the last leading axis
    ``lead[-1]``) as a flat finite float32 array and ``B`` (1 for one table): how the fused
    kernel and the native decode step take a ``matched`` basis or mean.

    Raises:
        KvqrsError: another shape, or a non-finite entry (named ``arg``).
    """
    a = as_array(x, arg)
    heads = lead[-1] if lead else 1
    if a.shape == shape:
        count = 1
    elif a.shape == (heads, *shape):
        count = heads
    else:
        raise KvqrsError(f"{arg}: expected shape {shape} or ({heads} kv_heads, {', '.join(map(str, shape))}), got {a.shape}")
    return as_float_rows(a.reshape(-1, shape[-1]), arg)[0].reshape(-1), count


NATIVE_ROWS = (MSERows, UniformRows, DenseRows, ChannelRunRows, TokenRunRows)
"""The row classes the native binding reads (``rust/py/src/rows.rs``), alone or in one
:class:`CentredRows`."""


def reads_natively(rows: Any) -> bool:
    """Whether the native binding has a row type for ``rows``: one of :data:`NATIVE_ROWS`, alone
    or in a :class:`CentredRows`. Decided from the classes alone (the fields are checked when
    the rows are bound, :func:`binding_rows`)."""
    return isinstance(rows.rows if isinstance(rows, CentredRows) else rows, NATIVE_ROWS)


def _base(rows: Rows, arg: str) -> Any:
    """The rows of ``rows`` without a mean (raising for rows the kernel does not read)."""
    inner = rows.rows if isinstance(rows, CentredRows) else rows
    if isinstance(inner, CentredRows):
        raise KvqrsError(f"{arg}.rows: expected rows around one mean, got CentredRows in CentredRows")
    if not isinstance(inner, NATIVE_ROWS):
        raise KvqrsError(f"{arg}: expected {_ROW_CLASSES}, got {type(inner).__name__}")
    return inner


def map_parts(rows: Any, part: Callable[[Any, str], Any], arg: str = "rows") -> Any:
    """``rows`` (any row class of this module, :class:`SideRows` included) with each stored part
    replaced by ``part(x, name)``, ``name`` its part in the rows' layout (``codes``,
    ``qjl.signs``, ``norm_exps``, ``runs[1].scales``): the same classes, a basis or mean as it
    is. :func:`binding_rows` builds on it; over rows of :meth:`~kvqrs.schemes.Encoded.named`
    parts, ``part`` resolves the names (:func:`by_name`).

    Raises:
        KvqrsError: an unknown row class or nested ``CentredRows`` (named ``arg``), or what
            ``part`` raises.
    """
    if isinstance(rows, SideRows):
        return rows._replace(codes=part(rows.codes, "codes"), scales=part(rows.scales, "scales"))
    inner = _base(rows, arg)
    if isinstance(rows, CentredRows):
        return rows._replace(rows=map_parts(inner, part, arg))
    if isinstance(rows, ChannelRunRows):
        runs = tuple(
            run._replace(**{k: part(getattr(run, k), f"runs[{i}].{k}") for k in ("codes", "scales", "zeros")})
            for i, run in enumerate(rows.runs)
        )
        return rows._replace(runs=runs)
    if isinstance(rows, TokenRunRows):
        truns = tuple(run._replace(codes=part(run.codes, f"runs[{i}].codes")) for i, run in enumerate(rows.runs))
        return rows._replace(runs=truns, scales=part(rows.scales, "scales"))
    if isinstance(rows, MSERows):
        q = rows.qjl
        qjl = None if q is None else q._replace(signs=part(q.signs, "qjl.signs"), norms=part(q.norms, "qjl.norms"))
        n = rows.norms
        norms = (
            LogScalars(part(n.codes, "norms"), part(n.exps, "norm_exps"), int(n.group)) if isinstance(n, LogScalars) else part(n, "norms")
        )
        return rows._replace(codes=part(rows.codes, "codes"), norms=norms, qjl=qjl)
    if isinstance(rows, UniformRows):
        return rows._replace(**{k: part(getattr(rows, k), k) for k in ("codes", "scales", "zeros")})
    return DenseRows(part(rows.values, "values"))


def by_name(parts: Mapping[str, Any], arg: str, to: Callable[[str], Any]) -> Callable[[Any, str], Any]:
    """The ``part`` callback of :func:`binding_rows`, :func:`binding_side` and
    :func:`map_parts` for rows that a coder's ``attention_rows`` built from an ``Encoded`` of
    :class:`~kvqrs.layout.PartRef` s (:meth:`~kvqrs.schemes.Encoded.named`): each ref replaced
    by ``to(ref.name)`` (the layer store's part name, a place in a page, an array).

    The callback raises :class:`KvqrsError` naming the field (``arg.field``) for anything else:
    an array or other object in a part's place (the coder put something there that is not one
    of its parts), or a ref whose name is not in ``parts``."""

    def part(x: Any, field: str) -> Any:
        if not isinstance(x, lay.PartRef):
            raise KvqrsError(
                f"{arg}.{field}: expected a stored part (a PartRef of the Encoded given to attention_rows), got "
                f"{type(x).__name__}; attention_rows must place the Encoded's parts in its rows as they are"
            )
        if x.name not in parts:
            raise KvqrsError(f"{arg}.{field}: reads part {x.name!r}, which is not among the parts held ({', '.join(parts)})")
        return to(x.name)

    return part


def binding_rows(rows: Rows, arg: str, lead: tuple[int, ...], d: int, part: Callable[[Any, str], Any]) -> Any:
    """``rows`` as the native binding reads them (the typed objects of ``rust/py/src/rows.rs``):
    each stored part replaced by ``part(x, name)`` as :func:`map_parts` does: the fused kernel
    passes the checked flat array, the layer store the part's name in the store, the paged
    cache the part's place in a page (both resolve the names of
    :class:`~kvqrs.layout.PartRef` s, :func:`by_name`). A ``ChannelRunRows`` basis and a
    ``CentredRows`` mean go flat float32 with their per-head count (``lead``: the leading
    shape, ``d``: head_dim); a ``TokenRunRows`` basis likewise.

    Raises:
        KvqrsError: an unknown row class, nested ``CentredRows``, a basis or mean of another
            shape or not finite, or what ``part`` raises.
    """
    inner = _base(rows, arg)
    if isinstance(rows, CentredRows):
        mean, count = per_head_table(rows.mean, f"{arg}.mean", lead, (d,))
        return _FlatCentred(binding_rows(inner, arg, lead, d, part), mean, count)
    if isinstance(rows, ChannelRunRows):
        basis, count = per_head_table(rows.basis, f"{arg}.basis", lead, (d, d))
        return _FlatRuns(list(map_parts(rows, part, arg).runs), int(rows.group), basis, count)
    if isinstance(rows, TokenRunRows):
        basis, count = per_head_table(rows.basis, f"{arg}.basis", lead, (d, d))
        mapped = map_parts(rows, part, arg)
        return _FlatTokenRuns(list(mapped.runs), mapped.scales, basis, count)
    return map_parts(rows, part, arg)


def _flat_rows(rows: Rows, arg: str, lead: tuple[int, ...], t: int, d: int) -> Any:
    """``rows`` with every array checked against its declared layout and flattened (what the
    native kernel borrows; it reads the fields by name)."""
    inner = _base(rows, arg)
    try:
        parts = inner.layout(lead, t, d)
    except KvqrsError as e:
        raise KvqrsError(f"{arg}.{e}") from None
    return binding_rows(rows, arg, lead, d, lambda a, name: lay.flat(a, f"{arg}.{name}", parts[name]))


class _FlatSide(NamedTuple):
    """:class:`SideRows` checked and flattened, with the basis count and rank."""

    codes: np.ndarray
    scales: np.ndarray
    basis: np.ndarray
    bits: int
    sign: float
    rank: int
    basis_heads: int


def binding_side(side: SideRows, lead: tuple[int, ...], d: int, part: Callable[[Any, str], Any]) -> _FlatSide:
    """HeadQ's ``side`` as the native binding reads it (as :func:`binding_rows`): ``codes`` and
    ``scales`` replaced by ``part(x, name)`` (:func:`map_parts`), the basis flat float32 with
    its rank and count.

    Raises:
        KvqrsError: not :class:`SideRows`, a basis other than ``(d, rank)`` or ``(kv_heads, d,
            rank)``, bad bits, or what ``part`` raises.
    """
    if not isinstance(side, SideRows):
        raise KvqrsError(f"side: expected SideRows, got {type(side).__name__}")
    basis = np.asarray(side.basis, dtype=np.float32)
    if basis.ndim not in (2, 3) or basis.shape[-2] != d or (basis.ndim == 3 and (not lead or lead[-1] != basis.shape[0])):
        raise KvqrsError(
            f"side.basis: expected (head_dim={d}, rank) or (kv_heads={lead[-1] if lead else 1}, {d}, rank), got shape {basis.shape}"
        )
    bits = check_bits(side.bits, "side.bits")
    heads = 1 if basis.ndim == 2 else basis.shape[0]
    flat = np.ascontiguousarray(basis).reshape(-1)
    parts = map_parts(side, part)
    return _FlatSide(parts.codes, parts.scales, flat, bits, float(side.sign), basis.shape[-1], heads)


def decode_attention(
    q: Any,
    keys: Rows,
    values: Rows,
    side: SideRows | None = None,
    scale: float | None = None,
    probs: bool = False,
) -> AttentionResult:
    """Attention of a few query rows over a coded cache, computed from the codes.

    ``out[..., r, :] = sum_j p_rj v_hat_j`` with ``p_r = softmax_j(scale * (q_r . k_hat_j +
    side_j))`` and ``side_j = sign * (U^T q_r) . z_j`` (HeadQ, docs/kernels.md section 7); ``k_hat``, ``v_hat``
    the decodes of docs/kernels.md sections 5, 6 and 9 (the QJL residual enters the logits
    through its inner-product estimator, Zandieh et al. 2024, Lemma 3.2). :class:`ChannelRunRows`
    keys are scored as ``(q U) . y_hat`` and :class:`TokenRunRows` keys as ``s_t (q B) . z_hat``
    (the query projected once per row); the key mean of
    :class:`CentredRows` enters ``lse`` only (``scale * q . mean``: the same for every token, so
    ``probs`` and ``out`` do not depend on it); a value mean is added once to ``out``. The rows
    of one leading index (e.g. the query heads of a GQA group times the query tokens) share one
    pass over that index's codes.

    Args:
        q: float ``(..., rows, head_dim)``; the leading shape is the keys' (one KV head each).
        keys: :class:`MSERows`, :class:`UniformRows` (per token or per channel),
            :class:`DenseRows`, :class:`ChannelRunRows` or :class:`TokenRunRows`, each optionally in
            :class:`CentredRows`, with leading shape ``(...)`` and ``T`` tokens.
        values: the same but per-channel :class:`UniformRows` and :class:`TokenRunRows`.
        side: optional :class:`SideRows` of the keys.
        scale: logit scale, default ``1 / sqrt(head_dim)``.
        probs: also return the probabilities.

    Returns:
        :class:`AttentionResult` (float32; the accumulations run in float64, the per-key
        scores in float32); empty arrays for no query rows or heads.

    Raises:
        KvqrsError: shapes that do not match (naming e.g. ``keys.codes`` or
            ``keys.runs[1].scales``), no tokens, bad bits, seeds, groups, a per-channel value
            layout, invalid stored scalars, a bad HeadQ basis, runs out of order or beyond
            ``head_dim``, a basis or mean of the wrong shape or not finite, non-finite queries,
            values or logits (named by row and position; ``scale * q . mean`` too).
    """
    flat, lead, d, _ = as_float_rows(q, "q", min_dim=2)
    if len(lead) < 1:
        raise KvqrsError(f"q: expected shape (..., rows, head_dim), got {np.shape(q)}")
    lead, rows = lead[:-1], lead[-1]
    vin = values.rows if isinstance(values, CentredRows) else values
    if isinstance(vin, UniformRows) and vin.per_channel:
        raise KvqrsError("values: expected per-token values; per-channel uniform groups are a key layout (KIVI keys)")
    if isinstance(vin, TokenRunRows):
        raise KvqrsError("values: expected value rows; TokenRunRows (per-token runs in a basis) are a key layout")
    t = _tokens(values, "values", lead)
    if t == 0:
        raise KvqrsError("values: expected at least one token to attend to, got 0")
    inner = keys.rows if isinstance(keys, CentredRows) else keys
    if not (isinstance(inner, UniformRows) and inner.per_channel):
        tk = _tokens(keys, "keys", lead)
        if tk != t:
            raise KvqrsError(f"keys: expected the values' {t} tokens, got {tk}")
    krows = _flat_rows(keys, "keys", lead, t, d)
    vrows = _flat_rows(values, "values", lead, t, d)
    srows = None
    if side is not None:
        srows = binding_side(side, lead, d, lambda a, name: a)
        parts = lay.side(lead, t, srows.rank, srows.bits)
        srows = srows._replace(
            codes=lay.flat(side.codes, "side.codes", parts["codes"]), scales=lay.flat(side.scales, "side.scales", parts["scales"])
        )
    sc = 1.0 / math.sqrt(d) if scale is None else _scale(scale)
    heads = int(np.prod(lead)) if lead else 1
    if rows == 0 or heads == 0:  # no query rows (or heads): nothing to attend, nothing to call
        out, lse, p = np.zeros(0, np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32)
    else:
        out, lse, p = _native.decode_attention(flat, krows, vrows, srows, heads, rows, t, d, sc, bool(probs))
    return AttentionResult(
        out.reshape(*lead, rows, d),
        lse.reshape(*lead, rows),
        p.reshape(*lead, rows, t) if probs else None,
    )


def _scale(scale: Any) -> float:
    """The logit scale as a float (the kernel checks that it is finite and positive)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise KvqrsError(f"scale: expected a finite positive number, got {scale!r}")
    return float(scale)
