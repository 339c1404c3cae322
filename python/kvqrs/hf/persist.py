"""A whole :class:`~kvqrs.hf.QuantizedKVCache` as bytes (docs/format.md), and back.

One container (``kvqrs_core::format``): a ``meta`` section (format tag, the
:class:`~kvqrs.hf.QuantConfig` fields, per layer its sliding window, the positions it holds
(tokens seen, first held, first coded), the quantized token count, dtype and which parts
exist), each layer's encoded keys and values as nested :mod:`kvqrs.format` containers (each
with its own parameters and checksums), its full-precision tensors (window, sinks, for
key-only configs the values of quantized tokens, and originals kept for a rollback) as raw
tensors, and the HeadQ bases.
Loading rebuilds the config, or checks it equals the one given, and loads every encoded part
against the layer's codec, so other settings or altered bytes raise instead of decoding garbage.
"""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Any

import numpy as np
import torch

from .. import _native
from .. import format as fmt
from .._arrays import KvqrsError
from .config import QuantConfig

FORMAT = "kvqrs-cache-v2"
_U8, _UTF8 = 0, 5
_FLOAT = {torch.float32: 2, torch.float16: 1, torch.float64: 3, torch.bfloat16: 6}  # container dtype codes


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


# Full-precision tensors of a layer: section suffix -> attribute (the optional ones may be absent).
_FP_SECTIONS = {"window_keys": "keys", "window_values": "values", "sink_keys": "sink_k", "sink_values": "sink_v"}
_FP_OPTIONAL = {"fp_values": "_fp_values_quantized", "pending_keys": "pending_k", "pending_values": "pending_v"}
_POSITIONS = ("seen", "start", "q_start")


def dumps(cache) -> bytes:
    """The cache as bytes. Raises :class:`KvqrsError` for a cache on a non-CPU device."""
    layers, sections = [], []
    for i, layer in enumerate(cache.layers):
        info = {"initialized": bool(layer.is_initialized), "quantized": int(layer.quantized), "sliding_window": layer.sliding_window}
        info["record_past"] = bool(layer.record_past)
        if layer.is_initialized:
            if layer.keys.device.type != "cpu":
                raise KvqrsError(f"cache: layer {i} lives on {layer.keys.device}; move it to the CPU to save it")
            info.update(
                dtype=str(layer.dtype).removeprefix("torch."),
                head_dim=int(layer.head_dim),
                keys=bool(layer.chunks_k),
                values=bool(layer.chunks_v and layer.chunks_v[0] is not None),
                **{name: int(getattr(layer, name)) for name in _POSITIONS},
            )
            for name, attr in {**_FP_SECTIONS, **_FP_OPTIONAL}.items():
                t = getattr(layer, attr, None)
                info[name] = t is not None
                if t is not None:
                    sections.append(_tensor_section(f"L{i}.{name}", t))
            if layer.fitted is not None:  # calibration="prefill": the layer's own calibration
                blob = _calibration_bytes({0: layer.fitted})
                sections.append((f"L{i}.calibration", _U8, [len(blob)], blob))
                info["fitted_tokens"] = int(layer.fitted_tokens)
            if info["keys"]:
                blob = fmt.dumps(layer.chunks_k[0])
                sections.append((f"L{i}.keys", _U8, [len(blob)], blob))
            if info["values"]:
                blob = fmt.dumps(layer.chunks_v[0])
                sections.append((f"L{i}.values", _U8, [len(blob)], blob))
        layers.append(info)
    bases = cache.config.bases
    if isinstance(bases, dict):
        for layer_idx, b in sorted(bases.items()):
            a = np.ascontiguousarray(b, np.float32)
            sections.append((f"bases.{int(layer_idx)}", 2, list(a.shape), a.tobytes()))
    meta = {"format": FORMAT, "config": _config_fields(cache.config), "bases": bases if isinstance(bases, str) else None, "layers": layers}
    text = json.dumps(meta).encode()
    return _native.container_write([("meta", _UTF8, [len(text)], text), *_calibration_section(cache.config), *sections])


def _tensor(sections: dict, name: str, dtype: str, head_dim: int) -> torch.Tensor:
    if name not in sections:
        raise KvqrsError(f"compressed cache: section {name!r} is missing")
    code, shape, payload = sections[name]
    want = getattr(torch, dtype, None)
    if want not in _FLOAT or _FLOAT[want] != code or len(shape) != 4 or shape[-1] != head_dim:
        raise KvqrsError(f"compressed cache: section {name!r} is not a (batch, heads, tokens, {head_dim}) {dtype} tensor")
    return torch.frombuffer(bytearray(payload), dtype=want).reshape(shape) if payload else torch.zeros(shape, dtype=want)


