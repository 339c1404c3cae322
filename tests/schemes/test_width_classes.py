"""Value widths in fixed per-chunk classes ordered by A^2 importance: the rounding of a width
histogram, the assignment by weight, the coder against the plain MSE stage token by token,
joining and cutting at whole chunks, the causal importance against a loop, calibration files,
and the fast path and cache's handling of calibrations that hold classes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError
from kvqrs.hf import QuantConfig, QuantizedKVCache, load_matched, save_matched
from kvqrs.hf.attention import causal_importance
from kvqrs.hf.calibration import fit_value_classes
from kvqrs.schemes import KVCodec
from kvqrs.schemes.matched import MatchedCalibration, random_calibration
from kvqrs.schemes.mse import MSECoder
from kvqrs.schemes.width_classes import WidthClassCoder, assign, check_classes, class_counts

SEED = 11


@settings(max_examples=60, deadline=None)
@given(
    hist=st.lists(st.integers(0, 50), min_size=8, max_size=8).filter(lambda h: sum(h) > 0),
    bits=st.integers(1, 8),
    chunk=st.sampled_from([8, 32, 128, 256]),
)
def test_class_counts_fill_the_chunk_at_the_exact_mean(hist, bits, chunk):
    classes = class_counts([0, *hist], bits, chunk)
    assert sum(c for _, c in classes) == chunk
    assert sum(w * c for w, c in classes) == bits * chunk
    assert [w for w, _ in classes] == sorted({w for w, _ in classes}, reverse=True)


def test_class_counts_keep_a_histogram_of_the_right_mean():
    # 1/4 at 1 bit, 1/2 at 2, 1/4 at 3: mean 2 already, nothing moves.
    assert class_counts([0, 25, 50, 25, 0, 0, 0, 0, 0], 2, 128) == ((3, 32), (2, 64), (1, 32))


@pytest.mark.parametrize("bad", [[], [(2, 0)], [(9, 8)], [(2, 4), (2, 4)], [(3, 7)], "x", 5, [(3,)], [(3.5, 8)], [(True, 8)]])
def test_bad_classes_are_named(bad):
    with pytest.raises(KvqrsError, match="value_classes"):
        check_classes(bad, 8)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_assignment_gives_the_widest_classes_the_largest_weights(t, seed):
    rng = np.random.default_rng(seed)
    classes, chunk = ((4, 3), (2, 9), (1, 4)), 16
    w = rng.choice([0.0, 0.5, 1.0, 2.0], size=(2, t))  # ties too
    cls = assign(w, classes, chunk)
    widths = np.array([b for b, _ in classes])[cls]
    for c0 in range(0, t, chunk):
        cw, ww = widths[:, c0 : c0 + chunk], w[:, c0 : c0 + chunk]
        counts = [(cls[:, c0 : c0 + chunk] == i).sum(axis=-1) for i in range(len(classes))]
        if ww.shape[-1] == chunk:
            assert all((n == c).all() for n, (_, c) in zip(counts, classes))
        else:  # a short chunk fills the widest classes first
            assert all((n <= c).all() for n, (_, c) in zip(counts, classes))
        # Rearrangement: a wider token never has a smaller weight than a narrower one.
        for r in range(w.shape[0]):
            order = np.lexsort((np.arange(ww.shape[-1]), -ww[r]))
            assert (np.diff(cw[r][order]) <= 0).all()


def _coder(classes=((3, 4), (2, 8), (1, 4)), chunk=16, h=3, d=64, norms="float", group=None):
    mean = np.random.default_rng(5).standard_normal((h, d)).astype(np.float32)
    return WidthClassCoder(classes, chunk, mean, lambda b: MSECoder(d, b, SEED, "matched", "values", norms=norms, norm_group=group))


@pytest.mark.parametrize("norms,group", [("float", None), ("log8", 4)])
@pytest.mark.parametrize("t", [1, 16, 37, 48])
def test_each_token_decodes_as_the_mse_stage_at_its_width(t, norms, group):
    """The slot bookkeeping is exact: every token decodes to what the plain MSE stage at its
    class's width gives for it (float norms; log8 norms are grouped over a class's slots, so
    there the decode is checked within the codes' distortion)."""
    coder = _coder(norms=norms, group=group)
    rng = np.random.default_rng(t)
    x = rng.standard_normal((2, 3, t, 64)).astype(np.float32) * 2
    w = rng.random((2, 3, t))
    enc = coder.encode(x, w)
    assert set(enc.parts) == set(coder.layout(x.shape))
    assert all(enc.parts[k].shape == p.shape for k, p in coder.layout(x.shape).items())
    y, widths = coder.decode(enc), coder.widths(enc)
    centred = x - coder.mean[:, None, :]
    for b in np.unique(widths):
        sel = widths == b
        if norms == "float":
            stage = MSECoder(64, int(b), SEED, "matched", "values")
            want = stage.decode(stage.encode(centred[sel])) + np.broadcast_to(coder.mean[:, None, :], x.shape)[sel]
            np.testing.assert_array_equal(y[sel], want)
        else:
            err = np.sum((y[sel] - x[sel]) ** 2, axis=-1) / np.sum(centred[sel] ** 2, axis=-1)
            assert err.mean() < {1: 0.45, 2: 0.16, 3: 0.06}[int(b)]


