"""What every scheme shares: the encoded container that counts its own bytes, and the shape
handling of (..., tokens, head_dim) tensors.

A scheme is a composition of kernel calls (``kvqrs.kernels``); nothing here loops over
elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import layout as lay
from .._arrays import KvqrsError, as_array, first_nonfinite

if TYPE_CHECKING:
    from .backend import Backend


@dataclass(frozen=True)
class Encoded:
    """A compressed tensor: every stored array in ``parts``, nothing else.

    Attributes:
        scheme: scheme name (``kv``, ``kqv``, ...).
        kind: ``"keys"`` or ``"values"``.
        shape: shape of the original tensor ``(..., tokens, head_dim)``.
        dtype: numpy dtype of the original tensor (decoding returns it).
        parts: name -> stored array (packed codes, norms, scales, sketches, side codes, ...),
            or :class:`~kvqrs.layout.PartRef` stand-ins (:meth:`named`): the parts by name,
            no data.
        params: scheme parameters needed to decode (bits, seeds, group sizes); not counted as
            storage, since they are per-codec constants, not per-token data.
        device: the torch device (``"cpu"``, ``"cuda:0"``, ...) of the tensor it was encoded
            from, None for a NumPy array: :class:`~kvqrs.schemes.KVCodec` decodes a tensor's
            codes back to a tensor of its dtype on that device. The parts themselves are NumPy
            arrays in host memory either way; not stored by :mod:`kvqrs.format`.
        seed: the seed of the :class:`~kvqrs.schemes.KVCodec` that encoded it (its rotation
            and sketch seeds in ``params`` derive from it), None when unknown: errors about
            decoding under another seed name this one. Stored by :mod:`kvqrs.format`.
    """

    scheme: str
    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype
    parts: Mapping[str, np.ndarray]
    params: Mapping[str, Any] = field(default_factory=dict)
    device: str | None = None
    seed: int | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: the sum of every part's ``nbytes``."""
        return int(sum(np.asarray(p).nbytes for p in self.parts.values()))

    @property
    def bits_per_element(self) -> float:
        """Stored bits per original element, every overhead included (norms, scales, zero
        points, sketches, side codes, padding to d' and to whole bytes)."""
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    def breakdown(self) -> dict[str, float]:
        """Bits per element contributed by each part."""
        n = max(self.numel, 1)
        return {k: 8.0 * np.asarray(v).nbytes / n for k, v in self.parts.items()}

    def named(self) -> Encoded:
        """This tensor with each part replaced by a :class:`~kvqrs.layout.PartRef` of its name,
        shape and dtype (scheme, parameters and shape kept): what a coder's ``attention_rows``
        is given to say which part each field of its rows reads, by name."""
        return replace(self, parts=lay.part_refs(self.parts))


class Coder(Protocol):
    """What every coder of one side of the cache has; the scheme registry
    (:mod:`kvqrs.schemes.registry`) builds them. The coders of :mod:`kvqrs.schemes`
    (``MSECoder``, ``MSEQJLCoder``, ``KIVICoder``, ``BlockCoder``, ``HeadQCoder``,
    ``MatchedCoder``, ``MatchedValueCoder``, ``A2ValueCoder``, ``WidthClassCoder``) subclass it
    and set the capabilities that differ from the defaults below.

    Capabilities (class attributes; HeadQ's ``fused`` is its base coder's), each with what it
    promises:

    - ``fused`` (default False): ``attention_rows(enc)`` gives the rows
      :func:`kvqrs.kernels.decode_attention` reads, codes still packed (HeadQ's: ``(base rows,
      side rows)``); ``KVCodec.fused_attention`` reads them on the ``"cpu"`` backend. Without
      it, attention decodes first.
    - ``has_layout`` (default True): ``layout(shape) -> {part: kvqrs.layout.Part}`` declares
      the stored parts of a ``(..., T, d)`` tensor (what joining, cutting and the file format
      check). False for ``a2``, whose parts follow the widths it stored.
    - ``takes_weights`` (default False): ``encode(x, weights)`` takes each token's A^2
      importance ``(..., T)`` (``a2``: None gives every token ``bits``).
    - ``needs_weights`` (default False): ``encode`` raises without them (width classes).

    Key coders also have ``scores(q, enc)``: logits ``q . k_hat / sqrt(d)``, float32 ``(..., nq,
    T)``, for queries ``(..., nq, d)`` with the keys' leading dims.

    Attributes:
        scheme: the name recorded in every tensor it encodes.
        kind: ``"keys"`` or ``"values"``.
        head_dim: d.
        params: what decoding needs besides the parts (bits, seeds, group, calibration
            digests): a tensor decodes only under equal ``params``.
        k: the kernels' backend (:mod:`kvqrs.schemes.backend`).
    """

    scheme: str
    kind: str
    head_dim: int
    params: Mapping[str, Any]
    k: Backend
    fused: bool = False
    has_layout: bool = True
    takes_weights: bool = False
    needs_weights: bool = False

    def encode(self, x: Any) -> Encoded:
        """``x`` ``(..., T, d)`` (a float NumPy array or torch tensor) encoded.

        Raises:
            KvqrsError: a NaN or infinity, another head_dim, a row whose norm or range
                overflows float32.
        """
        ...

    def decode(self, enc: Encoded) -> np.ndarray:
        """The reconstruction, float32 of ``enc.shape``.

        Raises:
            KvqrsError: ``enc`` not encoded by a coder of this scheme, side and ``params``.
        """
        ...


