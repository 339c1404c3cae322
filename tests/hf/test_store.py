"""The layer store (``kvqrs.hf.store.CodeStore`` over ``kvqrs._native.LayerStore``): appends,
cuts and batch selections equal the joined, sliced and indexed ``Encoded`` parts of every
scheme the cache holds (``KVCodec.concat`` / ``slice_tokens`` as the reference), bit for bit;
its one-call decode step equals the fused kernel over the joined codes merged with a float64
softmax over the full-precision tokens; the saved format of the previous version still loads;
bad input raises ``KvqrsError`` naming the problem."""

from __future__ import annotations

import dataclasses
import json
from collections import namedtuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvqrs import KvqrsError, _native  # noqa: E402
from kvqrs import format as fmt  # noqa: E402
from kvqrs.hf import QuantConfig, QuantizedKVCache  # noqa: E402
from kvqrs.hf.attention import _STATE  # noqa: E402
from kvqrs.hf.store import CodeStore, StorePart, WindowRows, attend_full_precision  # noqa: E402
from kvqrs.kernels.attention import (  # noqa: E402
    CentredRows,
    ChannelRun,
    ChannelRunRows,
    DenseRows,
    MSERows,
    UniformRows,
    binding_rows,
    by_name,
    decode_attention,
    map_parts,
)
from kvqrs.layout import PartRef  # noqa: E402
from kvqrs.schemes.matched import MatchedBasis, MatchedCalibration, random_calibration  # noqa: E402

from tests.cache_helpers import per_head_matched_calibration  # noqa: E402
from tests.process_helpers import stdout_per_thread_count  # noqa: E402

D = 32
CONFIGS = {
    "kv": QuantConfig("kv", 2, "kv", 3),
    "kqv": QuantConfig("kqv", 4, "kqv", 4),
    "qkqv": QuantConfig("qkqv", 3, "qkqv", 2),
    "block": QuantConfig("block", 4, "block", 4, group=16),
    "kivi": QuantConfig("kivi", 2, "kivi", 3, group=8),
    "kqv-keyonly": QuantConfig("kqv", 4),
    "headq-kqv": QuantConfig("headq", 2, "kivi", 2, headq_base="kqv", bases="random"),
    "headq-kivi": QuantConfig("headq", 3, group=8, bases="random"),
    "matched": QuantConfig("matched", 3, "matched", 3, group=8, calibration="random"),
}

# The decode step's configs besides CONFIGS: matched with a calibration per KV head (2 heads)
# and transform-coded values, and matched keys with full-precision values.
STEP_CONFIGS = {
    **CONFIGS,
    "matched-per-head": QuantConfig("matched", 3, "matched", 3, group=8, calibration={0: per_head_matched_calibration(2, D, 5)}),
    "matched-keyonly": QuantConfig("matched", 3, group=8, calibration="random"),
    "matched-log8": QuantConfig(
        "matched", 3, "matched", 3, group=8, calibration="random", value_norms="log8", value_scale="preserve_norm", sink_tokens=1
    ),
}


def _with_deviations(cal: MatchedCalibration, seed: int) -> MatchedCalibration:
    """``cal`` with seeded key deviations: its keys take per-token scales
    (:class:`~kvqrs.schemes.matched_tokens.MatchedTokenCoder`)."""
    dev = np.random.default_rng(seed).uniform(0.2, 3.0, cal.keys.mean.shape).astype(np.float32)
    return dataclasses.replace(cal, keys=dataclasses.replace(cal.keys, deviations=dev))


# Matched keys with a float16 absmax scale per token (one calibrated head serving all, and one
# calibration per KV head, 2 heads), natively encoded ("token_runs").
TOKEN_CONFIGS = {
    "matched-tokens": QuantConfig("matched", 3, "matched", 3, group=8, calibration={0: _with_deviations(random_calibration(D, 3, 9), 1)}),
    "matched-tokens-per-head": QuantConfig(
        "matched", 3, "matched", 3, group=8, calibration={0: _with_deviations(per_head_matched_calibration(2, D, 5), 2)}
    ),
}
ALL_CONFIGS = {**STEP_CONFIGS, **TOKEN_CONFIGS}


def _x(batch, heads, tokens, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((batch, heads, tokens, D)) * scale).astype(np.float32)


def _encode(codec, k, v):
    return codec.encode_keys(k), (torch.from_numpy(v) if codec.values is None else codec.encode_values(v))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
        return
    assert a.shape == b.shape and a.parts.keys() == b.parts.keys() and a.params == b.params and a.seed == b.seed
    for name in a.parts:
        pa, pb = np.asarray(a.parts[name]), np.asarray(b.parts[name])
        assert pa.dtype == pb.dtype and pa.shape == pb.shape and pa.tobytes() == pb.tobytes(), name


def _join(codec, a, b):
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b], dim=-2)
    return codec.concat([a, b])


def _cut(codec, a, lo, hi):
    return a[..., lo:hi, :] if isinstance(a, torch.Tensor) else codec.slice_tokens(a, hi, lo)


def _rows(a, idx):
    if isinstance(a, torch.Tensor):
        return a[idx]
    parts = {n: np.ascontiguousarray(np.asarray(p)[idx]) for n, p in a.parts.items()}
    return type(a)(a.scheme, a.kind, (len(idx), *a.shape[1:]), a.dtype, parts, a.params, a.device, a.seed)


