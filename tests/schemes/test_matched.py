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
    fit_bases,
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


def test_fit_bases_equal_one_fit_per_width():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 300, 16)) * np.linspace(0.2, 3, 16)
    w = np.stack([np.eye(16) * np.linspace(2, 0.5, 16)] * 2)
    widths = (2, 3.5, 5)
    for b, got in zip(widths, fit_bases(x, widths, 32, w)):
        want = fit_basis(x, b, 32, w)
        np.testing.assert_array_equal(got.widths, want.widths)
        np.testing.assert_array_equal(got.basis, want.basis)
        np.testing.assert_array_equal(got.mean, want.mean)
    with pytest.raises(KvqrsError, match="bits: expected 0 < bits"):
        fit_bases(x, (3, 9), 32, w)


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
    with pytest.raises(KvqrsError, match="the matched scheme needs one"):
        QuantConfig("matched", 3, "matched", 3)  # refused when built, not at the first update
    with pytest.raises(KvqrsError, match="the matched scheme needs one"):
        QuantConfig(None, 3, "matched", 3)
    with pytest.raises(KvqrsError, match="calibration for layer 1"):
        QuantConfig("matched", 3, "matched", 3, calibration={0: random_calibration(8, 3, 0)}).codec(1, 8)
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


def _filled_cache(cfg):
    """A two-layer cache fed 30 random tokens per layer."""
    import torch
    from kvqrs.hf import QuantizedKVCache
    from kvqrs.hf.attention import active

    cache = QuantizedKVCache(cfg, 2)
    g = torch.Generator().manual_seed(0)
    with active(None):
        for layer in range(2):
            cache.update(torch.randn(1, 3, 30, 16, generator=g), torch.randn(1, 3, 30, 16, generator=g), layer)
    return cache


def test_cache_save_load_round_trip(tmp_path):
    import torch
    from kvqrs.hf import QuantizedKVCache

    cfg = QuantConfig("matched", 3, "matched", 3, residual_length=2, group=8, calibration="random", sink_tokens=1)
    cache = _filled_cache(cfg)
    cache.save(tmp_path / "m.kvqc")
    back = QuantizedKVCache.load(tmp_path / "m.kvqc", cfg)
    assert back.nbytes() == cache.nbytes()
    for a, b in zip(cache.layers, back.layers):
        torch.testing.assert_close(a.keys, b.keys)


def _fitted(layers=2, h=3, d=16, value_bits=None, seed=0):
    from kvqrs.schemes.matched import fit_layer

    out = {}
    for layer in range(layers):
        x, w = _data(h=h, d=d, seed=seed + layer)
        v, _ = _data(h=h, d=d, seed=seed + 10 + layer)
        out[layer] = fit_layer(w, x, v, 3.0, 8, value_bits)
    return out


def test_query_moment_groups_query_heads_per_kv_head():
    from kvqrs.schemes.matched import query_moment

    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 6, 5, 4))  # batch 2, 6 query heads over 3 KV heads (g = 2)
    m = query_moment(q, 3)
    for h in range(3):
        rows = q[:, 2 * h : 2 * h + 2].reshape(-1, 4)
        np.testing.assert_allclose(m[h], rows.T @ rows / len(rows), rtol=1e-12)
    with pytest.raises(KvqrsError, match="multiple of 4 kv_heads"):
        query_moment(q, 4)


def test_channel_transform_is_a_permutation_weighted_by_the_diagonal():
    x, w = _data()
    cal = fit_basis(x, 3.0, 8, w, transform="channels")
    for b in cal.basis:
        assert set(np.abs(b).sum(axis=0)) == {1.0} and set(b.ravel()) <= {0.0, 1.0}  # permutation
    # channel 0 has the largest variance and the largest query weight: the widest code
    assert all(int(np.argmax(b[:, 0])) == 0 for b in cal.basis)
    assert cal.code_bits() == 3.0
    with pytest.raises(KvqrsError, match="transform"):
        fit_basis(x, 3.0, 8, w, transform="pca")


