"""What a cache holds and what it writes: ``nbytes()`` against its parts and window, by hand and
against a dense cache, nothing hidden; save / load and to_bytes / from_bytes round trips (model
dtypes, HeadQ bases, an empty layer, least-squares value scales, sink dtypes), loads under
other settings and altered or truncated bytes refused, and a loaded, copied or pickled prefix
continuing SmolLM2 as the original does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvqrs import KvqrsError  # noqa: E402
from kvqrs import format as fmt  # noqa: E402
from kvqrs.hf import CompressedLayer, QuantConfig, QuantizedKVCache  # noqa: E402
from kvqrs.hf.attention import _STATE  # noqa: E402
from kvqrs.schemes import KVCodec  # noqa: E402

from tests.hf.cache_cases import CROP_SCHEMES, GROUPED, HEAD_DIM, PER_TOKEN, TEXT, _dense_bytes, _kv, _layers, _pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("isolated_attention_state")

# Compressed cache bytes vs a dense float32 cache of the same content, for an n-bit scheme with no
# full-precision window: n bits per element plus at most 1 bit of side data (norms: 16 bits per 64
# elements = 0.25; KIVI / block scale + zero point per 32 elements = 1.0; QJL norms 0.25).
SIDE_BITS_MAX = 1.0


# --- memory ------------------------------------------------------------------------------------


NBYTES_SCHEMES = CROP_SCHEMES + [pytest.param(QuantConfig("headq", 2, residual_length=3, bases="random"), id="headq-kivi")]


@pytest.mark.parametrize("cfg", NBYTES_SCHEMES)
def test_nbytes_is_parts_plus_window(cfg):
    k, v = _kv(batch=2, tokens=45)
    qc, _ = _pair(cfg, k, v)
    total = 0
    for layer in qc.layers:
        n = layer.quantized
        assert n > 0
        parts = sum(np.asarray(p).nbytes for c in layer.chunks_k + layer.chunks_v for p in c.parts.values())
        window = (layer.keys.numel() + layer.values.numel()) * 4
        fp_values = 0 if cfg.value_scheme is not None else 2 * 3 * n * HEAD_DIM * 4  # key-only: values stay float32
        assert layer.nbytes() == parts + window + fp_values
        total += parts + window + fp_values
    assert qc.nbytes() == total
    assert QuantizedKVCache(cfg, 2).nbytes() == 0


def test_nbytes_by_hand_kqv3():
    # kqv 3-bit keys: 64 codes x 3 bits = 24 bytes + a float16 norm; qkqv-style 3-bit values:
    # 64 x 2-bit codes = 16 bytes + float16 norm + 64 QJL sign bits = 8 bytes + float16 QJL norm.
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=4)
    layer = CompressedLayer(cfg, 0)
    layer.update(*_kv(batch=2, tokens=75))
    rows = 2 * 3
    assert layer.nbytes() == rows * 71 * ((24 + 2) + (16 + 2 + 8 + 2)) + rows * 4 * HEAD_DIM * 4 * 2


@pytest.mark.parametrize(
    "scheme,bits",
    [
        ("kv", 2),
        ("kv", 4),
        ("kqv", 2),
        ("kqv", 3),
        ("kqv", 4),
        ("qkqv", 2),
        ("qkqv", 3),
        ("qkqv", 4),
        ("kivi", 2),
        ("kivi", 4),
        ("block", 4),
    ],
)
def test_nbytes_smaller_than_dense(scheme, bits):
    cfg = QuantConfig(scheme, bits, scheme, bits, residual_length=0)
    k, v = _kv(batch=2, tokens=64)
    qc, dc = _pair(cfg, k, v)
    dense = _dense_bytes(dc)
    assert qc.nbytes() < dense
    assert qc.nbytes() <= dense * (bits + SIDE_BITS_MAX) / 32


def test_layer_does_not_keep_the_decoded_keys_alive():
    layer = CompressedLayer(QuantConfig("kqv", 3, "kqv", 3, residual_length=2), 0)
    k, v = _kv(tokens=20)
    rk, _ = layer.update(k, v)
    assert layer._returned() is rk
    del rk
    import gc

    gc.collect()
    assert layer._returned() is None  # nbytes() counts what the cache holds, nothing hidden


# --- the compressed-cache format: save / load a whole cache ---------------------------------------


def _filled_cache(cfg, layers=2, tokens=70, dtype=torch.float32):
    cache = QuantizedKVCache(cfg, layers)
    for i in range(layers):
        k, v = _kv(tokens=tokens, seed=10 + i, dtype=dtype)
        cache.update(k, v, i)
    _STATE.set(None)
    return cache


def _layers_equal(a, b):
    for la, lb in zip(a.layers, b.layers):
        assert la.is_initialized == lb.is_initialized
        if not la.is_initialized:
            continue
        ka, va = la.materialize()
        kb, vb = lb.materialize()
        assert torch.equal(ka, kb) and torch.equal(va, vb) and la.quantized == lb.quantized


@pytest.mark.parametrize("cfg", PER_TOKEN + GROUPED)
def test_cache_save_load_round_trip(cfg, tmp_path):
    cache = _filled_cache(cfg)
    cache.save(tmp_path / "c.kvqc")
    back = QuantizedKVCache.load(tmp_path / "c.kvqc")
    assert back.config.label() == cfg.label() and back.nbytes() == cache.nbytes()
    _layers_equal(cache, back)
    # Both continue identically: the next tokens flush the same chunks.
    k, v = _kv(tokens=40, seed=99)
    for c in (cache, back):
        c.update(k, v, 0)
    _STATE.set(None)
    _layers_equal(cache, back)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_save_load_keeps_the_model_dtype(dtype):
    cache = _filled_cache(QuantConfig("kqv", 3, residual_length=4), dtype=dtype)
    back = QuantizedKVCache.from_bytes(cache.to_bytes())
    assert back.layers[0].keys.dtype == dtype and back.layers[0].fp_values_quantized.dtype == dtype
    _layers_equal(cache, back)


def test_cache_with_calibrated_bases_and_an_empty_layer():
    rng = np.random.default_rng(0)
    bases = {i: np.stack([np.linalg.qr(rng.standard_normal((HEAD_DIM, 4)))[0] for _ in range(3)]).astype(np.float32) for i in range(3)}
    cfg = QuantConfig("headq", 2, residual_length=3, headq_base="kqv", bases=bases)
    cache = _filled_cache(cfg, layers=2)
    cache.layers.append(CompressedLayer(cfg, 2))  # a layer the model never reached
    back = QuantizedKVCache.from_bytes(cache.to_bytes(), cfg)
    assert not back.layers[2].is_initialized
    _layers_equal(cache, back)
    other = {i: b[:, ::-1].copy() for i, b in bases.items()}
    with pytest.raises(KvqrsError, match="bases"):
        QuantizedKVCache.from_bytes(cache.to_bytes(), QuantConfig("headq", 2, residual_length=3, headq_base="kqv", bases=other))


@pytest.mark.parametrize(
    "other",
    [
        QuantConfig("kqv", 3, "kqv", 3, residual_length=4, seed=1),
        QuantConfig("kqv", 4, "kqv", 4, residual_length=4),
        QuantConfig("kqv", 3, "kqv", 3, residual_length=5),
        QuantConfig("qkqv", 3, "qkqv", 3, residual_length=4),
    ],
)
def test_cache_load_under_other_settings_raises(other):
    data = _filled_cache(QuantConfig("kqv", 3, "kqv", 3, residual_length=4)).to_bytes()
    with pytest.raises(KvqrsError, match="other settings"):
        QuantizedKVCache.from_bytes(data, other)


def test_cache_load_with_a_config_that_is_not_a_quant_config_raises():
    data = _filled_cache(QuantConfig("kqv", 3, "kqv", 3, residual_length=4)).to_bytes()
    with pytest.raises(KvqrsError, match="config: expected a QuantConfig or None, got dict"):
        QuantizedKVCache.from_bytes(data, {"key_scheme": "kqv"})


def test_cache_bytes_altered_or_truncated_raise():
    data = _filled_cache(QuantConfig("kivi", 2, "kivi", 2, residual_length=5), tokens=40).to_bytes()
    rng = np.random.default_rng(3)
    for i in rng.integers(0, len(data), 200):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(KvqrsError):
            QuantizedKVCache.from_bytes(bytes(bad))
    for n in rng.integers(0, len(data), 100):
        with pytest.raises(KvqrsError):
            QuantizedKVCache.from_bytes(data[:n])
    with pytest.raises(KvqrsError, match="not a kvqrs-cache-v3"):
        QuantizedKVCache.from_bytes(fmt.dumps(KVCodec("kqv", 3, 8).encode_keys(np.ones((2, 8), np.float32))))


def test_loaded_cache_continues_the_model_identically(model32, tmp_path):
    model, tok = model32
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :40]
    # fused=False: both caches read through the same (decode) path, so equality is exact; a
    # loaded layer takes the fused path only after the kvqrs attention has served it once.
    cfg = QuantConfig("kqv", 3, "kqv", 3, residual_length=8, fused=False)
    cache = QuantizedKVCache(cfg, _layers(model))
    with torch.no_grad():
        model(ids[:, :32], cache=cache, use_cache=True)
    cache.save(tmp_path / "prefix.kvqc")
    loaded = QuantizedKVCache.load(tmp_path / "prefix.kvqc", cfg)
    with torch.no_grad():
        steps = [[model(ids[:, t : t + 1], cache=c, use_cache=True).logits for t in range(32, 40)] for c in (cache, loaded)]
    for a, b in zip(*steps):
        assert torch.equal(a, b)


def test_a_deep_copied_or_pickled_prefix_continues_like_the_original(model32):
    """transformers' prefix reuse deep-copies a prefilled cache for each continuation: the copy
    (and a pickled one) holds the same bytes, continues the model as the original does, and
    continuing it leaves the original untouched."""
    import copy
    import pickle

    model, tok = model32
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :40]
    cache = QuantizedKVCache(QuantConfig("kivi", 2, "kivi", 2, residual_length=8, group=8, fused=False), _layers(model))
    with torch.no_grad():
        model(ids[:, :32], cache=cache, use_cache=True)
    prefix = cache.to_bytes()
    copies = [copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))]
    assert all(type(c) is QuantizedKVCache and c.to_bytes() == prefix for c in copies)
    with torch.no_grad():
        steps = [[model(ids[:, t : t + 1], cache=c, use_cache=True).logits for t in range(32, 40)] for c in copies]
        assert cache.to_bytes() == prefix  # the copies' steps did not touch the original
        steps.append([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(32, 40)])
    for a, b, c in zip(*steps):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(QuantConfig("kv", 2, "kv", 2, residual_length=3, value_scale="least_squares"), id="kv"),
        pytest.param(QuantConfig("kqv", 3, "kqv", 3, residual_length=4, value_scale="least_squares"), id="kqv"),
        pytest.param(
            QuantConfig("matched", 3, "matched", 3, residual_length=2, group=8, calibration="random", value_scale="least_squares"),
            id="matched",
        ),
    ],
)
def test_least_squares_value_scale_cache_round_trip(cfg):
    """A cache written with value_scale="least_squares" loads (the setting travels in the config)
    and decodes identically; the same tokens under the norm setting store other scales in the
    same layout, and the file refuses to load under that setting."""
    import dataclasses

    assert cfg.label().endswith("[ls-scale]")
    cache = _filled_cache(cfg)
    data = cache.to_bytes()
    back = QuantizedKVCache.from_bytes(data)
    assert back.config.value_scale == "least_squares" and back.nbytes() == cache.nbytes()
    _layers_equal(cache, back)
    norm_cfg = dataclasses.replace(cfg, value_scale="norm")
    assert _filled_cache(norm_cfg).nbytes() == cache.nbytes()
    with pytest.raises(KvqrsError, match="other settings"):
        QuantizedKVCache.from_bytes(data, norm_cfg)


def test_cache_saved_with_a_sink_dtype_and_no_sinks_still_loads(tmp_path):
    """A cache saved with a sink dtype and no sinks (a config refused since) loads, without the
    sink dtype: it held only empty sink tensors in it."""
    cfg = QuantConfig("kqv", 4, "kqv", 4, residual_length=4)
    object.__setattr__(cfg, "sink_dtype", "float16")  # what such a config was, past the check added since
    k, v = _kv(tokens=20, seed=7)
    old = QuantizedKVCache(cfg, 1)
    old.update(k, v, 0)
    assert old.layers[0].sink_k.dtype == torch.float16 and old.layers[0].sink_k.shape[-2] == 0
    old.save(tmp_path / "old.kvqc")
    back = QuantizedKVCache.load(tmp_path / "old.kvqc")
    assert back.config.sink_dtype is None and back.layers[0].sink_k.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(back.layers[0].materialize(), old.layers[0].materialize()))


def test_sinks_stored_in_sink_dtype_are_read_back_in_the_layer_dtype(tmp_path):
    """``sink_dtype``: the sinks held in float16 (half the bytes), read back as float32 values
    rounded once, the same through a save and load; other dtypes are refused."""
    cfg = QuantConfig("kqv", 4, "kqv", 4, residual_length=4, sink_tokens=3, sink_dtype="float16")
    plain = QuantConfig("kqv", 4, "kqv", 4, residual_length=4, sink_tokens=3)
    k, v = _kv(tokens=20, seed=7)
    caches = [QuantizedKVCache(c, 1) for c in (cfg, plain)]
    for c in caches:
        c.update(k, v, 0)
    half, full = (c.layers[0] for c in caches)
    assert half.sink_k.dtype == torch.float16 and full.sink_k.dtype == torch.float32
    assert full.nbytes() - half.nbytes() == 2 * k[..., :3, :].numel() * 2
    hk, hv = half.materialize()
    assert hk.dtype == torch.float32
    torch.testing.assert_close(hk[..., :3, :], k[..., :3, :].half().float(), rtol=0, atol=0)
    torch.testing.assert_close(hv[..., 3:, :], full.materialize()[1][..., 3:, :], rtol=0, atol=0)
    assert not torch.equal(hk[..., :3, :], k[..., :3, :])
    caches[0].save(tmp_path / "s.kvqc")
    back = QuantizedKVCache.load(tmp_path / "s.kvqc", cfg)
    assert back.layers[0].sink_k.dtype == torch.float16
    assert all(torch.equal(a, b) for a, b in zip(back.layers[0].materialize(), half.materialize()))
    with pytest.raises(KvqrsError, match="sink_dtype: expected None or one of"):
        QuantConfig("kqv", 4, sink_tokens=1, sink_dtype="float8")
    big = QuantizedKVCache(cfg, 1)
    with pytest.raises(KvqrsError, match="beyond float16's range; use sink_dtype='bfloat16'"):
        big.update(k * 1e5, v, 0)
    # Refused before anything is stored: the cache takes the next prompt as its first.
    assert big.get_seq_length() == 0
    big.update(k, v, 0)
    assert all(torch.equal(a, b) for a, b in zip(big.layers[0].materialize(), half.materialize()))
