"""transformers integration: the ``kvqrs`` attention function, the fast fake-quant evaluation
path, :class:`QuantizedKVCache` and HeadQ calibration."""

from .attention import active, fake_quant, kvqrs_attention, register
from .cache import QuantizedKVCache, QuantizedLayer
from .calibration import calibrate, load_bases, save_bases
from .config import QuantConfig

__all__ = [
    "QuantConfig",
    "QuantizedKVCache",
    "QuantizedLayer",
    "active",
    "calibrate",
    "load_bases",
    "save_bases",
    "fake_quant",
    "kvqrs_attention",
    "register",
]
