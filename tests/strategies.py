"""Hypothesis strategies and comparison helpers shared by the kernel test modules."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

# Head dims of common models (40 to 256), plus small and odd ones.
HEAD_DIMS = [40, 64, 80, 96, 112, 128, 160, 192, 256]
EDGE_DIMS = [2, 3, 5, 8, 17, 33]

bits = st.integers(min_value=1, max_value=8)
seeds = st.integers(min_value=0, max_value=2**64 - 1)
head_dims = st.sampled_from(HEAD_DIMS + EDGE_DIMS)
leading_shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5)

# Absolute tolerance, in unit-vector coordinates, within which a float32 value may fall on
# either side of a Lloyd-Max decision boundary (float32 rotation vs the float64 oracle).
BOUNDARY_TOL = 1e-5


def float_rows(draw, leading, dim, scale=10.0, dtype=np.float32):
    """Draw finite rows ``(*leading, dim)`` with values in [-scale, scale]."""
    return draw(
        hnp.arrays(
            dtype,
            (*leading, dim),
            elements=st.floats(-scale, scale, allow_nan=False, allow_infinity=False, width=32),
        )
    )


def gaussian_rows(seed: int, n: int, dim: int) -> np.ndarray:
    """Seeded standard normal rows (float32)."""
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def codes_match_except_near_boundaries(got, want, values, boundaries, tol=BOUNDARY_TOL):
    """Assert ``got == want`` except where ``values`` lies within ``tol`` of a boundary.

    Returns the number of positions excused (callers may bound it).
    """
    got = np.asarray(got)
    want = np.asarray(want)
    diff = got != want
    if not diff.any():
        return 0
    v = np.asarray(values, dtype=np.float64)[diff]
    dist = np.min(np.abs(v[:, None] - np.asarray(boundaries, dtype=np.float64)[None, :]), axis=1)
    assert np.all(dist <= tol), f"codes differ away from boundaries: distances {dist[dist > tol][:5]}"
    assert np.all(np.abs(got[diff].astype(int) - want[diff].astype(int)) == 1), "codes differ by more than one step"
    return int(diff.sum())


# ---------------------------------------------------------------------------------------------
# Appended for test_mse / test_qjl / test_headq.
# ---------------------------------------------------------------------------------------------

# Values below this magnitude are flushed to zero by ``finite_rows``: a row whose every value is
# near float32's subnormal range loses relative precision in any float32 rotation or projection
# (by design, kernels.md section 3 fixes float32 arithmetic), which is not what the
# kernel-vs-oracle comparisons are about.
TINY = 1e-30

POWER_OF_TWO_DIMS = [d for d in HEAD_DIMS + EDGE_DIMS if d & (d - 1) == 0]


def finite_rows(draw, leading, dim, scale=10.0, dtype=np.float32, tiny=TINY):
    """Draw finite rows ``(*leading, dim)`` in [-scale, scale], no subnormals, ``|v| < tiny``
    flushed to 0, then cast to ``dtype`` (so float16 / bfloat16 / float64 work too)."""
    bound = float(np.float32(scale))
    x = draw(
        hnp.arrays(
            np.float32,
            (*leading, dim),
            elements=st.floats(-bound, bound, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32),
        )
    )
    x[np.abs(x) < tiny] = 0.0
    return x.astype(dtype)
