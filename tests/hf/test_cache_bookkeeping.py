"""QuantizedKVCache bookkeeping against transformers' DynamicCache and against one-shot encoding
(robustness): streaming one token at a time equals one encode call for every scheme,
bit for bit, also when some stored scalars fall outside float16's range; the residual window
at every prefill and decode step; what a multi-token prefill holds and what the prompt's own
queries read; beam search, crop-then-continue and dropping a finished row of a left-padded
batch, compared with DynamicCache on SmolLM2-135M.

Reference semantics: with nothing quantized (a window longer than the text) the cache must be
DynamicCache exactly (same logits, same generated tokens); with quantization on, the cache holds
``encode(first n tokens)`` in one call, ``n = QuantConfig.quantized_count(seen)``, and the newest
``seen - n`` tokens untouched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache, fake_quant  # noqa: E402
from kvqrs.hf.attention import _STATE, FakeQuant, active  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

HEAD_DIM = 64
TEXT = (
    "Anthropology is the study of humans and their societies in the past and present. Its main "
    "subdivisions are social anthropology and cultural anthropology, which describe the workings "
    "of societies around the world."
)

# Every key scheme, every value scheme the cache holds, key-only, and HeadQ on both of its
# chunkings (per token over kqv, whole KIVI groups over kivi).
EVERY_SCHEME = [
    pytest.param(QuantConfig("kv", 2, "kv", 3, residual_length=3), id="kv"),
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4), id="kqv"),
    pytest.param(QuantConfig("qkqv", 3, "qkqv", 2, residual_length=2), id="qkqv"),
    pytest.param(QuantConfig("block", 4, "block", 4, residual_length=5, group=16), id="block"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=5, group=8), id="kivi"),
    pytest.param(QuantConfig("kivi", 4, "kqv", 2, residual_length=0, group=16), id="kivi-kqv"),
    pytest.param(QuantConfig("kqv", 4, residual_length=1), id="kqv-keyonly"),
    pytest.param(QuantConfig("headq", 2, "kivi", 2, residual_length=2, headq_base="kqv", bases="random"), id="headq-kqv"),
    pytest.param(QuantConfig("headq", 2, residual_length=0, group=8, bases="random"), id="headq-kivi"),
    pytest.param(QuantConfig("headq", 3, "block", 3, residual_length=3, headq_base="block", bases="random"), id="headq-block"),
    pytest.param(QuantConfig("matched", 3, "matched", 3, residual_length=3, group=8, calibration="random"), id="matched"),
    pytest.param(
        QuantConfig("matched", 3, "matched", 3, residual_length=3, group=8, calibration="random", value_norms="log8"), id="matched-log8"
    ),
]


pytestmark = pytest.mark.usefixtures("isolated_attention_state")


def _kv(batch=2, heads=3, tokens=70, seed=0, outliers=True):
    """Synthetic keys and values. With ``outliers``, two 8-token runs sit outside float16's
    normal range (tiny: norms, KIVI scales and zero points below 2^-14; huge: above 65504), so
    some encode calls store their scalars in float32 and others in float16."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, heads, tokens, HEAD_DIM, generator=g) * 2 + 0.5
    v = torch.randn(batch, heads, tokens, HEAD_DIM, generator=g)
    if outliers:
        for t in (k, v):
            t[:, :, 8:16] *= 1e-6
            t[:, :, 40:48] *= 3e4
    return k, v


def _parts_equal(a, b, what):
    assert a.shape == b.shape and a.parts.keys() == b.parts.keys(), what
    for name in a.parts:
        pa, pb = np.asarray(a.parts[name]), np.asarray(b.parts[name])
        assert pa.dtype == pb.dtype and pa.shape == pb.shape, f"{what}: part {name} {pa.dtype}{pa.shape} vs {pb.dtype}{pb.shape}"
        assert pa.tobytes() == pb.tobytes(), f"{what}: part {name} differs"


