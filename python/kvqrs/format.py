"""The compressed-cache format (docs/format.md): an :class:`~kvqrs.schemes.Encoded` tensor as
versioned, self-describing, checksummed bytes.

The container (magic, version, length-prefixed sections, each with a CRC-32 over its header and
payload) is read and written by Rust (``kvqrs_core::format``, layout in ``docs/format.md``); this
module gives the sections their meaning: a first ``meta`` section of UTF-8 JSON (format tag,
scheme, kind, original shape and dtype, the scheme's parameters: bits, seeds (rotation and
sketch identity), group sizes, HeadQ basis hash) and one section per stored part.

Loading checks the container (truncation, altered bytes, hostile lengths raise
:class:`KvqrsError`, never crash) and the meaning (a known tag, a well-formed meta, the parts
it lists). Given a codec, it also checks the tensor belongs to it (scheme, side, parameters,
and every part's shape and dtype as the codec would store that shape), so loading under other
settings raises instead of decoding garbage.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import numpy as np

from . import _native
from ._arrays import KvqrsError
from .layout import check_parts
from .schemes.base import Encoded

if TYPE_CHECKING:
    from .schemes.codec import KVCodec

FORMAT = "kvqrs-encoded-v1"
# Container dtype codes by NumPy name, from the core's one dtype table (kvqrs._native.DTYPES).
_DTYPES = {name: code for name, (code, _) in _native.DTYPES.items() if name != "utf-8"}
_UTF8 = _native.DTYPES["utf-8"][0]
_TENSOR_DTYPES = ("float16", "float32", "float64", "bfloat16")


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dumps(enc: Encoded) -> bytes:
    """``enc`` as container bytes. Raises :class:`KvqrsError` for a part of an unsupported
    dtype or parameters that JSON cannot hold."""
    if not isinstance(enc, Encoded):
        raise KvqrsError(f"enc: expected a kvqrs Encoded object, got {type(enc).__name__}")
    meta = {
        "format": FORMAT,
        "scheme": enc.scheme,
        "kind": enc.kind,
        "shape": [int(n) for n in enc.shape],
        "dtype": str(np.dtype(enc.dtype)),
        "params": dict(enc.params),
        "parts": list(enc.parts),
    }
    if enc.seed is not None:
        meta["codec_seed"] = int(enc.seed)  # named by seed-mismatch errors; optional
    try:
        text = json.dumps(meta, sort_keys=True).encode()
    except TypeError as e:
        raise KvqrsError(f"enc.params: expected JSON-serialisable parameters ({e})") from None
    sections = [("meta", _UTF8, [len(text)], text)]
    for name, part in enc.parts.items():
        a = np.ascontiguousarray(part)
        if str(a.dtype) not in _DTYPES:
            raise KvqrsError(f"enc.parts[{name!r}]: expected one of {sorted(_DTYPES)}, got dtype {a.dtype}")
        sections.append((name, _DTYPES[str(a.dtype)], [int(n) for n in a.shape], a.tobytes()))
    return _native.container_write(sections)


def _meta(section) -> dict:
    name, code, _, payload = section
    if name != "meta" or code != _UTF8:
        raise KvqrsError("compressed cache: the first section must be the UTF-8 'meta' section")
    try:
        meta = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KvqrsError(f"compressed cache: meta is not valid JSON ({e})") from None
    expected = {"format": str, "scheme": str, "kind": str, "shape": list, "dtype": str, "params": dict, "parts": list}
    if not isinstance(meta, dict) or any(not isinstance(meta.get(k), t) for k, t in expected.items()):
        raise KvqrsError(f"compressed cache: meta must hold {sorted(expected)} with the right types")
    if meta["format"] != FORMAT:
        raise KvqrsError(f"compressed cache: format {meta['format']!r}, this version reads {FORMAT!r}")
    if meta["kind"] not in ("keys", "values") or meta["dtype"] not in _TENSOR_DTYPES:
        raise KvqrsError(f"compressed cache: kind {meta['kind']!r} / dtype {meta['dtype']!r} not understood")
    if not meta["shape"] or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in meta["shape"]):
        raise KvqrsError(f"compressed cache: shape must be a non-empty list of non-negative integers, got {meta['shape']}")
    return meta


def loads(data: bytes, codec: KVCodec | None = None) -> Encoded:
    """Container bytes back into an :class:`Encoded`.

    Args:
        data: bytes from :func:`dumps`.
        codec: optional :class:`~kvqrs.schemes.KVCodec`; when given, the tensor must be keys or
            values of this codec: same scheme and parameters, parts shaped as it stores them.

    Raises:
        KvqrsError: truncated, altered or hostile bytes; an unknown format; a tensor that does
            not belong to ``codec``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KvqrsError(f"data: expected bytes, got {type(data).__name__}")
    sections = _native.container_read(bytes(data))
    if not sections:
        raise KvqrsError("compressed cache: no sections")
    meta = _meta(sections[0])
    names = [s[0] for s in sections[1:]]
    if names != meta["parts"]:
        raise KvqrsError(f"compressed cache: meta lists parts {meta['parts']}, the container holds {names}")
    codes = {v: k for k, v in _DTYPES.items()}
    parts = {}
    for name, code, shape, payload in sections[1:]:
        if code not in codes:
            raise KvqrsError(f"compressed cache: part {name!r} has dtype code {code}")
        parts[name] = np.frombuffer(payload, dtype=_np_dtype(codes[code])).reshape(shape)
        # Encoders store no NaN or infinity (norms, scales, zero points): such a part was altered.
        if codes[code] in _TENSOR_DTYPES and not np.isfinite(parts[name].astype(np.float64)).all():
            raise KvqrsError(f"compressed cache: part {name!r} holds a NaN or an infinity")
    seed = meta.get("codec_seed")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**64 else None
    enc = Encoded(meta["scheme"], meta["kind"], tuple(meta["shape"]), _np_dtype(meta["dtype"]), parts, meta["params"], seed=seed)
    if codec is not None:
        check_belongs(enc, codec)
    return enc


def check_belongs(enc: Encoded, codec: KVCodec) -> None:
    """Raise :class:`KvqrsError` unless ``enc`` is a tensor ``codec`` could have stored:
    same scheme, side and parameters (seeds, bits, basis hash), and exactly the parts of the
    coder's declared layout for that shape (:mod:`kvqrs.layout`), each of its shape and dtype."""
    from .schemes.base import check_encoded

    coder = codec._key_coder() if enc.kind == "keys" else codec.values
    if coder is None:
        raise KvqrsError(f"compressed cache: the codec stores no {enc.kind}")
    codec.check_seed_of(enc)
    check_encoded(enc, coder.scheme, enc.kind, coder.params)
    if len(enc.shape) < 2 or enc.shape[-1] != codec.head_dim:
        raise KvqrsError(f"compressed cache: shape {enc.shape}, the codec expects (..., tokens, {codec.head_dim})")
    if not coder.has_layout:
        return  # a2: its parts follow the per-token widths it stored; decode checks them
    check_parts(enc.parts, coder.layout(enc.shape), "compressed cache")


def save(path: str | os.PathLike, enc: Encoded) -> None:
    """Write :func:`dumps` of ``enc`` to ``path``."""
    with open(path, "wb") as f:
        f.write(dumps(enc))


def load(path: str | os.PathLike, codec: KVCodec | None = None) -> Encoded:
    """Read a file written by :func:`save` (see :func:`loads`)."""
    with open(path, "rb") as f:
        return loads(f.read(), codec)
