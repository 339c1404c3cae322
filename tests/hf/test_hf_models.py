"""QuantizedKVCache on the architectures users bring, as tiny random models built from
transformers configs (float64, so that paths compare without float32 noise): Gemma-3 with
alternating sliding-window and full layers, a Mistral-style sliding window, Qwen3 with QK-norm,
a Llama with head_dim 128 and GQA 4. Against DynamicCache(config=...) and the fast path;
attention sinks; assisted (speculative) generation against plain greedy generation for every
scheme; the ``cache=`` and ``past_key_values=`` argument names."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import QuantConfig, QuantizedKVCache, fake_quant, register  # noqa: E402
from kvqrs.hf.attention import sdpa_prefill  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from tests.cache_helpers import held_tensors  # noqa: E402

WINDOW = 16
VOCAB = 96
# float64 model, the two paths quantize the same float32 copies of the same keys: per-position
# log-probabilities agree to ~1e-13; a schedule one token off moves them by >1e-3.
LOGPROB_ATOL = 1e-8


def _build(kind: str, **over):
    """A tiny random model (float64, kvqrs attention, fixed seed)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, max_position_embeddings=256)
    common.update(over)
    if kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (common["num_hidden_layers"] // 2),
        )
        cls = transformers.Gemma3ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW)
        cls = transformers.MistralForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "llama128":
        cfg = transformers.LlamaConfig(**{**common, "num_hidden_layers": 2}, num_attention_heads=4, num_key_value_heads=1, head_dim=128)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(kind)
    register()
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float64).eval()
    model.set_attn_implementation("kvqrs")
    model.generation_config.pad_token_id = 0
    return model


MODELS = ["gemma3", "mistral", "qwen3", "llama128"]


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, kind):
    if kind not in models:
        models[kind] = _build(kind)
    return models[kind]


pytestmark = pytest.mark.usefixtures("isolated_attention_state")


def _ids(n, seed=1):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, cache, splits):
    """Logits of feeding ``ids`` in forwards ending at ``splits`` (the last is the length)."""
    out, lo = [], 0
    with torch.no_grad():
        for hi in splits:
            out.append(model(ids[:, lo:hi], cache=cache, use_cache=True).logits)
            lo = hi
    return torch.cat(out, dim=1)


def _qcache(cfg, model):
    return QuantizedKVCache(cfg, model.config)


# --- layer types ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MODELS)
def test_layers_follow_the_model_config_as_dynamic_cache_does(models, kind):
    model = _model(models, kind)
    qc, dc = _qcache(QuantConfig("kqv", 3, residual_length=4), model), DynamicCache(config=model.config)
    assert qc.is_sliding == dc.is_sliding
    assert [layer.get_max_length() for layer in qc.layers] == [layer.get_max_length() for layer in dc.layers]
    if kind == "gemma3":
        assert qc.is_sliding == [True, False, True, False]