def _one_shot(codec, k, v, n):
    """What the cache must hold after quantizing ``n`` tokens: one encode call per side."""
    ck = codec.encode_keys(k[..., :n, :].numpy())
    cv = None if codec.values is None else codec.encode_values(v[..., :n, :].numpy())
    return ck, cv


def _check_holds_one_shot(layer, cfg, k, v, n=None):
    """``layer`` holds encode(first n tokens) bit for bit and the newest tokens untouched; ``n``
    is ``quantized_count(seen)`` unless given."""
    n = cfg.quantized_count(k.shape[-2]) if n is None else n
    assert layer.quantized == n
    assert torch.equal(layer.keys, k[..., n:, :]) and torch.equal(layer.values, v[..., n:, :])
    if n == 0:
        assert not layer.chunks_k
        return
    ck, cv = _one_shot(layer.codec(), k, v, n)
    _parts_equal(layer.chunks_k[0], ck, "keys")
    if cv is None:
        assert torch.equal(layer.fp_values_quantized, v[..., :n, :])
    else:
        _parts_equal(layer.chunks_v[0], cv, "values")


# --- streaming == one-shot, every scheme --------------------------------------------------------


def test_outlier_data_mixes_float16_and_float32_storage():
    """The data below really makes chunked encoding mix storage widths: otherwise the streaming
    test could not fail on a per-call storage choice."""
    cfg = QuantConfig("kivi", 2, "kivi", 2, group=8)
    codec = cfg.codec(0, HEAD_DIM)
    k, _ = _kv()
    dtypes = {codec.encode_keys(k[..., lo : lo + 8, :].numpy()).parts["zeros"].dtype for lo in range(0, 64, 8)}
    assert dtypes == {np.dtype(np.float16), np.dtype(np.float32)}


@pytest.mark.parametrize("cfg", EVERY_SCHEME)
def test_streaming_one_token_at_a_time_equals_one_shot(cfg):
    """Fails when scalar storage (float16 vs float32) is chosen per encode call: the first
    chunks then keep float16-rounded scales while one call over all tokens keeps float32."""
    k, v = _kv()
    stream = CompressedLayer(cfg, 0)
    for t in range(k.shape[-2]):
        stream.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
        assert stream.quantized == cfg.quantized_count(t + 1)
    assert stream.quantized > 48  # both outlier runs were quantized
    _check_holds_one_shot(stream, cfg, k, v)
    one = CompressedLayer(cfg, 0)
    one.update(k, v)
    for x, y in zip(one.materialize(), stream.materialize()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cfg", EVERY_SCHEME)
def test_fast_path_encoding_agrees_with_the_cache(cfg):
    """The fast path (``fake_quant``) encodes a whole window in one call, the last KIVI group
    partial; the tokens the cache holds quantized must decode to the same keys and values."""
    k, v = _kv(tokens=70)
    codec = cfg.codec(0, HEAD_DIM)
    window_k = codec.decode_keys(codec.encode_keys(k.numpy()), base_only=True)
    window_v = None if codec.values is None else codec.decode_values(codec.encode_values(v.numpy()))
    for seen in (20, 45, 70):
        layer = CompressedLayer(cfg, 0)
        for lo in range(0, seen, 7):  # uneven steps: prefill-sized and decode-sized updates
            layer.update(k[..., lo : min(lo + 7, seen), :], v[..., lo : min(lo + 7, seen), :])
        n = layer.quantized
        kk, vv = layer.materialize()
        np.testing.assert_array_equal(kk[..., :n, :].numpy(), window_k[..., :n, :])
        if window_v is not None:
            np.testing.assert_array_equal(vv[..., :n, :].numpy(), window_v[..., :n, :])


@pytest.mark.parametrize("cfg", EVERY_SCHEME)
def test_rows_encode_independently(cfg):
    """A batch row's codes do not depend on the other rows (an outlier row does not change its
    neighbours' storage), so dropping a finished row leaves the others as if encoded alone."""
    k, v = _kv(batch=3, tokens=40, outliers=False)
    k[1] *= 1e5  # row 1 alone beyond float16
    v[1] *= 1e-7
    both = CompressedLayer(cfg, 0)
    both.update(k, v)
    both.batch_select_indices(torch.tensor([0, 2]))
    alone = CompressedLayer(cfg, 0)
    alone.update(k[[0, 2]], v[[0, 2]])
    for x, y in zip(both.materialize(), alone.materialize()):
        assert torch.equal(x, y)


# --- the residual window at every step, on the model --------------------------------------------

# Layer 0's keys and values depend only on the tokens and their positions (not on any attention
# output), so the QuantizedKVCache and a DynamicCache fed the same tokens see the same layer-0
# tensors bit for bit even when quantization changes every later layer: the DynamicCache is the
# reference for what the quantized cache must hold.


def _forward(model, ids, cache, **kw):
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True, **kw).logits


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=6), id="kqv-r6"),
        pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=4, group=8), id="kivi-g8-r4"),
    ],
)
def test_window_at_every_prefill_and_decode_step(model64, cfg):
    model, tok = model64
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :36]
    qc, dc = QuantizedKVCache(cfg, model.config.num_hidden_layers), DynamicCache()
    steps = [(0, 20)] + [(t, t + 1) for t in range(20, 36)]
    for lo, hi in steps:
        _forward(model, ids[:, lo:hi], qc)
        _forward(model, ids[:, lo:hi], dc)
        layer, ref = qc.layers[0], dc.layers[0]
        # tokens leave the window exactly when quantized_count says: whole chunks beyond the
        # newest residual_length tokens, during prefill as during decode
        assert layer.quantized == cfg.quantized_count(hi) and qc.get_seq_length() == dc.get_seq_length() == hi
        _check_holds_one_shot(layer, cfg, ref.keys, ref.values)
    assert qc.layers[0].quantized > 0


