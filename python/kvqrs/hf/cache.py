"""``QuantizedKVCache``: a transformers cache whose layers (:class:`~kvqrs.hf.layer.CompressedLayer`)
store keys and values compressed with any kvqrs scheme, keep the first ``sink_tokens`` and the
newest ``residual_length`` tokens in full precision (during prefill too), and report their real
memory in bytes.

Built with the model's config (``QuantizedKVCache(config, model.config)``), the cache follows the
model's layer types as ``DynamicCache(config=...)`` does: sliding-window layers hold only their
window. A cache built with a layer count holds every token of every layer, and warns once when
the model turns out to have sliding-window layers. Use the model with
``attn_implementation="kvqrs"``; see :mod:`kvqrs.hf.layer_attention` for how each forward reads
the codes.
"""

from __future__ import annotations

import os
import warnings

from transformers.cache_utils import Cache

from .._arrays import KvqrsError, check_positive_int
from . import persist
from .attention import AttentionState, hand_over, register
from .config import QuantConfig
from .layer import CompressedLayer


def check_calibration_fits(config: QuantConfig, model_config) -> None:
    """Refuse a ``matched`` calibration (``{layer: MatchedCalibration}``, as a file gives it)
    made for another model, before any work: the model's decoder layers must be exactly the
    calibration's, with its head_dim and either one calibrated head or the model's KV heads.

    Raises:
        KvqrsError: naming what differs (layers, head_dim or KV heads) between the two.
    """
    cal = config.calibration
    if not isinstance(cal, dict) or not cal:
        return
    text = model_config.get_text_config(decoder=True)
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    first = cal[min(cal)]
    got = (len(cal), first.keys.basis.shape[-1], first.keys.kv_heads)
    if sorted(cal) != list(range(layers)) or got[1] != head_dim or got[2] not in (1, kv_heads):
        name = getattr(model_config, "_name_or_path", "") or type(model_config).__name__
        raise KvqrsError(
            f"calibration: made for a model of {got[0]} layers (indices {min(cal)}..{max(cal)}), head_dim {got[1]} and "
            f"{got[2]} calibrated KV heads; this model ({name}) has {layers} layers, head_dim {head_dim} and {kv_heads} KV "
            "heads. Fit one for it: kvqrs calibrate --model ... (or QuantConfig.preset(name) without a file, calibrated on the prompt)"
        )


def check_calibration_layers(config: QuantConfig, num_layers: int) -> None:
    """Refuse, before any work, a ``matched`` calibration that lacks some of the layers
    ``0 .. num_layers - 1`` of a cache sized by its layer count alone (its first layers may
    stand for a smaller model's, as the speed harness's one-layer caches use them; head_dim
    and KV heads are compared at each layer's first update).

    Raises:
        KvqrsError: naming both layer counts.
    """
    cal = config.calibration
    missing = sorted(set(range(num_layers)) - set(cal)) if isinstance(cal, dict) and cal else []
    if missing:
        raise KvqrsError(
            f"calibration: made for a model of {len(cal)} layers (indices {min(cal)}..{max(cal)}); this cache has "
            f"{num_layers} layers, and layers {missing[:8]}{' ...' if len(missing) > 8 else ''} have none. Fit one for "
            "the model: kvqrs calibrate --model ... (or QuantConfig.preset(name) without a file, calibrated on the prompt)"
        )


SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
"""Layer types held with a window: transformers' caches treat chunked attention as a sliding
window too (only the mask differs)."""