@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_store_operations_equal_joined_and_cut_codes(name, data):
    cfg = CONFIGS[name]
    codec = cfg.codec(0, D)
    step = cfg.chunk
    store = CodeStore(codec, 2, 3, D, torch.float32)
    ref_k = ref_v = None
    for i in range(data.draw(st.integers(1, 4), "chunks")):
        n = step * data.draw(st.integers(1, 3), f"groups {i}")
        # Some chunks hold values beyond float16's range: stored scalars widen to float32.
        scale = data.draw(st.sampled_from([1.0, 1e6]), f"scale {i}")
        ck, cv = _encode(codec, _x(2, 3, n, 2 * i, scale), _x(2, 3, n, 2 * i + 1, scale))
        store.append(ck, cv)
        ref_k = ck if ref_k is None else codec.concat([ref_k, ck])
        ref_v = cv if ref_v is None else _join(codec, ref_v, cv)
    _same(store.keys(), ref_k)
    _same(store.values(), ref_v)
    t = store.tokens
    lo = step * data.draw(st.integers(0, t // step), "lo")
    hi = data.draw(st.sampled_from(sorted({t, lo + (t - lo) // step * step})), "hi")
    store.keep(lo, hi)
    ref_k, ref_v = _cut(codec, ref_k, lo, hi), _cut(codec, ref_v, lo, hi)
    if hi > lo:
        _same(store.keys(), ref_k)
        _same(store.values(), ref_v)
    idx = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=4), "rows")
    store.select(idx)
    if hi > lo:
        _same(store.keys(), _rows(ref_k, idx))
        _same(store.values(), _rows(ref_v, idx))
    assert store.batch == len(idx) and store.nbytes() <= store.capacity_nbytes()


NATIVE_ENCODED = ("kv", "kqv", "qkqv", "kivi", "matched", "matched-per-head", "matched-log8")
"""The configs whose both sides have a native encoder (``CodeStore.encode_append``)."""


@pytest.mark.parametrize("name", list(STEP_CONFIGS))
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_encode_append_stores_the_bytes_of_the_codecs_encodes(name, data):
    """``CodeStore.encode_append`` (one native call) stores the bytes of ``append`` of the
    codec's encodes of the same float32 tokens, chunk after chunk: the first tokens of float16 /
    bfloat16 and strided windows, norms widened past float16 included. Configs without a native encoder on
    both sides store nothing and return False (their caller encodes in Python)."""
    cfg = STEP_CONFIGS[name]
    codec = cfg.codec(0, D)
    heads = 2 if name == "matched-per-head" else 3
    native, ref = CodeStore(codec, 2, heads, D, torch.float32), CodeStore(codec, 2, heads, D, torch.float32)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), "dtype")
    for i in range(data.draw(st.integers(1, 4), "chunks")):
        n = cfg.chunk * data.draw(st.integers(1, 3), f"tokens {i}")
        scale = data.draw(st.sampled_from([1.0, 1e3 if dtype == torch.float16 else 1e6]), f"scale {i}")
        w = n + data.draw(st.integers(0, 3), f"window {i}")  # a window holding more tokens than flushed
        k, v = (torch.from_numpy(_x(2, heads, 2 * w, 2 * i + j, scale)).to(dtype)[..., ::2, :] for j in (0, 1))
        done = native.encode_append(k, v, n)
        assert done == (name in NATIVE_ENCODED)
        if not done:
            assert native.tokens == 0
            return
        ref.append(*_encode(codec, k[..., :n, :].float().numpy(), v[..., :n, :].float().numpy()))
    _same(native.keys(), ref.keys())
    _same(native.values(), ref.values())


def test_a_native_encode_that_fails_stores_nothing_and_the_cache_names_the_error():
    codec = CONFIGS["kqv"].codec(0, D)
    store = CodeStore(codec, 1, 2, D, torch.float32)
    assert store.encode_append(torch.ones(1, 2, 1, D), torch.ones(1, 2, 1, D))
    huge = torch.full((1, 2, 1, D), 3e38)  # finite, but its norm overflows float32
    assert not store.encode_append(huge, torch.ones(1, 2, 1, D))
    assert store.tokens == 1
    cache = QuantizedKVCache(QuantConfig("kqv", 4, "kqv", 4, residual_length=1), 1)
    with pytest.raises(KvqrsError, match="magnitude"):  # the cache refuses it on arrival
        cache.update(huge.expand(1, 2, 3, D).clone(), torch.ones(1, 2, 3, D), 0)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("name", NATIVE_ENCODED + tuple(TOKEN_CONFIGS))
def test_a_streamed_cache_holds_the_codes_of_the_python_encode(name, monkeypatch):
    """A cache flushing through the native encoders holds, token after token, the codes of one
    that encodes in Python (``_native_encoder`` disabled), and reads the same attention."""
    import kvqrs.hf.store as store_mod

    cfg = dataclasses.replace(ALL_CONFIGS[name], residual_length=3)
    heads = 2 if name.endswith("per-head") else 3
    caches = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(store_mod, "_native_encoder", lambda coder, kv_heads: None)
        cache = QuantizedKVCache(cfg, 1)
        rng = np.random.default_rng(7)
        outs = [
            cache.update(*(torch.from_numpy(rng.standard_normal((1, heads, t, D)).astype(np.float32)) for _ in "kv"), 0)[0]
            for t in (5, 1, 1, 2, 1, 9, 8)
        ]
        caches.append((cache.layers[0], outs))
    (a, outs_a), (b, outs_b) = caches
    assert a.store._encodes and not b.store._encodes
    _same(a.store.keys(), b.store.keys())
    _same(a.store.values(), b.store.values())
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x, y)


def _token_runs_calibration(heads: int, widths: np.ndarray, seed: int) -> MatchedCalibration:
    """A seeded calibration of ``heads`` KV heads with per-token key scales: random orthonormal
    bases, means and deviations (0.2 .. 3), the key ``widths`` given."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.standard_normal((heads, D, D)))[0].astype(np.float32)
    mean, vmean = (rng.standard_normal((heads, D)).astype(np.float32) * 2 for _ in "kv")
    dev = rng.uniform(0.2, 3.0, (heads, D)).astype(np.float32)
    return MatchedCalibration(MatchedBasis(mean, basis, widths, dev), vmean)


@st.composite
def _widths(draw) -> np.ndarray:
    """Non-increasing key widths 0..8 over ``D`` columns: runs of several widths, width-0
    columns at the end (none, some, or every column)."""
    coded = draw(st.integers(0, D), "coded columns")
    w = sorted(draw(st.lists(st.integers(1, 8), min_size=coded, max_size=coded), "widths"), reverse=True)
    return np.array(w + [0] * (D - coded), np.uint8)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), widths=_widths(), per_head=st.booleans(), seed=st.integers(0, 2**16))
def test_token_keys_encode_natively_to_the_coders_bytes(data, widths, per_head, seed):
    """Matched keys with per-token scales encode natively (``token_runs``: the transform, the
    deviations, the absmax kernel, each run packed per token) to the bytes of the Python
    coder, every part, chunk after chunk of 0 to 300 tokens, for a calibration of one head
    serving the store's 3 and one of each of 2 heads, inputs of unit scale up to those whose
    largest coded coordinate comes near float16's largest scale. Tokens past it are refused
    natively (False, nothing stored), as the Python coder refuses them."""
    heads = 2 if per_head else 3
    codec = QuantConfig(
        "matched", 3, "matched", 3, group=8, calibration={0: _token_runs_calibration(2 if per_head else 1, widths, seed)}
    ).codec(0, D)
    assert type(codec._key_coder()).__name__ == "MatchedTokenCoder"
    native, ref = CodeStore(codec, 2, heads, D, torch.float32), CodeStore(codec, 2, heads, D, torch.float32)
    rng = np.random.default_rng(seed)
    for i in range(data.draw(st.integers(1, 3), "chunks")):
        n = data.draw(st.integers(0, 300), f"tokens {i}")
        k, v = (rng.standard_normal((2, heads, n, D)).astype(np.float32) for _ in "kv")
        top = data.draw(st.sampled_from([None, 1e3, 6e4]), f"largest coded coordinate {i}")
        if top is not None and n and widths.any():  # about the mean, so that the largest |y_i / sigma_i| is about top
            largest = float(np.asarray(codec.encode_keys(k).parts["scales"], np.float32).max())
            mean = codec._key_coder().cal.mean[:, None, :]
            k = (mean + (k - mean) * np.float32(top / max(largest, 1e-3))).astype(np.float32)
        assert native.encode_append(k, v, n)
        ref.append(codec.encode_keys(k), codec.encode_values(v))
    _same(native.keys(), ref.keys())
    _same(native.values(), ref.values())
    if widths.any():
        t = native.tokens
        huge = np.full((2, heads, 1, D), 1e30, np.float32)
        assert not native.encode_append(huge, np.ones_like(huge), 1)
        with pytest.raises(KvqrsError, match=r"^keys: the key at \(batch 0, head 0, token 0\), .* overflows its float16 per-token scale"):
            codec.encode_keys(huge)
        assert native.tokens == t


def test_the_slot_writer_stores_the_token_keys_of_the_python_coder():
    """vLLM's slot writer (``_native.SlotWriter``) with the ``token_runs`` key encoder writes
    each token's key parts (every run's packed codes, the float16 scale) and value parts into
    its slot of every KV head's page: the bytes of the Python coders' encodes of that token."""
    from kvqrs.hf.store import _native_encoder

    codec = TOKEN_CONFIGS["matched-tokens"].codec(0, D)
    kc, vc = codec._key_coder(), codec.values
    sides = [_native_encoder(kc, 1), _native_encoder(vc, 1)]
    assert sides[0].kind == "token_runs"
    heads, tokens, block_size = 3, 11, 4
    k, v = (np.random.default_rng(j).standard_normal((tokens, heads, D)).astype(np.float32) * 4 for j in (0, 1))
    enc = [coder.encode(np.ascontiguousarray(x.transpose(1, 0, 2))[None]) for coder, x in ((kc, k), (vc, v))]
    parts, offset = [], 0
    for side, e in enumerate(enc):
        for name, a in e.parts.items():
            a = np.asarray(a)
            row = int(np.prod(a.shape[3:], dtype=np.int64)) * a.itemsize
            parts.append((side, name, offset, row, a.dtype.name, a))
            offset += row
    writer = _native.SlotWriter(*sides, [p[:5] for p in parts], D)
    blocks, page = 3, block_size * offset
    cache = np.zeros(blocks * heads * page, np.uint8)
    slots = np.arange(tokens, dtype=np.int64)[::-1].copy()  # token i in slot tokens - 1 - i
    writer.write(cache, blocks, heads, block_size, heads * page, page, k.reshape(-1), v.reshape(-1), slots)
    for i, slot in enumerate(slots):
        for h in range(heads):
            at = (slot // block_size) * heads * page + h * page
            for _, name, off, row, _, a in parts:
                got = cache[at + block_size * off + (slot % block_size) * row :][:row]
                assert got.tobytes() == np.ascontiguousarray(a[0, h, i]).tobytes(), (name, i, h)


def test_appends_grow_geometrically_not_per_token():
    codec = CONFIGS["kqv"].codec(0, D)
    store = CodeStore(codec, 1, 2, D, torch.float32)
    caps = []
    for i in range(300):
        store.append(*_encode(codec, _x(1, 2, 1, i), _x(1, 2, 1, i + 1000)))
        caps.append(store.capacity_nbytes())
    assert len(set(caps)) <= 10  # 8, 12, 18, ..., 303 tokens of room (1.5x each): a handful of growths
    assert store.nbytes() == sum(np.asarray(p).nbytes for p in store.keys().parts.values()) + sum(
        np.asarray(p).nbytes for p in store.values().parts.values()
    )


def test_bad_input_raises_kvqrs_error_naming_the_problem():
    cfg = CONFIGS["kivi"]
    codec = cfg.codec(0, D)
    store = CodeStore(codec, 1, 2, D, torch.float32)
    store.append(*_encode(codec, _x(1, 2, 3, 0), _x(1, 2, 3, 1)))  # a partial KIVI group
    with pytest.raises(KvqrsError, match="keys.codes|keys.scales"):
        store.append(*_encode(codec, _x(1, 2, 8, 0), _x(1, 2, 8, 1)))
    assert store.tokens == 3
    with pytest.raises(KvqrsError, match="span"):
        store.keep(0, 9)
    with pytest.raises(KvqrsError, match="multiple of"):
        store.keep(1, 3)
    with pytest.raises(KvqrsError, match="batch rows in 0..1"):
        store.select([1])
    fresh = CodeStore(codec, 1, 2, D, torch.float32)
    with pytest.raises(KvqrsError, match=r"keys.codes: shape \[1, 2, 32, 2\] for 8 tokens"):
        fresh.append(*_encode(codec, _x(2, 2, 8, 0), _x(2, 2, 8, 1)))
    assert fresh.tokens == 0
    with pytest.raises(KvqrsError, match="no part"):
        store._native.part("nope")
    with pytest.raises(KvqrsError, match="unique part names"):
        _native.LayerStore([StorePart("a", "uint8", False, [1], [], 1, 1), StorePart("a", "uint8", False, [1], [], 1, 1)])
    with pytest.raises(KvqrsError, match="token rate"):
        _native.LayerStore([StorePart("a", "uint8", False, [1], [], 0, 1)])
    with pytest.raises(KvqrsError, match="call set_rows"):
        none = np.zeros(0, np.float32)
        store._native.attend(np.zeros(D, np.float32), 1, 1, D, 1.0, 1, none, none, 0, none, none, 0, 0, 0, None, 1)
    lead = (1, 2)
    dense = binding_rows(DenseRows("keys.codes"), "values", lead, D, _as_is)
    runs = ChannelRunRows((ChannelRun("keys.nope", "keys.scales", "keys.zeros", 2, 0, 4),), 8, np.eye(D, dtype=np.float32), 0)
    with pytest.raises(KvqrsError, match=r"keys.rows.runs\[0\].codes: no part named \"keys.nope\""):
        store._native.set_rows(binding_rows(CentredRows(runs, np.zeros(D, np.float32)), "keys", lead, D, _as_is), dense)
    with pytest.raises(KvqrsError, match="values: per-channel uniform groups are a key layout"):
        store._native.set_rows(dense, UniformRows("keys.codes", "keys.scales", "keys.zeros", 2, 8, per_channel=True))
    assert not store._native.has_rows


def _as_is(part, name):
    """For :func:`binding_rows` of rows that already hold the part names (a layer store's)."""
    return part


def test_set_rows_refuses_malformed_row_objects_with_a_type_error_naming_the_field():
    """The store's rows are typed objects read by attribute (``rust/py/src/rows.rs``): a
    missing field, a field of the wrong type, a mean inside a mean or an object of another
    class is a ``TypeError`` naming the row class and field, never a panic; nothing is
    declared."""
    store = _native.LayerStore(
        [
            StorePart("keys.codes", "uint8", False, [1, 1], [16], 1, 1),
            StorePart("keys.norms", "float16", True, [1, 1], [], 1, 1),
            StorePart("values.fp", "float32", False, [1, 1], [D], 1, 1),
        ]
    )
    dense = DenseRows("values.fp")
    mse = MSERows("keys.codes", "keys.norms", 4, 7)
    centred = binding_rows(CentredRows(mse, np.zeros(D, np.float32)), "keys", (1, 1), D, _as_is)
    cases = [  # (rows, the message, its cause or None)
        (mse._replace(codes=3), "MSERows.codes", "'int' object cannot be converted"),
        (mse._replace(bits="four"), "MSERows.bits", "cannot be interpreted as an integer"),
        (mse._replace(qjl=("keys.codes", "keys.norms")), "MSERows.qjl", "no attribute 'signs'"),
        (
            centred._replace(rows=centred),
            "CentredRows.rows",
            "expected MSERows, UniformRows, DenseRows, ChannelRunRows or TokenRunRows, got _FlatCentred",
        ),
        (namedtuple("Centred", "rows mean")(mse, centred.mean), "CentredRows: missing field", "no attribute 'mean_heads'"),
        ({"kind": "mse", "codes": "keys.codes", "norms": "keys.norms", "bits": 4, "seed": 7}, "expected a row object .* got a dict", None),
        (object(), "expected MSERows, UniformRows, DenseRows, ChannelRunRows or TokenRunRows, got object", None),
    ]
    for rows, match, cause in cases:
        with pytest.raises(TypeError, match=f"argument 'keys': .*{match}") as e:
            store.set_rows(rows, dense)
        assert cause is None or cause in str(e.value.__cause__)
    with pytest.raises(TypeError, match="SideRows: missing field"):
        store.set_rows(mse, dense, side=mse)
    assert not store.has_rows
    store.set_rows(mse, dense)
    assert store.has_rows


@pytest.mark.parametrize(
    "name", ["kqv", "kivi", "qkqv", "block", "kqv-keyonly", "headq-kqv", "headq-kivi", "matched", "matched-per-head", "matched-keyonly"]
)
@pytest.mark.parametrize("masked", [False, True])
def test_decode_step_equals_the_kernel_merged_with_the_window(name, masked):
    """``CodeStore.attend`` (one native call) equals the fused kernel over the joined codes
    merged with a float64 softmax over the window, to float32 rounding (rtol 1e-5, atol
    1e-6); every row kind here is read natively (``can_attend``), matched's runs and means
    included (a fallback to the Python path would fail the assertion)."""
    cfg = STEP_CONFIGS[name]
    codec = cfg.codec(0, D)
    b, h, g, nq, w = 2, 2, 3, 2, 5
    store = CodeStore(codec, b, h, D, torch.float32)
    chunks = [_encode(codec, _x(b, h, cfg.chunk * 2, 10 + i), _x(b, h, cfg.chunk * 2, 20 + i)) for i in range(3)]
    for ck, cv in chunks:
        store.append(ck, cv)
    assert store.can_attend()
    ref_k, ref_v = store.keys(), store.values()
    q = torch.from_numpy(_x(b, h * g, nq, 30))
    fk, fv = torch.from_numpy(_x(b, h, w, 31)), torch.from_numpy(_x(b, h, w, 32))
    mask = None
    if masked:  # causal over the window: query 0 does not see the newest window token
        mask = torch.ones(b, 1, nq, w, dtype=torch.bool)
        mask[:, :, 0, -1] = False
    got = store.attend(q, _no_sinks(fk), (fk, fv), mask, 0.2).numpy()
    # The same tokens as 2 sinks and a window read in place from a buffer with spare room
    # (NaN outside the window: a read beyond it shows): the same bits.
    buffers = [torch.full((b, h, w + 4, D), float("nan")) for _ in range(2)]
    for buf, t in zip(buffers, (fk, fv)):
        buf[..., 1 : w - 1, :] = t[..., 2:, :]
    window = tuple(buf.narrow(2, 1, w - 2) for buf in buffers)
    split = store.attend(q, (fk[..., :2, :], fv[..., :2, :]), window, mask, 0.2).numpy()
    assert split.tobytes() == got.tobytes()
    cv = DenseRows(ref_v.numpy()) if isinstance(ref_v, torch.Tensor) else ref_v
    res = codec.fused_attention(q.numpy(), ref_k, cv, scale=0.2)
    qg = q.double().reshape(b, h, g * nq, D)
    s = (qg @ fk.double().transpose(2, 3)) * 0.2
    if mask is not None:
        m = mask.expand(b, 1, nq, w).repeat(1, 1, g, 1)
        s = s.masked_fill(~m, float("-inf"))
    lse_w = torch.logsumexp(s, dim=-1).reshape(b, h * g, nq)
    out_w = (torch.softmax(s, dim=-1) @ fv.double()).reshape(b, h * g, nq, D)
    lse_c = torch.from_numpy(res.lse).double()
    lse = torch.logaddexp(lse_c, lse_w)
    want = (lse_c - lse).exp()[..., None] * torch.from_numpy(res.out).double() + (lse_w - lse).exp()[..., None] * out_w
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("sinks", [0, 2])
def test_attention_over_full_precision_tokens_alone_equals_a_float64_softmax(masked, sinks):
    """``attend_full_precision`` (a layer that has coded nothing yet: one native call over the
    sinks and the window) equals a float64 softmax to float32 rounding (rtol 1e-5, atol 1e-6),
    the same bits whether the tokens come joined or as sinks and a window read in place from
    a buffer with spare room (NaN outside the window: a read beyond it shows), and its
    log-sum-exp is the softmax's. A query row whose every token is masked gets zeros and a
    log-sum-exp of -inf; no token at all is an error naming the window."""
    b, h, g, nq, w = 2, 2, 3, 2, 6
    q = torch.from_numpy(_x(b, h * g, nq, 40))
    fk, fv = torch.from_numpy(_x(b, h, w, 41)), torch.from_numpy(_x(b, h, w, 42))
    mask = None
    if masked:  # query 0 does not see the newest token; batch row 1's query 1 sees none
        mask = torch.ones(b, 1, nq, w, dtype=torch.bool)
        mask[:, :, 0, -1] = False
        mask[1, :, 1, :] = False
    out, lse = attend_full_precision(q, _no_sinks(fk), (fk, fv), mask, 0.2, with_lse=True)
    buffers = [torch.full((b, h, w + 4, D), float("nan")) for _ in range(2)]
    for buf, t in zip(buffers, (fk, fv)):
        buf[..., 1 : w + 1 - sinks, :] = t[..., sinks:, :]
    window = tuple(buf.narrow(2, 1, w - sinks) for buf in buffers)
    split = attend_full_precision(q, (fk[..., :sinks, :], fv[..., :sinks, :]), window, mask, 0.2)
    assert split.numpy().tobytes() == out.numpy().tobytes()
    qg = q.double().reshape(b, h, g * nq, D)
    s = (qg @ fk.double().transpose(2, 3)) * 0.2
    if mask is not None:
        m = mask.expand(b, 1, nq, w).repeat(1, 1, g, 1)
        s = s.masked_fill(~m, float("-inf"))
    want_lse = torch.logsumexp(s, dim=-1).reshape(b, h * g, nq, 1)
    want = torch.nan_to_num(torch.softmax(s, dim=-1) @ fv.double()).reshape(b, h * g, nq, D)
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.numpy(), want_lse.numpy(), rtol=1e-5, atol=1e-6)
    if masked:
        assert np.all(out[1, :, 1].numpy() == 0) and np.all(lse[1, :, 1].numpy() == -np.inf)
    with pytest.raises(KvqrsError, match="window: expected at least one full-precision token"):
        attend_full_precision(q, _no_sinks(fk), _no_sinks(fk), None, 0.2)