def test_transform_coded_values_use_the_value_basis():
    cal = _fitted(layers=1, value_bits=3.0)[0]
    assert cal.values is not None and np.array_equal(cal.values.mean, cal.value_mean)
    codec = KVCodec("matched", 3, 16, value_scheme="matched", group=8, calibration=cal)
    v = _data(h=3, d=16, seed=10)[0][:, :64]  # the fitted distribution (its mean included)
    enc = codec.encode_values(v)
    assert any(name.startswith("codes") for name in enc.parts) and "norms" not in enc.parts
    err = np.mean((codec.decode_values(enc) - v) ** 2) / np.mean((v - v.mean(axis=1, keepdims=True)) ** 2)
    assert err < 0.1  # 3-bit transform codes keep >90% of the centred energy
    with pytest.raises(KvqrsError, match="mean must equal value_mean"):
        MatchedCalibration(cal.keys, cal.value_mean + 1, cal.values)


def test_calibration_file_keeps_value_bases(tmp_path):
    cal = _fitted(value_bits=2.0)
    back = load_matched(save_matched(tmp_path / "c.npz", cal))
    from kvqrs.schemes.matched import calibration_fingerprint

    assert [calibration_fingerprint(c) for c in back.values()] == [calibration_fingerprint(c) for c in cal.values()]


@pytest.mark.parametrize("value_bits", [None, 3.0])
def test_cache_saves_its_fitted_calibration(tmp_path, value_bits):
    import torch
    from kvqrs.hf import QuantizedKVCache

    cal = _fitted(value_bits=value_bits)
    cfg = QuantConfig("matched", 3, "matched", 3, residual_length=2, group=8, calibration=cal, sink_tokens=1)
    cache = _filled_cache(cfg)
    cache.save(tmp_path / "m.kvqc")
    back = QuantizedKVCache.load(tmp_path / "m.kvqc")  # the calibration travels with the cache
    for a, b in zip(cache.layers, back.layers):
        for x, y in zip(a.materialize(), b.materialize()):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    other = QuantConfig(
        "matched", 3, "matched", 3, residual_length=2, group=8, calibration=_fitted(value_bits=value_bits, seed=5), sink_tokens=1
    )
    with pytest.raises(KvqrsError, match="calibration"):
        QuantizedKVCache.load(tmp_path / "m.kvqc", other)


def test_prefill_calibration_is_refused_outside_matched():
    with pytest.raises(KvqrsError, match="matched scheme only"):
        QuantConfig("kqv", 4, "kqv", 4, calibration="prefill")
    with pytest.raises(KvqrsError, match="'prefill' or 'random'"):
        QuantConfig("matched", 4, "matched", 4, calibration="self")
    with pytest.raises(KvqrsError, match=r"got 'cal.npz' \(a calibration file is read by kvqrs.hf.load_matched\(path\)"):
        QuantConfig("matched", 4, "matched", 4, calibration="cal.npz")


def test_allocate_layers_matches_exhaustive_search_on_convex_costs():
    from kvqrs.schemes.matched import allocate_layers

    rng = np.random.default_rng(4)
    bits = np.array([2.3, 3.3, 4.3, 5.3])
    for _ in range(20):
        sens = rng.uniform(0.1, 10, 4)
        cost = sens[:, None] * 4.0 ** -np.arange(4)[None, :]  # convex in the bits, as measured distortions are
        b = np.tile(bits, (4, 1))
        budget = float(rng.uniform(2.3, 5.3))
        pick = allocate_layers(cost, b, budget)
        assert b[np.arange(4), pick].mean() <= budget + 1e-9
        feasible = [c for c in itertools.product(range(4), repeat=4) if b[np.arange(4), list(c)].mean() <= budget + 1e-9]
        best = min(cost[np.arange(4), list(c)].sum() for c in feasible)
        # the greedy on convex costs lands within one step of the optimum: at most the cost of one layer's next step
        assert cost[np.arange(4), pick].sum() <= best + sens.max() * 0.75 + 1e-12
    # the most sensitive layer gets the widest code
    pick = allocate_layers(np.array([[1.0, 0.1], [10.0, 1.0]]), np.array([[2.0, 3.0], [2.0, 3.0]]), 2.5)
    assert pick.tolist() == [0, 1]
    with pytest.raises(KvqrsError, match="cheapest"):
        allocate_layers(np.ones((2, 2)), np.array([[3.0, 4.0], [3.0, 4.0]]), 2.5)
    with pytest.raises(KvqrsError, match="finite"):
        allocate_layers(np.ones((2, 2)), np.array([[3.0, 4.0], [3.0, 4.0]]), float("nan"))


