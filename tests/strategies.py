"""Hypothesis strategies and comparison helpers shared by the kernel test modules."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import oracle as _oracle

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


# The least-squares scale vs the oracle's float64 one from the same codes: the Rust and WGSL paths decode
# the direction in float32 (DECODE_RTOL) and forms both dot products in float32 (section 8 order),
# then divides once. Measured <= 1.7e-6 relative over head_dims 2..1024, bits 1..8 and row norms
# across 12 decades (float32 storage); bound at 1e-5. A value stored as float16 may then be the
# adjacent float16 (one float16 ulp, 2^-10 relative).
LS_SCALE_RTOL = 1e-5
F16_LIMITS = (2.0**-14, 65504.0)


def assert_scales_close(got, x, codes, nbits, seed, scale="least_squares"):
    """Stored least-squares (or, with ``scale="preserve_norm"``, norm-preserving) scales against
    the oracle's from the same codes: same storage, values within one float16 ulp (float16-range
    values) or LS_SCALE_RTOL (the others; the norm-preserving scale's float32 norm, dot, square
    root and division stay within it too)."""
    x = np.asarray(x, np.float32)
    if scale == "least_squares":
        s = _oracle.mse_least_squares_scale(x, codes, nbits, seed)
    else:
        s = _oracle.mse_preserve_norm_scale(_oracle.vector_norm(x).astype(np.float32), codes, nbits, x.shape[-1], seed)
    want = _oracle.store_scalars(s.astype(np.float32))
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.astype(np.float64), want.astype(np.float64)
    in_f16 = (np.abs(w) >= F16_LIMITS[0]) & (np.abs(w) < F16_LIMITS[1])
    rtol = np.where(in_f16, 2.0**-10, LS_SCALE_RTOL)
    assert np.all(np.isfinite(g)) and np.all(g >= 0)
    assert np.all(np.abs(g - w) <= rtol * np.abs(w)), f"scales differ from the oracle: {g[np.abs(g - w) > rtol * np.abs(w)][:4]}"
