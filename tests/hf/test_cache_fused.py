"""Fused decode steps of ``CompressedLayer``: attention straight from the codes against the decoded
layer (every scheme, GQA, masks), the ``matched`` step streamed and one-shot, its native step
against the Python fused path, the fallback where a mask hides codes, generation on SmolLM2 in
float32 with fused steps against the decoded cache, and a float16 output that does not fit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache  # noqa: E402
from kvqrs.hf.store import CodeStore  # noqa: E402

from tests.cache_helpers import per_head_matched_calibration  # noqa: E402
from tests.hf.cache_cases import GROUPED, HEAD_DIM, PER_TOKEN, TEXT, _kv, _layers  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")

# Fused vs decoded cache, one layer, synthetic float32 tensors: the kernel evaluates the logits
# of the coded part in float32 from lookup tables and merges the window by log-sum-exp, the
# decoded path multiplies float32 decoded keys in torch; both accumulate in float32 or better.
# Outputs agree to float32 rounding of logits of size |q||k|/sqrt(d) ~ 10 here (measured 6e-7
# relative to the largest |v|); 1e-4 still fails on any code, scale or merge weight gone wrong
# (those move outputs by 1e-2 or more).
FUSED_LAYER_RTOL = 1e-4
# Generation on SmolLM2 in float32: 30 layers compound the per-layer float32 differences; the
# logits of fused and decoded runs differ by at most 5e-5 of the largest |logit| (measured 1.3e-3
# absolute on logits of ~25 for qkqv with no window, 3e-5 elsewhere); a wrong part of attention
# changes logits by whole units and the generated tokens.
FUSED_GEN_RTOL = 2e-4
# Those rounding differences reach the keys and values of the generated tokens, and one can land
# on the other side of a decision boundary: a code flipped (qkqv 3-bit keys with no window on an
# AMD EPYC: one value code of layer 28, then a few codes of layer 29, moved the later logits by up
# to 0.136 on a largest |logit| of 34.4, 4e-3 of it). Steps that read a flipped code are held to
# this looser bound, a third of what a wrong part of attention does (whole units, 3e-2 of it);
# after a flip the greedy tokens may part, and the steps after that are not compared.
FLIPPED_GEN_RTOL = 1e-2
# At most this share of the generated tokens' coded (layer, side, token) rows may differ between
# the two runs: the flips above changed 2%, a fused attention 2% off in its outputs over 90%.
FLIPPED_SHARE = 0.1


def _centred_calibration(layers: int, head_dim: int, bits: int) -> dict:
    """Seeded random-basis ``matched`` calibrations with nonzero key and value means, so that a
    fused step reads the key mean through the log-sum-exp (merged with the window) and adds the
    value mean."""
    from kvqrs.schemes.matched import MatchedBasis, MatchedCalibration, random_calibration

    out = {}
    for i in range(layers):
        c = random_calibration(head_dim, bits, 100 + i)
        g = torch.Generator().manual_seed(i)
        key_mean = (torch.randn(1, head_dim, generator=g) * 2).numpy()
        out[i] = MatchedCalibration(MatchedBasis(key_mean, c.keys.basis, c.keys.widths), torch.randn(1, head_dim, generator=g).numpy())
    return out


def _token_key_calibration(layers: int, head_dim: int, bits: int) -> dict:
    """:func:`_centred_calibration` with per-token key scales: seeded coordinate deviations, so
    the keys take the fixed-size layout (:class:`~kvqrs.schemes.matched_tokens.MatchedTokenCoder`)."""
    import dataclasses

    out = {}
    for i, c in _centred_calibration(layers, head_dim, bits).items():
        dev = np.random.default_rng(i).uniform(0.5, 2.0, (1, head_dim)).astype(np.float32)
        out[i] = dataclasses.replace(c, keys=dataclasses.replace(c.keys, deviations=dev))
    return out


# Keys of one size per token: a step of several new tokens moves several out of the window, read
# in full precision by the earlier queries, so only single-token steps are fused.
TOKEN_KEYS = QuantConfig("matched", 4, "matched", 4, residual_length=8, group=8, calibration=_token_key_calibration(30, HEAD_DIM, 4))

MATCHED_FUSED = [
    pytest.param(
        QuantConfig("matched", 4, "matched", 4, residual_length=8, group=8, calibration=_centred_calibration(30, HEAD_DIM, 4)),
        id="matched-means",
    ),
    pytest.param(
        QuantConfig("matched", 3, "matched", 3, residual_length=8, group=8, sink_tokens=1, calibration="random"), id="matched-sink"
    ),
    pytest.param(
        QuantConfig(
            "matched",
            3,
            "matched",
            3,
            residual_length=8,
            group=8,
            sink_tokens=1,
            sink_dtype="bfloat16",
            calibration="random",
            value_norms="log8",
        ),
        id="matched-log8-bf16-sink",
    ),
]

FUSED_CONFIGS = MATCHED_FUSED + [
    pytest.param(TOKEN_KEYS, id="matched-token-keys"),
    pytest.param(QuantConfig("kqv", 4, "kqv", 4, residual_length=8), id="kqv-k4v4-r8"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=8, group=8), id="kivi-k2v2-g8"),
    pytest.param(QuantConfig("qkqv", 3, "kv", 4, residual_length=0), id="qkqv-k3-kv4-r0"),
    pytest.param(QuantConfig("headq", 3, "block", 4, residual_length=4, headq_base="kqv", bases="random"), id="headq-kqv-block"),
    pytest.param(QuantConfig("kqv", 4, residual_length=4), id="kqv-keyonly"),
]


class _Module:
    """What the attention function reads from a transformers attention module."""

    def __init__(self, groups: int):
        self.num_key_value_groups, self.layer_idx = groups, 0


def _causal_mask(batch, nq, total):
    """transformers' additive causal mask for ``nq`` new queries over ``total`` positions."""
    pos = torch.arange(total)[None, :] <= torch.arange(total - nq, total)[:, None]
    return torch.where(pos, 0.0, torch.finfo(torch.float32).min).expand(batch, 1, nq, total)


