"""Determinism and thread safety: the same seed gives the same bytes in another process, under
other thread counts and with the scalar path forced; repeated calls are identical; concurrent
encode/decode from Python threads on shared codecs equals the sequential results."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from kvqrs import format as fmt
from kvqrs.schemes.registry import KEY_SCHEMES

from tests.scheme_helpers import scheme_codec

SCHEMES = KEY_SCHEMES  # each with its seeded control where it needs a calibration
# Every stored byte of every scheme's keys and values for a fixed input, as one digest.
SCRIPT = """
import hashlib, numpy as np
from kvqrs import format as fmt
from kvqrs.schemes import KVCodec
from kvqrs.schemes.registry import REGISTRY
x = np.random.default_rng(7).standard_normal((2, 3, 800, 96)).astype(np.float32)  # rows x 128 above par::PAR_MIN_WORK
h = hashlib.sha256()
for s in {schemes!r}:
    b = REGISTRY[s].keys.bits(3)
    c = KVCodec(s, b, 96, seed=11, **REGISTRY[s].control_kwargs(96, b, 11))
    h.update(fmt.dumps(c.encode_keys(x)))
    h.update(fmt.dumps(c.encode_values(x)))
print(h.hexdigest())
"""


def _digest_here() -> str:
    """The script's digest computed in this process (its print captured)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(SCRIPT.format(schemes=SCHEMES), {})
    return out.getvalue().strip()


@pytest.mark.parametrize(
    "env",
    [{}, {"RAYON_NUM_THREADS": "1"}, {"RAYON_NUM_THREADS": "7"}, {"KVQRS_FORCE_SCALAR": "1"}],
    ids=["default", "1-thread", "7-threads", "scalar"],
)
def test_same_bytes_in_another_process(env):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(schemes=SCHEMES)], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == _digest_here()


def test_repeated_calls_are_identical():
    x = np.random.default_rng(1).standard_normal((4, 200, 64)).astype(np.float32)
    for s in SCHEMES:
        c = scheme_codec(s, 2, 64, seed=3)
        first = fmt.dumps(c.encode_keys(x))
        assert all(fmt.dumps(c.encode_keys(x)) == first for _ in range(3)), s


@pytest.mark.parametrize("scheme", SCHEMES)
def test_concurrent_threads_on_a_shared_codec(scheme):
    c = scheme_codec(scheme, 3, 64, seed=5)
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal((2, 96, 64)).astype(np.float32) for _ in range(16)]
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)

    def work(x):
        ck, cv = c.encode_keys(x), c.encode_values(x)
        return (hashlib.sha256(fmt.dumps(ck) + fmt.dumps(cv)).hexdigest(), c.decode_values(cv), c.scores(q, ck))

    sequential = [work(x) for x in inputs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(work, inputs * 2))
    for i, (digest, v, s) in enumerate(concurrent):
        ref = sequential[i % len(inputs)]
        assert digest == ref[0]
        np.testing.assert_array_equal(v, ref[1])
        np.testing.assert_array_equal(s, ref[2])
