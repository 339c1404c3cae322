"""The kvqrs attention and QuantizedKVCache on the architecture families users bring, as tiny
random models (2 layers, hidden 64) built from transformers configs, nothing downloaded: Llama,
Qwen2 (biased key projections: keys far from zero), Qwen3 (QK-norm), Gemma-2 (logit
soft-capping, sliding layers), Gemma-3 (sliding layers), Mistral (sliding window), Phi-3 (fused
QKV projection), gpt-oss (learned sink logits, sliding layers, experts) and OLMo-2 (QK-norm over
the whole projection).

- Logit soft-capping and learned sinks against transformers' own eager attention with a
  DynamicCache: equal when every token stays in full precision, closer at 8 bits than the same
  cache without them; the fast path equals the cache; the fused decode step (native call and
  Python merge) equals the decoded path.
- For every architecture and scheme (``kqv`` 4/4, ``kivi`` 4/4, the prompt-calibrated ``4bit``
  preset): greedy ``generate``, assisted decoding equal to plain greedy, beam search, crop, save
  and load.

Models are float64 where paths must agree exactly (a float64 model keeps the decoded path) and
float32 where the fused decode step runs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import QuantConfig, QuantizedKVCache, fake_quant, register  # noqa: E402
from kvqrs.hf import attention as attention_mod  # noqa: E402
from kvqrs.hf.attention import sdpa_prefill  # noqa: E402
from kvqrs.hf.store import CodeStore  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

VOCAB = 96
WINDOW = 16  # sliding layers' window: the prompts and generations below cross it
PROMPT = 12
NEW_TOKENS = 12
SOFTCAP = 1.0  # small against Gemma-2's logits at scaling 1 (query_pre_attn_scalar=1): capping changes them
SINK_STD = 2.0  # learned sink logits of this spread take a visible share of each softmax
# (config class, model class, config arguments beyond the common ones). The Gemmas untie their
# embeddings: tied ones, scaled by sqrt(hidden), make these tiny models repeat one token.
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": SOFTCAP,
            "query_pre_attn_scalar": 1,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16, "sliding_window": WINDOW}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 2, "num_experts_per_tok": 1},
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
}
# Every architecture's config: 2 layers, GQA 2, weights spread enough (0.1) that attention is not
# uniform and 4-bit codes change some greedy tokens; no end-of-sequence token, so every
# generation runs its full length.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
# float64 model: the cache and transformers' eager attention read the same full-precision
# tokens; Gemma-2's eager softmax runs in float32, so logits agree to ~1e-7.
EAGER_ATOL = 1e-6
# float64 model, the fast path and the cache quantize the same float32 copies of the same keys.
LOGPROB_ATOL = 1e-8
# float32 model: the fused kernel against the decoded path (float32 sums in another order).
FUSED_ATOL = 1e-4


def _classes(arch: str):
    """The config and model classes of ``arch``; skips when this transformers lacks them."""
    config_name, model_name, _ = ARCHS[arch]
    cfg_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if cfg_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    return cfg_cls, model_cls


def _build(arch: str, dtype=torch.float64):
    """A tiny random model of ``arch`` with the kvqrs attention (fixed seed); Qwen2's key biases
    and gpt-oss' sink logits drawn large enough to matter."""
    cfg_cls, model_cls = _classes(arch)
    cfg = cfg_cls(**COMMON, **ARCHS[arch][2])
    register()
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    for module in model.modules():
        if arch == "qwen2" and hasattr(module, "k_proj"):
            torch.nn.init.normal_(module.k_proj.bias, mean=1.0, std=2.0)
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, std=SINK_STD)
    if arch == "gpt_oss":
        model.set_experts_implementation("eager")  # the grouped-matmul experts take no float64
    model = model.to(dtype)
    model.set_attn_implementation("kvqrs")
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these tiny models gain nothing from more, and where another process
    keeps a core busy torch's spinning workers make each forward many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    return {}


def _model(models, arch, dtype=torch.float64):
    if (arch, dtype) not in models:
        models[arch, dtype] = _build(arch, dtype)
    return models[arch, dtype]


pytestmark = [pytest.mark.usefixtures("isolated_attention_state"), pytest.mark.filterwarnings("ignore::FutureWarning")]


