"""A whole :class:`~kvqrs.hf.QuantizedKVCache` as bytes (docs/format.md), and back.

One container (``kvqrs_core::format``): a ``meta`` section (format tag, the
:class:`~kvqrs.hf.QuantConfig` fields, per layer its sliding window, the positions it holds
(tokens seen, first held, first coded), the quantized token count, dtype, batch, KV heads and
which tensors exist), each layer's code store as its sections (``L<i>.store.keys.<part>``,
``L<i>.store.values.<part>``: one per part of the codec's declared layouts, written by
:meth:`~kvqrs.hf.store.CodeStore.sections`), its full-precision tensors (window, sinks,
originals kept for a rollback) as raw tensors, and the HeadQ bases.
Loading rebuilds the config, or checks it equals the one given, and reads every store part
against the shape and dtype the layer's codec declares for its tokens, so other settings or
altered bytes raise instead of decoding garbage. Files of the previous version
(``kvqrs-cache-v2``: nested :mod:`kvqrs.format` containers per side) still load.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import _native
from .. import format as fmt
from .._arrays import KvqrsError
from .config import QuantConfig
from .store import TORCH_CODES, CodeStore

FORMAT = "kvqrs-cache-v3"
"""The format tag written; :data:`READABLE` are the tags read."""
READABLE = (FORMAT, "kvqrs-cache-v2")
_U8, _UTF8 = _native.DTYPES["uint8"][0], _native.DTYPES["utf-8"][0]
_FLOAT = TORCH_CODES  # container dtype codes of full-precision tensors


def _config_fields(config: QuantConfig) -> dict:
    """The config's JSON fields; the arrays (HeadQ bases, a fitted ``matched`` calibration)
    travel in sections of their own, and a ``calibration`` string (``"random"``) stays here."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in ("bases", "_codecs")}
    if not (out["calibration"] is None or isinstance(out["calibration"], str)):
        out.pop("calibration")
    return out


def _calibration_section(config: QuantConfig) -> list[tuple]:
    """A fitted ``matched`` calibration as one section (the ``kvqrs calibrate`` .npz bytes)."""
    if not isinstance(config.calibration, dict):
        return []
    blob = _calibration_bytes(config.calibration)
    return [("matched_calibration", _U8, [len(blob)], blob)]


def _calibration_bytes(calibration: dict) -> bytes:
    from .calibration import save_matched

    return save_matched(io.BytesIO(), calibration).getvalue()


def _read_calibration(sections: dict, name: str) -> dict:
    from .calibration import load_matched

    code, _, payload = sections[name]
    if code != _U8:
        raise KvqrsError(f"compressed cache: section {name!r} is not a byte section")
    return load_matched(io.BytesIO(payload))


def _calibration(meta: dict, sections: dict) -> Any:
    """The saved ``matched`` calibration: its section, else the config's string (or None)."""
    if "matched_calibration" not in sections:
        return meta["config"].get("calibration")
    return _read_calibration(sections, "matched_calibration")


def _tensor_section(name: str, t: torch.Tensor) -> tuple:
    """A full-precision tensor's raw bytes in its own dtype (bfloat16 included)."""
    t = t.detach().contiguous()
    return (name, _FLOAT[t.dtype], list(t.shape), t.view(torch.uint8).numpy().tobytes())


# Full-precision tensors of a layer (CompressedLayer.fp_tensors): always present, optional.
_FP_ALWAYS = ("window_keys", "window_values", "sink_keys", "sink_values")
_FP_OPTIONAL = ("pending_keys", "pending_values")
_POSITIONS = ("seen", "start", "q_start")


