"""The steady decode step of ``CompressedLayer.update`` (one token written into the window's
buffer, a chunk leaving the window encoded natively, the general path's bookkeeping skipped)
against the general path it shortcuts: the same tokens, the same logits and the same cache
bytes, on a tiny random Llama in float32, for each scheme with a native encoder. Also: the
general path runs again after anything else changes the layer."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache  # noqa: E402

from tests.cache_helpers import held_tensors, per_head_matched_calibration, tiny_llama  # noqa: E402

KV_HEADS, GROUPS, HEAD_DIM, LAYERS = 2, 2, 32, 2
PROMPT, NEW = 40, 48


pytestmark = pytest.mark.usefixtures("isolated_attention_state")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(KV_HEADS, GROUPS, HEAD_DIM, LAYERS)


def _configs() -> list:
    cal = {i: per_head_matched_calibration(KV_HEADS, HEAD_DIM, seed=i) for i in range(LAYERS)}
    return [
        pytest.param(QuantConfig("kqv", 4, "kqv", 4, residual_length=8), id="kqv-chunk1"),
        # A prompt shorter than the window: the first steps read the window alone, natively.
        pytest.param(QuantConfig("kqv", 4, "kqv", 4, residual_length=64), id="kqv-window-first"),
        pytest.param(QuantConfig("kivi", 4, "kivi", 4, residual_length=8, group=16), id="kivi-group16"),
        pytest.param(QuantConfig("kv", 4, "kv", 4, residual_length=4, sink_tokens=2), id="kv-sinks"),
        pytest.param(
            QuantConfig("matched", 4, "matched", 4, residual_length=8, group=16, calibration=cal, sink_tokens=1), id="matched-group16"
        ),
    ]


class _Counting:
    """Counts the steady path's answers; ``off``: every update takes the general path."""

    def __init__(self, monkeypatch, off: bool):
        self.taken = self.declined = 0
        steady = CompressedLayer._steady_update

        def counted(layer, k, v):
            out = None if off else steady(layer, k, v)
            if out is None:
                self.declined += 1
            else:
                self.taken += 1
            return out

        monkeypatch.setattr(CompressedLayer, "_steady_update", counted)


def _generate(model, config, monkeypatch, off: bool):
    count = _Counting(monkeypatch, off)
    cache = QuantizedKVCache(config, LAYERS)
    ids = torch.randint(0, 96, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    monkeypatch.undo()
    return out, cache, count


@pytest.mark.parametrize("config", _configs())
def test_the_steady_step_equals_the_general_path(model, config, monkeypatch):
    fast, fast_cache, count = _generate(model, config, monkeypatch, off=False)
    slow, slow_cache, _ = _generate(model, config, monkeypatch, off=True)
    # Most decode updates take the steady path (each layer's first decode step and the steps
    # after a buffer change take the general one).
    assert count.taken >= LAYERS * (NEW - 1) * 3 // 4, (count.taken, count.declined)
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.logits, slow.logits):
        assert torch.equal(a, b)
    assert fast_cache.to_bytes() == slow_cache.to_bytes()
    for a, b in zip(held_tensors(fast_cache), held_tensors(slow_cache)):
        assert torch.equal(a, b)
    for fl, sl in zip(fast_cache.layers, slow_cache.layers):
        assert (fl.seen, fl.quantized, fl.q_start, fl.start) == (sl.seen, sl.quantized, sl.q_start, sl.start)


class _Module:
    """What the kvqrs attention function reads of an attention module."""

    layer_idx, num_key_value_groups = 0, GROUPS


def _decoding_layer() -> tuple[CompressedLayer, object]:
    """A one-layer cache in its steady decode state (kqv, window 8), and a decode token maker."""
    rng = np.random.default_rng(0)

    def kv(t: int) -> torch.Tensor:
        return torch.from_numpy(rng.standard_normal((1, KV_HEADS, t, HEAD_DIM)).astype(np.float32))

    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=8), 1)
    q = torch.from_numpy(rng.standard_normal((1, KV_HEADS * GROUPS, 1, HEAD_DIM)).astype(np.float32))
    module = _Module()
    for t in (32, 1, 1):
        k, v = cache.update(kv(t), kv(t), 0)
        cache.attend(module, q, k, v, None, HEAD_DIM**-0.5)
    return cache, kv


def test_a_non_finite_token_is_refused_by_name_and_stores_nothing():
    """A steady step writes its token into the window buffer at once (the window it hands back
    is whole): a refused token is named by that update, and the layer is left as before it."""
    cache, kv = _decoding_layer()
    layer = cache.layers[0]
    assert layer._steady is not None
    before = (layer.seen, layer.quantized, cache.to_bytes())
    bad = kv(1)
    bad[0, 1, 0, 3] = float("nan")
    with pytest.raises(KvqrsError, match=r"key_states: .*nan.* at index \(0, 1, 0, 3\)"):
        cache.update(bad, kv(1), 0)
    assert (layer.seen, layer.quantized, cache.to_bytes()) == before
    q = torch.ones(1, KV_HEADS * GROUPS, 1, HEAD_DIM)
    k, v = cache.update(kv(1), kv(1), 0)  # and goes on
    cache.attend(_Module(), q, k, v, None, HEAD_DIM**-0.5)
    assert layer.seen == before[0] + 1


def test_a_steady_update_hands_back_the_whole_window():
    """The keys and values a steady update returns hold its token before any attention reads
    them (an attention other than kvqrs' may read them)."""
    cache, kv = _decoding_layer()
    assert cache.layers[0]._steady is not None
    new_k, new_v = kv(1), kv(1)
    k, v = cache.update(new_k, new_v, 0)
    assert cache.layers[0]._deferred is not None  # the steady path
    assert torch.equal(k[..., -1:, :], new_k) and torch.equal(v[..., -1:, :], new_v)


@pytest.mark.parametrize("change", ["batch_select_indices", "reset"])
def test_a_changed_layer_sends_the_next_update_down_the_general_path(monkeypatch, change):
    cache, kv = _decoding_layer()
    layer = cache.layers[0]
    assert layer._steady is not None
    if change == "reset":
        cache.reset()
    else:
        layer.batch_select_indices(torch.tensor([0]))
    calls = []
    steady = CompressedLayer._steady_update
    monkeypatch.setattr(CompressedLayer, "_steady_update", lambda s, k, v: calls.append(out := steady(s, k, v)) or out)
    cache.update(kv(1), kv(1), 0)
    assert all(out is None for out in calls), "the steady path served a changed layer"


def test_steady_steps_without_attention_are_written_by_the_next_reader():
    """A steady update defers its writes (the token into the window buffer, a flushed chunk
    into the store) to the native call that attends; with no attention, the layer's next
    update or read makes them: the cache then holds the bytes of one that attended."""
    (attended, kv_a), (alone, kv_b) = _decoding_layer(), _decoding_layer()
    q = torch.ones(1, KV_HEADS * GROUPS, 1, HEAD_DIM)
    for _ in range(12):  # kqv, window 8: a token leaves the window at every step
        k, v = attended.update(kv_a(1), kv_a(1), 0)
        attended.attend(_Module(), q, k, v, None, HEAD_DIM**-0.5)
        alone.update(kv_b(1), kv_b(1), 0)
        assert alone.layers[0]._deferred is not None
    assert alone.to_bytes() == attended.to_bytes()
    assert alone.layers[0].nbytes() == attended.layers[0].nbytes()