def concat_tokens(encs: list[Encoded], layout: Callable[[tuple[int, ...]], lay.Layout]) -> Encoded:
    """Join encoded chunks of consecutive tokens into one ``Encoded`` (what a growing cache
    does), each part along its token axis in the coder's ``layout(shape)``; every chunk but the
    last must end where each part can be cut (KIVI key chunks of whole groups do)."""
    if not encs:
        raise KvqrsError("encoded: expected at least one chunk to concatenate")
    first = encs[0]
    for e in encs[1:]:
        if (e.scheme, e.kind, dict(e.params), e.shape[:-2], e.shape[-1]) != (
            first.scheme,
            first.kind,
            dict(first.params),
            first.shape[:-2],
            first.shape[-1],
        ):
            raise KvqrsError("encoded: chunks to concatenate must share scheme, parameters and shape except tokens")
    tokens = [e.shape[-2] for e in encs]
    shape = (*first.shape[:-2], sum(tokens), first.shape[-1])
    parts = lay.concat([e.parts for e in encs], tokens, layout(shape))
    return Encoded(first.scheme, first.kind, shape, first.dtype, parts, first.params)


def slice_rows(enc: Encoded, layout: Callable[[tuple[int, ...]], lay.Layout], n: int, start: int = 0) -> Encoded:
    """Tokens ``start .. n - 1`` of ``enc``, each part cut along its token axis in the coder's
    ``layout(shape)`` (codes untouched); raises where a part cannot be cut there (``n`` may
    always be the last token held)."""
    lead, d = enc.shape[:-2], enc.shape[-1]
    parts = lay.take(enc.parts, (layout((*lead, start, d)), layout((*lead, n, d))), (start, n), n == enc.shape[-2])
    return Encoded(enc.scheme, enc.kind, (*lead, n - start, d), enc.dtype, parts, enc.params)


def split_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
    """``(leading shape, tokens, head_dim)`` of a ``(..., tokens, head_dim)`` shape."""
    return tuple(shape[:-2]), shape[-2], shape[-1]


def flat_rows(a: np.ndarray, tail: int) -> np.ndarray:
    """``a`` with its leading axes merged into one and its last ``tail`` axes kept; unlike
    ``reshape(-1, ...)`` this also works when some axis is empty."""
    return a.reshape(math.prod(a.shape[:-tail]), *a.shape[a.ndim - tail :])


def check_head_dim(x: np.ndarray, head_dim: int, arg: str) -> None:
    """Raise unless ``x`` has shape ``(..., tokens, head_dim)``."""
    if x.ndim < 2 or x.shape[-1] != head_dim:
        raise KvqrsError(f"{arg}: expected shape (..., tokens, {head_dim}), got {x.shape}")


def check_encoded(enc: Encoded, scheme: str, kind: str, params: Mapping[str, Any] | None = None) -> None:
    """Raise if ``enc`` was produced by another scheme, for the other side of the cache, or
    under other parameters (bits, seeds, group, basis): decoding it would give garbage."""
    if not isinstance(enc, Encoded):
        raise KvqrsError(f"encoded: expected a kvqrs Encoded object, got {type(enc).__name__}")
    if enc.scheme != scheme or enc.kind != kind:
        raise KvqrsError(f"encoded: expected {kind} of scheme {scheme!r}, got {enc.kind} of scheme {enc.scheme!r}")
    if params is not None and dict(enc.params) != dict(params):
        diff = sorted(k for k in set(params) | set(enc.params) if params.get(k) != enc.params.get(k))
        raise KvqrsError(f"encoded: expected {kind} encoded with {dict(params)}, got {dict(enc.params)} (differs in {', '.join(diff)})")


def as_float_array(x: Any, arg: str) -> np.ndarray:
    """``x`` (NumPy array or torch tensor) as a float array; the kernels do the rest of the
    validation (NaN/Inf included: see :func:`name_nonfinite`)."""
    arr = as_array(x, arg)
    if arr.dtype.kind != "f" and str(arr.dtype) != "bfloat16":
        raise KvqrsError(f"{arg}: expected a float array, got dtype {arr.dtype}")
    return arr


def name_nonfinite(encode, x: Any, arg: str, *args: Any) -> Encoded:
    """``encode(x, *args)``; if it raises, a NaN or infinity in ``x`` is reported by its index
    in ``x`` instead: the kernels name a flattened row of what they were given (KIVI keys
    transposed, batches merged). Searching only on the error path keeps encodes free of an
    extra pass over the data."""
    try:
        return encode(x, *args)
    except KvqrsError:
        first_nonfinite(as_array(x, arg), arg)
        raise
