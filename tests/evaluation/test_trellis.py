"""The prototype trellis stand-in coder (kvqrs.evaluation.trellis): valid tail-biting bit
streams, the distortion it reaches against scalar codes at the same rate, and its rows on
llama.cpp's protocol at the codec's bits."""

from __future__ import annotations

import numpy as np
import pytest
from kvqrs import KvqrsError
from kvqrs.evaluation import llama_protocol as lp
from kvqrs.evaluation import trellis
from kvqrs.hf import QuantConfig


@pytest.mark.parametrize("k", [1, 2, 3])
def test_states_form_one_tail_biting_stream(k):
    """Every state shifts in k bits after its predecessor, and the first state's prefix is the
    last state's low L - k bits: the T k stored bits read circularly give every state."""
    book = trellis.codebook(k + 4, "gaussian", k)
    x = np.random.default_rng(k).standard_normal((12, 40))
    lap = trellis.viterbi(np.concatenate([x, x], axis=1), k, book)
    prefix = lap[:, x.shape[1]] >> k
    states = trellis.viterbi(x, k, book, prefix)
    m = 1 << 4
    assert np.array_equal(states[:, 1:] >> k, states[:, :-1] % m)
    assert np.array_equal(states[:, 0] >> k, states[:, -1] % m)
    assert np.array_equal(trellis.trellis_quantize(x, k, book), book[states])


def test_viterbi_finds_the_least_squared_error_stream():
    """On short sequences the trellis path equals the best of every bit stream (brute force)."""
    k, L, t = 1, 3, 6
    book = trellis.codebook(L, "uniform", 0)
    x = np.random.default_rng(3).uniform(-1, 1, (5, t))
    got = ((book[trellis.viterbi(x, k, book)] - x) ** 2).sum(axis=1)
    best = np.full(len(x), np.inf)
    for first in range(1 << L):
        for bits in range(1 << (k * (t - 1))):
            s, states = first, [first]
            for i in range(t - 1):
                s = ((s << k) | ((bits >> (k * i)) & ((1 << k) - 1))) % (1 << L)
                states.append(s)
            best = np.minimum(best, ((book[states] - x) ** 2).sum(axis=1))
    np.testing.assert_allclose(got, best, rtol=1e-12)


@pytest.mark.parametrize("k", [2, 4])
def test_gaussian_trellis_beats_lloyd_max_at_the_same_rate(k):
    """Unit Gaussian samples, 64 per sequence (a value token's coordinates): the tail-biting
    trellis at k bits per sample with L = k + 8 lies within 1.5x of the rate-distortion bound
    2^(-2k), where the k-bit Lloyd-Max quantizer lies at 1.88x (k = 2) and 2.43x (k = 4)."""
    x = np.random.default_rng(k).standard_normal((128, 64))
    book = trellis.codebook(k + 8, "gaussian", k)
    mse = ((trellis.trellis_quantize(x, k, book) - x) ** 2).mean()
    assert mse < 1.5 * 2.0 ** (-2 * k)


def test_codebooks_and_shapes_are_checked():
    with pytest.raises(KvqrsError, match="gaussian"):
        trellis.codebook(4, "laplace", 0)
    with pytest.raises(KvqrsError, match="L > k"):
        trellis.viterbi(np.zeros((1, 4)), 4, trellis.codebook(4, "uniform", 0))
    book = trellis.codebook(5, "uniform", 1)
    assert book.min() == -1 and book.max() == 1 and len(set(book.tolist())) == 32
    assert trellis.trellis_quantize(np.zeros((0, 8)), 2, book).shape == (0, 8)
    with pytest.raises(KvqrsError, match="expected one of"):
        trellis.trellis_wrap("trellis")


def test_trellis_keys_keep_each_group_range_and_drop_zero_widths():
    """Keys in the coder's basis: a coded coordinate's group extremes decode within a float16
    rounding and a grid step of themselves (the uniform grid holds both ends), finer at more
    bits, and a width-0 coordinate decodes to the key mean, as the coder's does."""
    import dataclasses

    from kvqrs.schemes.matched import MatchedCoder, random_calibration

    basis = dataclasses.replace(random_calibration(64, 3, 5).keys, widths=np.repeat(np.array([6, 3, 1, 0], np.uint8), 16))
    coder = MatchedCoder(64, basis, 32, "matched", "keys")
    x = (np.random.default_rng(0).standard_normal((1, 64, 64)) * 3 + 1).astype(np.float32)
    out = trellis.trellis_keys(coder, x)
    assert out.shape == x.shape and out.dtype == np.float32
    to_y = lambda a: (a.astype(np.float64) - basis.mean[0]) @ basis.basis[0].astype(np.float64)  # noqa: E731
    y, yh = to_y(x), to_y(out)
    np.testing.assert_allclose(yh[..., 48:], 0, atol=1e-4)
    cols = np.arange(48)
    for s in (0, 32):
        blk, got = y[0, s : s + 32, :48], yh[0, s : s + 32, :48]
        half = (blk.max(0) - blk.min(0)) / 2
        tol = half * (2.0**-9 + 2.0 / (2.0 ** basis.widths[:48].astype(float) - 1)) + 1e-4
        for ext in (blk.argmin(0), blk.argmax(0)):
            assert np.all(np.abs(got[ext, cols] - blk[ext, cols]) <= tol)
    err = ((yh - y)[..., :48] ** 2).mean(axis=(0, 1))
    assert err[:16].mean() < err[16:32].mean() < err[32:48].mean()


def test_trellis_rows_stand_in_for_the_codec(model32):
    from kvqrs.evaluation import text

    model, tok = model32
    cfg = QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, calibration="random")
    row = lp.LlamaRow("matched random", cfg)
    rows = [lp.LlamaRow("dense", None), row, *lp.channel_rows(row, ["trellis-values"])]
    res = lp.run_llama(model, tok, text.default(), rows, ctx=32, chunks=1, progress=False)
    _, codec, values = res["rows"]
    assert values["row"] == "matched random, trellis-values (prototype)"
    assert (values["bpe_k"], values["bpe_v"]) == (codec["bpe_k"], codec["bpe_v"])  # the codec's bits
    assert np.isfinite(values["kl_mean"]) and values["kl_mean"] > 0 and values["kl_mean"] != codec["kl_mean"]
    with pytest.raises(KvqrsError, match="matched transform-coded keys"):
        trellis.TrellisCodec(QuantConfig("kqv", 4, "kqv", 4).codec(0, 64), "trellis-keys")
