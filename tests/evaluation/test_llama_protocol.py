"""llama.cpp's perplexity protocol (``kvqrs eval --protocol llama``): chunking, the scored
positions, the dense reference, bits per element with every byte counted, and the reports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from kvqrs import KvqrsError
from kvqrs.evaluation import llama_protocol as lp
from kvqrs.hf import QuantConfig
from kvqrs.schemes.matched import token_code_bytes

CTX, CHUNKS = 64, 2


@pytest.fixture(scope="module")
def texts():
    from kvqrs.evaluation import text

    return text.default()


def test_chunks_are_consecutive_and_refuse_short_text(model32, texts):
    _, tok = model32
    ids = tok(texts.evaluation, return_tensors="pt").input_ids[0]
    ch = lp.llama_chunks(tok, texts.evaluation, CTX, 3)
    assert [c.shape for c in ch] == [(1, CTX)] * 3
    assert torch.equal(torch.cat([c[0] for c in ch]), ids[: 3 * CTX])
    with pytest.raises(KvqrsError, match="fewer than one chunk"):
        lp.llama_chunks(tok, "too short", CTX, 1)


def test_rows_beside_llama_cpp(model32, texts, tmp_path):
    model, tok = model32
    rows = [
        lp.LlamaRow("dense", None),
        lp.LlamaRow("kqv k4 v4", QuantConfig("kqv", 4, "kqv", 4)),
        lp.LlamaRow("matched random", QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, calibration="random")),
    ]
    res = lp.run_llama(model, tok, texts, rows, ctx=CTX, chunks=CHUNKS, progress=False)
    dense, kqv, matched = res["rows"]
    assert res["scored_tokens"] == CHUNKS * (CTX // 2 - 1) == dense["tokens"]
    # the dense row is the model's own loss on the scored positions
    nll = []
    with torch.no_grad():
        for c in lp.llama_chunks(tok, texts.evaluation, CTX, CHUNKS):
            logp = torch.log_softmax(model(c).logits[0].double(), -1)
            nll += [-logp[t, c[0, t + 1]].item() for t in range(CTX // 2, CTX - 1)]
    assert dense["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-9)
    assert dense["kl_mean"] == 0 and dense["excess"] == 0 and dense["same_top"] == 1
    # kqv at d = 64: 4 + 16/64 key bits, values 3 + 1 QJL + two 16-bit norms
    assert (kqv["bpe_k"], kqv["bpe_v"]) == (4.25, 4.5)
    assert kqv["kl_mean"] > 0 and kqv["excess"] != 0
    # one sink token of 64 in float32 on top of the codes
    assert matched["bpe_k"] > 3.0 + 28 / 64 and matched["kl_p99"] >= matched["kl_mean"] > 0
    md = lp.write(res, tmp_path, 1.0)
    text = md.read_text()
    assert "llama.cpp q4_0 / q4_0, rotation" in text and "| kqv k4 v4 | 4.250 / 4.500" in text
    assert json.loads((tmp_path / "llama.json").read_text())["rows"][2]["row"] == "matched random"
    assert (tmp_path / "llama.csv").read_text().splitlines()[0].startswith("row,ppl")


def test_matched_rows_cover_each_technique():
    from kvqrs.schemes.matched import random_calibration

    one = {0: random_calibration(64, 4, 0)}  # a stand-in: the rows' names depend on the budgets only
    cal = {(4.0, 128): one, (3.0, 256): one}
    names = [r.name for r in lp.matched_rows(cal)]
    assert names == [
        "matched k4 v4 sinks:1",
        "matched k4 sinks:1 (keys only)",
        "matched k4 v4 (no sinks)",
        "matched k3 g256 v3 sinks:1",
        "matched k3 g256 sinks:1 (keys only)",
        "matched k3 g256 v3 (no sinks)",
    ]


def test_self_calibrated_row_counts_its_calibration(model32, texts):
    from kvqrs.evaluation.capture import record
    from kvqrs.hf.calibration import prefill_calibration

    model, tok = model32
    ids = lp.llama_chunks(tok, texts.evaluation, CTX, 1)[0]
    qkv = {layer: tuple(x[None] for x in t) for layer, t in record(model, ids).items()}
    cfg = QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, calibration="prefill")
    fitted = {
        layer: prefill_calibration(cfg, *(torch.from_numpy(x) for x in (q, k[..., 1:, :], v[..., 1:, :])))
        for layer, (q, k, v) in qkv.items()
    }
    fixed = QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, calibration=fitted)
    bk, bv = lp.chunk_bits(cfg, qkv)
    fk, fv = lp.chunk_bits(fixed, qkv)
    numel = sum(k.size for _, k, _ in qkv.values())
    side_k = sum(c.keys.nbytes for c in fitted.values()) * 8 / numel
    side_v = sum(c.value_mean.nbytes for c in fitted.values()) * 8 / numel
    assert bk == pytest.approx(fk + side_k) and bv == pytest.approx(fv + side_v)
    assert all(c.keys.permutation is not None for c in fitted.values())  # the cheap channel transform
    # Sinks stored in float16 count 16 bits per element instead of the model's 32.
    half = QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, sink_dtype="float16", calibration=fitted)
    hk, hv = lp.chunk_bits(half, qkv)
    n_sink = sum(k[..., :1, :].size for _, k, _ in qkv.values())
    assert fk - hk == pytest.approx(16 * n_sink / numel) and fv - hv == pytest.approx(16 * n_sink / numel)


def test_calibration_file_row_reads_its_settings(tmp_path):
    import dataclasses

    from kvqrs.hf import save_matched
    from kvqrs.schemes.matched import random_calibration

    cal = {i: dataclasses.replace(random_calibration(64, 3, i), value_bits=2 + i) for i in range(2)}
    p = save_matched(tmp_path / "a.npz", cal, {"group": 256, "sink_tokens": 2, "budget": 3.25})
    row = lp.file_row(p)
    assert row.name == "matched budget 3.25, per-layer widths g256 sinks:2 (a.npz)"
    assert (row.config.group, row.config.sink_tokens) == (256, 2)
    assert [row.config.codec(i, 64).values.bits for i in range(2)] == [2, 3]
    assert row.config.value_scale == "norm"
    ls = lp.file_row(p, "least_squares")
    assert ls.name == "matched budget 3.25, per-layer widths g256 sinks:2 ls-scale (a.npz)" and ls.config.value_scale == "least_squares"
    # A file recording its value scale (`kvqrs calibrate --value-scale`) evaluates with it unless told otherwise.
    q = save_matched(tmp_path / "b.npz", cal, {"group": 256, "sink_tokens": 2, "budget": 3.25, "value_scale": "preserve_norm"})
    pn = lp.file_row(q)
    assert (
        pn.config.value_scale == "preserve_norm" and pn.name == "matched budget 3.25, per-layer widths g256 sinks:2 preserve_norm (b.npz)"
    )
    assert lp.file_row(q, "norm").config.value_scale == "norm"
    # A file recording a sink dtype but no sinks (made before QuantConfig refused the pair)
    # evaluates without one: nothing was stored in it.
    z = save_matched(tmp_path / "c.npz", cal, {"group": 256, "sink_tokens": 0, "sink_dtype": "float16", "budget": 3.25})
    zr = lp.file_row(z)
    assert zr.config.sink_tokens == 0 and zr.config.sink_dtype is None and "float16" not in zr.name


def test_allocation_spends_the_budget_on_sensitive_layers(model32, texts):
    from kvqrs.hf.calibration import allocate_matched

    model, tok = model32
    ch = lp.llama_chunks(tok, texts.calibration, CTX, 3)
    # At 64 tokens, groups of 16 and one float32 sink, width 2 costs about 3.4 bits per element
    # and width 4 about 5.6: a budget between them gives some layers each.
    cal = allocate_matched(model, ch[:2], ch[2:], budget=4.5, key_widths=(2, 4), group=16, sink_tokens=1)
    pairs = [(c.keys.code_bits(), c.value_bits) for _, c in sorted(cal.items())]
    assert {k for k, _ in pairs} | {v for _, v in pairs} == {2, 4}  # some layers or sides each
    # Key widths chosen apart from the value widths: values at 3 bits, keys at 2 or 4.
    cal = allocate_matched(model, ch[:2], ch[2:], budget=4.5, key_widths=(2, 4), value_widths=(3,), group=16, sink_tokens=1)
    assert {c.value_bits for c in cal.values()} == {3} and {c.keys.code_bits() for c in cal.values()} == {2.0, 4.0}
    with pytest.raises(KvqrsError, match="value_widths: expected integer bits"):
        allocate_matched(model, ch[:2], ch[2:], budget=4.5, key_widths=(2, 4), value_widths=(2.5,), group=16)


def test_fisher_sensitivity_estimates_the_measured_kl(model32, texts):
    """The second-order estimate of each layer's KL (one forward and a few backward passes)
    against the KL measured by re-running the model with that layer alone coded: the same
    totals within 25% and the same ranking of the layers, for keys and for values."""
    from kvqrs.hf.calibration import fisher_sensitivity, fit_matched, layer_sensitivity, record_matched
    from scipy.stats import spearmanr

    model, tok = model32
    ch = lp.llama_chunks(tok, texts.calibration, 2 * CTX, 3)
    # The presets' regime, where one layer's coding is a small change (at 2-bit keys the KL of
    # one layer reaches 0.05 and the expansion overstates it).
    fit = fit_matched(record_matched(model, ch[:2], 1), 3, 32)
    configs = [
        QuantConfig("matched", 3, None, group=32, sink_tokens=1, calibration=fit),
        QuantConfig(None, 3, "matched", 3, group=32, sink_tokens=1, calibration=fit, value_scale="preserve_norm"),
    ]
    est = fisher_sensitivity(model, ch[2:], configs, samples=8)
    measured = layer_sensitivity(model, ch[2:], configs)
    assert est.shape == measured.shape == (model.config.num_hidden_layers, 2)
    for j in range(2):
        assert est[:, j].sum() == pytest.approx(measured[:, j].sum(), rel=0.25)
        assert spearmanr(est[:, j], measured[:, j]).statistic > 0.7
    # seeded: the same draws give the same estimate
    np.testing.assert_array_equal(
        fisher_sensitivity(model, ch[2:], configs[:1], samples=2), fisher_sensitivity(model, ch[2:], configs[:1], samples=2)
    )
    with pytest.raises(KvqrsError, match="samples"):
        fisher_sensitivity(model, ch[2:], configs, samples=0)
    with pytest.raises(KvqrsError, match="sensitivity: expected"):
        from kvqrs.hf.calibration import allocate_matched

        allocate_matched(model, ch[:1], ch[2:], budget=4.5, key_widths=(2, 4), group=16, sensitivity="exact")


def test_allocation_with_value_classes_measures_and_counts_them(model32, texts, tmp_path):
    """`allocate_matched(..., value_classes=True)` fits classes at every candidate value width and
    keeps the chosen width's; the file's row evaluates them (the fast path) and counts the
    class index of every token in the value bits."""
    from kvqrs.hf import save_matched
    from kvqrs.hf.calibration import allocate_matched

    model, tok = model32
    ch = lp.llama_chunks(tok, texts.calibration, CTX, 3)
    cal = allocate_matched(
        model, ch[:2], ch[2:], budget=4.5, key_widths=(3,), value_widths=(2, 3), group=16, sink_tokens=1, value_classes=True
    )
    assert all(c.value_classes is not None and sum(b * n for b, n in c.value_classes) == 16 * c.value_bits for c in cal.values())
    row = lp.file_row(save_matched(tmp_path / "c.npz", cal, {"group": 16, "sink_tokens": 1, "budget": 4.5}))
    assert "a2-classes" in row.name
    v = np.random.default_rng(0).standard_normal((1, 3, CTX - 1, 64)).astype(np.float32)
    for layer, c in cal.items():  # 63 coded tokens fill 4 chunks of 16 slots, each slot with its class index
        enc = row.config.codec(layer, 64).encode_values(v, np.ones(v.shape[:-1]))
        k = max(1, math.ceil(math.log2(len(c.value_classes))))
        assert enc.nbytes == 3 * 4 * (sum(n * (8 * b + 2) for b, n in c.value_classes) + 2 * k)
    result = lp.run_llama(model, tok, texts, [row], ctx=CTX, chunks=1, progress=False)
    assert np.isfinite(result["rows"][0]["kl_mean"])


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_gaussian_channel_reaches_the_rate_distortion_bound(bits):
    from kvqrs.evaluation.channel import gaussian_channel

    rng = np.random.default_rng(bits)
    var = np.array([[0.25], [4.0]])
    y = rng.standard_normal((2, 200_000)) * np.sqrt(var)
    out = gaussian_channel(y, var, bits, np.random.default_rng(7))
    bound = var[:, 0] * 2.0 ** (-2 * bits)
    # E[(y_hat - y)^2] = s^2 2^(-2b) and Var(y_hat) = s^2 - D (Cover and Thomas, the backward channel)
    np.testing.assert_allclose(((out - y) ** 2).mean(axis=1), bound, rtol=0.02)
    np.testing.assert_allclose(out.var(axis=1), var[:, 0] - bound, rtol=0.02)
    assert not gaussian_channel(y, var, 0, rng).any() and not gaussian_channel(y, np.zeros((2, 1)), bits, rng).any()


def test_channel_keys_keep_group_means_and_drop_zero_widths():
    from kvqrs.evaluation.channel import channel_keys, channel_values
    from kvqrs.schemes.matched import MatchedCoder, MatchedValueCoder, random_calibration

    cal = random_calibration(64, 3, 5)
    widths = np.repeat(np.array([8, 4, 2, 0], np.uint8), 16)
    import dataclasses

    basis = dataclasses.replace(cal.keys, widths=widths)
    coder = MatchedCoder(64, basis, 32, "matched", "keys")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 96, 64)) * 3 + 1).astype(np.float32)
    out = channel_keys(coder, x, np.random.default_rng(1))
    assert out.shape == x.shape and out.dtype == np.float32
    y = (x.astype(np.float64) - basis.mean[0]) @ basis.basis[0].astype(np.float64)
    yh = (out.astype(np.float64) - basis.mean[0]) @ basis.basis[0].astype(np.float64)
    np.testing.assert_allclose(yh[..., 48:], 0, atol=1e-4)  # width 0: the coordinate dropped
    for s in range(0, 96, 32):  # each group's mean kept (the zero point's job), to sampling error
        np.testing.assert_allclose(yh[:, s : s + 32, :48].mean(1), y[:, s : s + 32, :48].mean(1), atol=1.2)
    err = ((yh - y) ** 2).mean(axis=(0, 1))
    assert err[:16].max() < 1e-3 < err[16:32].mean() < err[32:48].mean()
    values = MatchedValueCoder(64, 2, 3, np.zeros((1, 64), np.float32), "matched", "values")
    v = rng.standard_normal((1, 64, 64)).astype(np.float32)
    vh = channel_values(values, v, np.random.default_rng(2))
    rel = ((vh - v) ** 2).sum(-1) / (v.astype(np.float64) ** 2).sum(-1)
    assert rel.mean() == pytest.approx(2.0**-4, rel=0.1)


def test_channel_rows_stand_in_for_the_codec(model32, texts):
    from kvqrs.evaluation.channel import ChannelCodec

    model, tok = model32
    cfg = QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, calibration="random")
    row = lp.LlamaRow("matched random", cfg)
    rows = [lp.LlamaRow("dense", None), row, *lp.channel_rows(row, ["keys", "values", "both"])]
    res = lp.run_llama(model, tok, texts, rows, ctx=CTX, chunks=CHUNKS, progress=False)
    _, codec, keys, values, both = res["rows"]
    assert both["row"] == "matched random, Gaussian test channel (both)"
    for r in (keys, values, both):  # the bits of the codec it stands in for
        assert (r["bpe_k"], r["bpe_v"]) == (codec["bpe_k"], codec["bpe_v"])
        assert np.isfinite(r["kl_mean"]) and r["kl_mean"] > 0
    assert len({r["kl_mean"] for r in (codec, keys, values, both)}) == 4
    for sides in (["all"], "both", ["keys", "keys"]):
        with pytest.raises(KvqrsError, match="distinct sides"):
            lp.channel_rows(row, sides)
    with pytest.raises(KvqrsError, match="not a matched row"):
        lp.channel_rows(lp.LlamaRow("kqv", QuantConfig("kqv", 4, "kqv", 4)), ["keys"])
    import dataclasses

    from kvqrs.schemes.matched import random_calibration

    r = random_calibration(64, 3, 0)
    for fitted in (dataclasses.replace(r, values=r.keys), dataclasses.replace(r, value_bits=4, value_classes=((5, 8), (3, 8)))):
        coded = lp.LlamaRow("transform", dataclasses.replace(cfg, calibration={0: fitted}))
        assert [x.channel for x in lp.channel_rows(coded, ["keys"])] == ["keys"]
        with pytest.raises(KvqrsError, match="--channel keys runs"):
            lp.channel_rows(coded, ["keys", "both"])
    with pytest.raises(KvqrsError, match="no codec"):
        lp.channel_rows(rows[0], ["both"])
    with pytest.raises(KvqrsError, match="matched transform-coded keys"):
        ChannelCodec(QuantConfig("kqv", 4, "kqv", 4).codec(0, 64), "keys", np.random.default_rng(0))


def test_uniform_layers_give_every_layer_one_slot_within_the_budget(model32, texts):
    """`allocate_matched(..., uniform_layers=True)`: every layer's paged slot (keys' runs padded
    to whole bytes, their float16 scale, the value codes and norm) is the same size, at most
    the budget's bytes, and the layers may split it between keys and values differently. The
    default allocation across layers at the same budget gives the layers unequal slots."""
    from kvqrs.hf.calibration import allocate_matched
    from kvqrs.vllm.layout import SlotLayout

    model, tok = model32
    ch = lp.llama_chunks(tok, texts.calibration, CTX, 3)
    opts = {"value_widths": (3, 4, 5), "group": 16, "sink_tokens": 0, "key_scales": "tokens", "value_scale": "preserve_norm"}
    budget, d = 4.25, 64
    slot = int(budget * 2 * d / 8)  # 68 bytes per token and KV head

    def slots(cal):
        cfg = QuantConfig("matched", 4, "matched", 4, group=16, sink_tokens=0, calibration=cal, value_scale="preserve_norm")
        return [SlotLayout(cfg, layer, d).slot_bytes for layer in sorted(cal)]

    uniform = allocate_matched(model, ch[:2], ch[2:], budget, key_widths=(3, 4, 5), uniform_layers=True, **opts)
    assert set(uniform) == set(range(model.config.num_hidden_layers))
    assert set(slots(uniform)) == {slot}
    for c in uniform.values():  # the keys take what the values leave: 2 + 8 b bytes of values, a 2-byte key scale
        assert token_code_bytes(c.keys.widths) == slot - (2 + 8 * c.value_bits) - 2
    across = allocate_matched(model, ch[:2], ch[2:], budget, key_widths=(3, 4, 5), **opts)
    assert len(set(slots(across))) > 1
    with pytest.raises(KvqrsError, match="key_scales='tokens'"):
        allocate_matched(model, ch[:2], ch[2:], budget, uniform_layers=True, **{**opts, "key_scales": "groups"})
    with pytest.raises(KvqrsError, match="leaves the keys"):
        allocate_matched(model, ch[:2], ch[2:], 2.8, uniform_layers=True, **{**opts, "value_widths": (5,)})