def dumps(cache) -> bytes:
    """The cache as bytes. Raises :class:`KvqrsError` for a cache on a non-CPU device."""
    layers, sections = [], []
    for i, layer in enumerate(cache.layers):
        info = {"initialized": bool(layer.is_initialized), "quantized": int(layer.quantized), "sliding_window": layer.sliding_window}
        info["record_past"] = bool(layer.record_past)
        if layer.is_initialized:
            fp = layer.fp_tensors()
            if fp["window_keys"].device.type != "cpu":
                raise KvqrsError(f"cache: layer {i} lives on {fp['window_keys'].device}; move it to the CPU to save it")
            info.update(
                dtype=str(layer.dtype).removeprefix("torch."),
                head_dim=int(layer.head_dim),
                batch=int(fp["window_keys"].shape[0]),
                kv_heads=int(fp["window_keys"].shape[1]),
                store=bool(layer.quantized),
                **{name: int(v) for name, v in layer.positions().items() if name in _POSITIONS},
            )
            for name in (*_FP_ALWAYS, *_FP_OPTIONAL):
                info[name] = name in fp
                if name in fp:
                    sections.append(_tensor_section(f"L{i}.{name}", fp[name]))
            if layer.fitted is not None:  # calibration="prefill": the layer's own calibration
                blob = _calibration_bytes({0: layer.fitted})
                sections.append((f"L{i}.calibration", _U8, [len(blob)], blob))
                info["fitted_tokens"] = int(layer.fitted_tokens)
            if info["store"]:
                sections += layer.store.sections(f"L{i}.store.")
        layers.append(info)
    bases = cache.config.bases
    if isinstance(bases, dict):
        for layer_idx, b in sorted(bases.items()):
            a = np.ascontiguousarray(b, np.float32)
            sections.append((f"bases.{int(layer_idx)}", 2, list(a.shape), a.tobytes()))
    meta = {"format": FORMAT, "config": _config_fields(cache.config), "bases": bases if isinstance(bases, str) else None, "layers": layers}
    text = json.dumps(meta).encode()
    return _native.container_write([("meta", _UTF8, [len(text)], text), *_calibration_section(cache.config), *sections])


def _tensor(sections: dict, name: str, dtype: str, lead: tuple) -> torch.Tensor:
    """Section ``name`` as a ``(batch, kv_heads, tokens, head_dim)`` tensor of ``dtype`` whose
    batch, heads and head_dim are ``lead`` (the meta's; None: any), finite (a full-precision
    tensor with a NaN or infinity was altered: the cache never stores one)."""
    if name not in sections:
        raise KvqrsError(f"compressed cache: section {name!r} is missing")
    code, shape, payload = sections[name]
    want = getattr(torch, dtype, None) if dtype in _FLOAT_NAMES else None
    dims = "({}, {}, tokens, {})".format(*("any" if n is None else n for n in lead))
    if (
        want not in _FLOAT
        or _FLOAT[want] != code
        or len(shape) != 4
        or any(n is not None and n != m for n, m in zip(lead, (shape[0], shape[1], shape[3])))
        # a token's row beyond 2^40 elements (terabytes) is no cache's; empty, it overflows torch's strides
        or shape[0] * shape[1] * shape[3] > 2**40
    ):
        raise KvqrsError(f"compressed cache: section {name!r} is not a {dims} {dtype} tensor, got shape {shape}")
    t = torch.frombuffer(bytearray(payload), dtype=want).reshape(shape) if payload else torch.zeros(shape, dtype=want)
    if not torch.isfinite(t).all():
        raise KvqrsError(f"compressed cache: section {name!r} holds a NaN or an infinity")
    return t


_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
_FLOAT_CODES = {_native.DTYPES[name][0]: name for name in _FLOAT_NAMES}  # container dtype codes of float payloads


def _check_finite_sections(raw: list, prefix: str) -> None:
    """Refuse a stored float (norms, scales, zero points, a key-only config's values) that is a
    NaN or an infinity: encoders never write one, so the bytes were altered."""
    from ..format import _np_dtype

    for name, code, _, payload in raw:
        if name.startswith(prefix) and code in _FLOAT_CODES and payload:
            a = np.frombuffer(payload, dtype=_np_dtype(_FLOAT_CODES[code]))
            if not np.isfinite(a.astype(np.float64)).all():
                raise KvqrsError(f"compressed cache: section {name!r} holds a NaN or an infinity")


def _layer_info(i: int, info: Any) -> dict:
    """Layer ``i``'s meta entry, its types checked (an edited meta fails here, by name, not as
    a KeyError or an OverflowError further on)."""
    if not isinstance(info, dict):
        raise KvqrsError(f"compressed cache: layer {i}'s meta must be an object, got {type(info).__name__}")
    window = info.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise KvqrsError(f"compressed cache: layer {i} has sliding window {window!r}")
    if not info.get("initialized"):
        return info
    counts = {"head_dim": 1, "batch": 1, "kv_heads": 1, "quantized": 0, **dict.fromkeys(_POSITIONS, 0)}
    for name, low in counts.items():
        if name in ("batch", "kv_heads") and name not in info:
            continue  # kvqrs-cache-v2 did not record them: the window's shape gives them
        v = info.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v < 2**62:
            raise KvqrsError(f"compressed cache: layer {i}'s {name}: expected an integer in {low} .. 2^62 - 1, got {v!r}")
    if info.get("dtype") not in _FLOAT_NAMES:
        raise KvqrsError(f"compressed cache: layer {i}'s dtype: expected one of {_FLOAT_NAMES}, got {info.get('dtype')!r}")
    fitted = info.get("fitted_tokens", 0)
    if isinstance(fitted, bool) or not isinstance(fitted, int) or not 0 <= fitted <= info["seen"]:
        raise KvqrsError(f"compressed cache: layer {i}'s fitted_tokens: expected 0 .. seen ({info['seen']}), got {fitted!r}")
    return info


