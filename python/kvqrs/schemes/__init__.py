"""Schemes of docs/schemes.md, composed from the kernels: ``kv``, ``kqv``, ``qkqv``, ``kivi``,
``block``, ``headq`` (keys on any base), ``matched``, the ``a2`` value allocation and ``none``
values, behind :class:`KVCodec`; :data:`REGISTRY` holds each one's :class:`SchemeSpec` (how its
coders are built, what it can do), every coder is a :class:`Coder`."""

from .a2 import A2ValueCoder, allocate_bits
from .backend import CPU, Backend, get_backend
from .base import Coder, Encoded
from .codec import KVCodec, derive_seed
from .headq import HeadQCoder
from .kivi import KIVICoder
from .mse import MSECoder, MSEQJLCoder
from .registry import REGISTRY, SchemeSpec, names, register

# The registry's name lists, derived from it when read (``SCHEMES``: the key schemes).
KEY_SCHEMES: tuple[str, ...]
SCHEMES: tuple[str, ...]
VALUE_SCHEMES: tuple[str, ...]


def __getattr__(name: str) -> tuple[str, ...]:
    if name in ("KEY_SCHEMES", "SCHEMES", "VALUE_SCHEMES"):
        return names("KEY_SCHEMES" if name == "SCHEMES" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "register",
]