@pytest.mark.parametrize("cfg", FUSED_CONFIGS + PER_TOKEN + GROUPED)
@pytest.mark.parametrize("nq", [1, 3])
def test_fused_decode_step_matches_decoded_layer(cfg, nq):
    k, v = _kv(tokens=45, seed=4)
    k2, v2 = _kv(tokens=nq, seed=5)
    q = torch.randn(2, 9, nq, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    module, scaling = _Module(3), HEAD_DIM**-0.5
    outs = []
    for fused in (True, False):
        layer = CompressedLayer(cfg, 0)
        rk, rv = layer.update(k, v, fused=fused)  # prefill: never fused
        assert rk.shape[-2] == 45
        layer.attend(module, q[..., :1, :], rk, rv, None, scaling)
        rk, rv = layer.update(k2, v2, fused=fused)
        # fused only when every new query reads every new code quantized (a per-token scheme
        # flushing 3 tokens in one step is read in full precision by its earlier queries)
        # (and only for codecs with a fused read path)
        has_path = cfg.codec(0, HEAD_DIM).has_fused_path()
        assert layer._fused == (fused and has_path and cfg.quantized_span(46)[1] >= cfg.quantized_span(45 + nq)[1])
        # a fused step hands back the window alone, as it lies in its buffer: nothing is
        # decoded or joined (attend reads the sinks and the codes)
        assert rk.shape[-2] == (layer.keys.shape[-2] if layer._fused else 45 + nq)
        if layer._fused and layer._buffered() is not None:
            assert rk.untyped_storage().data_ptr() == layer._window.keys.untyped_storage().data_ptr()
        mask = _causal_mask(2, nq, 45 + nq)
        outs.append(layer.attend(module, q, rk, rv, mask, scaling)[0])
    fused_out, decoded = outs
    assert fused_out.shape == decoded.shape == (2, nq, 9, HEAD_DIM)
    assert torch.allclose(fused_out, decoded, rtol=0, atol=FUSED_LAYER_RTOL * v.abs().max().item())


@pytest.mark.parametrize("cfg", [*MATCHED_FUSED, pytest.param(TOKEN_KEYS, id="matched-token-keys")])
def test_fused_matched_step_streaming_equals_one_shot(cfg):
    """A layer fed one token per step (fused steps along the way) and one fed the prompt at once
    hold the same codes, so their fused decode step agrees (to 1e-6 of the largest |v|: the
    NumPy basis product of the matched encoder can round a stored scalar one ulp apart between
    a 1-token and a 45-token call; a wrong code, mean or merge moves outputs by 1e-3 or more)."""
    k, v = _kv(tokens=45, seed=4)
    k2, v2 = _kv(tokens=1, seed=5)
    q = torch.randn(2, 9, 1, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    module, scaling = _Module(3), HEAD_DIM**-0.5
    outs = []
    for step in (45, 1):
        layer = CompressedLayer(cfg, 0)
        for i in range(0, 45, step):
            rk, rv = layer.update(k[..., i : i + step, :], v[..., i : i + step, :], fused=True)
            layer.attend(
                module,
                q if step == 1 else q.expand(2, 9, step, HEAD_DIM),
                rk,
                rv,
                None if step == 1 else _causal_mask(2, step, i + step),
                scaling,
            )
        rk, rv = layer.update(k2, v2, fused=True)
        assert layer._fused and rk.shape[-2] < 46
        outs.append(layer.attend(module, q, rk, rv, None, scaling)[0])
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-6 * v.abs().max().item())


@pytest.mark.parametrize(
    "cfg",
    MATCHED_FUSED
    + [
        pytest.param(
            QuantConfig(
                "matched",
                3,
                "matched",
                3,
                residual_length=8,
                group=8,
                sink_tokens=2,
                calibration={0: per_head_matched_calibration(3, HEAD_DIM, 9)},
            ),
            id="matched-per-head-sinks",
        ),
        pytest.param(QuantConfig("matched", 4, residual_length=8, group=8, calibration="random"), id="matched-keyonly"),
    ],
)
@pytest.mark.parametrize("nq", [1, 2])
def test_native_matched_step_equals_the_decoded_path(cfg, nq, monkeypatch):
    """A matched layer's decode step in one native call (``CodeStore.attend``: runs, means,
    window and sinks, log-sum-exp merge in Rust) equals the decoded path (the codes decoded,
    then eager attention in torch, as a row kind the native step does not read takes) to
    float32 rounding: 2e-6 of the largest |v| (measured up to 5e-7; a wrong run, basis, mean or merge moves outputs
    by 1e-3 or more). GQA 3, a causal mask over the window, several width runs, width-0
    columns."""
    from kvqrs.hf.store import CodeStore

    k, v = _kv(tokens=45, seed=4)
    k2, v2 = _kv(tokens=nq, seed=5)
    q = torch.randn(2, 9, nq, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    module, scaling = _Module(3), HEAD_DIM**-0.5
    native_attend, calls = CodeStore.attend, []

    def spy(self, *a, **kw):
        calls.append(self)
        return native_attend(self, *a, **kw)

    monkeypatch.setattr(CodeStore, "attend", spy)
    outs = []
    for native in (True, False):
        layer = CompressedLayer(cfg, 0)
        layer.attend(module, q[..., :1, :], *layer.update(k, v, fused=True), None, scaling)
        rk, rv = layer.update(k2, v2, fused=True)
        assert layer._fused
        if not native:  # the decoded path, as for a row kind the native step does not read
            monkeypatch.setattr(CodeStore, "can_attend", lambda self: False)
        n = len(calls)
        outs.append(layer.attend(module, q, rk, rv, _causal_mask(2, nq, 45 + nq), scaling)[0])
        assert len(calls) == n + native  # one native call per step, none on the decoded path
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=2e-6 * v.abs().max().item())


def test_native_step_of_token_keys_equals_the_decoded_path(monkeypatch):
    """As above for keys of one size per token (runs of absmax codes in ``U diag(sigma)``)."""
    test_native_matched_step_equals_the_decoded_path(TOKEN_KEYS, 1, monkeypatch)


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("nq", [1, 3])
def test_a_decode_step_before_any_code_reads_the_window_natively(sinks, nq, monkeypatch):
    """A fused step on a layer that has coded nothing yet (a prompt shorter than the window)
    attends over its sinks and window in one native call (no store), and its output equals
    the decoded layer's eager softmax, under a causal mask whose batch row 0 hides a padded
    first token (tolerance: FUSED_LAYER_RTOL)."""
    import kvqrs.hf.layer_attention as la

    calls = []
    native = la.attend_full_precision
    monkeypatch.setattr(la, "attend_full_precision", lambda *a, **kw: calls.append(1) or native(*a, **kw))
    cfg = QuantConfig("kqv", 4, "kqv", 4, residual_length=64, sink_tokens=sinks)
    k, v = _kv(tokens=20, seed=4)
    k2, v2 = _kv(tokens=nq, seed=5)
    q = torch.randn(2, 9, nq, HEAD_DIM, generator=torch.Generator().manual_seed(6))
    module, scaling = _Module(3), HEAD_DIM**-0.5
    mask = _causal_mask(2, nq, 20 + nq).clone()
    mask[0, ..., 0] = torch.finfo(torch.float32).min
    outs = []
    for fused in (True, False):
        layer = CompressedLayer(cfg, 0)
        layer.attend(module, q[..., :1, :], *layer.update(k, v, fused=fused), None, scaling)
        rk, rv = layer.update(k2, v2, fused=fused)
        assert layer._fused == fused and layer.store is None
        outs.append(layer.attend(module, q, rk, rv, mask, scaling)[0])
    assert calls == [1]  # the fused layer's step alone
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=FUSED_LAYER_RTOL * v.abs().max().item())