def _v2_bytes(cache) -> bytes:
    """The cache in the previous format (kvqrs-cache-v2): one nested kvqrs.format container
    per side, the full-precision values of a key-only config as ``fp_values``."""
    layers, sections = [], []
    codes = {torch.float32: 2, torch.float16: 1, torch.bfloat16: 6, torch.float64: 3}

    def tensor(name, t):
        t = t.contiguous()
        sections.append((name, codes[t.dtype], list(t.shape), t.view(torch.uint8).numpy().tobytes()))

    for i, layer in enumerate(cache.layers):
        pos = layer.positions()
        fp = layer.fp_tensors()
        keys = layer.chunks_k
        info = {"initialized": True, "quantized": pos["quantized"], "sliding_window": None, "record_past": False}
        info.update(dtype="float32", head_dim=int(layer.head_dim), keys=bool(keys), values=bool(layer.chunks_v))
        info.update(seen=pos["seen"], start=pos["start"], q_start=pos["q_start"], fp_values=layer.fp_values_quantized is not None)
        for name in ("window_keys", "window_values", "sink_keys", "sink_values"):
            info[name] = True
            tensor(f"L{i}.{name}", fp[name])
        info["pending_keys"] = info["pending_values"] = False
        if info["fp_values"]:
            tensor(f"L{i}.fp_values", layer.fp_values_quantized)
        if keys:
            blob = fmt.dumps(keys[0])
            sections.append((f"L{i}.keys", 0, [len(blob)], blob))
        if info["values"]:
            blob = fmt.dumps(layer.chunks_v[0])
            sections.append((f"L{i}.values", 0, [len(blob)], blob))
        layers.append(info)
    config = {k: v for k, v in vars(cache.config).items() if k != "bases" and not k.startswith("_")}
    meta = json.dumps({"format": "kvqrs-cache-v2", "config": config, "bases": None, "layers": layers}).encode()
    return _native.container_write([("meta", 5, [len(meta)], meta), *sections])