def test_the_model_config_by_position_or_keyword(models):
    model = _model(models, "gemma3")
    cfg = QuantConfig("kqv", 3, residual_length=4)
    by_keyword = QuantizedKVCache(cfg, model_config=model.config)
    assert QuantizedKVCache(cfg, model.config).is_sliding == by_keyword.is_sliding == [True, False, True, False]
    assert [layer.sliding_window for layer in by_keyword.layers] == [WINDOW, None, WINDOW, None]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_layer_count_cache_warns_once_on_sliding_window_layers(models):
    """Built with a layer count, every layer holds all tokens; on a model with sliding-window
    layers the cache warns once (at its first forward), built with the config it does not."""
    model = _model(models, "gemma3")
    cfg = QuantConfig("kqv", 3, residual_length=4)
    ids = _ids(WINDOW + 4)
    for cache, expected in ((QuantizedKVCache(cfg, model.config.num_hidden_layers), 1), (_qcache(cfg, model), 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(model, ids, cache, [WINDOW, WINDOW + 2, WINDOW + 4])
        caught = [w for w in caught if "QuantizedKVCache" in str(w.message)]
        assert len(caught) == expected
        assert all("layer 0" in str(w.message) and f"window of {WINDOW} tokens" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a model without sliding windows: no warning
        _run(_model(models, "qwen3"), ids, QuantizedKVCache(cfg, 4), [WINDOW + 4])


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", MODELS)
def test_unquantized_cache_equals_dynamic_cache(models, kind):
    """Nothing quantized: identical logits to DynamicCache(config=...) at every prefill and
    decode step, past the sliding window, and the same held tokens."""
    model = _model(models, kind)
    ids = _ids(40)
    splits = [20, *range(21, 41)]
    qc = _qcache(QuantConfig("kqv", 3, "kqv", 3, residual_length=64), model)
    dc = DynamicCache(config=model.config)
    assert torch.equal(_run(model, ids, qc, splits), _run(model, ids, dc, splits))
    for layer, ref in zip(qc.layers, dc.layers):
        k, v = layer.materialize()
        assert torch.equal(k, ref.keys) and torch.equal(v, ref.values)
        assert layer.get_mask_sizes(1) == ref.get_mask_sizes(1)


CONFIGS = [
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4), id="kqv-r4"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=8, sink_tokens=2), id="kivi-g8-r3-s2"),
    pytest.param(QuantConfig("qkqv", 3, "block", 4, residual_length=2, sink_tokens=4), id="qkqv-block-s4"),
    pytest.param(
        QuantConfig(
            "matched",
            3,
            "matched",
            3,
            residual_length=3,
            group=8,
            sink_tokens=2,
            sink_dtype="float16",
            calibration="random",
            value_norms="log8",
        ),
        id="matched-log8-s2-f16",
    ),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("kind", MODELS)
def test_cache_agrees_with_the_fast_path(models, kind, cfg):
    """Prefill then single steps and a multi-token forward, on sliding and full layers, with
    sinks: the cache's log-probabilities equal the fast path's over the same tokens."""
    model = _model(models, kind)
    ids = _ids(56, seed=2)
    with torch.no_grad(), fake_quant(cfg):
        fast = model(ids).logits
    with torch.no_grad():
        dense = model(ids).logits
    cache = _qcache(cfg, model)
    slow = _run(model, ids, cache, [24, *range(25, 41), 47, *range(48, 57)])
    assert (fast - dense).abs().max() > 1e-3, "configuration does not quantize anything visible"
    lp = lambda x: torch.log_softmax(x, dim=-1)  # noqa: E731
    assert (lp(fast) - lp(slow)).abs().max() < LOGPROB_ATOL


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(QuantConfig("kqv", 4, "kqv", 4, residual_length=4), id="kqv-k4v4-r4"),
        pytest.param(QuantConfig("kqv", 4, "kqv", 4, residual_length=4, sink_tokens=4), id="kqv-k4v4-r4-s4"),
        pytest.param(QuantConfig("kivi", 4, "kivi", 4, residual_length=4, group=8), id="kivi-k4v4-g8-r4"),
        pytest.param(QuantConfig("matched", 4, "matched", 4, group=8, sink_tokens=1, calibration="random"), id="matched-k4v4-g8-s1"),
    ],
)
def test_sliding_layers_hold_at_most_their_window(models, cfg):
    """Gemma-3 after 72 tokens, 16-token window: each sliding layer holds the newest W - 1
    tokens (KIVI: plus the rest of the oldest group), fewer bytes than DynamicCache's layer;
    full layers hold all 72."""
    model = _model(models, "gemma3")
    ids = _ids(72, seed=3)
    qc, dc = _qcache(cfg, model), DynamicCache(config=model.config)
    _run(model, ids, qc, [40, *range(41, 73)])
    _run(model, ids, dc, [40, *range(41, 73)])
    for layer, ref in zip(qc.layers, dc.layers):
        held = layer.seen - layer.start
        dense = sum(t.numel() * t.element_size() for t in (ref.keys, ref.values))
        if layer.is_sliding:
            assert ref.keys.shape[-2] == WINDOW - 1 <= held <= WINDOW - 1 + cfg.chunk - 1
            assert layer.nbytes() < dense
        else:
            assert held == 72
        assert layer.get_mask_sizes(1) == ref.get_mask_sizes(1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sliding_cache_save_load_continues_identically(models, tmp_path):
    model = _model(models, "gemma3")
    cfg = QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=8, sink_tokens=2)
    ids = _ids(60, seed=4)
    cache = _qcache(cfg, model)
    _run(model, ids, cache, [30, *range(31, 49)])
    cache.save(tmp_path / "c.kvqc")
    back = QuantizedKVCache.load(tmp_path / "c.kvqc", cfg)
    assert back.is_sliding == cache.is_sliding and back.nbytes() == cache.nbytes()
    a = _run(model, ids[:, 48:], cache, [1, 2, 3, 12])
    b = _run(model, ids[:, 48:], back, [1, 2, 3, 12])
    assert torch.equal(a, b)


# --- the SDPA prefill ---------------------------------------------------------------------------