def test_per_layer_value_width_overrides_the_config():
    cal = MatchedCalibration(*(_fitted(layers=1)[0].keys, _fitted(layers=1)[0].value_mean), value_bits=5)
    codec = KVCodec("matched", 3, 16, value_scheme="matched", group=8, calibration=cal)
    v = np.random.default_rng(0).standard_normal((3, 20, 16)).astype(np.float32)
    assert codec.encode_values(v).parts["codes"].shape[-1] == 10  # 16 coordinates x 5 bits = 10 bytes
    with pytest.raises(KvqrsError, match="value_bits"):
        MatchedCalibration(cal.keys, cal.value_mean, value_bits=9)


def test_channel_calibration_is_stored_as_a_permutation(tmp_path):
    x, w = _data()
    keys = fit_basis(x, 3.0, 8, w, transform="channels")
    perm = keys.permutation
    assert perm is not None and keys.nbytes == keys.mean.nbytes + keys.widths.nbytes + perm.size
    assert fit_basis(x, 3.0, 8, w).permutation is None  # an eigenbasis is not a permutation
    cal = {0: MatchedCalibration(keys, x.mean(axis=1))}
    p = save_matched(tmp_path / "c.npz", cal)
    with np.load(p) as z:
        assert "perm_0" in z.files and "basis_0" not in z.files
    np.testing.assert_array_equal(load_matched(p)[0].keys.basis, keys.basis)


def test_preset_refuses_what_is_not_a_calibration_for_it(tmp_path):
    """An empty dict, the random-basis control and a file that is not a calibration are refused
    by the preset, naming what it takes."""
    with pytest.raises(KvqrsError, match="empty calibration dict"):
        QuantConfig.preset("4bit", {})
    control = r"calibrated on the prompt .* not calibration='random' \(the random-basis control: QuantConfig\('matched', 4, "
    with pytest.raises(KvqrsError, match=control):
        QuantConfig.preset("4bit", "random")
    with pytest.raises(KvqrsError, match=control):
        QuantConfig.preset("4bit", calibration="random")
    for bad in ([], 0, b"prefill"):
        with pytest.raises(KvqrsError, match="expected a .layer: MatchedCalibration. dict or a file path"):
            QuantConfig.preset("4bit", bad)
    junk = tmp_path / "junk.npz"
    junk.write_text("not an archive")
    with pytest.raises(KvqrsError, match="junk.npz'.*not a NumPy .npz archive"):
        QuantConfig.preset("4bit", junk)
    with pytest.raises(KvqrsError, match="not a NumPy .npz archive"):
        load_matched(junk)
    array = tmp_path / "array.npy"
    np.save(array, np.zeros(3))
    with pytest.raises(KvqrsError, match="array.npy'.*not a NumPy .npz archive"):
        QuantConfig.preset("4bit", array)
    other = tmp_path / "other.npz"
    np.savez(other, a=np.zeros(3))
    with pytest.raises(KvqrsError, match=r"^calibration: '.*other.npz' is not a kvqrs matched calibration file"):
        QuantConfig.preset("4bit", other)


@pytest.mark.parametrize("name", ["4bit", "3bit", "2bit"])
def test_preset_without_a_file_is_calibrated_on_the_prompt(name):
    """No calibration (or "prefill", the same): the preset's settings self-calibrated on the
    prompt, keys and values at the preset's value bits (the per-layer widths need a file);
    overrides apply and are validated as against a file."""
    from kvqrs.hf.config import PRESETS

    p = PRESETS[name]
    settings = {k: p[k] for k in ("group", "sink_tokens", "sink_dtype", "value_norms", "value_scale")}
    b = p["value_bits"]
    cfg = QuantConfig.preset(name)
    assert cfg == QuantConfig("matched", b, "matched", b, calibration="prefill", **settings)
    assert QuantConfig.preset(name, "prefill") == cfg and QuantConfig.preset(name, calibration="prefill") == cfg
    assert QuantConfig.preset(name, None, calibration="prefill") == cfg
    longer = QuantConfig.preset(name, residual_length=16, seed=3)
    assert (longer.residual_length, longer.seed, longer.calibration) == (16, 3, "prefill")
    no_sinks = QuantConfig.preset(name, sink_tokens=0)
    assert (no_sinks.sink_tokens, no_sinks.sink_dtype) == (0, None)
    with pytest.raises(KvqrsError, match=r"^preset: overrides: expected QuantConfig fields other than .* got \['key_bits'\]"):
        QuantConfig.preset(name, key_bits=8)
    with pytest.raises(KvqrsError, match="group must be a multiple of 8"):
        QuantConfig.preset(name, group=12)
    with pytest.raises(KvqrsError, match="^value_scale: 'preserve_norm' applies to the MSE value stage"):  # so do log8 norms
        QuantConfig.preset(name, value_transform=True)


