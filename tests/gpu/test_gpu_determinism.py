"""The WGSL path beyond one dispatch's workgroup limit, and its determinism: a call
needing more than 65535 workgroups in x runs on the 2-D grid (common.wgsl) and equals the Rust
path; the same seed gives the same stored bytes on repeated dispatches and in another process,
and those equal the cpu backend's within the stated boundary tolerance (test_gpu_schemes)."""

from __future__ import annotations

import os
import subprocess
import sys

import kvqrs
import numpy as np
from kvqrs import format as fmt
from kvqrs import gpu
from kvqrs.gpu import _device
from kvqrs.schemes import KVCodec
from kvqrs.schemes.registry import KEY_SCHEMES

from tests.gpu.gpu_helpers import FLUSH_ATOL, requires_adapter
from tests.gpu.test_gpu_schemes import assert_parts_close
from tests.scheme_helpers import scheme_codec

pytestmark = requires_adapter

ONE_DIM_LIMIT = _device.MAX_GROUPS_PER_DIM * _device.WORKGROUP  # invocations of a 1-D grid
SCHEMES = KEY_SCHEMES  # each with its seeded control where it needs a calibration
# Every stored byte of every scheme's keys and values on the WGSL path, as one digest.
SCRIPT = """
import hashlib, numpy as np
from kvqrs import format as fmt
from kvqrs.schemes import KVCodec
from kvqrs.schemes.registry import REGISTRY
x = np.random.default_rng(7).standard_normal((2, 3, 150, 64)).astype(np.float32)
h = hashlib.sha256()
for s in {schemes!r}:
    b = REGISTRY[s].keys.bits(3)
    c = KVCodec(s, b, 64, seed=11, backend="wgpu", **REGISTRY[s].control_kwargs(64, b, 11))
    h.update(fmt.dumps(c.encode_keys(x)))
    h.update(fmt.dumps(c.encode_values(x)))
print(h.hexdigest())
"""


def _record_dispatches(monkeypatch) -> list[int]:
    items: list[int] = []
    real = _device.Call.dispatch
    monkeypatch.setattr(_device.Call, "dispatch", lambda self, shader, entry, n, *a: items.append(n) or real(self, shader, entry, n, *a))
    return items


def test_rotation_beyond_the_workgroup_limit_equals_rust(monkeypatch):
    items = _record_dispatches(monkeypatch)
    rows = ONE_DIM_LIMIT // 64 + 65  # one row of 64 per 64 items: just past the 1-D limit
    x = np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32)
    got = gpu.hadamard(x, 3)
    assert max(items) > ONE_DIM_LIMIT
    np.testing.assert_allclose(got, kvqrs.hadamard(x, 3), rtol=0, atol=FLUSH_ATOL)  # bit-exact but for flushed subnormals
    back = gpu.inverse_hadamard(got, 3, 64)
    np.testing.assert_allclose(back, kvqrs.inverse_hadamard(got, 3, 64), rtol=0, atol=FLUSH_ATOL)
    assert np.array_equal(got[-1], kvqrs.hadamard(x[-1:], 3)[0])  # the last rows were not dropped


def test_scheme_beyond_the_workgroup_limit_equals_cpu(monkeypatch):
    items = _record_dispatches(monkeypatch)
    x = np.random.default_rng(1).standard_normal((1, 2, ONE_DIM_LIMIT // 128 + 40, 64)).astype(np.float32)
    cpu, wg = KVCodec("kqv", 3, 64, seed=5), KVCodec("kqv", 3, 64, seed=5, backend="wgpu")
    got, want = wg.encode_keys(x), cpu.encode_keys(x)
    assert max(items) > ONE_DIM_LIMIT
    assert_parts_close(got, want)
    np.testing.assert_allclose(wg.decode_keys(want), cpu.decode_keys(want), atol=1e-6)


def _digest_here() -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(SCRIPT.format(schemes=SCHEMES), {})
    return out.getvalue().strip()


def test_same_bytes_in_another_process():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(schemes=SCHEMES)], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == _digest_here()


def test_repeated_dispatches_are_identical_and_agree_with_cpu():
    x = np.random.default_rng(2).standard_normal((2, 2, 96, 64)).astype(np.float32)
    for scheme in SCHEMES:
        wg, cpu = scheme_codec(scheme, 2, 64, seed=3, backend="wgpu"), scheme_codec(scheme, 2, 64, seed=3)
        for encode, ref in ((wg.encode_keys, cpu.encode_keys), (wg.encode_values, cpu.encode_values)):
            first = encode(x)
            assert all(fmt.dumps(encode(x)) == fmt.dumps(first) for _ in range(3)), scheme
            assert_parts_close(first, ref(x))