SDPA_CONFIGS = [
    # (config, whether a chunked prefill takes the SDPA path in the cache; None: DynamicCache)
    pytest.param(None, True, id="dense"),
    pytest.param(QuantConfig("kqv", 4, "kqv", 4), True, id="kqv-r0"),
    pytest.param(QuantConfig("block", 2, "block", 2), True, id="block-r0"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, group=8), True, id="kivi-g8-r0"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, group=8, residual_length=5, sink_tokens=2), True, id="kivi-g8-r5-s2"),
    pytest.param(QuantConfig("matched", 3, "matched", 3, group=16, sink_tokens=1, calibration="random"), True, id="matched-g16-s1"),
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4), False, id="kqv-r4"),  # a run per query: eager
    pytest.param(QuantConfig("headq", 2, "kqv", 3, headq_base="kqv", bases="random"), False, id="headq"),  # a logit correction: eager
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("cfg, takes_sdpa", SDPA_CONFIGS)
@pytest.mark.parametrize("kind", ["llama128", "gemma3", "qwen3"])
def test_sdpa_prefill_equals_eager_prefill(models, kind, cfg, takes_sdpa, monkeypatch):
    """``sdpa_prefill``: a chunked prefill (chunks of 24, so later chunks read earlier codes
    and KIVI groups straddle chunks) and greedy decode give the same logits and the same cache
    (every code, every full-precision token) as eager attention, on full and sliding layers
    (float64: exactly equal). The SDPA path really ran where it applies (SDPA calls counted)."""
    import torch.nn.functional as F

    model = _model(models, kind)
    ids = _ids(90, seed=6)
    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(a[0].shape[-2]) or sdpa(*a, **k))
    results = {}
    for fast in (False, True):
        calls.clear()
        cache = DynamicCache(config=model.config) if cfg is None else _qcache(cfg, model)
        with torch.no_grad(), sdpa_prefill(fast):
            out = model.generate(
                ids, cache=cache, max_new_tokens=8, do_sample=False, prefill_chunk_size=24, output_scores=True, return_dict_in_generate=True
            )
        results[fast] = (out.sequences, torch.stack(out.scores), held_tensors(cache), len(calls))
    (seq0, scores0, state0, calls0), (seq1, scores1, state1, calls1) = results[False], results[True]
    assert calls0 == 0
    assert (calls1 > 0) == takes_sdpa
    assert torch.equal(seq0, seq1)
    assert torch.equal(scores0, scores1)
    assert len(state0) == len(state1) and all(torch.equal(a, b) for a, b in zip(state0, state1))
    if cfg is not None:
        assert any(layer.quantized for layer in cache.layers)


# --- assisted (speculative) generation --------------------------------------------------------

SCHEMES = [
    pytest.param(QuantConfig("kv", 3, "kv", 3, residual_length=4), id="kv"),
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4), id="kqv"),
    pytest.param(QuantConfig("qkqv", 3, "qkqv", 3, residual_length=4), id="qkqv"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=4, group=8), id="kivi"),
    pytest.param(QuantConfig("block", 3, "block", 3, residual_length=4), id="block"),
    pytest.param(QuantConfig("headq", 2, "kqv", 3, residual_length=4, headq_base="kqv", bases="random"), id="headq-random"),
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4, sink_tokens=4), id="kqv-sinks"),
    pytest.param(
        QuantConfig("matched", 3, "matched", 3, residual_length=4, group=8, sink_tokens=1, calibration="random"), id="matched-random"
    ),
]
NEW_TOKENS = 24
ASSISTED = [pytest.param("llama128", c.values[0], id=f"llama128-{c.id}") for c in SCHEMES] + [
    pytest.param("gemma3", c.values[0], id=f"gemma3-{c.id}") for c in SCHEMES if c.id in ("kqv", "kivi", "kqv-sinks", "matched-random")
]


def _greedy(model, prompt, cfg, assistant=None):
    cache = _qcache(cfg, model)
    with torch.no_grad():
        out = model.generate(prompt, cache=cache, assistant_model=assistant, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, prompt.shape[1] :]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind, cfg", ASSISTED)
def test_assisted_generation_equals_greedy_generation(models, kind, cfg):
    """Drafts of up to 20 tokens (transformers' default schedule) cross the residual window and
    KIVI groups; every rejection crops the cache, which must return to the state of a cache fed
    only the accepted tokens, so the assisted tokens equal plain greedy ones exactly. Drafts:
    the target itself with a dense cache (long accepted runs, rejected where quantization
    changes the greedy token) and an unrelated model with another head_dim (mostly rejected)."""
    model = _model(models, kind)
    prompt = _ids(12, seed=5)
    plain = _greedy(model, prompt, cfg)
    other = _model(models, "qwen3" if kind == "llama128" else "llama128")
    assert other.config.head_dim != model.config.head_dim or kind == "gemma3"
    for assistant in (model, other):
        assisted = _greedy(model, prompt, cfg, assistant=assistant)
        assert torch.equal(assisted, plain), f"{int((assisted == plain).sum())} of {NEW_TOKENS} tokens equal"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_assisted_generation_crops_into_quantized_tokens(models, monkeypatch):
    """The drafts above are rolled back across quantized tokens: without the originals that past
    recording keeps, the first such crop is refused (instead of silently diverging)."""
    from kvqrs.hf import CompressedLayer

    model = _model(models, "llama128")
    monkeypatch.setattr(CompressedLayer, "activate_past_recording", lambda self, **kwargs: None)
    with pytest.raises(KvqrsError, match="activate_past_recording"):
        _greedy(model, _ids(12, seed=5), QuantConfig("kqv", 3, "kqv", 3, residual_length=4), assistant=_model(models, "qwen3"))


