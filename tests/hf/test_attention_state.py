"""The attention state (kvqrs.hf.attention): every object the ``kvqrs`` attention function
consults is an ``AttentionState``; ``active(state)`` puts one in effect for a ``with`` block and
restores the one before on normal exit and after an exception; a cache hands itself to the
attention call after its ``update`` and leaves nothing installed after a forward."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs.evaluation.capture import Recorder  # noqa: E402
from kvqrs.hf import QuantConfig, QuantizedKVCache  # noqa: E402
from kvqrs.hf import calibration as cal  # noqa: E402
from kvqrs.hf.attention import _HANDED, AttentionState, FakeQuant, active, current  # noqa: E402

from tests.cache_helpers import tiny_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(kv_heads=1, groups=2, head_dim=16, layers=2)


class _Marker:
    """A state that declines every layer (attention stays eager)."""

    def attend(self, module, query, key, value, attention_mask, scaling):
        return None


def test_the_states_declare_the_protocol():
    config = QuantConfig("kv", 4)
    states = [
        QuantizedKVCache(config, 2),
        FakeQuant(config),
        Recorder(),
        cal._QueryRecorder(),
        cal._OnlyLayer(FakeQuant(config), 0),
        _Marker(),
    ]
    for state in states:
        assert isinstance(state, AttentionState), type(state).__name__
    assert not isinstance(object(), AttentionState)
    for cls in (QuantizedKVCache, FakeQuant, cal._QueryRecorder, cal._KVQRecorder, cal._OnlyLayer, cal._StateRecorder, cal._ClassRecorder):
        assert AttentionState in cls.__mro__, cls.__name__  # declared, not only matching


def test_active_restores_the_state_on_exit_and_after_an_exception():
    outer, inner = _Marker(), _Marker()
    assert current() is None
    with active(outer) as got:
        assert got is outer and current() is outer
        with active(inner):
            assert current() is inner
        assert current() is outer  # normal exit
        with pytest.raises(RuntimeError, match="boom"), active(inner):
            assert current() is inner
            raise RuntimeError("boom")
        assert current() is outer  # after an exception
        with active(None):
            assert current() is None
        assert current() is outer
    assert current() is None


def test_a_forward_through_a_cache_leaves_no_state(model):
    ids = torch.randint(0, 64, (1, 12))
    cache = QuantizedKVCache(QuantConfig("kv", 4, residual_length=4), model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        model(ids[:, :1], cache=cache, use_cache=True)
    assert current() is None  # the cache was never installed as the scoped state
    assert _HANDED.get() is None  # each hand-over was taken by its layer's attention
    assert cache.get_seq_length() == 13
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None  # nothing in kvqrs keeps the cache alive


def test_a_cache_forward_inside_an_active_state_restores_it(model):
    """A cache's forward inside ``active(state)``: its layers are served by the cache, the
    state is the same after the forward, and after a forward that raises."""
    ids = torch.randint(0, 64, (1, 10))
    marker = _Marker()
    with active(marker), torch.no_grad():
        cache = QuantizedKVCache(QuantConfig("kv", 4, residual_length=4), model.config)
        model(ids, cache=cache, use_cache=True)
        assert current() is marker and cache.get_seq_length() == 10
        with pytest.raises(IndexError):  # token ids beyond the vocabulary: the forward raises
            model(torch.full((1, 3), 10_000), cache=cache, use_cache=True)
        assert current() is marker
    assert current() is None


def test_an_update_without_attention_hands_over_weakly():
    cache = QuantizedKVCache(QuantConfig("kv", 4), 1)
    k = torch.randn(1, 1, 5, 16)
    cache.update(k, k, 0)  # no forward: nothing takes the hand-over
    assert current() is None and _HANDED.get()() is cache
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None and _HANDED.get()() is None  # a weak reference: the cache is not kept alive