# --- prefill semantics --------------------------------------------------------------------------


class _ConstantSchedule(FakeQuant):
    """The fast path with every query seeing keys ``j < held`` quantized: a prompt that read
    the cache in its final state (quantized at once)."""

    def __init__(self, config, held):
        super().__init__(config)
        self.held = held

    def _schedule(self, length):
        j = torch.arange(length)
        return (j[None, :] < self.held).expand(length, length), False


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4), id="kqv-r4"),
        pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=8, sink_tokens=2), id="kivi-g8-r3-s2"),
        pytest.param(QuantConfig("headq", 2, residual_length=2, headq_base="kqv", bases="random", sink_tokens=1), id="headq-s1"),
    ],
)
def test_prefill_reads_the_schedule_of_one_token_at_a_time(model64, cfg):
    """A P-token prefill leaves the oldest tokens quantized (``quantized_span(P)``) and the
    newest in the window, but each prompt query t reads key j quantized only once the cache
    fed one token at a time would hold it so (``j`` in ``quantized_span(t + 1)``): the fast
    path's schedule. So one prefill, the fast path and a token-by-token feed agree, and a
    forward over drafted tokens reads what single decode steps would (assisted generation)."""
    model, tok = model64
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :24]
    cache = QuantizedKVCache(cfg, model.config.num_hidden_layers)
    prefill = _forward(model, ids, cache)
    dc = DynamicCache()
    _forward(model, ids, dc)
    lo, hi = cfg.quantized_span(ids.shape[1])
    assert hi - lo >= 16 and cache.layers[0].quantized == hi - lo
    _STATE.set(None)
    with torch.no_grad(), active(_ConstantSchedule(cfg, hi)):
        constant = model(ids).logits
    with torch.no_grad(), fake_quant(cfg):
        fast = model(ids).logits
    # float64 model: equal to rounding (measured ~1e-13 on logits of ~10); reading the final
    # state at once moves the logits of the prompt's queries by far more.
    assert (prefill - fast).abs().max() < 1e-8
    assert (prefill - constant)[0].abs().amax(dim=-1).max() > 1e-4


