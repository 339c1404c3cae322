"""``QuantizedKVCache.crop`` and the batch operations against transformers' DynamicCache, on
synthetic keys and values: under past recording a crop of any depth returns to the state of a
fresh cache, without it a crop refuses what it cannot restore; HeadQ corrections of the kept
groups; crop conventions; reorder, batch selection and repeat, and bad indices."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache  # noqa: E402
from kvqrs.hf.attention import _STATE  # noqa: E402

from tests.hf.cache_cases import CROP_SCHEMES, HEAD_DIM, _kv, _pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")


def _check_against_dynamic(qc, dc, cfg):
    """Window: equal to the DynamicCache's newest tokens; quantized part: the quantize-dequantize
    of the DynamicCache's rows (which hold the same selection of original tokens)."""
    assert qc.get_seq_length() == dc.get_seq_length()
    for layer, dl in zip(qc.layers, dc.layers):
        k, v = layer.materialize()
        assert k.shape == dl.keys.shape and v.shape == dl.values.shape
        n = layer.quantized
        assert torch.equal(k[..., n:, :], dl.keys[..., n:, :])
        assert torch.equal(v[..., n:, :], dl.values[..., n:, :])
        codec = cfg.codec(layer.layer_idx, HEAD_DIM)
        if n:
            ck = codec.encode_keys(dl.keys[..., :n, :].numpy())
            assert torch.equal(k[..., :n, :], torch.from_numpy(codec.decode_keys(ck, base_only=True)))
            if codec.values is None:
                assert torch.equal(v[..., :n, :], dl.values[..., :n, :])
            else:
                v_hat = codec.decode_values(codec.encode_values(dl.values[..., :n, :].numpy()))
                assert torch.equal(v[..., :n, :], torch.from_numpy(v_hat))
            if cfg.key_scheme == "headq":
                q = torch.randn(k.shape[0], 9, 2, HEAD_DIM, generator=torch.Generator().manual_seed(3))
                expected = codec.score_correction(q.numpy(), ck)
                np.testing.assert_array_equal(layer.correction(q).numpy(), expected)


def _fed(cfg, k, v, layers=2, record=False):
    """A cache fed ``k, v`` in one update per layer (after ``activate_past_recording`` if ``record``)."""
    qc = QuantizedKVCache(cfg, layers)
    if record:
        qc.activate_past_recording()
    for i in range(layers):
        qc.update(k, v, i)
    _STATE.set(None)
    return qc


def _same_state(a, b):
    """Two caches hold the same tokens the same way: positions, codes (every part), full-precision
    tensors, bytes."""
    for la, lb in zip(a.layers, b.layers):
        assert (la.seen, la.start, la.q_start, la.quantized) == (lb.seen, lb.start, lb.q_start, lb.quantized)
        assert la.nbytes() == lb.nbytes()
        ta, tb = la._tensors(), lb._tensors()
        assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)
        for ca, cb in zip(la.chunks_k + la.chunks_v, lb.chunks_k + lb.chunks_v):
            assert (ca is None) == (cb is None)
            if ca is not None:
                assert ca.parts.keys() == cb.parts.keys() and ca.shape == cb.shape
                assert all(np.array_equal(ca.parts[n], cb.parts[n]) for n in ca.parts)
        assert len(la.chunks_k) == len(lb.chunks_k) and len(la.chunks_v) == len(lb.chunks_v)


CROP_WITH_SINKS = CROP_SCHEMES + [
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4, sink_tokens=3), id="kqv-sinks"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=8, sink_tokens=2), id="kivi-sinks"),
]


@pytest.mark.parametrize("cfg", CROP_WITH_SINKS)
@pytest.mark.parametrize("remove", [1, 6, 9, 17, 28, 30])
def test_crop_returns_to_the_state_of_a_fresh_cache(cfg, remove):
    """With past recording (as transformers' assisted generation sets it) a crop of any depth,
    inside the window or across it and the KIVI groups, leaves exactly the state of a cache
    fed only the kept tokens: the tokens it holds in full precision are full precision again."""
    k, v = _kv(batch=3, tokens=30)
    qc = _fed(cfg, k, v, record=True)
    assert qc.layers[0].pending_k is not None  # the originals of the quantized tokens, kept for a rollback
    qc.crop(-remove)
    keep = 30 - remove
    if keep >= cfg.sink_tokens:
        _same_state(qc, _fed(cfg, k[..., :keep, :], v[..., :keep, :]))
    assert qc.get_seq_length() == keep and qc.layers[0].pending_k is None
    # and decoding continues from there like a fresh cache (fed the same tokens one update apart)
    k2, v2 = _kv(batch=3, tokens=35, seed=5)
    k_all, v_all = torch.cat([k[..., :keep, :], k2], -2), torch.cat([v[..., :keep, :], v2], -2)
    for i in range(2):
        qc.update(k2, v2, i)
    qc.crop(0)
    _same_state(qc, _fed(cfg, k_all, v_all))