@pytest.mark.parametrize(
    "cfg", [QuantConfig("kqv", 3, "kqv", 3, residual_length=4), QuantConfig("kqv", 4, residual_length=2)], ids=["kqv", "keyonly"]
)
def test_files_of_the_previous_format_still_load(cfg):
    _STATE.set(None)
    cache = QuantizedKVCache(cfg, 2)
    for i in range(2):
        cache.update(torch.from_numpy(_x(1, 2, 40, i)), torch.from_numpy(_x(1, 2, 40, i + 7)), i)
    _STATE.set(None)
    old = QuantizedKVCache.from_bytes(_v2_bytes(cache), cfg)
    new = QuantizedKVCache.from_bytes(cache.to_bytes(), cfg)
    for a, b, c in zip(cache.layers, old.layers, new.layers):
        assert a.positions() == b.positions() == c.positions()
        for x, y in ((a.materialize(), b.materialize()), (a.materialize(), c.materialize())):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    assert b"kvqrs-cache-v3" in cache.to_bytes()


def test_a_row_kind_the_native_step_does_not_know_keeps_the_other_path(monkeypatch):
    codec = CONFIGS["kqv"].codec(0, D)
    store = CodeStore(codec, 1, 2, D, torch.float32)
    store.append(*_encode(codec, _x(1, 2, 4, 0), _x(1, 2, 4, 1)))

    class Composite:
        def spec(self):
            return {"kind": "composite", "codes": store.keys().parts["codes"]}

    monkeypatch.setattr(codec, "fused_rows", lambda ck, cv: (Composite(), Composite(), None))
    assert not store.can_attend()
    with pytest.raises(KvqrsError, match="no native decode step for kqv keys"):
        store.attend(torch.zeros(1, 2, 1, D), _no_sinks(torch.zeros(1, 2, 1, D)), _no_sinks(torch.zeros(1, 2, 1, D)), None, 0.2)
    monkeypatch.setattr(codec, "fused_rows", lambda ck, cv: None)  # no fused rows at all (another backend)
    assert not _kqv_store(codec).can_attend()
    monkeypatch.undo()
    assert _kqv_store(codec).can_attend()
    # Values in width classes have no fused rows (and need the A^2 weights to encode).
    cal = random_calibration(D, 3, 0)
    cal = MatchedCalibration(cal.keys, cal.value_mean, value_bits=3, value_classes=((4, 4), (2, 4)))
    classes = QuantConfig("matched", 3, "matched", 3, group=8, calibration={0: cal}).codec(0, D)
    store = CodeStore(classes, 1, 1, D, torch.float32)
    x = _x(1, 1, 8, 2)
    ck, cv = classes.encode_keys(x), classes.encode_values(x, np.ones((1, 1, 8), np.float32))
    store.append(ck, cv)
    assert classes.fused_rows(ck, cv) is None and not store.can_attend()


