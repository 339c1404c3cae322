"""``matched`` keys with a float16 absmax scale per token (fit_basis(..., scales="tokens")):
the coder against the composition of the kernel oracles, a fixed size per token, the
calibration file, and the cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError, oracle
from kvqrs.hf import QuantConfig, load_matched, save_matched
from kvqrs.kernels.pack import packed_size
from kvqrs.layout import fixed_per_token
from kvqrs.schemes import KVCodec
from kvqrs.schemes.matched import (
    MAX_WIDTH,
    TOKEN_SCALE_BYTES,
    MatchedBasis,
    MatchedCalibration,
    absmax_distortion,
    coordinate_deviations,
    fit_bases_bytes,
    fit_basis,
    token_code_bytes,
    water_fill,
    water_fill_bytes,
)
from kvqrs.schemes.matched_tokens import MatchedTokenCoder

from .test_matched import _data

# Decoded keys against the oracle's float64 decode composed with the float64 transform: the
# codes are exact away from decision boundaries; the reconstruction differs by the float32
# rounding of the transform, the division by the deviations and the decode (~1e-6 relative).
RECON_RTOL = 1e-4
# A code may differ from the oracle's where t + 0.5 lies this close to an integer (float32
# against float64 arithmetic of z / s).
BOUNDARY = 1e-3


def _token_calibration(h=2, n=300, d=8, bits=3.0, seed=0):
    x, w = _data(h=h, n=n, d=d, seed=seed)
    return x, MatchedCalibration(fit_basis(x, bits, 8, w, scales="tokens"), x.mean(axis=1))


def _codec(cal, d, bits=4):
    return KVCodec("matched", bits, d, value_scheme="matched", group=8, calibration=cal)


def test_fit_basis_with_token_scales_carries_the_deviations():
    x, w = _data(h=3, n=600, d=16)
    b = fit_basis(x, 3.0, 16, w, scales="tokens")
    assert b.deviations is not None and b.deviations.shape == (3, 16) and (b.deviations > 0).all()
    assert int(b.widths.astype(int).sum()) == 3 * 16 and (np.diff(b.widths.astype(int)) <= 0).all()
    y = np.einsum("hnd,hde->hne", x.astype(np.float64) - b.mean[:, None, :], b.basis.astype(np.float64))
    for i in range(3):
        np.testing.assert_allclose(b.deviations[i], coordinate_deviations(y[i]), rtol=1e-5)
    assert fit_basis(x, 3.0, 16, w).deviations is None  # groups: no deviations
    with pytest.raises(KvqrsError, match="scales"):
        fit_basis(x, 3.0, 16, w, scales="rows")


def test_absmax_distortion_measures_the_kernel():
    z = np.random.default_rng(3).standard_normal((200, 6)).astype(np.float32)
    dist = absmax_distortion(z)
    assert dist.shape == (6, 9)
    np.testing.assert_allclose(dist[:, 0], np.mean(z.astype(np.float64) ** 2, axis=0))
    codes, scales = oracle.absmax_encode(z, np.full(6, 3, np.uint8))
    ref = np.mean((z - oracle.absmax_decode(codes, scales, np.full(6, 3, np.uint8))) ** 2, axis=0)
    np.testing.assert_allclose(dist[:, 3], ref, rtol=1e-3)
    assert (np.diff(dist[:, 1:], axis=1) <= 1e-12).all()  # more bits, less error


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 70), bits=st.sampled_from([2.0, 3.0, 4.5]), seed=st.integers(0, 2**16))
def test_coder_equals_the_oracle_composition(tokens, bits, seed):
    _, cal = _token_calibration(bits=bits, seed=seed)
    codec = _codec(cal, 8)
    assert isinstance(codec._key_coder(), MatchedTokenCoder)
    k = np.random.default_rng(seed + 1).standard_normal((1, 2, tokens, 8)).astype(np.float32) * 3
    ck = codec.encode_keys(k)
    kc = cal.keys
    y = np.einsum("bhtd,hde->bhte", k.astype(np.float64) - kc.mean[None, :, None, :], kc.basis.astype(np.float64))
    z = y / kc.deviations[None, :, None, :]
    codes, scales = oracle.absmax_encode(z, kc.widths)
    np.testing.assert_array_equal(ck.parts["scales"], scales)
    coded = kc.widths > 0
    top = (2.0 ** kc.widths.astype(int) - 1)[coded]
    s = scales.astype(np.float64)[..., None]
    t = (np.divide(z[..., coded], s, out=np.zeros_like(z[..., coded]), where=s > 0) + 1) * 0.5 * top
    near = np.abs((t + 0.5) % 1.0 - 0.5) > 0.5 - BOUNDARY
    got = np.zeros_like(codes)
    for b, lo, hi in kc.width_runs():
        assert ck.parts[f"codes{b}"].shape == (1, 2, tokens, packed_size(hi - lo, b))
        got[..., lo:hi] = oracle.unpack_bits(ck.parts[f"codes{b}"], b, hi - lo)
    assert ((got[..., coded] == codes[..., coded]) | near).all()
    assert (got[..., ~coded] == 0).all()
    z_hat = oracle.absmax_decode(got, scales, kc.widths) * kc.deviations[None, :, None, :]
    ref = np.einsum("bhte,hde->bhtd", z_hat, kc.basis.astype(np.float64)) + kc.mean[None, :, None, :]
    np.testing.assert_allclose(codec.decode_keys(ck), ref, atol=RECON_RTOL * max(1.0, np.abs(k).max(initial=0.0)))
    if tokens:
        code_bits = sum(8 * packed_size(hi - lo, b) for b, lo, hi in kc.width_runs())
        assert ck.bits_per_element == pytest.approx((code_bits + 16) / 8)


def test_keys_have_a_fixed_size_per_token_and_join_anywhere():
    x, cal = _token_calibration(h=3, n=500, d=16)
    codec = _codec(cal, 16, 3)
    coder = codec._key_coder()
    assert fixed_per_token(coder.layout((1, 3, 5, 16)))
    k = x[None, :, :37]
    one = codec.encode_keys(k)
    joined = codec.concat([codec.encode_keys(k[..., :5, :]), codec.encode_keys(k[..., 5:6, :]), codec.encode_keys(k[..., 6:, :])])
    assert one.parts.keys() == joined.parts.keys()
    for name in one.parts:
        np.testing.assert_array_equal(one.parts[name], joined.parts[name])
    sl = codec.slice_tokens(one, 29, 3)
    np.testing.assert_array_equal(codec.decode_keys(sl), codec.decode_keys(codec.encode_keys(k[..., 3:29, :])))


def test_token_keys_refuse_what_is_not_theirs():
    x, cal = _token_calibration()
    _, other = _token_calibration(seed=5)
    with pytest.raises(KvqrsError, match="fingerprint"):
        _codec(other, 8).decode_keys(_codec(cal, 8).encode_keys(x[None, :, :4]))
    grouped = MatchedCalibration(MatchedBasis(cal.keys.mean, cal.keys.basis, cal.keys.widths), cal.value_mean)
    with pytest.raises(KvqrsError, match="deviations"):
        MatchedTokenCoder(8, grouped.keys, "matched", "keys")
    with pytest.raises(KvqrsError, match="deviations"):
        MatchedBasis(cal.keys.mean, cal.keys.basis, cal.keys.widths, np.zeros((2, 8)))
    with pytest.raises(KvqrsError, match="deviations"):
        MatchedBasis(cal.keys.mean, cal.keys.basis, cal.keys.widths, np.ones((1, 8)))
    with pytest.raises(KvqrsError, match="overflows its float16 per-token scale"):
        _codec(cal, 8).encode_keys(np.full((1, 2, 1, 8), 1e30, np.float32))


def test_key_scale_overflow_names_the_keys_by_head_and_token():
    """A key too far out for its float16 scale is named by (batch, head, token) in the keys the
    caller gave, not by the kernel's row of the flattened leading axes."""
    import torch
    from kvqrs.hf import QuantizedKVCache
    from kvqrs.hf.attention import active

    _, cal = _token_calibration()
    k = np.random.default_rng(1).standard_normal((1, 2, 5, 8)).astype(np.float32)
    k[0, 1, 3], k[0, 0, 4, 2] = 1e30, -1e30
    tail = r" overflows its float16 per-token scale: .*\|y_i / sigma_i\|, is [0-9.e+]+ \(expected below 65520"
    with pytest.raises(
        KvqrsError,
        match=r"^keys: the key at \(batch 0, head 0, token 4\), \(batch 0, head 1, token 3\) of keys shape \(1, 2, 5, 8\)" + tail,
    ):
        _codec(cal, 8).encode_keys(k)
    with pytest.raises(KvqrsError, match=r"^keys: the key at \(head 1, token 3\) of keys shape \(2, 4, 8\)" + tail):
        _codec(cal, 8).encode_keys(k[0, :, :4])
    many = np.full((2, 3, 8), 1e30, np.float32)
    with pytest.raises(KvqrsError, match=r"token 0\), \(head 0, token 1\), \(head 0, token 2\) and 3 more of keys"):
        _codec(cal, 8).encode_keys(many)
    with np.errstate(invalid="ignore"), pytest.raises(KvqrsError, match=r"^keys: expected finite"):  # the kernel's own error
        _codec(cal, 8).encode_keys(np.full((2, 3, 8), np.inf, np.float32))
    # Through the cache (whose native encoder refuses the tokens; the Python path names them).
    one = k.copy()
    one[0, 0, 4] = 0.0
    cache = QuantizedKVCache(QuantConfig("matched", 4, "matched", 4, group=8, calibration={0: cal}), 1)
    with (
        active(None),
        pytest.raises(KvqrsError, match=r"^keys: the key at \(batch 0, head 1, token 3\) of keys shape \(1, 2, 5, 8\)" + tail),
    ):
        cache.update(torch.from_numpy(one), torch.zeros(1, 2, 5, 8), 0)