# --- beam search, crop, finished rows: against DynamicCache --------------------------------------

# Nothing quantized: the cache must be DynamicCache exactly (the window is longer than the text).
UNQUANTIZED = QuantConfig("kqv", 3, "kqv", 3, residual_length=256)
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "Water boils at",
    "One, two, three, four,",
]


def _fields(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "_codecs"}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_beam_search_equals_dynamic_cache(model64, monkeypatch):
    model, tok = model64
    prompt = tok(PROMPTS[0], return_tensors="pt").input_ids
    calls = []
    reorder = CompressedLayer.reorder_cache
    monkeypatch.setattr(CompressedLayer, "reorder_cache", lambda self, idx: calls.append(idx.clone()) or reorder(self, idx))
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    before = _fields(UNQUANTIZED)
    with torch.no_grad():
        ref = model.generate(prompt, past_key_values=DynamicCache(), **kw)
        got = model.generate(prompt, past_key_values=QuantizedKVCache(UNQUANTIZED, model.config.num_hidden_layers), **kw)
    assert calls, "beam search never reordered the quantized cache"
    assert torch.equal(got.sequences, ref.sequences)
    assert torch.equal(got.sequences_scores, ref.sequences_scores)
    assert _fields(UNQUANTIZED) == before  # generate() left the shared config alone


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_beam_search_reorders_quantized_rows(model64, monkeypatch):
    """With quantization on, each row of layer 0 after beam search holds the one-shot encoding
    of that row's own token history (codes and window reordered together). The histories are
    rebuilt from what generate() fed the model and the beam indices it reordered by."""
    model, tok = model64
    cfg = QuantConfig("kqv", 4, "kqv", 4, residual_length=2)
    prompt = tok(PROMPTS[0], return_tensors="pt").input_ids
    history = []  # the token history of every cache row, updated as the cache is
    distinct = []  # at each check: did the rows hold different histories?
    reorder = CompressedLayer.reorder_cache

    def check(layer):
        rows = history[0]
        assert rows.shape == (3, layer.get_seq_length())
        distinct.append(len({tuple(r.tolist()) for r in rows}) > 1)
        dc = DynamicCache()
        hook.remove()  # these forwards are the check's, not generate()'s
        # fed as generate() fed the cache (prompt, then one token a step): the same roundings
        p = prompt.shape[1]
        _forward(model, rows[:, :p], dc)
        for t in range(p, rows.shape[1]):
            _forward(model, rows[:, t : t + 1], dc)
        hook_on()
        _check_holds_one_shot(layer, cfg, dc.layers[0].keys, dc.layers[0].values)

    def spy(self, idx):
        reorder(self, idx)
        if self.layer_idx == 0:
            history[0] = history[0][idx]
            check(self)

    def feed(module, args):
        ids = args[0]
        history[:] = [ids if not history else torch.cat([history[0], ids], -1)]

    def hook_on():
        nonlocal hook
        hook = model.get_input_embeddings().register_forward_pre_hook(feed)

    hook = None
    monkeypatch.setattr(CompressedLayer, "reorder_cache", spy)
    hook_on()
    cache = QuantizedKVCache(cfg, model.config.num_hidden_layers)
    try:
        with torch.no_grad():
            model.generate(prompt, past_key_values=cache, max_new_tokens=6, num_beams=3, do_sample=False)
    finally:
        hook.remove()
    assert len(distinct) >= 4 and any(distinct)  # reorders happened while the beams differed
    assert cache.layers[0].quantized > 0


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(UNQUANTIZED, id="unquantized"),
        pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=6), id="kqv-r6"),
    ],
)
def test_crop_then_continue(model64, cfg):
    """Crop back by 12 (into the quantized part) and by 5 (a rejected draft: no deeper than the
    tokens fed since the previous crop), then decode other tokens. Unquantized: DynamicCache's logits exactly. Quantized (past recording on, as
    assisted generation sets it): the kept tokens are held as a fresh cache fed only them
    would hold them (the newest back in full precision), and decoding continues by the schedule."""
    model, tok = model64
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :40]
    qc, dc = QuantizedKVCache(cfg, model.config.num_hidden_layers), DynamicCache()
    qc.activate_past_recording(recurrent_states_to_keep=12)  # crops reach back over several one-token forwards
    for cache in (qc, dc):
        _forward(model, ids[:, :24], cache)
        for t in range(24, 28):
            _forward(model, ids[:, t : t + 1], cache)
    seen = 28
    for remove, feed in ((12, ids[:, 33:40]), (5, ids[:, 30:33])):
        qc.crop(-remove)
        dc.crop(-remove)
        seen -= remove
        assert qc.get_seq_length() == dc.get_seq_length() == seen
        assert qc.layers[0].quantized == cfg.quantized_count(seen)
        _check_holds_one_shot(qc.layers[0], cfg, dc.layers[0].keys, dc.layers[0].values)
        for t in range(feed.shape[1]):
            a, b = _forward(model, feed[:, t : t + 1], qc), _forward(model, feed[:, t : t + 1], dc)
            seen += 1
            if cfg is UNQUANTIZED:
                assert torch.equal(a, b)
        _check_holds_one_shot(qc.layers[0], cfg, dc.layers[0].keys, dc.layers[0].values)
    qc.crop(0)
    assert qc.layers[0].pending_k is None
    _check_holds_one_shot(qc.layers[0], cfg, dc.layers[0].keys, dc.layers[0].values)


