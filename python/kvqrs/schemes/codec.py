"""``KVCodec``: one object that encodes keys and values with a named scheme (docs/schemes.md) and
computes attention logits and outputs from the encoded cache."""

from __future__ import annotations

import dataclasses
from math import lcm
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import layout as lay
from .._arrays import (
    KvqrsError,
    as_float_rows,
    check_bits,
    check_finite_output,
    check_positive_int,
    check_seed,
    first_nonfinite,
    is_tensor,
    numpy_to_torch,
)
from ..kernels.attention import AttentionResult, DenseRows, decode_attention
from ..kernels.headq import headq_basis
from ..kernels.rng import random_orthonormal_basis
from .backend import get_backend
from .base import Coder, Encoded, as_float_array, concat_tokens, name_nonfinite, slice_rows
from .matched import MatchedCalibration
from .registry import _RANDOM_BASIS, REGISTRY, CoderSettings, build_coder, check_value_stage, derive_seed, names

__all__ = [
    "HEADQ_BASES",
    "KEY_SCHEMES",
    "LOG_NORM_VALUE_SCHEMES",
    "MSE_VALUE_SCHEMES",
    "SCHEMES",
    "VALUE_SCHEMES",
    "KVCodec",
    "check_value_stage",
    "derive_seed",
]


if TYPE_CHECKING:
    from .._arrays import Array


# The registry's name lists, derived from it when read (``SCHEMES``: the key schemes).
HEADQ_BASES: tuple[str, ...]
KEY_SCHEMES: tuple[str, ...]
LOG_NORM_VALUE_SCHEMES: tuple[str, ...]
MSE_VALUE_SCHEMES: tuple[str, ...]
SCHEMES: tuple[str, ...]
VALUE_SCHEMES: tuple[str, ...]