def _ids(n, seed=1):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _steps(model, ids, cache, prefill=PROMPT):
    """Log-probabilities of a prefill of ``prefill`` tokens then one token per forward."""
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :prefill], cache=cache, use_cache=True).logits)
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.log_softmax(torch.cat(out, dim=1).double(), dim=-1)


def _eager(model, ids):
    """The same steps through transformers' own eager attention and a DynamicCache."""
    model.set_attn_implementation("eager")
    try:
        return _steps(model, ids, DynamicCache(config=model.config))
    finally:
        model.set_attn_implementation("kvqrs")


def _without_rules(monkeypatch):
    """Make the kvqrs attention drop soft-capping and sinks (what these tests must catch)."""
    monkeypatch.setattr(attention_mod, "layer_rule", lambda module, kwargs: None)


# --- logit soft-capping and learned sinks ----------------------------------------------------------

RULE_ARCHS = ["gemma2", "gpt_oss"]
FULL_PRECISION = QuantConfig("kqv", 4, "kqv", 4, residual_length=64)  # nothing leaves the window


@pytest.mark.parametrize("arch", RULE_ARCHS)
def test_softcap_and_sinks_equal_transformers_eager_attention(models, arch, monkeypatch):
    """Every token in full precision: the kvqrs attention without a cache, with a
    QuantizedKVCache and with the SDPA prefill gives transformers' eager logits; dropping the
    soft-capping or the sinks moves them by far more."""
    model = _model(models, arch)
    ids = _ids(PROMPT + 6)
    ref = _eager(model, ids)
    with torch.no_grad():
        alone = torch.log_softmax(model(ids).logits, dim=-1)
    cache = QuantizedKVCache(FULL_PRECISION, model.config)
    cached = _steps(model, ids, cache)
    with sdpa_prefill():
        sdpa = _steps(model, ids, QuantizedKVCache(FULL_PRECISION, model.config))
    assert not any(layer.quantized for layer in cache.layers)
    for got in (alone, cached, sdpa):
        assert (got - ref).abs().max() < EAGER_ATOL
    _without_rules(monkeypatch)
    dropped = _steps(model, ids, QuantizedKVCache(FULL_PRECISION, model.config))
    assert (dropped - ref).abs().max() > 1e3 * EAGER_ATOL


@pytest.mark.parametrize(
    "cfg",
    [QuantConfig("kqv", 8, "kivi", 8, residual_length=2), QuantConfig("kivi", 8, "kivi", 8, residual_length=2, group=4)],
    ids=["kqv", "kivi"],
)
@pytest.mark.parametrize("arch", RULE_ARCHS)
def test_softcap_and_sinks_at_8_bits_stay_close_to_eager_attention(models, arch, cfg, monkeypatch):
    """8-bit codes: the cache's logits stay within the quantization error of transformers'
    eager ones; the same cache without soft-capping or sinks is ten times further off."""
    model = _model(models, arch)
    ids = _ids(PROMPT + 8, seed=2)
    ref = _eager(model, ids)
    cache = QuantizedKVCache(cfg, model.config)
    err = (_steps(model, ids, cache) - ref).abs().max()
    assert all(layer.quantized for layer in cache.layers)
    _without_rules(monkeypatch)
    dropped = (_steps(model, ids, QuantizedKVCache(cfg, model.config)) - ref).abs().max()
    assert err * 10 < dropped