@pytest.mark.parametrize("cfg", CROP_SCHEMES)
def test_crop_without_past_recording_refuses_what_it_cannot_restore(cfg):
    k, v = _kv(batch=2, tokens=30)
    qc = _fed(cfg, k, v)
    assert qc.layers[0].pending_k is None  # nothing kept beyond the codes
    with pytest.raises(KvqrsError, match="activate_past_recording"):
        qc.crop(-9)
    # a crop inside the window that keeps every code (a KIVI group not yet due) needs no original
    grouped = QuantConfig("kivi", 2, "kivi", 2, residual_length=4, group=8)
    qc = _fed(grouped, k, v)
    assert qc.layers[0].quantized == 24 == grouped.quantized_count(29)
    qc.crop(-1)
    _same_state(qc, _fed(grouped, k[..., :29, :], v[..., :29, :]))


def test_crop_keeps_the_headq_correction_of_kept_groups():
    cfg = QuantConfig("headq", 2, residual_length=0, headq_base="kivi", group=8, bases="random")
    k, v = _kv(batch=1, tokens=32)
    layer = CompressedLayer(cfg, 0)
    layer.activate_past_recording()
    layer.update(k, v)
    q = torch.randn(1, 9, 2, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    before = layer.correction(q)
    assert before.abs().max() > 0.05  # a real correction to lose
    layer.crop(-4)  # keep 28 -> 24 coded tokens (3 groups of 8), 4 back in full precision
    after = layer.correction(q)
    assert layer.quantized == 24 and layer.keys.shape[-2] == 4
    np.testing.assert_allclose(after.numpy(), before[..., : after.shape[-1]].numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg", CROP_SCHEMES)
def test_crop_everything_and_restart(cfg):
    k, v = _kv(batch=3, tokens=20)
    qc, dc = _pair(cfg, k, v)
    with pytest.raises(KvqrsError, match="cannot remove 25 tokens"):
        qc.crop(-25)  # more than it holds
    qc.crop(-20)
    dc.crop(-20)
    assert qc.get_seq_length() == dc.get_seq_length() == 0
    assert qc.layers[0].quantized == 0 and qc.nbytes() == 0
    for i in range(2):
        qc.update(k, v, i)
        dc.update(k, v, i)
    _check_against_dynamic(qc, dc, cfg)


def test_crop_conventions():
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=2)
    k, v = _kv(tokens=10)
    layer = CompressedLayer(cfg, 0)
    layer.update(k, v)
    before = [t.clone() for t in layer.materialize()]
    layer.crop(0)
    assert all(torch.equal(a, b) for a, b in zip(layer.materialize(), before))
    with pytest.raises(ValueError, match="negative"):
        layer.crop(5)  # transformers' layers refuse the legacy absolute length too
    CompressedLayer(cfg, 0).crop(-3)  # uninitialized: nothing to do


BATCH_OPS = [
    pytest.param("reorder_cache", lambda: torch.tensor([2, 0, 1]), id="reorder"),
    pytest.param("reorder_cache", lambda: torch.tensor([1, 1, 2]), id="reorder-dup"),
    pytest.param("batch_select_indices", lambda: torch.tensor([2, 0]), id="select"),
    pytest.param("batch_select_indices", lambda: torch.tensor([1]), id="select-one"),
    pytest.param("batch_select_indices", lambda: torch.tensor([True, False, True]), id="select-mask"),
    pytest.param("batch_select_indices", lambda: torch.tensor([-1, 0]), id="select-negative"),
    pytest.param("batch_repeat_interleave", lambda: 2, id="repeat"),
]


@pytest.mark.parametrize("cfg", CROP_SCHEMES)
@pytest.mark.parametrize("op,arg", BATCH_OPS)
def test_batch_operations_against_dynamic_cache(cfg, op, arg):
    k, v = _kv(batch=3, tokens=20, seed=11)
    qc, dc = _pair(cfg, k, v)
    getattr(qc, op)(arg())
    getattr(dc, op)(arg())
    assert qc.layers[0].quantized == cfg.quantized_count(20) > 0
    for layer in qc.layers:
        assert all(c.shape[0] == dc.layers[0].keys.shape[0] for c in layer.chunks_k)
    _check_against_dynamic(qc, dc, cfg)
    # and the selected rows keep decoding
    b = dc.layers[0].keys.shape[0]
    k2, v2 = _kv(batch=b, tokens=2, seed=12)
    for i in range(2):
        qc.update(k2, v2, i)
        dc.update(k2, v2, i)
    _check_against_dynamic(qc, dc, cfg)


@pytest.mark.parametrize(
    "bad", [torch.tensor([5]), torch.tensor([-3]), torch.tensor([[0]]), torch.tensor([True, False, True]), torch.tensor([0.0])]
)
def test_batch_select_rejects_bad_indices(bad):
    layer = CompressedLayer(QuantConfig("kqv", 3, "kqv", 3), 0)
    k, v = _kv(batch=2, tokens=5)
    layer.update(k, v)
    with pytest.raises(KvqrsError, match="indices"):
        layer.batch_select_indices(bad)