def _kqv_store(codec) -> CodeStore:
    """A store of ``codec`` (1 batch row, 2 KV heads) holding 4 tokens."""
    store = CodeStore(codec, 1, 2, D, torch.float32)
    store.append(*_encode(codec, _x(1, 2, 4, 0), _x(1, 2, 4, 1)))
    return store


def _names_read(bound) -> list[str]:
    """Every part name in rows bound for ``LayerStore.set_rows`` (the strings among their fields)."""
    if isinstance(bound, str):
        return [bound]
    if isinstance(bound, (tuple, list)):
        return [n for x in bound for n in _names_read(x)]
    return []


@pytest.mark.parametrize("name", list(STEP_CONFIGS))
def test_rows_bind_each_stored_part_by_name_and_read_the_bits_of_the_arrays(name):
    """The coders' ``attention_rows``, given ``Encoded`` s of ``PartRef`` s (the store's
    layouts), name every part the store holds exactly once: the names ``set_rows`` gets are the
    store's. The same rows with each ref resolved by name to the store's array give the fused
    kernel the bits of the rows the codec builds from those arrays."""
    cfg = STEP_CONFIGS[name]
    codec = cfg.codec(0, D)
    b, h = 2, 2
    store = CodeStore(codec, b, h, D, torch.float32)
    for i in range(2):
        store.append(*_encode(codec, _x(b, h, cfg.chunk * 2, 50 + i), _x(b, h, cfg.chunk * 2, 60 + i)))
    kparts, vparts, rows = store._named_rows()
    assert sorted(_names_read(store._bound_rows(kparts, vparts, rows))) == sorted(store._native.names())
    assert store.can_attend()
    ck, cv = store.keys(), store.values()
    varrays = {"fp": cv.numpy()} if isinstance(cv, torch.Tensor) else cv.parts
    resolved = (
        map_parts(rows[0], by_name(kparts, "keys", ck.parts.__getitem__)),
        map_parts(rows[1], by_name(vparts, "values", varrays.__getitem__)),
        None if rows[2] is None else map_parts(rows[2], by_name(kparts, "side", ck.parts.__getitem__)),
    )
    direct = codec.fused_rows(ck, DenseRows(varrays["fp"]) if isinstance(cv, torch.Tensor) else cv)
    q = _x(b, h, 6, 70)
    got = decode_attention(q, resolved[0], resolved[1], side=resolved[2], scale=0.2, probs=True)
    want = decode_attention(q, direct[0], direct[1], side=direct[2], scale=0.2, probs=True)
    for a, e in zip(got, want):
        assert a.tobytes() == e.tobytes()


