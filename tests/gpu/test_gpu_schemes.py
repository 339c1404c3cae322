"""The schemes on the WGSL path: ``KVCodec(..., backend="wgpu")`` composes the kvqrs.gpu kernels
and agrees with the default cpu backend for every scheme: the same encoded format (codes
equal except at rounding ties, stored scalars within one float16 ulp), decoding across
backends in both directions, and the same scores and attention outputs."""

from __future__ import annotations

import inspect

import kvqrs
import numpy as np
import pytest
from kvqrs.schemes import KVCodec

from tests.gpu.gpu_helpers import F16_RTOL, requires_adapter

pytestmark = requires_adapter

CASES = [
    ("kv", {}),
    ("kqv", {}),
    ("qkqv", {}),
    ("kivi", {}),
    ("block", {}),
    ("headq", {"basis": "random"}),
    ("headq", {"basis": "random", "headq_base": "kqv", "value_scheme": "qkqv"}),
    ("kqv", {"value_scheme": "a2"}),
]
# Fraction of code bytes allowed to differ between backends (rounding ties; measured: none on
# these inputs with lavapipe), and the absolute tolerance of scores and outputs relative to
# their scale when a tie flips a code.
MAX_CODE_DIFF = 2e-3
OUTPUT_ATOL = 1e-4


def assert_parts_close(got, want):
    assert got.parts.keys() == want.parts.keys() and got.params == want.params
    for name, a in want.parts.items():
        b = got.parts[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.dtype == np.uint8:
            assert np.mean(a != b) <= MAX_CODE_DIFF, name
        else:
            np.testing.assert_allclose(b.astype(np.float64), a.astype(np.float64), rtol=F16_RTOL, err_msg=name)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("scheme,kw", CASES)
def test_wgpu_backend_agrees_with_cpu(scheme, kw, bits):
    rng = np.random.default_rng(bits)
    k = rng.standard_normal((2, 2, 64, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 64, 64)).astype(np.float32)
    q = rng.standard_normal((2, 4, 3, 64)).astype(np.float32)  # GQA: 2 query heads per KV head
    cpu = KVCodec(scheme, bits, 64, seed=7, **kw)
    gpu = KVCodec(scheme, bits, 64, seed=7, backend="wgpu", **kw)
    assert gpu.backend.name == "wgpu" and cpu.backend.name == "cpu"
    ck, gk = cpu.encode_keys(k), gpu.encode_keys(k)
    cv, gv = cpu.encode_values(v), gpu.encode_values(v)
    assert_parts_close(gk, ck)
    assert_parts_close(gv, cv)
    assert gk.bits_per_element == ck.bits_per_element
    # Cross-backend decoding, both directions.
    np.testing.assert_allclose(cpu.decode_keys(gk), gpu.decode_keys(gk), atol=1e-6)
    np.testing.assert_allclose(gpu.decode_keys(ck), cpu.decode_keys(ck), atol=1e-6)
    np.testing.assert_allclose(cpu.decode_values(gv), gpu.decode_values(gv), atol=1e-6)
    np.testing.assert_allclose(gpu.decode_values(cv), cpu.decode_values(cv), atol=1e-6)
    # Score paths (QJL estimator, HeadQ correction) and attention.
    np.testing.assert_allclose(gpu.scores(q, ck), cpu.scores(q, ck), atol=OUTPUT_ATOL)
    out_g, p_g = gpu.attention(q, gk, gv)
    out_c, p_c = cpu.attention(q, ck, cv)
    np.testing.assert_allclose(out_g, out_c, atol=OUTPUT_ATOL)
    np.testing.assert_allclose(p_g, p_c, atol=OUTPUT_ATOL)


def test_a2_weights_and_calibration_on_the_gpu_backend():
    rng = np.random.default_rng(3)
    v = rng.standard_normal((1, 40, 64)).astype(np.float32)
    w = rng.uniform(0, 1, (1, 40))
    cpu, gpu = KVCodec("kqv", 3, 64, value_scheme="a2"), KVCodec("kqv", 3, 64, value_scheme="a2", backend="wgpu")
    np.testing.assert_array_equal(gpu.values.widths(gpu.encode_values(v, w)), cpu.values.widths(cpu.encode_values(v, w)))
    hq_c, hq_g = KVCodec("headq", 2, 64), KVCodec("headq", 2, 64, backend="wgpu")
    queries = rng.standard_normal((100, 64))
    np.testing.assert_array_equal(hq_g.calibrate(queries), hq_c.calibrate(queries))
    k = rng.standard_normal((1, 40, 64)).astype(np.float32)
    np.testing.assert_array_equal(hq_g.encode_keys(k).parts["side_codes"], hq_c.encode_keys(k).parts["side_codes"])


def test_cpu_backend_is_the_default_and_unchanged():
    codec = KVCodec("kqv", 4, 64)
    # The Rust kernels themselves, without the torch adapter around the public functions.
    assert codec.backend.name == "cpu" and codec.backend.mse_encode is inspect.unwrap(kvqrs.mse_encode)
    assert "backend" not in repr(codec) and "backend='wgpu'" in repr(KVCodec("kqv", 4, 64, backend="wgpu"))
