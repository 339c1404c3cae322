"""Shared by the tests/gpu/test_gpu_*.py modules: the one-time adapter check behind their module
skip, the WGSL path's stated tolerances, and helpers comparing it with the Rust path."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from kvqrs.gpu import unavailable_reason

# Mesa's lavapipe (the adapter of a machine without a GPU) loads its LLVM into the process, and
# triton's library, which importing transformers loads (through torch._dynamo), then crashes the
# process as it loads. Loaded before the adapter, both work: the WGSL tests can share a run with
# tests of the transformers integration in any order (``pytest tests/gpu tests/hf``).
with contextlib.suppress(ImportError):
    import triton  # noqa: F401

# Computed once per session: None when a WebGPU adapter exists (lavapipe counts), else why not.
NO_ADAPTER = unavailable_reason()
requires_adapter = pytest.mark.skipif(
    NO_ADAPTER is not None, reason=f"the WGSL tests need a WebGPU adapter and none exists here: {NO_ADAPTER}"
)

# --------------------------------------------------------------------------------------------
# Tolerances of the WGSL path against the Rust path (docs/kernels.md section 10)
# --------------------------------------------------------------------------------------------

# Drivers may flush float32 subnormals (|v| < 2^-126) to zero (llvmpipe does); a transform then
# differs from the Rust path by at most a few subnormals per output, below this absolute bound.
FLUSH_ATOL = 1e-35
# Norms: the device sums (x 2^-e)^2 in float32 (the Rust path in float64) over eight strided
# accumulators of <= 32 terms each for d <= 256, then takes a WGSL sqrt (not required to be
# correctly rounded): <= (d/8 + 4) / 2 + 3 float32 ulps, i.e. < 2^-18 relative.
NORM_RTOL = 2.0**-18
# One ulp of float16 storage, relative: a float32 norm or scale that moved by a rounding may
# land on the adjacent float16.
F16_RTOL = 2.0**-10
# Unit coordinates y / ||x|| move by <= NORM_RTOL + 2.5 ulp of the WGSL division (|u| <= 1), so a
# Lloyd-Max code may change only within this distance of a boundary.
GPU_BOUNDARY_TOL = 2.0**-17
# Rounding to an integer (HeadQ side codes, KIVI codes): WGSL divisions are within 2.5 ulp, so
# p / s (+ h) + 0.5 may fall on the other side of an integer only within this distance of it.
ROUND_TIE_TOL = 1e-4
# Dot-product results (QJL estimators, HeadQ corrections) relative to the sum of absolute
# terms: bit-identical on drivers that do not fuse a*b+c (lavapipe), within a rounding per
# term where a driver contracts to FMA.
SUM_RTOL = 1e-5


def assert_stored_close(got: np.ndarray, want: np.ndarray, rtol32: float = NORM_RTOL) -> None:
    """Stored scalars (float16 or float32) of the two paths: same storage and shape, values
    within one float16 ulp (float16) or ``rtol32`` (float32)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert got.dtype == want.dtype, f"storage {got.dtype} != Rust path's {want.dtype}"
    rtol = F16_RTOL if want.dtype == np.float16 else rtol32
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=0)


def codes_equal_except_ties(got, want, dist, tol) -> int:
    """``got == want`` except at positions whose distance to the decision point ``dist`` is
    within ``tol``, where they may differ by one step. Returns the number excused."""
    got, want, dist = np.asarray(got).astype(int), np.asarray(want).astype(int), np.asarray(dist)
    diff = got != want
    assert np.all(dist[diff] <= tol), f"codes differ away from a decision point: distances {dist[diff][:5]}"
    assert np.all(np.abs(got[diff] - want[diff]) == 1), "codes differ by more than one step"
    return int(diff.sum())


def same_error(gpu_call, cpu_call) -> str:
    """Both calls raise KvqrsError with the same message; returns it."""
    import kvqrs

    with pytest.raises(kvqrs.KvqrsError) as cpu_err:
        cpu_call()
    with pytest.raises(kvqrs.KvqrsError) as gpu_err:
        gpu_call()
    assert str(gpu_err.value) == str(cpu_err.value)
    return str(gpu_err.value)