def test_a_coder_that_copies_or_replaces_a_part_in_its_rows_is_an_error_not_the_decoded_path(monkeypatch):
    """Rows bound by part name: a coder's ``attention_rows`` that copies a part raises a
    ``TypeError`` from ``can_attend`` (a ``PartRef`` holds no data), one that puts an array
    or another part in a part's place a ``KvqrsError`` naming the field; neither is remembered
    as "no native step" (the decoded path)."""
    codec = CONFIGS["kqv"].codec(0, D)
    keys_of, values_of = codec.keys.attention_rows, codec.values.attention_rows
    monkeypatch.setattr(codec.keys, "attention_rows", lambda enc: keys_of(enc)._replace(codes=np.ascontiguousarray(keys_of(enc).codes)))
    store = _kqv_store(codec)
    for _ in range(2):  # decided again on the next call, not remembered as False
        with pytest.raises(TypeError, match="part 'codes': a PartRef names a stored part, it holds no data"):
            store.can_attend()
    assert not store._native.has_rows
    held = store.keys().parts["codes"]
    monkeypatch.setattr(codec.keys, "attention_rows", lambda enc: keys_of(enc)._replace(codes=held))
    with pytest.raises(KvqrsError, match=r"keys.codes: expected a stored part \(a PartRef .*\), got ndarray"):
        _kqv_store(codec).can_attend()
    monkeypatch.undo()
    monkeypatch.setattr(codec.values, "attention_rows", lambda enc: values_of(enc)._replace(norms=PartRef("nope", (1, 2, 4), np.float16)))
    with pytest.raises(
        KvqrsError, match=r"values.norms: reads part 'nope', which is not among the parts held \(codes, norms, qjl_signs, qjl_norms\)"
    ):
        _kqv_store(codec).can_attend()
    monkeypatch.undo()
    assert _kqv_store(codec).can_attend()


