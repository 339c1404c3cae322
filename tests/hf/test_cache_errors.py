"""Misuse of ``QuantizedKVCache`` is an error, not a silent wrong number: configs a cache cannot
hold, states that are not float tensors of one dtype, keys and values that disagree or do not
join the layer, values beyond the storable range, an encode refused mid-update (nothing is
stored), the fast path without the kvqrs attention; float16 extremes decode saturated, not
refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import QuantConfig, QuantizedKVCache, fake_quant  # noqa: E402

from tests.hf.cache_cases import TEXT  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")


def test_cache_refuses_configs_it_cannot_hold():
    with pytest.raises(KvqrsError, match="num_layers"):
        QuantizedKVCache(QuantConfig("kqv", 3), 0)
    with pytest.raises(KvqrsError, match="key_scheme"):
        QuantizedKVCache(QuantConfig(None, 2, "kqv", 2), 2)  # value-only: fast path only
    with pytest.raises(KvqrsError, match="a2"):
        QuantizedKVCache(QuantConfig("kqv", 2, "a2", 2), 2)  # needs future attention
    for bad in (2.5, "2", True):
        with pytest.raises(KvqrsError, match="num_layers: expected an integer"):
            QuantizedKVCache(QuantConfig("kqv", 3), bad)
    with pytest.raises(KvqrsError, match="config: expected a QuantConfig, got NoneType"):
        QuantizedKVCache(None, 2)


@pytest.mark.parametrize("scheme", ["kqv", "kivi"])
def test_update_refuses_states_that_are_not_float_tensors_of_one_dtype(scheme):
    """Integer tensors, NumPy arrays and keys and values of different dtypes raise a KvqrsError
    naming the argument (integer keys were coded by some schemes; mixed dtypes came back in the
    keys' dtype) and store nothing."""
    cache = QuantizedKVCache(QuantConfig(scheme, 4, scheme, 4, residual_length=4), 1)
    k = torch.randn(1, 3, 8, 64)
    cases = [
        ((k * 100).long(), (k * 100).long(), "key_states: expected a floating-point tensor, got dtype torch.int64"),
        (k.numpy(), k.numpy(), "key_states: expected a torch.Tensor, got ndarray"),
        (k, k.half(), r"value_states: expected the dtype of key_states \(torch.float32\), got torch.float16"),
    ]
    for key, value, message in cases:
        with pytest.raises(KvqrsError, match=message):
            cache.update(key, value, 0)
        assert cache.get_seq_length() == 0
    cache.update(k, k, 0)
    with pytest.raises(KvqrsError, match="key_states: layer 0 holds torch.float32, got torch.float16"):
        cache.update(k.half(), k.half(), 0)
    assert cache.get_seq_length() == 8
    cache.crop(-8)  # emptied: it takes what a fresh layer takes
    cache.update(k.half(), k.half(), 0)
    assert cache.get_seq_length() == 8


def test_fake_quant_refuses_a_model_without_the_kvqrs_attention(model32):
    model, tok = model32
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :16]
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(KvqrsError, match="attn_implementation='kvqrs'"), torch.no_grad(), fake_quant(QuantConfig("kv", 2, "kv", 2)):
            model(ids)
    finally:
        model.set_attn_implementation("kvqrs")


@pytest.mark.parametrize(
    "k_shape, v_shape",
    [((1, 3, 8, 64), (1, 3, 7, 64)), ((2, 3, 8, 64), (1, 3, 8, 64)), ((1, 2, 8, 64), (1, 3, 8, 64)), ((1, 3, 8, 64, 1), (1, 3, 8, 64, 1))],
)
def test_update_refuses_keys_and_values_that_disagree(k_shape, v_shape):
    """Keys and values of different batch, heads or tokens used to be stored as they came (a
    cache that then failed to load, or returned values of another batch)."""
    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=4), 1)
    with pytest.raises(KvqrsError, match="key_states|value_states"):
        cache.update(torch.randn(*k_shape), torch.randn(*v_shape), 0)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("shape", [(1, 3, 4, 64), (2, 5, 4, 64), (2, 3, 4, 32)])