def layer_windows(model_config) -> list[int | None]:
    """Per decoder layer, the sliding window (None: full attention) of a transformers model
    config, read as ``DynamicCache(config=...)`` reads it (``layer_types``, or
    ``sliding_window`` / ``attention_chunk_size`` per layer). Raises :class:`KvqrsError`
    naming any other layer type (linear attention, convolution, indexed attention, shared
    or attention-free layers): their state is not a key/value cache kvqrs can quantize."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(model_config.get_text_config(decoder=True))
    other = sorted({t for t in types if t != "full_attention" and t not in SLIDING_LAYER_TYPES})
    if other:
        raise KvqrsError(
            f"model_config: layer types {other} are not supported by QuantizedKVCache (it holds full_attention, "
            f"{' and '.join(SLIDING_LAYER_TYPES)} layers)"
        )
    return [kw["sliding_window"] if t in SLIDING_LAYER_TYPES else None for t, kw in zip(types, kwargs)]


class QuantizedKVCache(Cache, AttentionState):
    """A transformers cache holding keys and values compressed by kvqrs.

    Args:
        config: :class:`QuantConfig` (schemes, bits, ``residual_length``, ``sink_tokens``,
            HeadQ bases, seed).
        num_layers: the model's config (``model.config``, as ``DynamicCache(config=...)``
            takes it): one layer per decoder layer, sliding-window layers where the model has
            them (see :func:`layer_windows`); or a number of decoder layers, all full attention
            (a cache that then meets a sliding-window layer of the model warns once, at its
            first forward).
        model_config: the model's config by keyword, in place of ``num_layers``. Give exactly
            one of the two.

    Example::

        model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="kvqrs")
        cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=32), model.config)
        model.generate(ids, cache=cache, max_new_tokens=20)
        cache.nbytes()
    """

    def __init__(self, config: QuantConfig, num_layers: int | None = None, *, model_config=None):
        register()
        if not isinstance(config, QuantConfig):
            raise KvqrsError(f"config: expected a QuantConfig, got {type(config).__name__}")
        if hasattr(num_layers, "get_text_config"):  # a transformers config, as DynamicCache(config=...) takes
            if model_config is not None:
                raise KvqrsError("num_layers, model_config: give exactly one (model_config to follow the model's sliding-window layers)")
            num_layers, model_config = None, num_layers
        if num_layers is not None:
            num_layers = check_positive_int(num_layers, "num_layers")
        if config.key_scheme is None:
            raise KvqrsError("key_scheme: the cache quantizes keys; value-only rows run in the fast evaluation path only")
        if config.value_scheme == "a2":
            raise KvqrsError(
                "value_scheme: the a2 allocation needs each token's future attention; it runs in the fast evaluation path only"
            )
        if config.has_value_classes:
            raise KvqrsError(
                "calibration: values in width classes need the A^2 importance of each token from the queries that read it; "
                "they run in the fast evaluation path (kvqrs.hf.fake_quant) only"
            )
        if (num_layers is None) == (model_config is None):
            raise KvqrsError("num_layers, model_config: give exactly one (model_config to follow the model's sliding-window layers)")
        windows = [None] * max(num_layers, 0) if model_config is None else layer_windows(model_config)
        if model_config is not None:
            check_calibration_fits(config, model_config)
        else:
            check_calibration_layers(config, num_layers)
        if len(windows) < 1:
            raise KvqrsError(f"num_layers: expected >= 1, got {num_layers if model_config is None else 0}")
        # The cache's own settings: the caller may go on changing its config (QuantConfig's
        # setters rebuild its codecs) without changing what this cache has coded or codes next.
        self.config = config = config.in_use_copy()
        self._window_warned = False
        super().__init__(layers=[CompressedLayer(config, i, w) for i, w in enumerate(windows)])

    def note_sliding_window(self, module, sliding_window: int) -> None:
        """Called by the ``kvqrs`` attention function for a layer the model runs with a sliding
        window (its ``sliding_window`` argument): warns once when this cache holds that layer as
        full attention (built with a layer count, not the model's config)."""
        layer = getattr(module, "layer_idx", None)
        if self._window_warned or not isinstance(layer, int) or not 0 <= layer < len(self.layers) or self.layers[layer].is_sliding:
            return
        self._window_warned = True
        warnings.warn(
            f"QuantizedKVCache: layer {layer} of the model attends over a sliding window of {sliding_window} tokens, but this "
            "cache, built with a layer count, holds all its tokens as full attention (more memory than the model reads); "
            "build it with QuantizedKVCache(config, model.config) to follow the model's layer types",
            UserWarning,
            stacklevel=2,
        )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise KvqrsError(f"num_layers: this cache has {len(self.layers)} layers, the model updated layer {layer_idx}")
        hand_over(self)  # the kvqrs attention call of this layer, next, consults this cache
        # The layer's own update: transformers' Cache.update adds only offloading, which this
        # cache never turns on.
        return self.layers[layer_idx].update(key_states, value_states, *args, fused=self.config.fused, **kwargs)

    def attend(self, module, query, key, value, attention_mask, scaling):
        # Handed to the attention call after each update (hand_over); keys other than the ones
        # this layer returned (a stale hand-over, another forward) are declined.
        if not 0 <= module.layer_idx < len(self.layers):
            return None
        return self.layers[module.layer_idx].attend(module, query, key, value, attention_mask, scaling)

    def nbytes(self) -> int:
        """Real memory of the cache in bytes (codes, norms, scales, sketches, side codes and
        the full-precision window)."""
        return sum(layer.nbytes() for layer in self.layers)

    # -- the compressed-cache format (docs/format.md; kvqrs.hf.persist) ---------------------------------
    def __deepcopy__(self, memo: dict) -> QuantizedKVCache:
        """A copy through :meth:`to_bytes` / :meth:`from_bytes` (the codes live in native
        stores): ``copy.deepcopy(cache)`` reuses a prefilled prompt, as transformers' prefix
        caching recipe does. The copy holds the same bytes; its window is contiguous where the
        original's may be a view of a longer buffer, so a fused decode step may round its last
        bit differently. Raises :class:`KvqrsError` for a cache on a non-CPU device."""
        return type(self).from_bytes(self.to_bytes())

    def __reduce__(self):
        """Pickled as its :meth:`to_bytes` (Ray, multiprocessing)."""
        return (_cache_from_bytes, (type(self), self.to_bytes()))

    def to_bytes(self) -> bytes:
        """The whole cache (config, codes, full-precision window, HeadQ bases) as checksummed bytes."""
        return persist.dumps(self)

    @classmethod
    def from_bytes(cls, data: bytes, config: QuantConfig | None = None) -> QuantizedKVCache:
        """A cache from :meth:`to_bytes`; with ``config``, its settings must equal the saved
        ones. Raises :class:`KvqrsError` on altered, truncated or foreign bytes."""
        return persist.loads(data, config, lambda cfg, n: cls(cfg, n))

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_bytes` to ``path``."""
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike, config: QuantConfig | None = None) -> QuantizedKVCache:
        """Read a cache written by :meth:`save` (see :meth:`from_bytes`); a file that cannot be
        read raises :class:`KvqrsError` naming it."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise KvqrsError(f"path: cannot read the saved cache {os.fspath(path)!r}: {e.strerror or type(e).__name__}") from None
        return cls.from_bytes(data, config)


def _cache_from_bytes(cls: type, data: bytes) -> QuantizedKVCache:
    """Unpickle a :class:`QuantizedKVCache` (or subclass) from its :meth:`~QuantizedKVCache.to_bytes`."""
    return cls.from_bytes(data)