def test_weights_decide_which_tokens_get_the_wide_codes():
    coder = _coder()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 32, 64)).astype(np.float32)
    w = np.ones((1, 3, 32))
    w[..., [3, 20]] = 1e6  # two tokens read by every query
    widths = coder.widths(coder.encode(x, w))
    assert (widths[..., [3, 20]] == 3).all()


def test_chunks_join_and_cut_at_whole_chunks():
    cal = dataclasses.replace(random_calibration(64, 3, 1), value_bits=2, value_classes=((3, 4), (2, 8), (1, 4)))
    codec = KVCodec("matched", 3, 64, seed=SEED, group=16, calibration=cal)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 1, 40, 64)).astype(np.float32), rng.random((1, 1, 40))
    whole = codec.encode_values(x, w)
    parts = [codec.encode_values(x[..., a:b, :], w[..., a:b]) for a, b in ((0, 16), (16, 32), (32, 40))]
    joined = codec.concat(parts)
    assert all(np.array_equal(joined.parts[k], whole.parts[k]) for k in whole.parts)
    kept = codec.slice_tokens(whole, 32, 16)
    np.testing.assert_array_equal(codec.decode_values(kept), codec.decode_values(parts[1]))
    with pytest.raises(KvqrsError, match="whole groups of 16 tokens"):
        codec.slice_tokens(whole, 8)


def test_encode_needs_finite_non_negative_weights_of_the_tokens_shape():
    coder = _coder()
    x = np.zeros((1, 3, 5, 64), np.float32)
    with pytest.raises(KvqrsError, match="A\\^2 importance"):
        coder.encode(x)
    with pytest.raises(KvqrsError, match="shape"):
        coder.encode(x, np.ones((1, 3, 4)))
    for bad in ("abc", np.ones((1, 3, 5)) * 1j):
        with pytest.raises(KvqrsError, match="real importances"):
            coder.encode(x, bad)
    w = np.ones((1, 3, 5))
    w[0, 1, 2] = -1
    with pytest.raises(KvqrsError, match=r"non-negative importances, got -1.0 at index \(0, 1, 2\)"):
        coder.encode(x, w)


