"""The seeded generator in WGSL (shaders/philox.wgsl, shaders/rng.wgsl): Philox4x32-10 word for
word against the Rust path (kvqrs.rng.philox4x32_10) and the oracle, and the rotation signs
generated on the device bit for bit (docs/kernels.md section 1)."""

from __future__ import annotations

import kvqrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvqrs import gpu, oracle

from tests.gpu.gpu_helpers import requires_adapter, same_error
from tests.strategies import seeds

pytestmark = requires_adapter

words = st.integers(0, 2**32 - 1)


def test_known_answers():
    assert gpu.philox4x32_10([0, 0, 0, 0], [0, 0]) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 2**32 - 1
    assert gpu.philox4x32_10([ones] * 4, [ones] * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)


@given(st.lists(st.tuples(st.tuples(words, words, words, words), st.tuples(words, words)), min_size=1, max_size=64))
def test_blocks_equal_rust_path_word_for_word(pairs):
    counters = np.array([c for c, _ in pairs], dtype=np.uint64)
    keys = np.array([k for _, k in pairs], dtype=np.uint64)
    got = gpu.philox_blocks(counters, keys)
    want = np.array([kvqrs.rng.philox4x32_10(list(map(int, c)), list(map(int, k))) for c, k in pairs], dtype=np.uint32)
    np.testing.assert_array_equal(got, want)


def test_carries_of_the_16_bit_halves():
    # Words whose 16-bit halves are all ones maximise the carries of the split multiply.
    special = [0, 1, 0xFFFF, 0x10000, 0xFFFF0000, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 0xD2511F53, 0xCD9E8D57]
    c = np.array([[a, b, a, b] for a in special for b in special], dtype=np.uint64)
    k = np.array([[b, a] for a in special for b in special], dtype=np.uint64)
    want = np.array([oracle.philox4x32_10(tuple(int(v) for v in ci), tuple(int(v) for v in ki)) for ci, ki in zip(c, k)], dtype=np.uint32)
    np.testing.assert_array_equal(gpu.philox_blocks(c, k), want)


@given(seeds, st.integers(1, 600))
def test_rotation_signs_equal_rust_path(seed, dim):
    np.testing.assert_array_equal(gpu.rotation_signs(seed, dim), kvqrs.rng.rotation_signs(seed, dim))


def test_gaussian_objects_are_the_hosts():
    # Specified in float64 (Box-Muller, Gram-Schmidt): WGSL has no f64, so they are host-built.
    assert gpu.qjl_matrix is kvqrs.rng.qjl_matrix
    assert gpu.random_orthonormal_basis is kvqrs.rng.random_orthonormal_basis


@pytest.mark.parametrize(
    "args",
    [([0, 0, 0], [0, 0]), ([0, 0, 0, 2**32], [0, 0]), ([0, 0, 0, 0], [-1, 0]), (["a", 0, 0, 0], [0, 0])],
)
def test_bad_words_raise_like_the_rust_path(args):
    same_error(lambda: gpu.philox4x32_10(*args), lambda: kvqrs.rng.philox4x32_10(*args))


def test_bad_block_arrays_raise():
    with pytest.raises(kvqrs.KvqrsError, match=r"counters/keys: expected shapes \(n, 4\) and \(n, 2\)"):
        gpu.philox_blocks(np.zeros((2, 3), np.uint32), np.zeros((2, 2), np.uint32))
    with pytest.raises(kvqrs.KvqrsError, match="counters: expected unsigned 32-bit"):
        gpu.philox_blocks(np.full((1, 4), 2**32, np.uint64), np.zeros((1, 2), np.uint32))
    same_error(lambda: gpu.rotation_signs(-1, 4), lambda: kvqrs.rng.rotation_signs(-1, 4))