# Stored bits per element of a prompt-calibrated preset, below its budget by at most this much
# (head_dim 64, as the presets were measured on; every token quantized but the sink): equal
# widths at the preset's value bits spend the fixed costs (key scales, 8-bit value norms, the
# float16 sink, the calibration fitted on the prompt) that per-layer widths from a file would
# spend on wider layers; measured 4.17 / 3.17 / 2.29 against 4.25 / 3.25 / 2.5.
PROMPT_PRESET_UNDER_BUDGET = 0.25


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", ["4bit", "3bit", "2bit"])
def test_prompt_calibrated_preset_generates_within_its_budget(name):
    """``QuantConfig.preset(name)`` in a QuantizedKVCache on a tiny random Llama: ``generate``
    fits every layer on the prompt, decodes with that calibration (the last group flushes
    during decoding), and the cache's bits per element stay within the preset's budget."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvqrs.hf import QuantizedKVCache, register
    from kvqrs.hf.attention import _STATE
    from kvqrs.hf.config import PRESETS

    register()
    kv_heads, head_dim, layers, new = 2, 64, 2, 8
    model_cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        attn_implementation="kvqrs",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(model_cfg).eval()
    cfg = QuantConfig.preset(name)
    # Every token but the sink in whole groups once the new tokens are in (the last one
    # generated is not fed back): nothing left in full precision at the end.
    tokens = cfg.sink_tokens + 4 * cfg.group
    prompt = tokens - (new - 1)
    ids = torch.randint(0, 96, (1, prompt), generator=torch.Generator().manual_seed(1))
    cache = QuantizedKVCache(cfg, model.config)
    _STATE.set(None)
    try:
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    finally:
        _STATE.set(None)
    assert out.shape == (1, prompt + new) and torch.equal(out[:, :prompt], ids)
    assert cache.get_seq_length() == tokens
    for layer in cache.layers:
        assert layer.fitted is not None and layer.fitted_tokens == prompt  # fitted on the prompt only
        assert layer.quantized == 4 * cfg.group
    bits = cache.nbytes() * 8 / (2 * layers * kv_heads * tokens * head_dim)
    budget = PRESETS[name]["budget"]
    assert budget - PROMPT_PRESET_UNDER_BUDGET <= bits <= budget, bits


def preset_meta(name: str) -> dict:
    """The metadata `kvqrs calibrate --preset NAME` records with its file."""
    from kvqrs.hf.config import PRESETS

    p = PRESETS[name]
    meta = {k: p[k] for k in ("group", "sink_tokens", "value_norms", "budget")} | {"preset": name}
    meta |= {k: " ".join(str(float(w) if k == "key_widths" else w) for w in p[k]) for k in ("key_widths", "value_widths")}
    meta |= {k: p[k] for k in ("sink_dtype",) if p[k] is not None} | (
        {"value_scale": p["value_scale"]} if p["value_scale"] != "norm" else {}
    )
    return meta


def test_preset_refuses_a_file_calibrated_for_other_settings(tmp_path):
    """A preset's per-layer widths were allocated for its group, value norms, sink dtype and
    value scale: a
    file recording others is refused by name (one recording the preset's loads)."""
    from kvqrs.hf.config import PRESETS

    cal = {0: random_calibration(16, 3, 0)}
    p = PRESETS["3bit"]
    same = preset_meta("3bit")
    cfg = QuantConfig.preset("3bit", save_matched(tmp_path / "ok.npz", cal, same))
    assert (cfg.group, cfg.value_norms, cfg.sink_dtype, cfg.value_scale) == (
        p["group"],
        p["value_norms"],
        p["sink_dtype"],
        p["value_scale"],
    )
    other_norms = "float" if p["value_norms"] == "log8" else "log8"
    other_scale = "least_squares" if p["value_scale"] != "least_squares" else "norm"
    for key, value in (("group", 64), ("value_norms", other_norms), ("value_scale", other_scale)):
        path = save_matched(tmp_path / f"{key}.npz", cal, {**same, key: value})
        with pytest.raises(KvqrsError, match=f"was made with {key} '{value}'"):
            QuantConfig.preset("3bit", path)