def test_causal_importance_equals_a_loop():
    rng = np.random.default_rng(4)
    b, hq, g, n, sinks, queries, window = 1, 4, 2, 12, 1, 3, 4
    logits = torch.from_numpy(rng.standard_normal((b, hq, n, n)) * 3)
    got = causal_importance(logits, sinks, g, queries, window)
    want = np.zeros((b, hq // g, n))
    for h in range(hq):
        for t in range(n):
            keys = [j for j in range(t + 1) if t - j < window or j < sinks]
            z = np.exp(logits[0, h, t, keys].numpy()).sum()
            for j in range(t, min(n, t + queries)):  # the key's own query and the ones before it
                e = np.exp(logits[0, h, t, j].item())
                want[0, h // g, j] += (e / z if j == t else e / (z + e)) ** 2
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_causal_importance_reads_no_later_position():
    rng = np.random.default_rng(5)
    logits = torch.from_numpy(rng.standard_normal((1, 6, 40, 40)))
    later = logits.clone()
    later[..., 21:, :] += torch.from_numpy(rng.standard_normal((1, 6, 19, 40)))
    later[..., :, 21:] -= 2.0
    a, b = causal_importance(logits, 1, 3), causal_importance(later, 1, 3)
    np.testing.assert_array_equal(a[..., :21], b[..., :21])
    assert not np.allclose(a[..., 21:], b[..., 21:])


def test_causal_importance_refuses_bad_arguments():
    x = torch.zeros(1, 6, 8, 8)
    bad = [
        ((torch.zeros(6, 8, 8), 1, 3), "logits: expected a \\(batch, q_heads, len, len\\)"),
        ((torch.zeros(1, 6, 8, 7), 1, 3), "logits: expected"),
        ((np.zeros((1, 6, 8, 8)), 1, 3), "torch tensor, got ndarray"),
        ((torch.zeros(1, 6, 8, 8, dtype=torch.int64), 1, 3), "real floating-point"),
        ((x, 1, 4), "groups: expected a divisor of the 6 query heads"),
        ((x, 1, 0), "groups: expected an integer >= 1"),
        ((x, -1, 3), "sinks: expected an integer >= 0"),
        ((x, 1, 3, 0), "queries: expected an integer >= 1"),
        ((x, 1, 3, 16, 0), "window: expected an integer >= 1"),
    ]
    for args, match in bad:
        with pytest.raises(KvqrsError, match=match):
            causal_importance(*args)
    y = x.clone()
    y[0, 2, 5, 1] = float("nan")
    with pytest.raises(KvqrsError, match=r"logits: expected finite values, got nan at index \(0, 2, 5, 1\)"):
        causal_importance(y, 1, 3)


def test_class_counts_refuses_a_fractional_mean():
    with pytest.raises(KvqrsError, match="bits: expected an integer bit width"):
        class_counts(np.ones(9), 2.5, 128)
    with pytest.raises(KvqrsError, match="chunk: expected an integer >= 1"):
        class_counts(np.ones(9), 2, 0)


def test_fit_value_classes_names_missing_layers(model32):
    model, tok = model32
    ids = tok("a b c " * 100, return_tensors="pt").input_ids
    cal = {0: random_calibration(model.config.hidden_size // model.config.num_attention_heads, 3, 0)}
    with pytest.raises(KvqrsError, match="missing layers \\[1"):
        fit_value_classes(model, [ids], cal, 32)


def test_calibration_file_keeps_the_classes(tmp_path):
    cal = {0: dataclasses.replace(random_calibration(64, 3, 1), value_bits=2, value_classes=((3, 32), (2, 64), (1, 32)))}
    back = load_matched(save_matched(tmp_path / "c.npz", cal))
    assert back[0].value_classes == ((3, 32), (2, 64), (1, 32))


def test_calibration_refuses_classes_of_another_mean():
    base = random_calibration(64, 3, 1)
    with pytest.raises(KvqrsError, match="mean width value_bits"):
        MatchedCalibration(base.keys, base.value_mean, value_bits=3, value_classes=((3, 32), (2, 64), (1, 32)))
    cal = {0: dataclasses.replace(base, value_bits=2, value_classes=((3, 4), (2, 8), (1, 4)))}
    with pytest.raises(KvqrsError, match="chunks of 16 tokens, the config's group is 32"):
        QuantConfig("matched", 3, "matched", 2, calibration=cal).codec(0, 64)


def test_the_cache_refuses_classes_and_the_fast_path_uses_them(model32, monkeypatch):
    from kvqrs.hf import attention, fake_quant

    model, tok = model32
    layers = model.config.num_hidden_layers
    d = model.config.hidden_size // model.config.num_attention_heads
    plain = {i: dataclasses.replace(random_calibration(d, 3, i), value_bits=2) for i in range(layers)}
    classed = {i: dataclasses.replace(c, value_classes=((3, 8), (2, 16), (1, 8))) for i, c in plain.items()}
    with pytest.raises(KvqrsError, match="fast evaluation path"):
        QuantizedKVCache(QuantConfig("matched", 3, "matched", 2, group=32, calibration=classed), layers)
    ids = tok("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt").input_ids[:, :80]
    out = {}
    for name, cal in (("plain", plain), ("classes", classed), ("equal importances", classed)):
        cfg = QuantConfig("matched", 3, "matched", 2, group=32, calibration=cal, sink_tokens=1)
        if name == "equal importances":
            monkeypatch.setattr(attention, "causal_importance", lambda s, sinks, g: np.ones((1, s.shape[1] // g, s.shape[-1])))
        with torch.no_grad(), fake_quant(cfg, one_shot=True):
            out[name] = model(ids).logits
    # The classes change the codes, and the importances decide which token takes which class.
    assert not torch.equal(out["plain"], out["classes"])
    assert not torch.equal(out["classes"], out["equal importances"])