def test_a_part_ref_is_no_array():
    """``PartRef``: shape, dtype and ndim of its part; converting, indexing or computing on it
    raises ``TypeError``."""
    ref = PartRef("codes", (2, 3, 4), np.uint8)
    assert (ref.name, ref.shape, ref.dtype, ref.ndim) == ("codes", (2, 3, 4), np.uint8, 3)
    for op in (np.asarray, np.ascontiguousarray, lambda r: r + 1, lambda r: np.zeros(4) * r, lambda r: r[0], lambda r: np.add(r, 1)):
        with pytest.raises(TypeError):
            op(ref)
    with pytest.raises(AttributeError):
        ref.view(np.uint8)


def _matched_step_bytes() -> bytes:
    """One native matched step (4 KV heads with their own calibrations, 1,000 coded tokens, a
    256-token window, 4 query tokens, GQA 3) as bytes."""
    codec = QuantConfig("matched", 3, "matched", 3, group=8, calibration={0: per_head_matched_calibration(4, 64, 3)}).codec(0, 64)
    rng = np.random.default_rng(4)
    k, v, q, fk, fv = (
        rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 1000, 64),) * 2 + ((2, 12, 4, 64),) + ((2, 4, 256, 64),) * 2
    )
    store = CodeStore(codec, 2, 4, 64, torch.float32)
    store.append(codec.encode_keys(k), codec.encode_values(v))
    assert store.can_attend()
    q, fk, fv = map(torch.from_numpy, (q, fk, fv))
    return store.attend(q, _no_sinks(fk), (fk, fv), None, 0.125).numpy().tobytes()