def test_update_refuses_states_the_layer_cannot_join(shape):
    """A later update of another batch, head count or head_dim raises KvqrsError (it used to
    escape as torch's RuntimeError from the concatenation) and leaves the layer as it was."""
    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4), 1)
    cache.update(torch.randn(2, 3, 8, 64), torch.randn(2, 3, 8, 64), 0)
    before = [t.clone() for t in cache.layers[0].materialize()]
    with pytest.raises(KvqrsError, match="layer 0 holds"):
        cache.update(torch.randn(*shape), torch.randn(*shape), 0)
    assert cache.get_seq_length() == 8
    assert all(torch.equal(a, b) for a, b in zip(cache.layers[0].materialize(), before))


@pytest.mark.parametrize("side", ["keys", "values"])
@pytest.mark.parametrize("residual,sinks", [(0, 0), (3, 1), (20, 0)])
@pytest.mark.parametrize("first", [True, False])
def test_values_beyond_the_storable_range_are_refused_on_arrival(side, residual, sinks, first):
    """A value past MAX_STATE could make a group's range (max - min) or a norm overflow float32
    when its chunk is coded, updates later (a KIVI group of 3e38 and -3e38): the update that
    brings it is refused, naming it, and the cache goes on as if it never came."""
    config = QuantConfig("kivi", 4, "kivi", 4, group=8, residual_length=residual, sink_tokens=sinks)
    gen = torch.Generator().manual_seed(residual + 2 * first)
    good = [(torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)) for n in (9, 8, 1, 1, 16, 16)]
    bad_k, bad_v = torch.randn(1, 2, 16, 16, generator=gen), torch.randn(1, 2, 16, 16, generator=gen)
    bad = bad_k if side == "keys" else bad_v
    bad[0, 1, 2, 5], bad[0, 1, 5 if side == "keys" else 2, 5 if side == "keys" else 6] = 3e38, -3e38
    refused, clean = QuantizedKVCache(config, 1), QuantizedKVCache(config, 1)
    message = rf"{side[:-1]}_states: expected values of magnitude <= 1e\+35, got 3e\+38 at index \(0, 1, 2, 5\)"
    for step, (k, v) in enumerate(good):
        if step == (0 if first else 2):
            with pytest.raises(KvqrsError, match=message):
                refused.update(bad_k, bad_v, 0)
            assert refused.get_seq_length() == sum(t[0].shape[-2] for t in good[:step])
        ka, va = refused.update(k, v, 0)
        kb, vb = clean.update(k, v, 0)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert refused.to_bytes() == clean.to_bytes()


def _refuse_next_encode(monkeypatch):
    """Make the next chunk encode of any cache raise (as a code that cannot be stored would)."""
    from kvqrs.hf import store as store_mod

    real = store_mod.CodeStore.encode_append
    calls = []

    def refuse_once(self, *args, **kwargs):
        if not calls:
            calls.append(1)
            raise KvqrsError("x: row 0 overflows float32")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(store_mod.CodeStore, "encode_append", refuse_once)


@pytest.mark.parametrize("residual,sinks", [(0, 0), (3, 1)])
def test_an_update_whose_encode_is_refused_stores_nothing(monkeypatch, residual, sinks):
    """An update refused when its chunk is encoded (after the tokens reached the window and the
    sinks) leaves the cache as it was: the next updates give the bytes of a cache that never
    saw it."""
    config = QuantConfig("kivi", 4, "kivi", 4, group=8, residual_length=residual, sink_tokens=sinks)
    gen = torch.Generator().manual_seed(residual)
    good = [(torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)) for n in (9, 8, 1, 1)]
    refused, clean = QuantizedKVCache(config, 1), QuantizedKVCache(config, 1)
    refused.update(*good[0], 0)
    clean.update(*good[0], 0)
    _refuse_next_encode(monkeypatch)
    with pytest.raises(KvqrsError, match="overflows float32"):
        refused.update(torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16), 0)
    assert refused.get_seq_length() == 9
    for k, v in good[1:]:
        ka, va = refused.update(k, v, 0)
        kb, vb = clean.update(k, v, 0)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert refused.to_bytes() == clean.to_bytes()