def _left_padded(tok, texts, pad_id=0):
    rows = [tok(t, return_tensors="pt").input_ids[0] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def _greedy(model, cache, ids, mask, steps, drop_after=None, keep=None):
    """Greedy decoding by hand, as generate() does with left padding (positions from the mask);
    after ``drop_after`` steps the rows ``keep`` stay (the others finished) via
    ``batch_select_indices``. Returns the logits of every step."""
    logits, out = [], ids
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    step = _forward(model, ids, cache, attention_mask=mask, position_ids=pos)
    for s in range(steps):
        logits.append(step[:, -1])
        nxt = step[:, -1].argmax(-1, keepdim=True)
        if s == drop_after:
            cache.batch_select_indices(keep)
            nxt, mask, out = nxt[keep], mask[keep], out[keep]
        out = torch.cat([out, nxt], -1)
        mask = torch.cat([mask, torch.ones_like(nxt)], -1)
        pos = mask.sum(-1, keepdim=True) - 1
        step = _forward(model, nxt, cache, attention_mask=mask, position_ids=pos)
    return logits


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_dropping_a_finished_row_of_a_left_padded_batch(model64):
    model, tok = model64
    ids, mask = _left_padded(tok, PROMPTS)
    keep = torch.tensor([0, 2])
    layers = model.config.num_hidden_layers
    ref = _greedy(model, DynamicCache(), ids, mask, 6, drop_after=1, keep=keep)
    got = _greedy(model, QuantizedKVCache(UNQUANTIZED, layers), ids, mask, 6, drop_after=1, keep=keep)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    # Quantized: the surviving rows continue as if the dropped row had never been in the batch
    # (codes are per row; float64 batched and unbatched forwards agree to rounding).
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=2)
    dropped = _greedy(model, QuantizedKVCache(cfg, layers), ids, mask, 6, drop_after=1, keep=keep)
    alone = _greedy(model, QuantizedKVCache(cfg, layers), ids[keep], mask[keep], 6)
    for a, b in zip(dropped, alone):
        a = a if a.shape[0] == 2 else a[keep]  # steps 0-1 ran with the third row present
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)


