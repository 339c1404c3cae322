"""transformers integration: the ``kvqrs`` attention function, the fast fake-quant evaluation
path, :class:`QuantizedKVCache` and HeadQ calibration."""

from .attention import active, fake_quant, kvqrs_attention, register
from .cache import QuantizedKVCache, QuantizedLayer
from .config import QuantConfig

__all__ = ["QuantConfig", "QuantizedKVCache", "QuantizedLayer", "active", "fake_quant", "kvqrs_attention", "register"]