@pytest.mark.parametrize(
    "cfg",
    [
        QuantConfig("kqv", 3, "kqv", 3, residual_length=4),
        QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=4, sink_tokens=2),
        QuantConfig("matched", 3, "matched", 3, residual_length=3, group=8, sink_tokens=1, calibration="random"),
    ],
    ids=["kqv", "kivi-s2", "matched"],
)
@pytest.mark.parametrize("arch", RULE_ARCHS)
def test_the_fast_path_applies_softcap_and_sinks_as_the_cache_does(models, arch, cfg):
    """The fast evaluation path and the cache give the same log-probabilities with soft-capping
    and sinks (both apply them, to the same quantized logits)."""
    model = _model(models, arch)
    ids = _ids(PROMPT + 8, seed=3)
    with torch.no_grad(), fake_quant(cfg):
        fast = torch.log_softmax(model(ids).logits, dim=-1)
    with torch.no_grad():
        dense = torch.log_softmax(model(ids).logits, dim=-1)
    slow = _steps(model, ids, QuantizedKVCache(cfg, model.config))
    assert (fast - dense).abs().max() > 1e-3, "configuration does not quantize anything visible"
    assert (fast - slow).abs().max() < LOGPROB_ATOL


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"softcap": 0.0}, r"softcap: expected a positive finite logit cap, got 0\.0"),
        ({"softcap": float("nan")}, "softcap: expected a positive finite logit cap, got nan"),
        ({"softcap": "50"}, "softcap: expected a positive finite logit cap, got '50'"),
        ({"s_aux": torch.zeros(3)}, r"s_aux: expected one learned sink logit per query head \(4\), got shape \(3,\)"),
        ({"s_aux": torch.zeros(4, 1)}, r"s_aux: expected one learned sink logit per query head \(4\), got shape \(4, 1\)"),
        ({"s_aux": torch.tensor([0.0, float("inf"), 0.0, 0.0])}, r"s_aux: expected finite values, got inf at index \(1,\)"),
    ],
)
def test_bad_softcap_or_sinks_are_refused_by_name(models, kwargs, match):
    module = _model(models, "gpt_oss").model.layers[0].self_attn
    with pytest.raises(KvqrsError, match=match):
        attention_mod.layer_rule(module, kwargs)


def _count_calls(monkeypatch, cls, name: str) -> list[int]:
    """A list that grows by one at each call of ``cls.name``."""
    calls, method = [], getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *a, **k: calls.append(1) or method(self, *a, **k))
    return calls


@pytest.mark.parametrize(
    "arch, native",
    [(a, True) for a in ARCHS] + [(a, False) for a in RULE_ARCHS],
    ids=lambda x: {True: "native", False: "python-merge"}.get(x, x),
)
def test_fused_decode_steps_equal_the_decoded_path(models, arch, native, monkeypatch):
    """float32 (where decode steps attend from the codes): the fused step's log-probabilities
    equal those of the decoded path (``fused=False``). Learned sinks join the fused softmax
    through its log-sum-exp in the one native call; sliding-window layers read their codes
    natively too. Soft-capped layers never read the codes natively (the kernel's softmax reads
    uncapped logits), nor does a store whose rows the native step does not read: both take the
    decoded path."""
    model = _model(models, arch, torch.float32)
    ids = _ids(PROMPT + 10, seed=4)
    kw = dict(residual_length=2, sink_tokens=1)
    attends, steps = _count_calls(monkeypatch, CodeStore, "attend"), _count_calls(monkeypatch, CodeStore, "step")
    if not native:
        monkeypatch.setattr(CodeStore, "can_attend", lambda self: False)
    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, **kw), model.config)
    fused = _steps(model, ids, cache)
    counts = len(attends), len(steps)
    decoded = _steps(model, ids, QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, fused=False, **kw), model.config))
    assert (len(attends), len(steps)) == counts  # the decoded path never attends from the codes
    assert (fused - decoded).abs().max() < FUSED_ATOL
    if arch == "gemma2" or not native:
        assert counts == (0, 0)
    else:  # every layer attends from the codes at every decode step
        assert counts[0] > 0
        assert (counts[1] > 0) == (not all(cache.is_sliding))  # steady full-attention layers: one call with the writes


# --- every architecture: generate, assisted decoding, beam search, crop, save and load ------------

PRESET_OVERRIDES = dict(group=8, residual_length=4)  # groups and window that the short sequences below cross
SCHEMES = {
    "kqv": QuantConfig("kqv", 4, "kqv", 4, residual_length=4),
    "kivi": QuantConfig("kivi", 4, "kivi", 4, residual_length=4, group=8),
    "4bit": QuantConfig.preset("4bit", **PRESET_OVERRIDES),
}


def _greedy(model, prompt, cfg, **kw):
    cache = QuantizedKVCache(cfg, model.config)
    with torch.no_grad():
        out = model.generate(prompt, cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False, **kw)
    return out[0, prompt.shape[1] :], cache


