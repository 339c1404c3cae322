"""Every kernel on every instruction-set path this CPU supports (``_native.simd_available()``)
returns the scalar path's bytes exactly: codes, packed bytes, stored norms and scales (dtype
included) and floats compared bit for bit. Plus the path controls themselves."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import _native

from .strategies import HEAD_DIMS, bits, float_rows, head_dims, seeds
from .test_attention import matched_problems, problems

SIMD = [i for i in _native.simd_available() if i != "scalar"]


@contextlib.contextmanager
def isa(name: str):
    _native.set_isa(name)
    try:
        yield
    finally:
        _native.set_isa(None)


def run_all(fn):
    """``fn()`` on the scalar path and on every other supported path."""
    with isa("scalar"):
        want = fn()
    return want, {name: _run(fn, name) for name in SIMD}


def _run(fn, name):
    with isa(name):
        return fn()


def same_bytes(a, b) -> bool:
    """Equal dtype, shape and bytes, recursively through tuples."""
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same_bytes(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def assert_identical(fn):
    want, got = run_all(fn)
    for name, g in got.items():
        assert same_bytes(g, want), f"{name} differs from scalar"


@st.composite
def rows_of_mixed_scale(draw):
    """Rows of a drawn head_dim, scaled by a power of ten from 1e-30 to 1e30, some rows zero."""
    d = draw(head_dims)
    n = draw(st.integers(0, 6))
    x = float_rows(draw, (n,), d, scale=4.0)
    x = x * np.float32(10.0 ** draw(st.sampled_from([-30, -8, 0, 5, 30])))
    if n and draw(st.booleans()):
        x[draw(st.integers(0, n - 1))] = 0.0
    return x


@given(x=rows_of_mixed_scale(), b=bits, seed=seeds | st.none())
def test_mse_and_rotation_are_identical_on_every_path(x, b, seed):
    def kernels():
        code = kvqrs.mse_encode(x, b, seed)
        out = (code.codes, code.norms, kvqrs.mse_decode(code.codes, code.norms, b, x.shape[-1], seed))
        out += tuple(kvqrs.mse_encode(x, b, seed, scale="least_squares"))
        out += tuple(kvqrs.mse_encode_packed(x, b, seed, scale="least_squares"))
        out += tuple(kvqrs.mse_encode_packed(x, b, seed, scale="preserve_norm"))
        if seed is not None:
            y = kvqrs.hadamard(x, seed)
            out += (y, kvqrs.inverse_hadamard(y, seed, x.shape[-1]))
        return out

    assert_identical(kernels)


@given(x=rows_of_mixed_scale(), b=bits)
def test_lloyd_max_and_packing_are_identical_on_every_path(x, b):
    cb = kvqrs.lloyd_max_codebook(max(x.shape[-1], 2), b)
    unit = np.clip(x / np.float32(max(float(np.abs(x).max(initial=0.0)), 1e-30)), -1, 1).astype(np.float32)

    def kernels():
        codes = kvqrs.lloyd_max_encode(unit, cb)
        packed = kvqrs.pack_bits(codes, b)
        return codes, kvqrs.lloyd_max_decode(codes, cb), packed, kvqrs.unpack_bits(packed, b, codes.shape[-1])

    assert_identical(kernels)


@given(x=rows_of_mixed_scale(), seed=seeds, extra=st.integers(0, 9), data=st.data())
def test_qjl_and_headq_are_identical_on_every_path(x, seed, extra, data):
    d = x.shape[-1]
    m = d + extra
    rank = data.draw(st.integers(1, min(d, 12)))
    q_bits = data.draw(bits)
    y = float_rows(data.draw, (3,), d, scale=2.0)
    basis = kvqrs.random_orthonormal_basis(seed % 1000, d, rank)

    def kernels():
        sk = kvqrs.qjl_sketch(x, seed, m)
        code = kvqrs.headq_encode(x, basis, q_bits)
        return (
            sk.signs,
            sk.norms,
            kvqrs.qjl_inner_product(y, sk, seed),
            kvqrs.qjl_vector_estimate(sk, seed),
            code.codes,
            code.scales,
            kvqrs.headq_score_correction(y, code, basis),
            kvqrs.headq_decode(code, basis),
        )

    assert_identical(kernels)


@given(data=st.data())
def test_fused_attention_is_identical_on_every_path(data):
    # Every key and value layout of the fused kernel (tests/test_attention.py draws them):
    # outputs, log-sum-exp and probabilities bit for bit.
    codec, q, ck, cv = data.draw(problems())
    assert_identical(lambda: tuple(codec.fused_attention(q, ck, cv, probs=True)))


@given(data=st.data())
def test_fused_matched_attention_is_identical_on_every_path(data):
    # Per-channel runs in a basis around a mean, as keys and (either coding) as values.
    codec, q, ck, cv = data.draw(matched_problems())
    assert_identical(lambda: tuple(codec.fused_attention(q, ck, cv, probs=True)))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_large_batches_split_over_threads_are_identical(d):
    # Above the single-thread threshold, so the rows are split over rayon tasks.
    x = np.random.default_rng(d).standard_normal((1200, d)).astype(np.float32)
    assert_identical(lambda: tuple(kvqrs.mse_encode(x, 4, 1)) + (kvqrs.hadamard(x, 2),))


def test_errors_name_the_same_position_on_every_path():
    x = np.ones((5, 64), np.float32)
    x[3, 17] = np.inf
    big = np.full((3, 64), 3e38, np.float32)

    def errors():
        msgs = []
        for call in (lambda: kvqrs.mse_encode(x, 3, 1), lambda: kvqrs.hadamard(x, 1), lambda: kvqrs.mse_encode(big, 3, 1)):
            with pytest.raises(kvqrs.KvqrsError) as e:
                call()
            msgs.append(str(e.value))
        return tuple(msgs)

    assert_identical(errors)


def test_path_controls():
    avail = _native.simd_available()
    assert avail[0] == "scalar"
    assert _native.simd_level() in avail
    for name in avail:
        with isa(name):
            assert _native.simd_level() == name
    with isa("SCALAR"):
        assert _native.simd_level() == "scalar"
    with pytest.raises(kvqrs.KvqrsError, match="name: expected one of scalar, avx2, avx512, neon or None"):
        _native.set_isa("sse9")
    missing = [n for n in ("avx2", "avx512", "neon") if n not in avail]
    for name in missing:
        with pytest.raises(kvqrs.KvqrsError, match=f"isa: expected one of the supported paths .* got {name}"):
            _native.set_isa(name)
    assert _native.simd_level() in avail


@pytest.mark.parametrize("value, forced", [("1", True), ("0", False)])
def test_environment_variable_forces_scalar(value, forced):
    env = {**os.environ, "KVQRS_FORCE_SCALAR": value}
    code = "from kvqrs import _native; print(_native.simd_level(), _native.simd_available()[-1])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    level, best = out.stdout.split()
    assert level == ("scalar" if forced else best)