def test_calibration_file_keeps_the_deviations(tmp_path):
    _, cal = _token_calibration()
    back = load_matched(save_matched(tmp_path / "cal", {0: cal, 1: cal}))
    np.testing.assert_array_equal(back[1].keys.deviations, cal.keys.deviations)
    k = np.random.default_rng(0).standard_normal((1, 2, 9, 8)).astype(np.float32)
    enc = _codec(cal, 8).encode_keys(k)
    np.testing.assert_array_equal(_codec(back[1], 8).decode_keys(enc), _codec(cal, 8).decode_keys(enc))


def test_cache_codes_every_token_at_once():
    import torch
    from kvqrs.hf import QuantizedKVCache
    from kvqrs.hf.attention import active

    x, cal = _token_calibration(h=3, n=400, d=16)
    cfg = QuantConfig("matched", 4, "matched", 4, residual_length=0, group=8, calibration={0: cal})
    cache = QuantizedKVCache(cfg, 1)
    k = torch.from_numpy(x[None, :, :13].copy())
    v = torch.from_numpy(x[None, :, 13:26].copy())
    with active(None):
        for t in range(13):  # one token at a time: none is left in full precision
            keys, _ = cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    codec = cfg.codec(0, 16)
    ck, cv = codec.encode_keys(x[None, :, :13]), codec.encode_values(x[None, :, 13:26])
    torch.testing.assert_close(keys, torch.from_numpy(codec.decode_keys(ck)))
    assert cache.nbytes() == ck.nbytes + cv.nbytes  # codes only: no token waits in full precision


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_fused_attention_equals_the_decoded_path(tokens):
    x, cal = _token_calibration(h=3, n=500, d=16, bits=4.0)
    codec = _codec(cal, 16)
    rng = np.random.default_rng(tokens)
    k = (x[None, :, rng.integers(0, 500, tokens)] + 0.1 * rng.standard_normal((1, 3, tokens, 16))).astype(np.float32)
    v = rng.standard_normal((1, 3, tokens, 16)).astype(np.float32)
    q = rng.standard_normal((1, 6, 2, 16)).astype(np.float32)  # GQA: 2 query heads per KV head, 2 query tokens
    ck, cv = codec.encode_keys(k), codec.encode_values(v)
    got = codec.fused_attention(q, ck, cv)
    keys, values = codec.decode_keys(ck).astype(np.float64), codec.decode_values(cv).astype(np.float64)
    qg = q.reshape(1, 3, 2 * 2, 16).astype(np.float64)
    logits = qg @ np.swapaxes(keys, -1, -2) / 4.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ values
    np.testing.assert_allclose(np.asarray(got.out).reshape(ref.shape), ref, atol=2e-5 * max(1.0, np.abs(values).max()))