# --- argument names -----------------------------------------------------------------------------


def test_cache_and_past_key_values_both_reach_the_cache(models):
    """transformers 5.24 takes ``cache=`` and still accepts ``past_key_values=`` (deprecated,
    FutureWarning) in forward and generate: both fill the QuantizedKVCache the same way."""
    model = _model(models, "qwen3")
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=4)
    ids = _ids(20, seed=6)
    new, old = _qcache(cfg, model), _qcache(cfg, model)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = model(ids, cache=new, use_cache=True).logits
        assert not [w for w in caught if "past_key_values" in str(w.message)]
        b = model(ids, past_key_values=old, use_cache=True).logits
    assert torch.equal(a, b) and new.get_seq_length() == old.get_seq_length() == 20
    assert new.layers[0].quantized == old.layers[0].quantized > 0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ga = model.generate(ids, cache=_qcache(cfg, model), max_new_tokens=6, do_sample=False)
        gb = model.generate(ids, past_key_values=_qcache(cfg, model), max_new_tokens=6, do_sample=False)
    assert torch.equal(ga, gb)


# --- bad input ----------------------------------------------------------------------------------


def test_unsupported_layer_types_are_named():
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(KvqrsError, match="linear_attention"):
        QuantizedKVCache(QuantConfig("kqv", 3), model_config=cfg)
    with pytest.raises(KvqrsError, match="linear_attention"):
        QuantizedKVCache(QuantConfig("kqv", 3), cfg)
    for both in ((2,), (cfg,)):
        with pytest.raises(KvqrsError, match="exactly one"):
            QuantizedKVCache(QuantConfig("kqv", 3), *both, model_config=cfg)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sinks_beyond_the_prompt_raise(models):
    model = _model(models, "qwen3")
    cfg = QuantConfig("kqv", 3, residual_length=2, sink_tokens=8)
    with pytest.raises(KvqrsError, match="sink_tokens"), torch.no_grad():
        model(_ids(5), cache=_qcache(cfg, model), use_cache=True)
    with pytest.raises(KvqrsError, match="sink_tokens"), torch.no_grad(), fake_quant(cfg):
        model(_ids(5))
    with pytest.raises(KvqrsError, match="sink_tokens"):
        QuantConfig("kqv", 3, sink_tokens=-1)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_crop_beyond_the_cache_raises(models):
    model = _model(models, "gemma3")
    cache = _qcache(QuantConfig("kqv", 3, residual_length=4), model)
    _run(model, _ids(30), cache, [30])
    with pytest.raises(KvqrsError, match="cannot remove 31 tokens"):
        cache.crop(-31)
    # a sliding layer that dropped its oldest tokens cannot roll back past them without recording
    with pytest.raises(KvqrsError, match="activate_past_recording"):
        cache.crop(-5)


def test_a_config_with_sinks_names_them_in_its_label():
    assert QuantConfig("kqv", 3, sink_tokens=4).label() == "kqv k3 sinks:4"


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
@pytest.mark.parametrize("prompt", [23, 30])
def test_sliding_layers_fit_prefill_calibration_on_the_whole_prompt(models, kind, prompt):
    """calibration="prefill" on sliding layers, a prompt longer than the window: each layer fits
    on the whole prompt and codes it before dropping what no later forward reads (the prompt
    then equals the fast path's fit on the same tokens), and decode steps go on reading the
    window (the prompt was once trimmed before the fit: an IndexError at these lengths)."""
    model = _model(models, kind)
    cfg = QuantConfig("matched", 4, "matched", 4, group=8, sink_tokens=1, calibration="prefill")
    ids = _ids(prompt + 6, seed=5)
    with torch.no_grad(), fake_quant(cfg):
        fast = model(ids[:, :prompt]).logits
    cache = _qcache(cfg, model)
    slow = _run(model, ids, cache, [prompt, *range(prompt + 1, prompt + 7)])
    lp = lambda x: torch.log_softmax(x, dim=-1)  # noqa: E731
    assert (lp(fast) - lp(slow[:, :prompt])).abs().max() < LOGPROB_ATOL
    assert all(layer.fitted_tokens == prompt for layer in cache.layers)
    for layer in cache.layers:
        held = layer.seen - layer.start
        assert held <= WINDOW - 1 + cfg.chunk - 1 if layer.is_sliding else held == prompt + 6