def _draft_models(models, arch):
    """The target itself (drafting with a dense cache: long accepted runs, rejected where the
    codes change the greedy token) and an unrelated tiny model of the same vocabulary (its
    drafts mostly rejected, so nearly every verification forward ends in a crop)."""
    return _model(models, arch), _model(models, "qwen3" if arch == "llama" else "llama")


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generate_and_assisted_decoding(models, arch, scheme):
    """Greedy generation codes tokens on every layer; assisted decoding gives the same tokens.
    The prompt-calibrated preset fits each layer on the prompt: assisted decoding, whose first
    forward holds the prompt and the drafts, takes the calibrations that fit made (as a
    calibration file gives them) and gives the prompt-calibrated tokens."""
    model, cfg = _model(models, arch), SCHEMES[scheme]
    prompt = _ids(PROMPT, seed=5)
    plain, cache = _greedy(model, prompt, cfg)
    assert all(layer.quantized for layer in cache.layers)
    if cfg.calibration == "prefill":
        assert all(layer.fitted_tokens == PROMPT for layer in cache.layers)
        cfg = QuantConfig.preset(scheme, {i: layer.fitted for i, layer in enumerate(cache.layers)}, **PRESET_OVERRIDES)
    for assistant in _draft_models(models, arch):
        assisted, _ = _greedy(model, prompt, cfg, assistant_model=assistant)
        assert torch.equal(assisted, plain), f"{int((assisted == plain).sum())} of {NEW_TOKENS} tokens equal"


def test_assisted_decoding_refuses_to_fit_a_prompt_calibration_on_drafts(models):
    """Assisted decoding's first forward holds the prompt and draft tokens, and a crop may
    remove drafts: a prompt-calibrated cache that has not fitted yet refuses it, naming the
    way out, instead of fitting on tokens it may lose."""
    model = _model(models, "llama")
    with pytest.raises(KvqrsError, match=r"calibration='prefill'.*assisted decoding.*`kvqrs calibrate` file"):
        _greedy(model, _ids(PROMPT, seed=5), SCHEMES["4bit"], assistant_model=_draft_models(models, "llama")[1])


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_beam_search_crop_save_and_load(models, arch, scheme, tmp_path):
    """Beam search over the cache runs (its rows reordered every step); a cache cropped after a
    forward of 5 tokens continues as a cache fed only the kept tokens; a saved and loaded cache
    continues as the original."""
    model, cfg = _model(models, arch), SCHEMES[scheme]
    prompt = _ids(PROMPT, seed=6)
    with torch.no_grad():
        beams = model.generate(prompt, cache=QuantizedKVCache(cfg, model.config), max_new_tokens=4, num_beams=2, do_sample=False)
    assert beams.shape == (1, PROMPT + 4) and torch.equal(beams[:, :PROMPT], prompt)
    ids = _ids(PROMPT + 10, seed=7)
    cropped, fresh = QuantizedKVCache(cfg, model.config), QuantizedKVCache(cfg, model.config)
    with torch.no_grad():
        for cache, hi in ((cropped, PROMPT + 5), (fresh, PROMPT + 2)):
            model(ids[:, :PROMPT], cache=cache, use_cache=True)
            if cache is cropped:
                cache.activate_past_recording()  # as transformers does after the prefill
            model(ids[:, PROMPT:hi], cache=cache, use_cache=True)
    cropped.crop(-3)
    assert cropped.get_seq_length() == fresh.get_seq_length() == PROMPT + 2
    assert all(layer.quantized for layer in fresh.layers)
    rest = ids[:, PROMPT + 2 :]
    assert torch.equal(_steps(model, rest, cropped, prefill=1), _steps(model, rest, fresh, prefill=1))
    fresh.save(tmp_path / "c.kvqc")
    back = QuantizedKVCache.load(tmp_path / "c.kvqc", cfg)
    assert back.is_sliding == fresh.is_sliding and back.nbytes() == fresh.nbytes()
    more = _ids(6, seed=8)
    assert torch.equal(_steps(model, more, back, prefill=1), _steps(model, more, fresh, prefill=1))
