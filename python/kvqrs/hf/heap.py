"""Handing freed heap memory back to the system after a long prompt is encoded.

Encoding a long prompt's keys and values makes tens of MiB of temporaries per layer (the
window's copy of the prompt, float32 rows, unpacked codes). glibc's allocator raises its mmap
threshold after the first large free, so later temporaries come from the heap, and the codes
appended between them pin its pages: freed but resident. On SmolLM2-135M with a 16k-token prompt
(30 layers, ``kqv`` 4/4) the process kept about 510 MiB resident for 103 MiB of codes until
``malloc_trim`` returned the rest. The cache calls :func:`release_freed` after each large flush,
so that a compressed cache also costs less resident memory, not only fewer bytes of codes.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

RELEASE_MIN_BYTES = 4 << 20
"""A flush of at least this many bytes of originals (keys and values, float32) releases the
freed heap afterwards; a decode step's flushes stay far below it."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from the C library already loaded in this process (no library
    search, which would run ``ldconfig``), or None where it has none (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def release_freed(nbytes: int = RELEASE_MIN_BYTES) -> bool:
    """Return the allocator's free pages to the system when ``nbytes`` (the temporaries just
    freed, in bytes) reaches :data:`RELEASE_MIN_BYTES`. Returns whether it asked the allocator."""
    trim = _malloc_trim() if nbytes >= RELEASE_MIN_BYTES else None
    if trim is None:
        return False
    trim(0)
    return True
