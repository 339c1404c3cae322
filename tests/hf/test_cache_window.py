"""``CompressedLayer``'s schedule and full-precision window, on synthetic keys and values: which
tokens are quantized, the window after a prefill, streaming one token at a time = one update,
what an update returns, dtypes, reset; the in-place window buffer against joining the window
at every step (full and sliding layers, rollback, batch selection), KIVI groups of whole bytes
step after step, log-coded norms flushing whole groups."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache  # noqa: E402

from tests.hf.cache_cases import GROUPED, HEAD_DIM, PER_TOKEN, _kv  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")


def test_quantized_count_by_hand():
    assert QuantConfig("kqv", 3, residual_length=5).chunk == 1
    assert QuantConfig("kivi", 2).chunk == 32
    assert QuantConfig("headq", 2, headq_base="kivi").chunk == 32
    assert QuantConfig("headq", 2, headq_base="kqv").chunk == 1
    assert QuantConfig("kivi", 2, group=16).chunk == 16
    per_token = QuantConfig("kqv", 3, residual_length=5)
    assert [per_token.quantized_count(s) for s in (0, 5, 6, 70)] == [0, 0, 1, 65]
    kivi = QuantConfig("kivi", 2, residual_length=5)
    assert [kivi.quantized_count(s) for s in (0, 36, 37, 69, 70)] == [0, 0, 32, 64, 64]
    with pytest.raises(KvqrsError):
        QuantConfig("kqv", 3, residual_length=-1)


@pytest.mark.parametrize(
    "cfg",
    [
        QuantConfig("kqv", 3, residual_length=5),
        QuantConfig("kivi", 2, residual_length=3, sink_tokens=2, group=8),
        QuantConfig("kivi", 2),
        QuantConfig("matched", 2, group=128, sink_tokens=1, calibration="random"),
    ],
)
def test_quantized_ends_equal_quantized_span(cfg):
    seen = np.arange(0, 400)
    assert cfg.quantized_ends(seen).tolist() == [cfg.quantized_span(int(n))[1] for n in seen]


@pytest.mark.parametrize("scheme", ["kqv", "kivi"])
@pytest.mark.parametrize("residual", [0, 5, 40])
@pytest.mark.parametrize("tokens", [1, 5, 31, 32, 33, 64, 70])
def test_prefill_window(scheme, residual, tokens):
    cfg = QuantConfig(scheme, 2, scheme, 2, residual_length=residual)
    chunk = 32 if scheme == "kivi" else 1
    expected = max(0, (tokens - residual) // chunk * chunk)
    k, v = _kv(tokens=tokens)
    layer = CompressedLayer(cfg, 0)
    rk, rv = layer.update(k, v)
    assert layer.quantized == cfg.quantized_count(tokens) == expected
    assert layer.keys.shape[-2] == layer.values.shape[-2] == tokens - expected
    assert layer.get_seq_length() == tokens
    assert rk.shape == k.shape and rv.shape == v.shape
    # the window is the newest tokens, untouched
    assert torch.equal(layer.keys, k[..., expected:, :]) and torch.equal(layer.values, v[..., expected:, :])
    assert sum(c.shape[-2] for c in layer.chunks_k) == expected


@pytest.mark.parametrize("cfg", PER_TOKEN + GROUPED)
def test_streaming_equals_one_shot_prefill(cfg):
    tokens = 70
    k, v = _kv(tokens=tokens, seed=1)
    one = CompressedLayer(cfg, 0)
    one.update(k, v)
    stream = CompressedLayer(cfg, 0)
    for t in range(tokens):
        rk, rv = stream.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
        assert stream.quantized == cfg.quantized_count(t + 1)
        assert rk.shape[-2] == rv.shape[-2] == t + 1
    assert one.quantized == stream.quantized > 0
    assert len(one.chunks_k) == len(stream.chunks_k) == 1
    for a, b in zip(one.chunks_k + one.chunks_v, stream.chunks_k + stream.chunks_v):
        assert a.shape == b.shape and a.parts.keys() == b.parts.keys()
        for name in a.parts:
            pa, pb = np.asarray(a.parts[name]), np.asarray(b.parts[name])
            assert pa.dtype == pb.dtype and pa.shape == pb.shape
            assert pa.tobytes() == pb.tobytes(), f"part {name} differs"
    assert torch.equal(one.keys, stream.keys) and torch.equal(one.values, stream.values)
    for x, y in zip(one.materialize(), stream.materialize()):
        assert torch.equal(x, y)


@pytest.mark.parametrize("cfg", PER_TOKEN + GROUPED)
def test_update_returns_window_exact_and_quantized_part_decoded(cfg):
    k, v = _kv(tokens=45, seed=2)
    layer = CompressedLayer(cfg, 0)
    rk, rv = layer.update(k, v)
    n = layer.quantized
    assert n > 0
    codec = cfg.codec(0, HEAD_DIM)
    k_hat = torch.from_numpy(codec.decode_keys(codec.encode_keys(k[..., :n, :].numpy()), base_only=True))
    assert torch.equal(rk[..., :n, :], k_hat)
    assert not torch.equal(rk[..., :n, :], k[..., :n, :])  # really quantized
    assert torch.equal(rk[..., n:, :], k[..., n:, :])
    if codec.values is None:
        assert torch.equal(rv, v)
    else:
        v_hat = torch.from_numpy(codec.decode_values(codec.encode_values(v[..., :n, :].numpy())))
        assert torch.equal(rv[..., :n, :], v_hat)
        assert torch.equal(rv[..., n:, :], v[..., n:, :])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_update_keeps_dtype(dtype):
    k, v = _kv(tokens=12, dtype=dtype)
    layer = CompressedLayer(QuantConfig("kqv", 4, "kqv", 4, residual_length=3), 0)
    rk, rv = layer.update(k, v)
    assert rk.dtype == rv.dtype == dtype
    assert torch.equal(rk[..., 9:, :], k[..., 9:, :])


def test_reset_then_reuse_equals_fresh_layer():
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=2)
    k, v = _kv(tokens=10)
    layer = CompressedLayer(cfg, 0)
    layer.update(*_kv(tokens=20, seed=9))
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.nbytes() == 0
    a = layer.update(k, v)
    b = CompressedLayer(cfg, 0).update(k, v)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


WINDOW_CASES = [
    pytest.param(QuantConfig("kqv", 4, "kqv", 4, residual_length=4), None, id="kqv"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=3, group=8, sink_tokens=2), None, id="kivi-sinks"),
    pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=2, sink_tokens=1), 7, id="kqv-sliding"),
    pytest.param(QuantConfig("kivi", 2, "kivi", 2, residual_length=2, group=4), 9, id="kivi-sliding"),
    pytest.param(QuantConfig("kqv", 4, residual_length=3), None, id="kqv-keyonly"),
]


def _window_script(cfg: QuantConfig, window: int | None, buffered: bool) -> tuple[list, CompressedLayer]:
    """A layer fed a prompt, decode steps, a rollback under past recording, a batch selection
    and a long prompt after them; returns what each update returned (copies) and the layer.
    Checks that every tensor handed out kept its values (the buffer never writes below the
    window's end) and that a long prompt's buffer did not outlive the next step."""
    layer = CompressedLayer(cfg, 0, window)
    rng = np.random.default_rng(3)
    returned, handed = [], []

    def step(t):
        b = layer.keys.shape[0] if layer.is_initialized else 2
        k, v = (torch.from_numpy(rng.standard_normal((b, 3, t, 16)).astype(np.float32)) for _ in "kv")
        rk, rv = layer.update(k.transpose(2, 1).contiguous().transpose(2, 1), v)  # strided keys, as models hand them
        handed.append((rk, rk.clone(), rv, rv.clone()))
        returned.append((rk.clone(), rv.clone()))

    for t in (9, 1, 1):
        step(t)
    layer.activate_past_recording(recurrent_states_to_keep=3)  # the crop below reaches past the latest update
    step(3)
    step(1)
    layer.crop(-3)
    step(1)
    layer.batch_select_indices(torch.tensor([1, 0, 1]))
    for t in (2, 60, 1, 1):
        step(t)
    assert all(torch.equal(a, ca) and torch.equal(b, cb) for a, ca, b, cb in handed)
    assert (layer._window is not None) == buffered
    if buffered:
        assert layer._window.cap <= 4 * layer.keys.shape[-2] + 72
    return returned, layer


@pytest.mark.parametrize("cfg, window", WINDOW_CASES)
def test_the_window_buffer_holds_what_joining_the_window_holds(cfg, window, monkeypatch):
    """A float32 CPU layer writes new tokens in place into its window's buffer; a layer that
    joins the window at every step (the path of other dtypes) returns and holds the same
    tensors, bit for bit, through :func:`_window_script`."""
    import kvqrs.hf.layer as layer_mod

    ret_a, a = _window_script(cfg, window, True)
    monkeypatch.setattr(layer_mod, "_plain_f32", lambda *ts: False)
    ret_b, b = _window_script(cfg, window, False)
    for (ka, va), (kb, vb) in zip(ret_a, ret_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert a.positions() == b.positions()
    ta, tb = a._tensors(), b._tensors()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[n], tb[n]) for n in ta)
    for ea, eb in zip([*a.chunks_k, *a.chunks_v], [*b.chunks_k, *b.chunks_v]):
        assert all(np.array_equal(ea.parts[n], eb.parts[n]) for n in ea.parts)


def test_a_non_finite_token_leaves_the_window_buffer_as_it_was():
    layer = CompressedLayer(QuantConfig("kqv", 4, "kqv", 4, residual_length=4), 0)
    k = torch.randn(2, 3, 6, 16)
    layer.update(k, k)
    before = layer.keys.clone()
    bad = torch.randn(2, 3, 1, 16)
    bad[1, 2, 0, 5] = float("inf")
    with pytest.raises(KvqrsError, match=r"value_states: expected finite values, got inf at index \(1, 2, 0, 5\)"):
        layer.update(torch.randn(2, 3, 1, 16), bad)
    assert layer.seen == 6 and torch.equal(layer.keys, before)
    layer.update(bad.nan_to_num(posinf=0.0), bad.nan_to_num(posinf=0.0))  # 5 in the window: the oldest is flushed
    assert layer.seen == 7 and torch.equal(layer.keys[..., :-1, :], before[..., 1:, :])


def test_new_tokens_that_share_the_window_buffer_append_as_copies():
    """States that are views of the layer's own window (its buffer) are read before the
    buffer is written: the window is what joining copies of them gives."""
    layer = CompressedLayer(QuantConfig("kivi", 2, "kivi", 2, residual_length=8, group=4), 0)
    k = torch.randn(1, 2, 5, 16)
    layer.update(k, k)
    own_k, own_v = layer.keys[..., 1:3, :], layer.values[..., 2:4, :]
    want_k, want_v = torch.cat([layer.keys, own_k], dim=-2), torch.cat([layer.values, own_v], dim=-2)
    layer.update(own_k, own_v)
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)


@pytest.mark.parametrize("bits,group", [(2, 12), (4, 6), (3, 8)])
def test_kivi_groups_of_whole_bytes_join_step_after_step(bits, group):
    """Groups whose codes fill whole bytes (group x bits a multiple of 8, not group itself) keep
    joining the cache one decode step at a time, the codes equal to one encoding of them."""
    cache = QuantizedKVCache(QuantConfig("kivi", bits, "kivi", bits, group=group, residual_length=3), 1)
    gen = torch.Generator().manual_seed(bits * group)
    k, v = torch.randn(1, 2, 5, 64, generator=gen), torch.randn(1, 2, 5, 64, generator=gen)
    cache.update(k, v, 0)
    for _ in range(6 * group):
        k1, v1 = torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen)
        cache.update(k1, v1, 0)
        k, v = torch.cat([k, k1], dim=-2), torch.cat([v, v1], dim=-2)
    layer = cache.layers[0]
    assert layer.quantized >= 5 * group
    codec = layer.codec()
    want = codec.decode_keys(codec.encode_keys(k[..., : layer.quantized, :].numpy()))
    got, _ = layer.materialize(layer.view(0))
    torch.testing.assert_close(got[..., : layer.quantized, :], torch.from_numpy(want), rtol=0, atol=0)


def test_log8_value_norms_flush_whole_groups():
    """Log-coded norms share an exponent per group of tokens: the cache flushes whole groups
    whatever the keys (values alone too)."""
    assert QuantConfig("kqv", 3, "kv", 3, group=8, value_norms="log8").chunk == 8
    assert QuantConfig(None, 3, "kv", 3, group=8, value_norms="log8").chunk == 8
    assert QuantConfig("kqv", 3, "kv", 3, group=8).chunk == 1
