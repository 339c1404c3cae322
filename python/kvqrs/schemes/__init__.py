"""Schemes of docs/schemes.md, composed from the kernels: ``kv``, ``kqv``, ``qkqv``, ``kivi``,
``headq`` (keys on any base) and the ``a2`` value allocation, behind :class:`KVCodec`."""

from .a2 import A2ValueCoder, allocate_bits
from .backend import CPU, Backend, get_backend
from .base import Encoded
from .codec import KEY_SCHEMES, SCHEMES, VALUE_SCHEMES, KVCodec, derive_seed
from .headq import HeadQCoder
from .kivi import KIVICoder
from .mse import MSECoder, MSEQJLCoder

__all__ = [
    "A2ValueCoder",
    "Backend",
    "CPU",
    "Encoded",
    "HeadQCoder",
    "KEY_SCHEMES",
    "KIVICoder",
    "KVCodec",
    "MSECoder",
    "MSEQJLCoder",
    "SCHEMES",
    "VALUE_SCHEMES",
    "allocate_bits",
    "derive_seed",
    "get_backend",
]