def loads(data: bytes, config: QuantConfig | None = None):
    """A cache from :func:`dumps` bytes. With ``config``, its settings must equal the saved
    ones (HeadQ bases included). Raises :class:`KvqrsError` on altered, truncated or foreign
    bytes or other settings."""
    from .cache import QuantizedKVCache

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise KvqrsError(f"data: expected bytes, got {type(data).__name__}")
    raw = _native.container_read(bytes(data))
    if not raw or raw[0][0] != "meta" or raw[0][1] != _UTF8:
        raise KvqrsError("compressed cache: the first section must be the UTF-8 'meta' section")
    try:
        meta = json.loads(raw[0][3].decode("utf-8"))
        assert meta["format"] == FORMAT and isinstance(meta["layers"], list) and isinstance(meta["config"], dict)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AssertionError):
        raise KvqrsError(f"compressed cache: not a {FORMAT} file") from None
    sections = {name: (code, shape, payload) for name, code, shape, payload in raw[1:]}
    bases: Any = meta["bases"]
    if bases is None:
        found = {
            int(n.split(".")[1]): np.frombuffer(p, np.float32).reshape(s)
            for n, (c, s, p) in sections.items()
            if n.startswith("bases.") and c == 2
        }
        bases = found or None
    try:
        saved = QuantConfig(**{**meta["config"], "calibration": _calibration(meta, sections)}, bases=bases)
    except (TypeError, KvqrsError) as e:
        raise KvqrsError(f"compressed cache: its config cannot be rebuilt ({e})") from None
    if config is not None and not isinstance(config, QuantConfig):
        raise KvqrsError(f"config: expected a QuantConfig or None, got {type(config).__name__}")
    if config is not None:
        _check_same(config, saved)
    cache = QuantizedKVCache(config or saved, len(meta["layers"]))
    for i, (layer, info) in enumerate(zip(cache.layers, meta["layers"])):
        window = info.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise KvqrsError(f"compressed cache: layer {i} has sliding window {window!r}")
        layer.sliding_window, layer.record_past = window, bool(info.get("record_past"))
        if info.get("initialized"):
            _load_layer(layer, i, info, sections)
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


def _load_layer(layer, i: int, info: dict, sections: dict) -> None:
    dtype, d = info["dtype"], int(info["head_dim"])
    keys = _tensor(sections, f"L{i}.window_keys", dtype, d)
    layer.lazy_initialization(keys, keys)
    if f"L{i}.calibration" in sections:
        fitted = _read_calibration(sections, f"L{i}.calibration")
        if list(fitted) != [0] or layer.config.calibration != "prefill":
            raise KvqrsError(f"compressed cache: layer {i} carries its own calibration, but the config's calibration is not 'prefill'")
        layer.set_calibration(fitted[0], int(info.get("fitted_tokens", 0)))
    for name, attr in {**_FP_SECTIONS, **_FP_OPTIONAL}.items():
        if name in _FP_SECTIONS or info.get(name):
            setattr(layer, attr, _tensor(sections, f"L{i}.{name}", dtype, d))
    codec = layer.codec()
    for side, target in (("keys", layer.chunks_k), ("values", layer.chunks_v)):
        if info.get(side):
            code, shape, payload = sections.get(f"L{i}.{side}", (None, None, None))
            if code != _U8:
                raise KvqrsError(f"compressed cache: section 'L{i}.{side}' is missing")
            target.append(fmt.loads(payload, codec))
    layer.quantized = int(info["quantized"])
    held = layer.chunks_k[0].shape[-2] if layer.chunks_k else 0
    if held != layer.quantized or layer.keys.shape != layer.values.shape:
        raise KvqrsError(f"compressed cache: layer {i} holds {held} quantized tokens, its meta says {layer.quantized}")
    if not info.get("values") and not info.get("fp_values") and held:
        raise KvqrsError(f"compressed cache: layer {i} has quantized keys but no values for them")
    _load_positions(layer, i, info)


def _load_positions(layer, i: int, info: dict) -> None:
    """Positions held, checked against the tensors: sinks, codes and window are contiguous."""
    try:
        seen, start, q_start = (int(info[name]) for name in _POSITIONS)
    except (KeyError, TypeError, ValueError):
        raise KvqrsError(f"compressed cache: layer {i} lacks the positions it holds") from None
    ns, nw = layer.sink_k.shape[-2], layer.keys.shape[-2]
    pending = 0 if layer.pending_k is None else layer.pending_k.shape[-2]
    if not (0 <= start and start + ns == q_start and q_start + layer.quantized + nw == seen and pending <= layer.quantized):
        raise KvqrsError(
            f"compressed cache: layer {i} positions (seen {seen}, start {start}, first coded {q_start}) do not match its "
            f"{ns} sink, {layer.quantized} coded and {nw} window tokens"
        )
    layer.seen, layer.start, layer.q_start = seen, start, q_start
