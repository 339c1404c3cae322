"""The seeded counter-based generator (Philox4x32-10) and the random objects derived from it
(docs/kernels.md section 1)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from .. import _native
from .._arrays import KvqrsError, check_positive_int, check_seed

STREAM_ROTATION_SIGNS = 1
STREAM_QJL_MATRIX = 2
STREAM_RANDOM_BASIS = 3


def _word(v: object) -> int:
    if isinstance(v, bool):
        raise TypeError("bool is not a word")
    return operator.index(v)  # type: ignore[arg-type]


def philox4x32_10(counter: Sequence[int], key: Sequence[int]) -> tuple[int, int, int, int]:
    """One Philox4x32-10 block: four 32-bit words from a 4-word counter and a 2-word key."""
    try:
        c = [_word(v) for v in counter]
        k = [_word(v) for v in key]
    except TypeError:
        raise KvqrsError(f"counter/key: expected integer words, got {counter!r} and {key!r}") from None
    if len(c) != 4 or len(k) != 2 or not all(0 <= v < 2**32 for v in c + k):
        raise KvqrsError(f"counter/key: expected 4 and 2 unsigned 32-bit words, got {c} and {k}")
    return tuple(_native.philox4x32_10(c, k))  # type: ignore[return-value]


def rotation_signs(seed: int, dim: int) -> np.ndarray:
    """The rotation's +-1 sign vector (float32 ``(dim,)``)."""
    return _native.rotation_signs(check_seed(seed, optional=False), check_positive_int(dim, "dim"))


def gaussians(seed: int, stream: int, count: int) -> np.ndarray:
    """Entries ``0 .. count-1`` of a Gaussian stream (float32, Box-Muller in float64)."""
    tag = check_positive_int(stream, "stream", minimum=0)
    if tag >= 2**32:
        raise KvqrsError(f"stream: expected an unsigned 32-bit tag, got {stream}")
    return _native.gaussians(check_seed(seed, optional=False), tag, check_positive_int(count, "count", 0))


def qjl_matrix(seed: int, m: int, dim: int) -> np.ndarray:
    """The QJL matrix ``S`` (float32 ``(m, dim)``, i.i.d. N(0, 1))."""
    mm = check_positive_int(m, "m")
    d = check_positive_int(dim, "dim")
    return _native.qjl_matrix(check_seed(seed, optional=False), mm, d).reshape(mm, d)


def random_orthonormal_basis(seed: int, head_dim: int, rank: int) -> np.ndarray:
    """A seeded random orthonormal basis (float32 ``(head_dim, rank)``), the HeadQ control.

    Gaussian entries of stream 3 orthonormalised by modified Gram-Schmidt in float64.

    Raises:
        KvqrsError: rank < 1 or rank > head_dim, or a bad seed.
    """
    d = check_positive_int(head_dim, "head_dim")
    r = check_positive_int(rank, "rank")
    out = _native.random_orthonormal_basis(check_seed(seed, optional=False), d, r)
    return out.reshape(d, r)