def loads(data: bytes, config: QuantConfig | None, make_cache: Callable[[QuantConfig, int], Any]):
    """A cache from :func:`dumps` bytes (this version or ``kvqrs-cache-v2``), built by
    ``make_cache(config, num_layers)``. With ``config``, its settings must equal the saved
    ones (HeadQ bases included). Raises :class:`KvqrsError` on altered, truncated or foreign
    bytes or other settings."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KvqrsError(f"data: expected bytes, got {type(data).__name__}")
    raw = _native.container_read(bytes(data))
    if not raw or raw[0][0] != "meta" or raw[0][1] != _UTF8:
        raise KvqrsError("compressed cache: the first section must be the UTF-8 'meta' section")
    try:
        meta = json.loads(raw[0][3].decode("utf-8"))
        assert meta["format"] in READABLE and isinstance(meta["layers"], list) and isinstance(meta["config"], dict)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AssertionError):
        raise KvqrsError(f"compressed cache: not a {FORMAT} file (nor one of the earlier {', '.join(READABLE[1:])})") from None
    if not (meta.get("bases") is None or isinstance(meta["bases"], str)):
        raise KvqrsError(f"compressed cache: meta's bases: expected a bases name or null, got {meta['bases']!r}")
    infos = [_layer_info(i, info) for i, info in enumerate(meta["layers"])]
    sections = {name: (code, shape, payload) for name, code, shape, payload in raw[1:]}
    bases: Any = meta.get("bases")
    if bases is None:
        found = {
            int(n.split(".")[1]): np.frombuffer(p, np.float32).reshape(s)
            for n, (c, s, p) in sections.items()
            if n.startswith("bases.") and c == 2 and re.fullmatch("bases\\.[0-9]+", n)
        }
        if not all(np.isfinite(b).all() for b in found.values()):
            raise KvqrsError("compressed cache: a bases.<layer> section holds a NaN or an infinity")
        bases = found or None
    fields = meta["config"]
    # A sink_dtype without sinks (refused by QuantConfig since) stored only empty sink tensors,
    # in that dtype: the config is rebuilt without it and those tensors read as they were saved.
    unused_sink_dtype = None
    if isinstance(fields, dict) and fields.get("sink_tokens") == 0 and fields.get("sink_dtype") is not None:
        unused_sink_dtype, fields = fields["sink_dtype"], {**fields, "sink_dtype": None}
    try:
        saved = QuantConfig(**{**fields, "calibration": _calibration(meta, sections)}, bases=bases)
    except (TypeError, KvqrsError) as e:
        raise KvqrsError(f"compressed cache: its config cannot be rebuilt ({e})") from None
    if config is not None and not isinstance(config, QuantConfig):
        raise KvqrsError(f"config: expected a QuantConfig or None, got {type(config).__name__}")
    if config is not None:
        _check_same(config, saved)
    cache = make_cache(config or saved, len(infos))
    for i, (layer, info) in enumerate(zip(cache.layers, infos)):
        layer.sliding_window, layer.record_past = info.get("sliding_window"), bool(info.get("record_past"))
        if info.get("initialized"):
            _load_layer(layer, i, info, sections, raw, meta["format"], unused_sink_dtype)
    return cache


def _check_same(config: QuantConfig, saved: QuantConfig) -> None:
    a, b = _config_fields(config), _config_fields(saved)
    diff = sorted(k for k in a if a[k] != b.get(k))
    same_bases = (isinstance(config.bases, str) or config.bases is None) and config.bases == saved.bases
    if not same_bases and isinstance(config.bases, dict) and isinstance(saved.bases, dict):
        same_bases = config.bases.keys() == saved.bases.keys() and all(
            np.array_equal(np.asarray(config.bases[k], np.float32), saved.bases[k]) for k in config.bases
        )
    if not _same_calibration(config.calibration, saved.calibration):
        diff.append("calibration")
    if diff or not same_bases:
        raise KvqrsError(f"compressed cache: saved with other settings (differs in {', '.join(diff + ([] if same_bases else ['bases']))})")


def _same_calibration(a: Any, b: Any) -> bool:
    """Equal ``matched`` calibrations: the same string (or None), or the same layers with equal
    arrays (compared through the digest recorded with the codes)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return a == b if not (isinstance(a, dict) or isinstance(b, dict)) else False
    from ..schemes.matched import calibration_fingerprint

    return a.keys() == b.keys() and all(calibration_fingerprint(a[k]) == calibration_fingerprint(b[k]) for k in a)


