"""Schemes of docs/schemes.md, composed from the kernels: ``kv``, ``kqv``, ``qkqv``, ``kivi``,
``block``, ``headq`` (keys on any base), ``matched``, the ``a2`` value allocation and ``none``
values, behind :class:`KVCodec`; :data:`REGISTRY` holds each one's :class:`SchemeSpec` (how its
coders are built, what it can do), every coder is a :class:`Coder`."""

from .a2 import A2ValueCoder, allocate_bits
from .backend import CPU, Backend, get_backend
from .base import Coder, Encoded
from .codec import KEY_SCHEMES, SCHEMES, VALUE_SCHEMES, KVCodec, derive_seed
from .headq import HeadQCoder
from .kivi import KIVICoder
from .mse import MSECoder, MSEQJLCoder
from .registry import REGISTRY, SchemeSpec

__all__ = [
    "A2ValueCoder",
    "Backend",
    "CPU",
    "Coder",
    "Encoded",
    "HeadQCoder",
    "KEY_SCHEMES",
    "KIVICoder",
    "KVCodec",
    "MSECoder",
    "MSEQJLCoder",
    "REGISTRY",
    "SCHEMES",
    "SchemeSpec",
    "VALUE_SCHEMES",
    "allocate_bits",
    "derive_seed",
    "get_backend",
]
