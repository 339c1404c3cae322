"""The ``matched`` scheme: reverse water-filling, the fitted transform, the coder against a
composition of the NumPy oracle's kernels, streaming = one-shot, slicing, bits accounting,
calibration files and the llama.cpp protocol's bookkeeping."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError, oracle
from kvqrs.hf import QuantConfig, load_matched, save_matched
from kvqrs.schemes import KVCodec
from kvqrs.schemes.matched import (
    MAX_WIDTH,
    MatchedBasis,
    MatchedCalibration,
    bits_per_element,
    fit_basis,
    random_calibration,
    uniform_distortion,
    water_fill,
)

# Decoded coordinates against the oracle's float64 uniform quantizer, composed with the float32
# transform: the codes are exact (checked separately); the reconstruction differs by float32
# rounding of the two matrix products (measured ~1e-6 of the data scale).
RECON_ATOL = 1e-4


def _data(h=3, n=600, d=16, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.geomspace(4.0, 0.05, d)
    x = rng.standard_normal((h, n, d)) * scales + rng.standard_normal(d) * 3
    q = rng.standard_normal((h, 400, d)) * np.geomspace(1.0, 0.2, d)
    w = np.einsum("hnd,hne->hde", q, q) / q.shape[1]
    return x.astype(np.float32), w


def test_water_fill_matches_exhaustive_search_on_convex_costs():
    rng = np.random.default_rng(1)
    for _ in range(20):
        var = rng.uniform(0.01, 5, 3)
        cost = var[:, None] * 4.0 ** -np.arange(MAX_WIDTH + 1)[None, :]
        total = int(rng.integers(1, 12))
        w = water_fill(cost, total)
        best = min((sum(cost[i, c[i]] for i in range(3)), c) for c in itertools.product(range(MAX_WIDTH + 1), repeat=3) if sum(c) == total)
        assert w.sum() == total
        assert sum(cost[i, w[i]] for i in range(3)) == pytest.approx(best[0])


def test_water_fill_gives_nothing_to_a_coordinate_no_query_reads():
    cost = np.array([[1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001, 3e-4, 1e-4]] * 3)
    cost[2] = 0.0  # weight 0: no distortion at any width
    w = water_fill(cost, 8)
    assert w[2] == 0 and w.sum() == 8


def test_water_fill_skips_a_width_whose_single_step_does_not_pay():
    # 1-bit min-max codes worse than none (2.25 vs 1): the fill jumps straight to 2 bits
    cost = np.array([[1.0, 2.25, 0.25, 0.05, 0.01, 0.003, 0.001, 3e-4, 1e-4]])
    assert water_fill(cost, 2).tolist() == [2]


def test_fit_basis_is_orthonormal_ordered_and_spends_the_budget():
    x, w = _data()
    cal = fit_basis(x, 3.0, 32, w)
    d = x.shape[-1]
    assert cal.widths.sum() == 3 * d
    assert (np.diff(cal.widths.astype(int)) <= 0).all()
    for h in range(x.shape[0]):
        np.testing.assert_allclose(cal.basis[h].T @ cal.basis[h], np.eye(d), atol=1e-5)
    np.testing.assert_allclose(cal.mean, x.mean(axis=1), rtol=1e-5, atol=1e-5)


def test_fit_basis_weights_by_the_queries():
    """A direction with large key variance that no query reads gets no bits."""
    rng = np.random.default_rng(2)
    d = 8
    x = rng.standard_normal((1, 800, d)).astype(np.float32)
    x[..., 0] *= 50  # the largest variance ...
    w = np.eye(d)[None].copy()
    w[0, 0, 0] = 0.0  # ... in a direction no query reads
    cal = fit_basis(x, 2.0, 32, w)
    dead = int(np.argmax(np.abs(cal.basis[0][0])))  # the column along coordinate 0
    assert cal.widths[dead] == 0
    plain = fit_basis(x, 2.0, 32, None)  # plain MSE spends most there
    assert plain.widths[int(np.argmax(np.abs(plain.basis[0][0])))] == plain.widths.max()


def test_uniform_distortion_measures_the_kernel():
    y = np.random.default_rng(3).standard_normal((4, 100)).astype(np.float32)
    dist = uniform_distortion(y, 32)
    codes, scales, zeros = oracle.uniform_encode(y.astype(np.float64), 3, 32)
    ref = np.mean((y - oracle.uniform_decode(codes, scales, zeros, 3, 32)) ** 2, axis=1)
    np.testing.assert_allclose(dist[:, 3], ref, rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(dist[:, 0], np.mean(y.astype(np.float64) ** 2, axis=1))
    assert (np.diff(dist[:, 2:], axis=1) < 0).all()  # more bits, less error from 2 bits on


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 70), group=st.sampled_from([8, 16, 32]), bits=st.sampled_from([2.0, 3.0, 4.5]), seed=st.integers(0, 2**16))
def test_coder_equals_the_oracle_composition(tokens, group, bits, seed):
    x, w = _data(h=2, n=300, d=8, seed=seed)
    cal = MatchedCalibration(fit_basis(x, bits, group, w), x.mean(axis=1))
    codec = KVCodec("matched", 4, 8, value_scheme="matched", group=group, calibration=cal)
    k = np.random.default_rng(seed + 1).standard_normal((1, 2, tokens, 8)).astype(np.float32) * 3
    ck = codec.encode_keys(k)
    kc = cal.keys
    y = np.einsum("bhtd,hde->bhte", k.astype(np.float64) - kc.mean[None, :, None, :], kc.basis.astype(np.float64))
    y_hat = np.zeros_like(y)
    for b, lo, hi in kc.width_runs():
        rows = np.swapaxes(y[..., lo:hi], -1, -2)
        codes, scales, zeros = oracle.uniform_encode(rows, b, group)
        got = oracle.unpack_bits(ck.parts[f"codes{b}"], b, tokens)
        near = (
            np.abs(
                (rows - zeros.repeat(group, -1)[..., :tokens])
                / np.maximum(scales.astype(np.float64).repeat(group, -1)[..., :tokens], 1e-30)
                % 1
                - 0.5
            )
            < 1e-3
        )
        assert ((got == codes) | near).all()
        y_hat[..., lo:hi] = np.swapaxes(oracle.uniform_decode(codes, scales, zeros, b, group), -1, -2)
    ref = np.einsum("bhte,hde->bhtd", y_hat, kc.basis.astype(np.float64)) + kc.mean[None, :, None, :]
    np.testing.assert_allclose(codec.decode_keys(ck), ref, atol=RECON_ATOL * max(1.0, np.abs(k).max()))
    assert ck.bits_per_element == pytest.approx(bits_per_element(kc, group, tokens))


def test_streaming_equals_one_shot_and_slices_whole_groups():
    x, w = _data(h=3, n=500, d=16)
    cal = MatchedCalibration(fit_basis(x, 3.0, 16, w), x.mean(axis=1))
    codec = KVCodec("matched", 3, 16, value_scheme="matched", group=16, calibration=cal)
    k = x[None, :, :80]
    one = codec.encode_keys(k)
    joined = codec.concat([codec.encode_keys(k[..., :32, :]), codec.encode_keys(k[..., 32:64, :]), codec.encode_keys(k[..., 64:, :])])
    assert one.parts.keys() == joined.parts.keys()
    for name in one.parts:
        np.testing.assert_array_equal(one.parts[name], joined.parts[name])
    sl = codec.slice_tokens(one, 64, 16)
    np.testing.assert_array_equal(codec.decode_keys(sl), codec.decode_keys(codec.encode_keys(k[..., 16:64, :])))
    with pytest.raises(KvqrsError, match="whole groups"):
        codec.slice_tokens(one, 40)
    with pytest.raises(KvqrsError, match="whole groups"):
        codec.concat([codec.encode_keys(k[..., :20, :]), codec.encode_keys(k[..., 20:, :])])


def test_values_carry_their_mean():
    x, w = _data(h=2, n=300, d=16)
    mean = np.full((2, 16), 7.0, np.float32)
    cal = MatchedCalibration(fit_basis(x[:2], 3.0, 16, w[:2]), mean)
    codec = KVCodec("matched", 4, 16, value_scheme="matched", group=16, calibration=cal)
    v = np.full((1, 2, 5, 16), 7.0, np.float32)  # exactly the mean: the residual codes to zero
    np.testing.assert_allclose(codec.decode_values(codec.encode_values(v)), v, atol=1e-6)


def test_codes_refuse_another_calibration():
    x, w = _data(h=1, n=300, d=8)
    a = MatchedCalibration(fit_basis(x, 3.0, 8, w), x.mean(axis=1))
    b = MatchedCalibration(fit_basis(x * 2, 3.0, 8, w), x.mean(axis=1))
    ca = KVCodec("matched", 3, 8, value_scheme="matched", group=8, calibration=a)
    cb = KVCodec("matched", 3, 8, value_scheme="matched", group=8, calibration=b)
    with pytest.raises(KvqrsError, match="fingerprint"):
        cb.decode_keys(ca.encode_keys(x[None, :, :8]))


def test_bad_calibrations_are_named():
    with pytest.raises(KvqrsError, match="orthonormal"):
        MatchedBasis(np.zeros((1, 4)), np.ones((1, 4, 4)), np.full(4, 2))
    with pytest.raises(KvqrsError, match="non-increasing"):
        MatchedBasis(np.zeros((1, 4)), np.eye(4)[None], np.array([1, 2, 2, 1]))
    with pytest.raises(KvqrsError, match="calibration"):
        KVCodec("matched", 3, 8)
    with pytest.raises(KvqrsError, match="calibration for layer 0"):
        QuantConfig("matched", 3, "matched", 3).codec(0, 8)
    with pytest.raises(KvqrsError, match="kv_heads"):
        cal = random_calibration(8, 3, 0)
        wide = MatchedCalibration(MatchedBasis(np.zeros((2, 8)), np.stack([np.eye(8)] * 2), cal.keys.widths), np.zeros((2, 8)))
        KVCodec("matched", 3, 8, value_scheme="matched", group=8, calibration=wide).encode_keys(np.zeros((1, 3, 4, 8), np.float32))
    with pytest.raises(KvqrsError, match="bits"):
        fit_basis(np.zeros((1, 10, 4)), 9.0, 8)


def test_calibration_file_round_trip(tmp_path):
    x, w = _data(h=2, n=300, d=8)
    cal = {0: MatchedCalibration(fit_basis(x, 3.0, 8, w), x.mean(axis=1)), 3: random_calibration(8, 3, 5)}
    cal[3] = MatchedCalibration(
        MatchedBasis(np.zeros((2, 8)), np.stack([cal[3].keys.basis[0]] * 2), cal[3].keys.widths), np.ones((2, 8), np.float32)
    )
    path = save_matched(tmp_path / "cal", cal, {"bits": 3})
    back = load_matched(path)
    assert sorted(back) == [0, 3]
    for layer in cal:
        for a, b in (
            (cal[layer].keys.basis, back[layer].keys.basis),
            (cal[layer].keys.widths, back[layer].keys.widths),
            (cal[layer].value_mean, back[layer].value_mean),
        ):
            np.testing.assert_array_equal(a, b)
    np.savez(tmp_path / "other.npz", format=np.array("something-else"))
    with pytest.raises(KvqrsError, match="not a kvqrs matched calibration"):
        load_matched(tmp_path / "other.npz")


def test_random_control_keeps_the_average_width():
    cal = random_calibration(64, 3, 9)
    assert cal.keys.code_bits() == 3.0 and len(cal.keys.width_runs()) == 3


def test_cache_save_load_round_trip(tmp_path):
    import torch
    from kvqrs.hf import QuantizedKVCache
    from kvqrs.hf.attention import active

    cfg = QuantConfig("matched", 3, "matched", 3, residual_length=2, group=8, calibration="random", sink_tokens=1)
    cache = QuantizedKVCache(cfg, 2)
    g = torch.Generator().manual_seed(0)
    with active(None):
        for layer in range(2):
            cache.update(torch.randn(1, 3, 30, 16, generator=g), torch.randn(1, 3, 30, 16, generator=g), layer)
    cache.save(tmp_path / "m.kvqc")
    back = QuantizedKVCache.load(tmp_path / "m.kvqc", cfg)
    assert back.nbytes() == cache.nbytes()
    for a, b in zip(cache.layers, back.layers):
        torch.testing.assert_close(a.keys, b.keys)