def _load_calibration(layer, i: int, info: dict, sections: dict) -> None:
    """A self-calibrated layer's own calibration, set before its codec reads the codes."""
    if f"L{i}.calibration" not in sections:
        return
    fitted = _read_calibration(sections, f"L{i}.calibration")
    if list(fitted) != [0] or layer.config.calibration != "prefill":
        raise KvqrsError(f"compressed cache: layer {i} carries its own calibration, but the config's calibration is not 'prefill'")
    layer.set_calibration(fitted[0], int(info.get("fitted_tokens", 0)))


def _load_layer(layer, i: int, info: dict, sections: dict, raw: list, version: str, unused_sink_dtype: str | None = None) -> None:
    dtype, d, quantized = info["dtype"], info["head_dim"], info["quantized"]  # checked by _layer_info
    seen, start, q_start = (info[name] for name in _POSITIONS)
    lead = (info.get("batch"), info.get("kv_heads"), d)
    sink_dtype = layer.config.sink_dtype or dtype  # sinks stored in the config's sink_dtype when set
    fp = {
        name: _tensor(sections, f"L{i}.{name}", (unused_sink_dtype or sink_dtype) if name.startswith("sink_") else dtype, lead)
        for name in (*_FP_ALWAYS, *_FP_OPTIONAL)
        if name in _FP_ALWAYS or info.get(name)
    }
    if unused_sink_dtype is not None:  # empty: the dtype of no sinks
        fp.update({name: fp[name].to(getattr(torch, sink_dtype)) for name in ("sink_keys", "sink_values")})
    keys = fp["window_keys"]
    layer.lazy_initialization(keys, fp["window_values"])
    _load_calibration(layer, i, info, sections)
    codec = layer.codec()
    b, h = keys.shape[0], keys.shape[1]
    store = None
    n_sinks, n_window = fp["sink_keys"].shape[-2], keys.shape[-2]
    if not (start + n_sinks == q_start and q_start + quantized + n_window == seen):  # before a store of that size is made
        raise KvqrsError(
            f"compressed cache: layer {i} positions (seen {seen}, start {start}, first coded {q_start}) do not match its "
            f"{n_sinks} sink, {quantized} coded and {n_window} window tokens"
        )
    if version == FORMAT:
        if info.get("store"):
            prefix = f"L{i}.store."
            _check_finite_sections(raw[1:], prefix)
            mine = [s for s in raw[1:] if s[0].startswith(prefix)]
            store = CodeStore.from_sections(codec, (b, h, quantized, d), layer.dtype, mine, prefix)
    elif info.get("keys"):  # kvqrs-cache-v2: one nested kvqrs.format container per side
        ck = _nested(sections, f"L{i}.keys", codec)
        if info.get("values"):
            cv = _nested(sections, f"L{i}.values", codec)
        elif info.get("fp_values"):
            cv = _tensor(sections, f"L{i}.fp_values", dtype, lead)
        else:
            raise KvqrsError(f"compressed cache: layer {i} has quantized keys but no values for them")
        if ck.shape[-2] != quantized:
            raise KvqrsError(f"compressed cache: layer {i} holds {ck.shape[-2]} quantized tokens, its meta says {quantized}")
        store = CodeStore(codec, b, h, d, layer.dtype)
        store.append(ck, cv)
    layer.restore(fp, store, {"seen": seen, "start": start, "q_start": q_start, "quantized": quantized})


def _nested(sections: dict, name: str, codec):
    code, _, payload = sections.get(name, (None, None, None))
    if code != _U8:
        raise KvqrsError(f"compressed cache: section {name!r} is missing")
    return fmt.loads(payload, codec)