def test_fused_step_falls_back_where_a_mask_hides_codes():
    cfg = QuantConfig("kqv", 4, "kqv", 4, residual_length=2)
    k, v = _kv(tokens=20, seed=7)
    q = torch.randn(2, 9, 1, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    module, scaling = _Module(3), HEAD_DIM**-0.5
    mask = _causal_mask(2, 1, 21).clone()
    mask[0, ..., 3] = torch.finfo(torch.float32).min  # padding hides one quantized position
    outs = []
    for fused in (True, False):
        layer = CompressedLayer(cfg, 0)
        layer.attend(module, q, *layer.update(k, v, fused=fused), None, scaling)
        rk, rv = layer.update(k[..., :1, :], v[..., :1, :], fused=fused)
        outs.append(layer.attend(module, q, rk, rv, mask, scaling)[0])
    assert torch.equal(outs[0], outs[1])  # the fused layer decoded, exactly as the other


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("cfg", FUSED_CONFIGS)
def test_generation_with_fused_steps_matches_the_decoded_cache(model32, cfg, monkeypatch):
    import dataclasses

    model, tok = model32
    prompt = tok(TEXT, return_tensors="pt").input_ids[:, :40]
    calls = {"fused": 0, "materialize": 0}

    def spy(cls, name: str, counter: str) -> None:
        method = getattr(cls, name)

        def counted(self, *a, **kw):
            calls[counter] += 1
            return method(self, *a, **kw)

        monkeypatch.setattr(cls, name, counted)

    spy(CodeStore, "attend", "fused")  # native reads from the codes: a general step's
    spy(CodeStore, "step", "fused")  # and a steady step's, with its writes
    spy(CompressedLayer, "materialize", "materialize")
    runs = {}
    new = 8
    for fused in (False, True):
        calls.update(fused=0, materialize=0)
        cache = QuantizedKVCache(dataclasses.replace(cfg, fused=fused), _layers(model))
        with torch.no_grad():
            g = model.generate(
                prompt, past_key_values=cache, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        runs[fused] = (g.sequences, torch.stack(g.logits), dict(calls), cache)
    layers = _layers(model)
    # decoded run: the whole cache decoded at prefill and at every one of the new - 1 steps
    assert runs[False][2] == {"fused": 0, "materialize": layers * new}
    # fused run: decoded once at prefill, then every step attends from the codes
    assert runs[True][2] == {"fused": layers * (new - 1), "materialize": layers}
    prompt_len = prompt.shape[1]
    first, share = _flipped_rows(runs[False][3], runs[True][3], prompt_len)
    assert first is None or first >= prompt_len, first  # the prompt is coded alike in both runs
    assert share <= FLIPPED_SHARE, share
    # step s reads the codes of positions up to prompt_len - 1 + s (step 0: the prefill): the
    # steps before the first flipped position agree to rounding, the later ones (while the
    # tokens agree) to a flipped code
    exact = new if first is None else min(new, first - prompt_len + 1)
    (seq_d, logits_d), (seq_f, logits_f) = runs[False][:2], runs[True][:2]
    scale = logits_d.abs().max().item()
    assert torch.equal(seq_f[:, : prompt_len + exact], seq_d[:, : prompt_len + exact])
    assert (logits_f[:exact] - logits_d[:exact]).abs().max().item() < FUSED_GEN_RTOL * scale
    same = int((seq_f[0, prompt_len:] == seq_d[0, prompt_len:]).cumprod(0).sum())
    later = slice(exact, min(new, same + 1))
    if later.stop > later.start:
        assert (logits_f[later] - logits_d[later]).abs().max().item() < FLIPPED_GEN_RTOL * scale


def _flipped_rows(a: QuantizedKVCache, b: QuantizedKVCache, since: int) -> tuple[int | None, float]:
    """The first position whose stored codes differ between two caches of one config (a part
    that is not one row per token counts from its layer's first coded position), and the share
    of the coded (layer, side, token) rows at positions ``since`` or later that differ."""
    first, differing, total = None, 0, 0
    for la, lb in zip(a.layers, b.layers, strict=True):
        for side in ("chunks_k", "chunks_v"):
            for ea, eb in zip(getattr(la, side), getattr(lb, side), strict=True):
                tokens = ea.shape[-2]
                rows = np.zeros(tokens, dtype=bool)
                for name, pa in ea.parts.items():
                    pa, pb = np.asarray(pa), np.asarray(eb.parts[name])
                    if pa.shape != pb.shape:
                        rows[:] = True
                    elif pa.ndim >= 3 and pa.shape[2] == tokens:
                        rows |= (pa != pb).reshape(*pa.shape[:3], -1).any(axis=(0, 1, 3))
                    elif not np.array_equal(pa, pb):
                        rows[:] = True
                late = rows[max(0, since - la.q_start) :]
                total += late.size
                differing += int(late.sum())
                if rows.any():
                    at = la.q_start + int(np.argmax(rows))
                    first = at if first is None else min(first, at)
    return first, differing / max(total, 1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_generation_with_token_keys_encodes_them_in_the_native_step(model32, monkeypatch):
    """Matched keys with per-token scales have a native encoder (``token_runs``): a generate's
    prefill flushes natively and its steady decode steps encode the tokens leaving the window
    inside the one native call (``CodeStore.step`` with a flush), never in the Python coder;
    the tokens and logits are those of the same cache encoding in Python (``_native_encoder``
    disabled: the Python coder's bytes, the general path's attention), bit for bit."""
    import kvqrs.hf.store as store_mod
    from kvqrs.schemes.matched_tokens import MatchedTokenCoder

    model, tok = model32
    prompt = tok(TEXT, return_tensors="pt").input_ids[:, :40]
    flushes, encoded = [], []
    step, encode = CodeStore.step, MatchedTokenCoder.encode

    def counted_step(self, *a, **kw):
        flushes.append(a[4])  # (query, sinks, window, new, flush, ...)
        return step(self, *a, **kw)

    def counted_encode(self, x):
        encoded.append(x.shape[-2])
        return encode(self, x)

    monkeypatch.setattr(CodeStore, "step", counted_step)
    monkeypatch.setattr(MatchedTokenCoder, "encode", counted_encode)
    runs, new = {}, 8
    for native in (True, False):
        if not native:
            monkeypatch.setattr(store_mod, "_native_encoder", lambda coder, kv_heads: None)
        flushes.clear()
        encoded.clear()
        cache = QuantizedKVCache(TOKEN_KEYS, _layers(model))
        with torch.no_grad():
            g = model.generate(
                prompt, past_key_values=cache, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        runs[native] = (g.sequences, torch.stack(g.logits), list(flushes), [n for n in encoded if n])
    layers = _layers(model)
    # native: every layer's steady steps flush one token each in the native call, none in Python
    assert sum(f > 0 for f in runs[True][2]) >= layers * (new - 2) and runs[True][3] == []
    # Python encode: no steady native step, every flushed token (40 prompt and 7 decoded, less
    # the 8-token window) encoded by the coder
    assert runs[False][2] == [] and sum(runs[False][3]) == layers * (40 + new - 1 - 8)
    # the same codes, read by the same native attention: the same bits (as the steady step's
    # other tests find, tests/hf/test_cache_steady.py)
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])


@pytest.mark.parametrize("scheme", ["kqv", "qkqv"])
def test_a_fused_step_whose_output_does_not_fit_float16_raises(scheme):
    """A float16 layer whose values sit at float16's maximum: once they are coded, the fused
    step's float32 output can exceed 65504 (the codes overshoot); cast to the layer's dtype that
    is an error naming it, never an infinite output."""
    torch.manual_seed(0)
    d, heads, dt = 20, 2, torch.float16
    layer = CompressedLayer(QuantConfig(scheme, 4, scheme, 4, residual_length=4, group=8), 0)
    mod = _Module(1)
    k, v = torch.randn(1, heads, 16, d), torch.randn(1, heads, 16, d)
    rk, rv = layer.update(k.to(dt), v.to(dt), fused=True)
    layer.attend(mod, torch.randn(1, heads, 1, d).to(dt), rk, rv, None, d**-0.5)
    q = torch.full((1, heads, 1, d), 1e4 / d).to(dt)  # every later query reads the hot token
    with pytest.raises(KvqrsError, match="does not fit torch.float16"):
        for s in range(8):
            hot = s == 0
            kk = torch.ones(1, heads, 1, d) if hot else torch.randn(1, heads, 1, d) * 0.01
            vv = torch.full((1, heads, 1, d), 65504.0) if hot else torch.randn(1, heads, 1, d)
            rk, rv = layer.update(kk.to(dt), vv.to(dt), fused=True)
            out = layer.attend(mod, q, rk, rv, None, d**-0.5)[0]
            assert torch.isfinite(out).all()