def test_a_long_prompt_flush_hands_freed_heap_back(monkeypatch):
    """A flush of a long prompt's tokens asks the allocator to return freed pages (glibc's
    ``malloc_trim``); decode-step flushes, far below the threshold, do not."""
    import sys

    import kvqrs.hf.layer as layer_mod
    from kvqrs.hf import heap

    assert not heap.release_freed(heap.RELEASE_MIN_BYTES - 1)
    if sys.platform.startswith("linux") and heap._malloc_trim() is not None:
        assert heap.release_freed(heap.RELEASE_MIN_BYTES)
    asked = []
    monkeypatch.setattr(layer_mod, "release_freed", lambda n: asked.append(n))
    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=16), 1)
    prompt = torch.randn(1, 4, 4096, 64)  # 8 MiB of float32 keys and values
    cache.update(prompt, prompt.clone(), 0)
    cache.update(torch.randn(1, 4, 1, 64), torch.randn(1, 4, 1, 64), 0)
    assert asked[0] >= heap.RELEASE_MIN_BYTES and all(n < heap.RELEASE_MIN_BYTES for n in asked[1:])


def test_a_long_prompt_is_coded_where_it_lies_and_let_go():
    """A long prompt on an empty window is the window as given (no copy into a buffer): the
    flush codes it in place, and what stays of the window moves to a buffer of its size, so
    the layer keeps no reference to the prompt's tensors."""
    from kvqrs.hf.layer import LONG_APPEND

    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=16), 1)
    k, v = torch.randn(1, 2, LONG_APPEND + 40, 64), torch.randn(1, 2, LONG_APPEND + 40, 64)
    ref = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=16), 1)
    ref.update(k[:, :, :8], v[:, :, :8], 0)  # a window with tokens: the buffered path
    ref.update(k[:, :, 8:], v[:, :, 8:], 0)
    got = cache.update(k, v, 0)
    want = ref.layers[0].materialize()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    layer = cache.layers[0]
    for held, given in ((layer.keys, k), (layer.values, v)):
        assert held.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
        assert torch.equal(held, given[:, :, -held.shape[-2] :])
    bad = k.clone()
    bad[0, 1, 700, 3] = float("nan")
    fresh = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=16), 1)
    with pytest.raises(KvqrsError, match=r"key_states.*\(0, 1, 700, 3\)"):
        fresh.update(bad, v, 0)
    assert fresh.get_seq_length() == 0


@pytest.mark.parametrize("scheme", ["kqv", "kivi", "matched"])
def test_a_view_decoded_in_chunks_equals_one_decode(monkeypatch, scheme):
    """Decoding a view a few tokens at a time (whole groups) gives the tokens of one decode."""
    import kvqrs.hf.layer as layer_mod

    extra = {"calibration": "random", "group": 64} if scheme == "matched" else {"group": 32}
    cfg = QuantConfig(scheme, 4, scheme, 4, residual_length=8, **extra)
    cache = QuantizedKVCache(cfg, 1)
    k, v = torch.randn(1, 2, 700, 64), torch.randn(1, 2, 700, 64)
    cache.update(k, v, 0)
    whole = cache.layers[0].materialize()
    monkeypatch.setattr(layer_mod, "DECODE_CHUNK", 64)
    chunked = cache.layers[0].materialize()
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert whole[0].shape[-2] == 700


@pytest.mark.parametrize("residual,tokens", [(2000, 1500), (1024, 1100), (16, 3000)])
def test_the_window_never_shares_the_callers_tensors(residual, tokens):
    """Whatever part of a long prompt stays in full precision, the layer holds it in storage of
    its own: writing to the tensors handed to ``update`` afterwards changes nothing held."""
    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=residual), 1)
    k, v = torch.randn(1, 2, tokens, 64), torch.randn(1, 2, tokens, 64)
    cache.update(k, v, 0)
    before = [t.clone() for t in cache.layers[0].materialize()]
    k.fill_(7.0)
    v.fill_(-7.0)
    after = cache.layers[0].materialize()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
