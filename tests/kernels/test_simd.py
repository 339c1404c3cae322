"""Every kernel on every instruction-set path this CPU supports (``_native.simd_available()``)
returns the scalar path's bytes exactly: codes, packed bytes, stored norms and scales (dtype
included) and floats compared bit for bit; every bit-packing path (``simd_info()["pack_paths"]``)
gives the oracle's bytes. Plus the path controls and the dispatch report themselves."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import kvqrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kvqrs import _native, oracle

from tests.kernels.test_attention import matched_problems, problems
from tests.kernels.test_attention_token_runs import token_run_problems
from tests.strategies import HEAD_DIMS, bits, float_rows, head_dims, leading_shapes, seeds

SIMD = [i for i in _native.simd_available() if i != "scalar"]
PACK_PATHS = _native.simd_info()["pack_paths"]


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
    # Every key and value layout of the fused kernel (tests/kernels/test_attention.py draws them):
    # outputs, log-sum-exp and probabilities bit for bit.
    codec, q, ck, cv = data.draw(problems())
    assert_identical(lambda: tuple(codec.fused_attention(q, ck, cv, probs=True)))


@given(data=st.data())
def test_fused_matched_attention_is_identical_on_every_path(data):
    # Per-channel runs in a basis around a mean, as keys and (either coding) as values.
    codec, q, ck, cv = data.draw(matched_problems())
    assert_identical(lambda: tuple(codec.fused_attention(q, ck, cv, probs=True)))


@settings(deadline=None)
@given(pr=token_run_problems())
def test_fused_token_runs_attention_is_identical_on_every_path(pr):
    # Per-token runs in a basis (1..8 bits, widths read packed in registers and not), alone
    # and around a mean.
    mean = np.linspace(-2, 2, pr.d, dtype=np.float32)
    for keys in (pr.keys, kvqrs.kernels.CentredRows(pr.keys, mean)):
        assert_identical(lambda k=keys: tuple(kvqrs.kernels.decode_attention(pr.q, k, pr.values, scale=pr.scale, probs=True)))


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


@pytest.mark.parametrize(
    "value, forced",
    [("1", True), ("true", True), ("yes", True), ("0", False), ("", False), ("false", False), (" Off ", False), ("no", False)],
)
def test_environment_variable_forces_scalar(value, forced):
    env = {**os.environ, "KVQRS_FORCE_SCALAR": value}
    code = "from kvqrs import _native; print(_native.simd_level(), _native.simd_available()[-1])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    level, best = out.stdout.split()
    assert level == ("scalar" if forced else best)


@pytest.fixture
def restore_pack_path():
    """The default pack path back after the test, whatever it set."""
    yield
    _native.set_pack_path(None)


# The fixture only restores the default after the whole test, so sharing it between
# hypothesis examples is intended.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.parametrize("path", PACK_PATHS)
@given(b=bits, lead=leading_shapes, m=st.integers(0, 200), data=st.data())
def test_every_pack_path_gives_the_oracle_bytes(restore_pack_path, path, b, lead, m, data):
    _native.set_pack_path(path)
    assert _native.simd_info()["primitives"]["pack"]["path"] == path
    codes = data.draw(hnp.arrays(np.uint8, (*lead, m), elements=st.integers(0, 2**b - 1)))
    packed = kvqrs.pack_bits(codes, b)
    assert same_bytes(packed, oracle.pack_bits(codes, b))
    assert same_bytes(kvqrs.unpack_bits(packed, b, m), codes)
    # Arbitrary bytes: the unused high bits of the last byte are ignored.
    raw = data.draw(hnp.arrays(np.uint8, packed.shape))
    assert same_bytes(kvqrs.unpack_bits(raw, b, m), oracle.unpack_bits(raw, b, m))


def test_simd_info_reports_every_primitive():
    info = kvqrs.simd_info()
    assert {"vendor", "family", "model", "brand", "features", "isa", "isas", "pack_paths", "primitives"} <= set(info)
    assert isinstance(info["vendor"], str) and isinstance(info["family"], int) and isinstance(info["model"], int)
    assert info["isa"] == _native.simd_level() and info["isas"] == _native.simd_available()
    assert all(isinstance(v, bool) for v in info["features"].values())
    if info["vendor"] != "unknown":
        assert {"avx2", "bmi2", "avx512f", "avx512bw", "avx512vl", "f16c", "fma"} <= set(info["features"])
        assert ("bmi2" in info["pack_paths"]) == info["features"]["bmi2"]
    assert set(info["primitives"]) == {"pack", "unpack", "float kernels"}
    assert info["primitives"]["float kernels"]["path"] == info["isa"]
    for name, entry in info["primitives"].items():
        assert set(entry) == {"path", "reason"} and entry["reason"], name
    pack = info["primitives"]["pack"]
    assert pack["path"] in info["pack_paths"] and info["primitives"]["unpack"] == pack
    line = kvqrs.simd_summary()
    assert "\n" not in line
    assert line.startswith(f"{info['vendor']} fam {info['family']:#x} model {info['model']:#x} | isa {info['isa']} | ")
    assert f"| pack/unpack {pack['path']} ({pack['reason']}) | float kernels {info['isa']} (" in line


def test_set_pack_path_refuses_bad_names_and_missing_instructions(restore_pack_path):
    before = kvqrs.simd_info()["primitives"]["pack"]
    with pytest.raises(ValueError, match='name: expected one of scalar, bmi2, shift or None, got "pext"'):
        _native.set_pack_path("pext")
    if "bmi2" not in PACK_PATHS:
        with pytest.raises(ValueError, match=r"pack path: bmi2 is not supported here \(this CPU has no BMI2\); supported: scalar, shift"):
            _native.set_pack_path("bmi2")
    assert kvqrs.simd_info()["primitives"]["pack"] == before
    _native.set_pack_path("SHIFT")
    assert kvqrs.simd_info()["primitives"]["pack"] == {"path": "shift", "reason": "set_pack_path"}
    _native.set_pack_path(None)
    assert kvqrs.simd_info()["primitives"]["pack"] == before


@pytest.mark.parametrize(
    "env, path, reason",
    [
        ({"KVQRS_PACK_PATH": "shift"}, "shift", "KVQRS_PACK_PATH=shift"),
        ({"KVQRS_PACK_PATH": "shift", "KVQRS_FORCE_SCALAR": "1"}, "scalar", "isa scalar: the scalar reference"),
        ({"KVQRS_PACK_PATH": "pext"}, None, 'KVQRS_PACK_PATH="pext" ignored: expected one of scalar, bmi2, shift'),
    ],
)
def test_environment_chooses_the_pack_path(env, path, reason):
    # Read once per process, so each case runs in a fresh interpreter.
    base = {k: v for k, v in os.environ.items() if k not in ("KVQRS_PACK_PATH", "KVQRS_FORCE_SCALAR")}
    code = "import kvqrs; p = kvqrs.simd_info()['primitives']['pack']; print(p['path']); print(p['reason'])"
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    got_path, got_reason = out.stdout.splitlines()
    if not SIMD:  # no SIMD isa: the default is the scalar reference whatever the variable says
        path, reason = "scalar", "isa scalar"
    assert (got_path == path) if path else (got_path in PACK_PATHS)  # None: the CPU default
    assert reason in got_reason