def _no_sinks(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero sink tokens of ``like``'s batch, heads and head_dim (keys, values)."""
    return like[..., :0, :], like[..., :0, :]


def test_matched_decode_step_does_not_depend_on_the_thread_count():
    """The native matched step (runs and means; window heads split above the work minimum,
    here reached) gives the same bytes on one rayon thread as on four."""
    outs = stdout_per_thread_count("import sys; from tests.hf.test_store import _matched_step_bytes as f; sys.stdout.buffer.write(f())")
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_which_coders_encode_natively():
    """MSE stages of any stored scale (norms float or log8, around a mean or not), MSE + QJL
    storing norms, KIVI and ``matched`` (a calibration of one head or of the store's heads)
    encode natively; an MSE + QJL stage storing the least-squares scale encodes in Python."""
    from kvqrs.hf.store import NativeEncoder, _native_encoder
    from kvqrs.schemes import KVCodec

    native = lambda codec, heads=3: _native_encoder(codec.values, heads)  # noqa: E731
    assert isinstance(native(KVCodec("kv", 3, 64, value_scheme="kv", value_scale="least_squares")), NativeEncoder)
    assert native(KVCodec("kqv", 3, 64, value_scheme="kqv", value_scale="least_squares")) is None
    assert native(KVCodec("kqv", 3, 64, value_scheme="kqv")).kind == "mse_qjl"
    per_head = STEP_CONFIGS["matched-per-head"].codec(0, D)
    assert native(per_head, 2).kind == "channels" and native(per_head, 3) is None
    assert _native_encoder(CONFIGS["kivi"].codec(0, D)._key_coder(), 3).kind == "channels"
    assert native(CONFIGS["kivi"].codec(0, D)).kind == "tokens"
    keys = lambda name, heads: _native_encoder(TOKEN_CONFIGS[name].codec(0, D)._key_coder(), heads)  # noqa: E731
    assert keys("matched-tokens", 3).kind == keys("matched-tokens-per-head", 2).kind == "token_runs"
    assert keys("matched-tokens-per-head", 3) is None


@pytest.mark.parametrize("name", ["kqv", "kivi", "qkqv", "matched", "matched-per-head", "matched-log8", *TOKEN_CONFIGS])
@pytest.mark.parametrize("flush", [0, 1])
def test_step_equals_append_encode_then_attend(name, flush):
    """``CodeStore.step`` (one native call: the new tokens written into the window buffer, the
    window's oldest chunk encoded into the store, attention over codes, sinks and window) gives
    the bits of the three calls it replaces: ``_native.window_append``, ``encode_append`` from
    the buffer, ``attend`` over the window after the flush. A refused token (NaN) writes
    nothing: None, and the store and the buffer as before."""
    cfg = ALL_CONFIGS[name]
    codec = cfg.codec(0, D)
    b, h, g, cap, lo, w = 2, 2, 3, 3 * cfg.chunk + 8, 2, cfg.chunk + 3
    n = flush * cfg.chunk
    stores, buffers = [], []
    for _ in range(2):
        store = CodeStore(codec, b, h, D, torch.float32)
        store.append(*_encode(codec, _x(b, h, cfg.chunk * 2, 40), _x(b, h, cfg.chunk * 2, 41)))
        assert store.encodes_natively() and store.can_attend()
        buf = [torch.from_numpy(_x(b, h, cap, 42 + i)) for i in range(2)]
        stores.append(store)
        buffers.append(buf)
    q = torch.from_numpy(_x(b, h * g, 1, 44))
    sinks = (torch.from_numpy(_x(b, h, 1, 45)), torch.from_numpy(_x(b, h, 1, 46)))
    new = (torch.from_numpy(_x(b, h, 1, 47)), torch.from_numpy(_x(b, h, 1, 48)))
    flat = lambda buf: (buf[0].numpy().reshape(-1), buf[1].numpy().reshape(-1))  # noqa: E731
    rows = WindowRows(*flat(buffers[0]), cap, lo, w)
    got = stores[0].step(q, sinks, rows, new, n, None, 0.2, with_lse=True)
    (fk, fv), (ak, av) = flat(buffers[1]), buffers[1]
    assert _native.window_append(fk, fv, cap, lo + w, new[0].numpy(), new[1].numpy())
    if n:
        assert stores[1].encode_append(ak.numpy(), av.numpy(), n, lo)
    want = stores[1].attend(q, sinks, WindowRows(fk, fv, cap, lo + n, w + 1 - n), None, 0.2, with_lse=True)
    for a, e in zip(got, want):
        assert a.numpy().tobytes() == e.numpy().tobytes()
    assert stores[0].sections("x") == stores[1].sections("x")
    assert all(torch.equal(x, y) for x, y in zip(buffers[0], buffers[1]))
    bad = (new[0].clone(), new[1])
    bad[0][1, 0, 0, 5] = float("nan")
    before = (stores[0].sections("x"), [t.clone() for t in buffers[0]])
    rows = WindowRows(*flat(buffers[0]), cap, lo + n, w + 1 - n)
    assert stores[0].step(q, sinks, rows, bad, n, None, 0.2) is None
    assert stores[0].sections("x") == before[0] and all(torch.equal(x, y) for x, y in zip(buffers[0], before[1]))
    if n and name in TOKEN_CONFIGS:  # a flushed key past float16's scale: refused, the store as before
        buffers[0][0][1, 0, lo + n, 5] = 1e30
        before = (stores[0].sections("x"), [t.clone() for t in buffers[0]])
        assert stores[0].step(q, sinks, rows, new, n, None, 0.2) is None
        assert stores[0].sections("x") == before[0]
        for x, y in zip(buffers[0], before[1]):  # written only past the window's tokens
            assert torch.equal(x[..., : lo + n + w + 1 - n, :], y[..., : lo + n + w + 1 - n, :])


def test_a_steady_step_whose_flush_the_native_encode_refuses_takes_the_python_encode(monkeypatch):
    """A key whose per-token scale overflows float16 leaves the window in a steady decode
    step: the native step refuses its flush (nothing stored), the layer redoes the update on
    the general path, whose Python encode names the error, and the layer is left as a cache
    that encodes in Python leaves it."""
    import kvqrs.hf.store as store_mod

    class Module:
        layer_idx, num_key_value_groups = 0, 2

    cfg = dataclasses.replace(TOKEN_CONFIGS["matched-tokens"], residual_length=4)
    keys = [torch.from_numpy(_x(1, 3, t, i, s)) for i, (t, s) in enumerate([(20, 1), (1, 1), (1, 1), (1, 1), (1, 1e6)] + [(1, 1)] * 6)]
    values = [torch.from_numpy(_x(1, 3, k.shape[-2], 50 + i)) for i, k in enumerate(keys)]
    q = torch.from_numpy(_x(1, 6, 1, 99))
    step, results = CodeStore.step, []
    monkeypatch.setattr(CodeStore, "step", lambda self, *a, **kw: results.append(step(self, *a, **kw)) or results[-1])
    states = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(store_mod, "_native_encoder", lambda coder, kv_heads: None)
        cache = QuantizedKVCache(cfg, 1)
        with pytest.raises(KvqrsError, match=r"^keys: the key at \(batch 0, head \d, token 0\).* overflows its float16 per-token scale"):
            for k, v in zip(keys, values):
                cache.attend(Module(), q, *cache.update(k, v, 0), None, 0.2)
        layer = cache.layers[0]
        states.append((layer.seen, layer.quantized, cache.to_bytes(), [r is None for r in results]))
        results.clear()
    # the update of the 8th decode token (whose flush reaches the huge key) refused in both
    assert states[0][:3] == states[1][:3] and states[0][:2] == (27, 23)
    # native: the steady steps of decode tokens 2 to 7 in one native call each, then the refused
    # one; Python: none (no native encoder, no steady step)
    assert states[0][3] == [False] * 6 + [True] and states[1][3] == []


def test_storable_checks_every_value_of_any_layout():
    """``_native.storable``: finite and at most MAX_STATE in magnitude, contiguous or strided."""
    x = np.random.default_rng(0).standard_normal((2, 3, 50, 8)).astype(np.float32)
    assert _native.storable(x) and _native.storable(x.transpose(0, 2, 1, 3))
    for bad in (np.nan, np.inf, -np.inf, -1.5 * _native.MAX_STATE):
        y = x.copy()
        y[1, 2, 49, 7] = bad
        assert not _native.storable(y) and not _native.storable(y.transpose(0, 2, 1, 3))
    y[1, 2, 49, 7] = -_native.MAX_STATE
    assert _native.storable(y)