def test_token_code_bytes_counts_what_the_coder_stores():
    """`token_code_bytes` is the coder's packed codes per token: each run of equal width
    padded to whole bytes (the float16 scale on top)."""
    x, cal = _token_calibration(h=2, n=300, d=16, bits=3.3)
    coder = MatchedTokenCoder(16, cal.keys, "matched", "keys")
    enc = coder.encode(x[:, :10])
    assert enc.nbytes == 2 * 10 * (token_code_bytes(cal.keys.widths) + TOKEN_SCALE_BYTES)
    assert token_code_bytes([3, 3, 3, 2, 0]) == 2 + 1  # 9 bits in 2 bytes, 2 bits in 1
    assert token_code_bytes([5, 3, 5, 3, 3]) == 2 + 2  # order does not matter: runs by width


@given(st.integers(0, 40), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_water_fill_bytes_fits_and_fills_the_budget(budget, seed):
    """Under any byte budget the widths' padded bytes fit, and while a coordinate is left at
    width 0 the greedy fills the budget exactly (a 0 -> 1 step costs at most one byte)."""
    rng = np.random.default_rng(seed)
    n = 24
    # Distortions falling with the width, as measured ones do (about 4x per bit).
    cost = rng.uniform(0.1, 10.0, (n, 1)) * 4.0 ** -np.arange(MAX_WIDTH + 1)
    w = water_fill_bytes(cost, budget)
    assert w.shape == (n,) and w.min() >= 0 and w.max() <= MAX_WIDTH
    assert token_code_bytes(w) <= budget
    if (w == 0).any():
        assert token_code_bytes(w) == budget
    with pytest.raises(KvqrsError, match="code_bytes"):
        water_fill_bytes(cost, -1)


def test_water_fill_bytes_spends_padding_that_water_fill_wastes():
    """At the same budget in bytes, widths water-filled in bits lose padding bytes to their
    runs, so fewer bits would fit; `water_fill_bytes` fills the bytes."""
    cost = np.linspace(10.0, 1.0, 5)[:, None] * 4.0 ** -np.arange(MAX_WIDTH + 1)
    by_bits = water_fill(cost, 16)  # 16 bits = 2 bytes, but in runs of different widths
    assert token_code_bytes(by_bits) > 2
    by_bytes = water_fill_bytes(cost, 2)
    assert token_code_bytes(by_bytes) == 2


def test_fit_bases_bytes_fits_each_byte_budget_with_one_transform():
    """`fit_bases_bytes`: per-token keys (deviations carried) whose padded code bytes are each
    budget, from the transform `fit_basis(scales="tokens")` uses (the same columns where the
    widths agree); budgets out of range are refused."""
    x, w = _data(h=2, n=400, d=16)
    fits = fit_bases_bytes(x, [4, 6, 9], w)
    assert [token_code_bytes(f.widths) for f in fits] == [4, 6, 9]
    assert all(f.deviations is not None and f.kv_heads == 2 for f in fits)
    assert [f.code_bits() for f in fits] == sorted(f.code_bits() for f in fits)
    ref = fit_basis(x, 2.0, 8, w, scales="tokens")  # the same mean and deviations per column
    np.testing.assert_array_equal(ref.mean, fits[0].mean)
    with pytest.raises(KvqrsError, match="at most d = 16 bytes"):
        fit_bases_bytes(x, [17], w)
    with pytest.raises(KvqrsError, match="integer bytes"):
        fit_bases_bytes(x, [2.5], w)