def test_a_refused_first_update_leaves_the_layer_uninitialized(monkeypatch):
    """A first update refused after the layer took its dtype, batch and heads from it forgets
    them: the next update starts the layer anew."""
    config = QuantConfig("kivi", 4, "kivi", 4, group=8)
    bad = torch.randn(2, 2, 16, 64, dtype=torch.float64)
    refused, clean = QuantizedKVCache(config, 1), QuantizedKVCache(config, 1)
    _refuse_next_encode(monkeypatch)
    with pytest.raises(KvqrsError, match="overflows float32"):
        refused.update(bad, bad.clone(), 0)
    assert not refused.layers[0].is_initialized
    k, v = torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
    assert refused.update(k, v, 0)[0].dtype == torch.float32
    clean.update(k, v, 0)
    assert refused.to_bytes() == clean.to_bytes()


def test_codes_of_float16_extremes_decode_saturated_not_refused():
    """A float16 KIVI group spanning -65504 .. 65504 reconstructs a step past float16's range
    (its scale rounds up): the decoded keys saturate at the largest float16, and the update
    that coded them is neither refused nor left half done."""
    cache = QuantizedKVCache(QuantConfig("kivi", 4, "kivi", 4, group=8), 1)
    k = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    k[0, 1, 2, 5], k[0, 1, 5, 5] = 65504, -65504
    kk, _ = cache.update(k, torch.randn(1, 2, 16, 64, dtype=torch.float16), 0)
    assert torch.isfinite(kk).all() and kk[0, 1, 2, 5] == 65504 and kk[0, 1, 5, 5] == -65504
    assert cache.update(torch.randn(1, 2, 8, 64, dtype=torch.float16), torch.randn(1, 2, 8, 64, dtype=torch.float16), 0)[0].shape[-2] == 24


def test_an_empty_calibration_dict_is_refused_by_the_config():
    # Else the config is accepted and the cache fails only at its first update.
    with pytest.raises(KvqrsError, match="calibration: an empty dict"):
        QuantConfig("matched", 4, "matched", 4, calibration={})


def test_a_calibration_made_for_another_model_is_refused_before_any_work():
    """``QuantizedKVCache(config, model.config)`` compares a ``matched`` calibration (a
    ``kvqrs calibrate`` file's) with the model: the same decoder layers, head_dim, and one
    calibrated head or the model's KV heads; otherwise the error names both."""
    from transformers import LlamaConfig

    from tests.cache_helpers import per_head_matched_calibration

    cal = {i: per_head_matched_calibration(2, 16, i) for i in range(2)}
    cfg = QuantConfig("matched", 4, "matched", 4, group=8, calibration=cal)
    shape = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert len(QuantizedKVCache(cfg, LlamaConfig(**shape)).layers) == 2
    for change, has in (
        ({"num_hidden_layers": 3}, "has 3 layers, head_dim 16 and 2 KV heads"),
        ({"head_dim": 32}, "has 2 layers, head_dim 32 and 2 KV heads"),
        ({"num_key_value_heads": 4}, "has 2 layers, head_dim 16 and 4 KV heads"),
    ):
        with pytest.raises(
            KvqrsError,
            match=rf"calibration: made for a model of 2 layers \(indices 0..1\), head_dim 16 and 2 calibrated KV heads; this model \(.*\) {has}",
        ):
            QuantizedKVCache(cfg, LlamaConfig(**{**shape, **change}))
    # A cache sized by its layer count needs a calibrated layer for each of its own.
    assert len(QuantizedKVCache(cfg, 2).layers) == len(QuantizedKVCache(cfg, 1).layers) + 1 == 2
    with pytest.raises(
        KvqrsError, match=r"calibration: made for a model of 2 layers \(indices 0..1\); this cache has 3 layers, and layers \[2\] have none"
    ):
        QuantizedKVCache(cfg, 3)
