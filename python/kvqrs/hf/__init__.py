"""transformers integration: the ``kvqrs`` attention function, the fast fake-quant evaluation
path, :class:`QuantizedKVCache`, HeadQ calibration and the torch thread count
(:func:`fastest_threads`)."""

from .attention import active, fake_quant, kvqrs_attention, register
from .cache import QuantizedKVCache
from .calibration import calibrate, calibrate_matched, fit_matched, load_bases, load_matched, record_matched, save_bases, save_matched
from .config import QuantConfig
from .layer import CompressedLayer
from .threads import fastest_threads, set_num_threads

__all__ = [
    "QuantConfig",
    "QuantizedKVCache",
    "CompressedLayer",
    "active",
    "calibrate",
    "calibrate_matched",
    "fit_matched",
    "record_matched",
    "load_matched",
    "save_matched",
    "load_bases",
    "save_bases",
    "fake_quant",
    "fastest_threads",
    "set_num_threads",
    "kvqrs_attention",
    "register",
]