def __getattr__(name: str) -> tuple[str, ...]:
    if name in ("HEADQ_BASES", "KEY_SCHEMES", "LOG_NORM_VALUE_SCHEMES", "MSE_VALUE_SCHEMES", "SCHEMES", "VALUE_SCHEMES"):
        return names("KEY_SCHEMES" if name == "SCHEMES" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _with_source(enc: Encoded, x: Any, seed: int) -> Encoded:
    """``enc`` marked with the codec's seed and, when ``x`` is a tensor, its torch device
    (decodes return a tensor there)."""
    return dataclasses.replace(enc, device=str(x.device) if is_tensor(x) else None, seed=seed)


def _like_source(out: np.ndarray, enc: Encoded) -> Any:
    """A decoded array as the caller gave the source: a tensor on ``enc.device`` (in the
    encoded dtype) when it was a tensor, else the array itself."""
    if enc.device is None:
        return out
    import torch

    return numpy_to_torch(out, torch.empty(0, device=enc.device))


def _like_query(out: Any, q: Any) -> Any:
    """Results of a query-driven method as tensors on ``q``'s device when ``q`` is a tensor
    (in the dtypes the NumPy path returns), else unchanged."""
    if not is_tensor(q) or out is None:
        return out
    if isinstance(out, np.ndarray):
        return numpy_to_torch(out, q)
    items = [_like_query(o, q) for o in out]
    return type(out)(*items) if hasattr(out, "_fields") else tuple(items)


def _as_dtype(x: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``x`` in the encoded dtype; a decode beyond its range (float16 inputs near 65504 decode
    a little past it) raises instead of becoming inf."""
    if x.dtype == dtype:
        return x
    with np.errstate(over="ignore"):
        out = x.astype(dtype)
    if not np.isfinite(out).all():
        pos = tuple(int(i) for i in np.argwhere(~np.isfinite(out))[0])
        raise KvqrsError(
            f"{what}: decoded value {x[pos]:.6g} at index {pos} does not fit the encoded dtype "
            f"{np.dtype(dtype).name}; encode a float32 copy to decode in float32"
        )
    return out


class KVCodec:
    """Encode keys and values of one attention layer with a scheme of docs/schemes.md.

    Args:
        scheme: ``kv``, ``kqv``, ``qkqv``, ``kivi``, ``block`` (rotation + llama.cpp-style
            asymmetric blocks of 32) or ``headq`` (keys; values follow the same
            scheme unless ``value_scheme`` is given; ``headq`` values default to ``kivi``).
        bits: key bit budget n per coordinate (1..8; >= 2 where a QJL residual takes 1 bit).
        head_dim: d.
        seed: integer in ``[0, 2**64)``; all rotations, sketches and random bases derive from it.
        value_bits: value budget (default ``bits``).
        value_scheme: ``kv``, ``kqv``, ``qkqv``, ``kivi``, ``block``, ``a2``, or ``none`` (values
            kept in full precision: key-only quantization).
        group: KIVI group size (tokens for keys, channels for values), default 32.
        headq_base: base key scheme for ``headq`` (``kivi`` by default, or ``kqv``/``kv``).
        rank: HeadQ side-code rank r (default 4).
        side_bits: HeadQ side-code bits q (default 4).
        basis: HeadQ basis ``(d, r)`` or ``(kv_heads, d, r)``; ``"random"`` for the seeded
            random-basis control; None until :meth:`calibrate` is called.
        sign: +1, or -1 for HeadQ's wrong-sign control.
        value_scale: what each value token's MSE stage stores: ``"norm"`` (``||v||``, default),
            ``"least_squares"`` (the least-squares scale of the decoded direction,
            :func:`kvqrs.mse_encode`: the same bits and decode, a smaller error) or
            ``"preserve_norm"`` (``||v|| / ||r||``: each decoded value keeps its norm); for the value
            schemes with an MSE stage (``kv``, ``kqv``, ``qkqv``, ``matched`` without
            transform-coded values), an error for the others.
        value_norms: how that per-token scale is stored: ``"float"`` (float16, or float32
            outside its range; default) or ``"log8"`` (8 bits on a 1/16-octave grid with an
            exponent byte per ``group`` tokens, docs/kernels.md section 13: 8 bits per token
            instead of 16, at most 2.2% relative error); for ``kv`` and ``matched`` values
            (not transform-coded), an error for the others. Chunks of tokens join at whole
            groups.
        calibration: for ``matched`` keys or values, the layer's
            :class:`~kvqrs.schemes.matched.MatchedCalibration` (key transform and widths, value
            mean); ``bits`` is then the value budget's width and the key widths come from the
            calibration.
        backend: where the kernels run: ``"cpu"`` (the Rust path, default), ``"wgpu"`` (the WGSL
            shaders of :mod:`kvqrs.gpu` on the default adapter), a ``kvqrs.gpu.Device`` or a
            ``wgpu.GPUAdapter``, or a :class:`~kvqrs.schemes.backend.Backend`. The encoded
            format does not depend on it: either backend decodes the other's tensors.

    Raises:
        KvqrsError: unknown scheme or backend, bad bits, head_dim, seed or HeadQ settings; no
            GPU adapter for ``backend="wgpu"`` (the message says what to install).

    Example::

        codec = KVCodec(scheme="kqv", bits=4, head_dim=128, seed=0)
        ck, cv = codec.encode_keys(k), codec.encode_values(v)
        out, p = codec.attention(q, ck, cv)
        ck.bits_per_element
    """

    def __init__(
        self,
        scheme: str,
        bits: int,
        head_dim: int,
        seed: int = 0,
        *,
        value_bits: int | None = None,
        value_scheme: str | None = None,
        group: int = 32,
        headq_base: str = "kivi",
        rank: int = 4,
        side_bits: int = 4,
        basis: Any = None,
        sign: int = 1,
        backend: Any = "cpu",
        calibration: MatchedCalibration | None = None,
        value_scale: str = "norm",
        value_norms: str = "float",
    ):
        self.backend = get_backend(backend)
        self.scheme = scheme
        self.bits = check_bits(bits)
        self.value_bits = self.bits if value_bits is None else check_bits(value_bits, "value_bits")
        self.head_dim = check_positive_int(head_dim, "head_dim", minimum=2)
        self.seed = check_seed(seed, optional=False)
        self.group = check_positive_int(group, "group")
        spec = REGISTRY.get(scheme)
        if spec is None or spec.keys is None:
            raise KvqrsError(f"scheme: expected one of {names('KEY_SCHEMES')}, got {scheme!r}")
        # A scheme that codes keys only (headq) takes kivi values unless told otherwise.
        self.value_scheme = value_scheme or (scheme if spec.values is not None else "kivi")
        self.calibration = calibration
        self.value_scale, self.value_norms = value_scale, value_norms
        self.values: Coder | None = build_coder(
            CoderSettings(
                self.value_scheme,
                "values",
                self.value_bits,
                self.head_dim,
                self.seed,
                self.group,
                self.backend,
                calibration,
                value_scale,
                value_norms,
            )
        )
        self.rank, self.side_bits, self.sign, self.headq_base = rank, side_bits, sign, headq_base
        self.keys: Coder | None
        if scheme == "headq":
            if headq_base not in names("HEADQ_BASES"):
                raise KvqrsError(f"headq_base: expected one of {names('HEADQ_BASES')}, got {headq_base!r}")
            self.rank = check_positive_int(rank, "rank")
            self.side_bits = check_bits(side_bits, "side_bits")
            self._base = build_coder(self._key_settings(headq_base))
            self.keys = None
            if isinstance(basis, str):
                if basis != "random":
                    raise KvqrsError(f"basis: expected an array, None or 'random', got {basis!r}")
                basis = random_orthonormal_basis(derive_seed(self.seed, _RANDOM_BASIS), self.head_dim, self.rank)
            if basis is not None:
                self.set_basis(basis)
        else:
            self.keys = build_coder(self._key_settings(scheme, calibration))

    def _key_settings(self, scheme: str, calibration: Any = None, **headq: Any) -> CoderSettings:
        """What the registry builds ``scheme``'s key coder from (``headq``: ``base``,
        ``side_bits``, ``sign``)."""
        return CoderSettings(scheme, "keys", self.bits, self.head_dim, self.seed, self.group, self.backend, calibration, **headq)

    # -- HeadQ calibration ------------------------------------------------------------------
    def set_basis(self, basis: Array) -> None:
        """Use ``basis`` (``(d, r)`` or ``(kv_heads, d, r)``) for the HeadQ side code."""
        basis = as_float_array(basis, "basis")
        self.keys = build_coder(self._key_settings("headq", basis, base=self._base, side_bits=self.side_bits, sign=self.sign))
        self.rank = self.keys.rank

    def calibrate(self, queries: Array) -> Array:
        """Fit HeadQ's basis: top-``rank`` PCA directions of post-RoPE calibration queries.

        Args:
            queries: ``(n, d)`` for one KV head, or ``(kv_heads, n, d)`` with the queries of
                every head of a GQA group stacked along n.

        Returns:
            the basis, ``(d, r)`` or ``(kv_heads, d, r)``.
        """
        if self.scheme != "headq":
            raise KvqrsError(f"calibrate: only the headq scheme has a basis, this codec is {self.scheme!r}")
        q = as_float_array(queries, "queries")
        first_nonfinite(q, "queries")  # by its index in the stack, not in one head's rows
        if q.ndim not in (2, 3) or q.shape[-2] < self.rank:
            raise KvqrsError(f"queries: expected (n, d) or (kv_heads, n, d) with n >= rank = {self.rank}, got shape {q.shape}")
        basis = headq_basis(q, self.rank) if q.ndim == 2 else np.stack([headq_basis(h, self.rank) for h in q])
        self.set_basis(basis)
        return _like_query(basis, queries)

    def check_seed_of(self, enc: Encoded) -> None:
        """Raise :class:`KvqrsError` naming both codec seeds when ``enc`` was encoded under a
        seed other than this codec's and its rotation or sketch seeds therefore differ (the
        coders' own check can only name the derived seeds)."""
        if not isinstance(enc, Encoded):
            return
        coder = self.keys if enc.kind == "keys" else self.values
        if coder is None or enc.scheme != coder.scheme:
            return
        params = coder.params
        diff = [k for k in set(params) | set(enc.params) if params.get(k) != enc.params.get(k)]
        if not diff or not all("seed" in k for k in diff):
            return
        given = "another seed" if enc.seed is None else f"seed={enc.seed}"
        raise KvqrsError(
            f"encoded: these {enc.kind} were encoded by a KVCodec with {given}, this codec has seed={self.seed} "
            f"(the rotation and sketch seeds derive from it); decode them with the codec of the seed they were encoded with"
        )

    def _key_coder(self):
        if self.keys is None:
            raise KvqrsError("basis: the headq scheme needs a basis; call calibrate(queries) or pass basis=")
        return self.keys

    # -- keys ----------------------------------------------------------------------------------
    def encode_keys(self, k: Array) -> Encoded:
        """Encode keys ``(..., tokens, head_dim)`` (float16 / bfloat16 / float32 / float64
        NumPy array or torch tensor, any strides; empty axes allowed); returns an
        :class:`Encoded` that records the dtype.

        Raises:
            KvqrsError: a NaN or infinity (named by its index in ``k``), a wrong head_dim, a
                row whose norm or range overflows float32.
        """
        return _with_source(name_nonfinite(self._key_coder().encode, k, "keys"), k, self.seed)

    def decode_keys(self, ck: Encoded, base_only: bool = False) -> Array:
        """Reconstruct keys ``(..., tokens, head_dim)`` in the dtype they were encoded from: a
        NumPy array, or a torch tensor on the source's device when a tensor was encoded
        (:attr:`Encoded.device`).

        ``base_only=True`` returns HeadQ's base keys without the side code (what the score
        path multiplies the query with before adding :meth:`score_correction`)."""
        coder = self._key_coder()
        self.check_seed_of(ck)
        out = coder.decode_base(ck) if base_only and self.scheme == "headq" else coder.decode(ck)
        return _like_source(_as_dtype(out, ck.dtype, "keys"), ck)

    def scores(self, q: Array, ck: Encoded) -> Array:
        """Attention logits ``q . k_hat / sqrt(d)``, float32 ``(..., q_heads, nq, tokens)``.

        Uses the scheme's score path: the QJL inner-product estimator for ``qkqv`` keys, the
        HeadQ score-space correction for ``headq``. Queries ``(..., q_heads, nq, d)`` may have
        ``g`` times the keys' heads (GQA: query head h reads KV head ``h // g``); with the keys
        ``(..., tokens, d)`` and no head axis, leading dims must match.

        Raises:
            KvqrsError: a NaN or infinity in ``q`` (named by its index), leading dims that do not
                match, or a logit beyond float32 (keys near the bfloat16/float32 limit).
        """
        return _like_query(self._grouped(q, ck, self._key_coder().scores), q)

    def score_correction(self, q: Array, ck: Encoded) -> Array | None:
        """HeadQ's score-space correction ``sign * (U^T q) . z / sqrt(d)`` alone, shaped like
        :meth:`scores` (None for schemes without a side code). Added to
        ``q . decode_keys(ck, base_only=True) / sqrt(d)`` it gives :meth:`scores`."""
        if self.scheme != "headq":
            return None
        return _like_query(self._grouped(q, ck, self._key_coder().correction), q)

    def _grouped(self, q: Any, ck: Encoded, fn) -> np.ndarray:
        """Apply a per-KV-head score function with GQA grouping of query heads."""
        self.check_seed_of(ck)
        grouped, q_lead, nq = self._group_queries(q, ck)
        s = fn(grouped, ck)
        # Keys near the float32 limit can push a logit beyond it: an error, not inf or NaN later.
        return check_finite_output(s.reshape(*q_lead, nq, ck.shape[-2]), "logits", "q . k / sqrt(d) overflows: keys or queries too large")

    def _group_queries(self, q: Any, ck: Encoded) -> tuple[np.ndarray, tuple[int, ...], int]:
        """Queries as float32 ``(*kv_lead, g * nq, d)``: the ``g`` query heads of a KV head
        (query head h reads KV head ``h // g``) stacked with their tokens, no key copied.
        Returns ``(grouped, query leading shape, nq)``."""
        qa = as_float_array(q, "q")
        if qa.ndim < 2 or qa.shape[-1] != self.head_dim:
            raise KvqrsError(f"q: expected shape (..., nq, {self.head_dim}), got {qa.shape}")
        first_nonfinite(qa, "q")  # a few query rows: checked up front, by their index
        qa = np.asarray(as_float_rows(qa, "q")[0]).reshape(qa.shape)  # float32; float64 beyond it raises
        kv_lead = tuple(ck.shape[:-2])
        q_lead = qa.shape[:-2]
        if q_lead == kv_lead:
            return qa, q_lead, qa.shape[-2]
        if len(q_lead) == len(kv_lead) >= 1 and q_lead[:-1] == kv_lead[:-1] and q_lead[-1] % kv_lead[-1] == 0:
            g = q_lead[-1] // kv_lead[-1]
            return qa.reshape(*kv_lead, g * qa.shape[-2], self.head_dim), q_lead, qa.shape[-2]
        raise KvqrsError(f"q: leading dims {q_lead} do not match the keys' {kv_lead} (or a GQA multiple of their heads)")

    def slice_tokens(self, enc: Encoded, n: int, start: int = 0) -> Encoded:
        """Tokens ``start .. n - 1`` of an encoded tensor, codes untouched (a cache crop keeps
        a prefix; a sliding-window layer drops its oldest tokens)."""
        if not 0 <= int(n) <= enc.shape[-2]:
            raise KvqrsError(f"n: expected 0 <= n <= {enc.shape[-2]} tokens, got {n}")
        if not 0 <= int(start) <= int(n):
            raise KvqrsError(f"start: expected 0 <= start <= n = {n}, got {start}")
        self.check_seed_of(enc)
        kept = slice_rows(enc, self._layout_of(enc.kind), int(n), int(start))
        return dataclasses.replace(kept, device=enc.device, seed=enc.seed)

    def concat(self, encs: list[Encoded]) -> Encoded:
        """Join chunks of consecutive tokens encoded by this codec (keys or values)."""
        for e in encs:
            self.check_seed_of(e)
        joined = concat_tokens(encs, self._layout_of(encs[0].kind if encs else "keys"))
        return dataclasses.replace(joined, device=encs[0].device, seed=encs[0].seed)

    def layout(self, kind: str, shape: tuple[int, ...]):
        """The stored parts of this codec's ``kind`` (``"keys"`` or ``"values"``) for a tensor
        of ``shape`` ``(..., tokens, head_dim)``: ``{part: kvqrs.layout.Part}``
        (docs/layouts.md). Raises :class:`KvqrsError` for a side with no per-token layout
        (``a2`` values, full-precision values)."""
        if kind not in ("keys", "values"):
            raise KvqrsError(f"kind: expected 'keys' or 'values', got {kind!r}")
        if kind == "values" and self.values is None:
            raise KvqrsError("kind: this codec keeps values in full precision ('none'); they have no stored layout")
        return self._layout_of(kind)(tuple(int(n) for n in shape))

    def has_layout(self, kind: str) -> bool:
        """Whether this codec's ``kind`` declares a stored layout (not ``a2`` or full-precision values)."""
        coder = self._key_coder() if kind == "keys" else self.values
        return coder is not None and coder.has_layout

    def nbytes(self, kind: str, shape: tuple[int, ...]) -> int:
        """Bytes an encode of ``kind`` of ``shape`` ``(..., tokens, head_dim)`` stores, read off
        the declared layout (:func:`kvqrs.layout.nbytes`: stored scalars as float16, which they
        are unless a value leaves float16's range). Raises as :meth:`layout`."""
        return lay.nbytes(self.layout(kind, shape))

    def fixed_per_token(self, kind: str) -> bool:
        """Whether every token of ``kind`` stores its own parts of one size (each declared part
        one entry per token, cut anywhere: :func:`kvqrs.layout.fixed_per_token`); False for a
        side without a layout."""
        return self.has_layout(kind) and lay.fixed_per_token(self.layout(kind, (1, 0, self.head_dim)))

    def align(self) -> int:
        """The fewest tokens at whose multiples every stored part of the keys and values can be
        cut and joined (:func:`kvqrs.layout.align` of both declared layouts; a side without a
        layout is coded a chunk at a time and adds nothing): 1 where every token stores its
        own parts, a group of tokens where a part is shared by one."""
        layouts = [self.layout(kind, (1, 0, self.head_dim)) for kind in ("keys", "values") if self.has_layout(kind)]
        return lcm(1, *(lay.align(layout) for layout in layouts))

    def named(self, kind: str, shape: tuple[int, ...]) -> Encoded:
        """An :class:`Encoded` of ``kind`` of ``shape`` whose parts are the declared layout's
        :class:`~kvqrs.layout.PartRef` s (name, shape, stored dtype; no data), with the coder's
        scheme and parameters: what ``fused_rows`` reads to say which part each field of its
        rows reads, without encoding anything."""
        coder = self._key_coder() if kind == "keys" else self.values
        refs = lay.layout_refs(self.layout(kind, shape))
        return Encoded(coder.scheme, kind, tuple(shape), np.dtype(np.float32), refs, coder.params, seed=self.seed)

    def _layout_of(self, kind: str):
        """The ``layout(shape)`` of this codec's keys or values (:mod:`kvqrs.layout`)."""
        coder = self._key_coder() if kind == "keys" else self.values
        if coder is None or not coder.has_layout:
            raise KvqrsError(
                f"encoded: {self.value_scheme if kind == 'values' else self.scheme} {kind} have no per-token layout to join or cut"
            )
        return coder.layout

    # -- values --------------------------------------------------------------------------------
    def encode_values(self, v: Array, weights: Array | None = None) -> Encoded:
        """Encode values ``(..., tokens, head_dim)`` (inputs and errors as in
        :meth:`encode_keys`). ``weights`` (``(..., tokens)``, the A^2 importances
        ``sum_q p_qj^2``) is used by the ``a2`` value scheme only."""
        if self.values is None:
            raise KvqrsError("value_scheme: this codec keeps values in full precision ('none'); nothing to encode")
        if self.needs_weights:
            return _with_source(name_nonfinite(self.values.encode, v, "values", weights), v, self.seed)
        if weights is not None:
            raise KvqrsError(
                f"weights: only a2 values and matched values in width classes use attention weights, this codec's values are {self.value_scheme!r}"
            )
        return _with_source(name_nonfinite(self.values.encode, v, "values"), v, self.seed)

    def decode_values(self, cv: Encoded) -> Array:
        """Reconstruct values ``(..., tokens, head_dim)`` in the dtype they were encoded from
        (a torch tensor on the source's device when a tensor was encoded, as :meth:`decode_keys`)."""
        if self.values is None:
            raise KvqrsError("value_scheme: this codec keeps values in full precision ('none'); nothing to decode")
        self.check_seed_of(cv)
        return _like_source(_as_dtype(self.values.decode(cv), cv.dtype, "values"), cv)

    def _check_keys(self, ck: Encoded) -> None:
        if not isinstance(ck, Encoded) or ck.kind != "keys":
            raise KvqrsError("ck: expected encoded keys")
        if ck.shape[-2] == 0:
            raise KvqrsError("ck: expected at least one token to attend to, got 0")

    def _check_attention(self, ck: Encoded, cv: Encoded) -> None:
        if self.values is None:
            raise KvqrsError("value_scheme: this codec keeps values in full precision ('none'); nothing encoded to attend over")
        if not isinstance(ck, Encoded) or ck.kind != "keys":
            got = f"encoded {ck.kind} (keys and values swapped?)" if isinstance(ck, Encoded) else type(ck).__name__
            raise KvqrsError(f"ck: expected encoded keys, got {got}")
        if not isinstance(cv, Encoded) or cv.kind != "values":
            got = f"encoded {cv.kind}" if isinstance(cv, Encoded) else type(cv).__name__
            raise KvqrsError(f"cv: expected encoded values, got {got}")
        if cv.shape[:-1] != ck.shape[:-1]:
            raise KvqrsError(f"cv: expected values with the keys' heads and tokens {ck.shape[:-1]}, got {cv.shape[:-1]}")
        self._check_keys(ck)

    @property
    def needs_weights(self) -> bool:
        """Whether :meth:`encode_values` needs each token's A^2 importance (``a2`` values, or
        ``matched`` values in width classes): only the fast evaluation path has the queries."""
        return self.values is not None and self.values.takes_weights

    def has_fused_path(self) -> bool:
        """Whether :meth:`fused_attention` can read this codec's keys and values (or keys with
        values kept in full precision): the ``"cpu"`` backend and coders that declare a fused read
        path (``Coder.fused``: all but ``a2`` values and ``matched`` values in width classes).

        Raises:
            KvqrsError: ``headq`` keys without a basis yet.
        """
        known = self.__dict__.get("_has_fused_path")  # fixed at construction: asked once per decode step
        if known is None:
            keys, values = self._key_coder().fused, self.values is None or self.values.fused
            known = self.__dict__["_has_fused_path"] = self.backend.name == "cpu" and keys and values
        return known

    def fused_key_rows(self, ck: Encoded) -> tuple[Any, Any] | None:
        """``(key rows, HeadQ side rows or None)`` for :func:`kvqrs.kernels.decode_attention`,
        or None when the keys have no fused read path (a backend other than ``"cpu"``)."""
        if self.backend.name != "cpu" or not self._key_coder().fused:
            return None
        k = self._key_coder().attention_rows(ck)
        return k if self.scheme == "headq" else (k, None)

    def fused_rows(self, ck: Encoded, cv: Encoded | DenseRows) -> tuple[Any, Any, Any] | None:
        """``(key rows, value rows, HeadQ side rows or None)`` for
        :func:`kvqrs.kernels.decode_attention`, or None when this codec has no fused read path:
        a backend other than ``"cpu"``, or ``a2`` values (per-token widths). ``cv`` may also be
        :class:`~kvqrs.kernels.attention.DenseRows` (values kept in full precision). The coders
        place the parts of ``ck`` and ``cv`` in the rows as they are, so over
        :meth:`Encoded.named <kvqrs.schemes.Encoded.named>` tensors the rows hold the
        :class:`~kvqrs.layout.PartRef` of each part they read (how the layer store and the
        paged cache bind them by name)."""
        keys = self.fused_key_rows(ck)
        if keys is None:
            return None
        if isinstance(cv, DenseRows):
            return keys[0], cv, keys[1]
        if self.values is None or not self.values.fused:
            return None
        return keys[0], self.values.attention_rows(cv), keys[1]

    def fused_attention(
        self, q: Array, ck: Encoded, cv: Encoded | DenseRows, probs: bool = False, scale: float | None = None
    ) -> AttentionResult:
        """Decode attention straight from the codes (:func:`kvqrs.kernels.decode_attention`):
        no key or value is reconstructed; the query heads of a GQA group share one pass over
        their KV head's codes.

        Args:
            q: ``(..., q_heads, nq, d)`` (nq: a few query tokens), as in :meth:`scores`.
            ck, cv: encoded keys and values ``(..., kv_heads, T, d)``; ``cv`` may be
                :class:`~kvqrs.kernels.attention.DenseRows` of values kept in full precision.
            probs: also return the probabilities.
            scale: logit scale (default ``1 / sqrt(d)``).

        Returns:
            :class:`~kvqrs.kernels.attention.AttentionResult`: ``out`` float32
            ``(..., q_heads, nq, d)``, ``lse`` float32 ``(..., q_heads, nq)`` (log-sum-exp of the
            logits, to merge with another softmax part), ``probs`` ``(..., q_heads, nq, T)`` or
            None.

        Raises:
            KvqrsError: no fused read path for this codec (see :meth:`fused_rows`; use
                :meth:`attention` with ``fused=False``), or what :meth:`attention` raises.
        """
        if isinstance(cv, DenseRows):
            self._check_keys(ck)
            if np.shape(cv.values)[:-1] != ck.shape[:-1]:
                raise KvqrsError(f"cv: expected values with the keys' heads and tokens {ck.shape[:-1]}, got {np.shape(cv.values)[:-1]}")
        else:
            self._check_attention(ck, cv)
            self.check_seed_of(cv)
        self.check_seed_of(ck)
        rows = self.fused_rows(ck, cv)
        if rows is None:
            raise KvqrsError(
                f"fused: no fused attention for {self.scheme} keys with {self.value_scheme} values on the "
                f"{self.backend.name!r} backend; use attention(..., fused=False)"
            )
        grouped, q_lead, nq = self._group_queries(q, ck)
        res = decode_attention(grouped, rows[0], rows[1], side=rows[2], scale=scale, probs=probs)
        t = ck.shape[-2]
        out = AttentionResult(
            res.out.reshape(*q_lead, nq, self.head_dim),
            res.lse.reshape(*q_lead, nq),
            None if res.probs is None else res.probs.reshape(*q_lead, nq, t),
        )
        return _like_query(out, q)

    def attention(self, q: Array, ck: Encoded, cv: Encoded, fused: bool | None = None) -> tuple[Array, Array]:
        """Attention over the encoded cache: ``(softmax(scores) @ v_hat, probabilities)``.

        Args:
            q, ck, cv: as in :meth:`fused_attention`.
            fused: True: compute from the codes (:meth:`fused_attention`; raises where there is
                no fused path); False: the decode-based reference (decode keys and values, then
                softmax in float64); None (default): fused wherever :meth:`fused_rows` has a path,
                else the reference. The two agree to float32 rounding (tests/kernels/test_attention.py).

        Returns:
            output float32 ``(..., q_heads, nq, d)`` and probabilities float64
            ``(..., q_heads, nq, T)`` (computed in float32 on the fused path).
        """
        self._check_attention(ck, cv)
        self.check_seed_of(ck)
        self.check_seed_of(cv)
        if is_tensor(q):
            return _like_query(self.attention(as_float_array(q, "q"), ck, cv, fused), q)
        if fused is None:
            fused = self.fused_rows(ck, cv) is not None
        if fused:
            r = self.fused_attention(q, ck, cv, probs=True)
            return r.out, r.probs.astype(np.float64)
        s = self.scores(q, ck).astype(np.float64)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        v = self.values.decode(cv).astype(np.float64)
        q_lead, kv_lead = p.shape[:-2], v.shape[:-2]
        if q_lead != kv_lead:
            g = q_lead[-1] // kv_lead[-1]
            v = np.repeat(v, g, axis=-3)
        return (p @ v).astype(np.float32), p

    def __repr__(self) -> str:
        return (
            f"KVCodec(scheme={self.scheme!r}, bits={self.bits}, head_dim={self.head_dim}, seed={self.seed}, "
            f"value_scheme={self.value_scheme!r}, value_bits={self.value_bits}"
            + ("" if self.backend.name == "cpu" else f", backend={self.backend.name!r}")
            + ")"
        )
