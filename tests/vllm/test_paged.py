"""The paged kvqrs cache (``kvqrs.vllm.layout`` and the Rust ``paged_decode_attention``): tokens
written through a slot mapping into pages of a shuffled block table, then decode and causal
prefill attention from the codes, against kvqrs' contiguous fused attention over the same codes;
the stored bytes are the codec's own; ``matched`` with per-token key scales (its calibrated
tables, one or one per KV head, held by value); refused schemes and bad input are clear errors.
NumPy only (no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
from kvqrs import KvqrsError
from kvqrs.hf import QuantConfig
from kvqrs.vllm.layout import PAGED_SCHEMES, SlotLayout, query_positions, refuse_reason

D, KV_HEADS, Q_HEADS, BLOCK = 64, 3, 9, 16
# Per-page softmax parts merged by log-sum-exp against one softmax over all tokens: the parts'
# float32 outputs and log-sum-exps round at ~6e-8 relative; 1e-5 leaves room for 8 pages.
MERGE_RTOL = 1e-5


def _matched_config(table_heads: int, bits: int = 4, deviations: bool = True, **kw) -> QuantConfig:
    """``matched`` with seeded calibrations of 3 layers: one random orthonormal key basis, a
    nonzero key mean and (``deviations``) per-coordinate deviations per table head (keys of
    per-token scales: :class:`~kvqrs.schemes.matched_tokens.MatchedTokenCoder`), widths in
    several runs with width-0 columns, and a nonzero value mean (values the per-token MSE stage,
    no value basis); ``table_heads`` tables, 1 shared by every KV head or one per KV head."""
    from kvqrs.kernels.rng import random_orthonormal_basis
    from kvqrs.schemes.matched import MatchedBasis, MatchedCalibration

    rng = np.random.default_rng(table_heads)
    e = D // 8
    widths = np.array([5] * e + [3] * (2 * e) + [2] * (2 * e) + [1] * e + [0] * (2 * e), np.uint8)
    cal = {}
    for layer in range(3):
        basis = np.stack([random_orthonormal_basis(int(rng.integers(2**63)), D, D) for _ in range(table_heads)])
        dev = rng.uniform(0.5, 2.0, (table_heads, D)).astype(np.float32) if deviations else None
        keys = MatchedBasis((rng.standard_normal((table_heads, D)) * 2).astype(np.float32), basis, widths, dev)
        cal[layer] = MatchedCalibration(keys, rng.standard_normal((table_heads, D)).astype(np.float32))
    return QuantConfig("matched", bits, "matched", bits, calibration=cal, **kw)


MATCHED = [pytest.param(_matched_config(1), id="matched-shared-tables"), pytest.param(_matched_config(KV_HEADS), id="matched-per-head")]


def _cache(layout: SlotLayout, blocks: int) -> np.ndarray:
    return np.zeros((blocks, KV_HEADS, BLOCK, layout.slot_bytes), np.uint8)


def _fill(layout, lengths, seed=0):
    """Keys, values and queries of sequences of ``lengths`` written into a cache whose blocks are
    handed out in a shuffled order; returns (cache, block_table, keys, values)."""
    rng = np.random.default_rng(seed)
    width = max(-(-n // BLOCK) for n in lengths)
    blocks = sum(-(-n // BLOCK) for n in lengths) + 2
    order = rng.permutation(blocks)
    table = np.full((len(lengths), width), -1, np.int32)
    used = 0
    for r, n in enumerate(lengths):
        k = -(-n // BLOCK)
        table[r, :k] = order[used : used + k]
        used += k
    cache = _cache(layout, blocks)
    keys = [rng.standard_normal((n, KV_HEADS, D)).astype(np.float32) for n in lengths]
    values = [rng.standard_normal((n, KV_HEADS, D)).astype(np.float32) for n in lengths]
    for r, n in enumerate(lengths):
        pos = np.arange(n)
        slots = table[r, pos // BLOCK] * BLOCK + pos % BLOCK
        # in two steps, as a prefill then decode steps would
        layout.write(cache, keys[r][: n - 1], values[r][: n - 1], slots[: n - 1])
        layout.write(cache, keys[r][n - 1 :], values[r][n - 1 :], slots[n - 1 :])
    return cache, np.where(table < 0, 0, table), keys, values


def _reference(layout, q, keys, values, length):
    """kvqrs' contiguous fused attention over the first ``length`` tokens: ``(q_heads, d)``."""
    codec = layout.codec
    ck = codec.encode_keys(np.ascontiguousarray(keys[:length].transpose(1, 0, 2)))
    cv = codec.encode_values(np.ascontiguousarray(values[:length].transpose(1, 0, 2)))
    return codec.fused_attention(q[:, None, :], ck, cv, scale=D**-0.5).out[:, 0, :]


@pytest.mark.parametrize(
    "config",
    [*(pytest.param(QuantConfig(s, b, s, b), id=f"{s}{b}") for s, b in (("kqv", 4), ("kv", 8), ("qkqv", 3), ("block", 4))), *MATCHED],
)
def test_decode_and_prefill_from_pages_equal_the_contiguous_kernel(config):
    layout = SlotLayout(config, layer=2, head_dim=D)
    lengths = [37, 20, 1]
    cache, table, keys, values = _fill(layout, lengths)
    rng = np.random.default_rng(1)
    # a batch as vLLM forms it: a decode token of sequence 0, a prefill of 5 tokens of sequence 1
    # (its last 5), and the single token of sequence 2
    query_start = np.array([0, 1, 6, 7])
    seq_lens = np.array(lengths)
    seq, lens = query_positions(query_start, seq_lens)
    assert seq.tolist() == [0, 1, 1, 1, 1, 1, 2] and lens.tolist() == [37, 16, 17, 18, 19, 20, 1]
    q = rng.standard_normal((7, Q_HEADS, D)).astype(np.float32)
    out = layout.attend(cache, q, seq, lens, table, scale=D**-0.5)
    assert out.shape == (7, Q_HEADS, D) and out.dtype == np.float32
    for t in range(7):
        want = _reference(layout, q[t], keys[seq[t]], values[seq[t]], lens[t])
        np.testing.assert_allclose(out[t], want, rtol=MERGE_RTOL, atol=MERGE_RTOL)


@pytest.mark.parametrize(
    "config",
    [*(pytest.param(QuantConfig(s, b, s, b), id=f"{s}{b}") for s, b in (("kqv", 4), ("kv", 8), ("qkqv", 3), ("block", 4))), *MATCHED],
)
def test_reconstructed_rows_are_the_codecs_decode(config):
    """A prefill's dense rows: each sequence's keys and values decoded from its pages (through a
    shuffled block table, part of a sequence too, one longer than a unit of work) equal the
    codec's decode of the same tokens."""
    layout = SlotLayout(config, layer=2, head_dim=D)
    lengths = [300, 20, 1]
    cache, table, keys, values = _fill(layout, lengths)
    seq, lens = np.array([1, 0, 2, 0], np.int32), np.array([20, 300, 1, 277], np.int32)
    got = layout.reconstruct(cache, seq, lens, table)
    codec = layout.codec
    for (k, v), s, n in zip(got, seq, lens):
        assert k.shape == v.shape == (KV_HEADS, n, D) and k.dtype == v.dtype == np.float32
        ks, vs = (np.ascontiguousarray(x[s][:n].transpose(1, 0, 2)) for x in (keys, values))
        want_k = codec.decode_keys(codec.encode_keys(ks))
        want_v = codec.decode_values(codec.encode_values(vs))
        np.testing.assert_allclose(k, want_k, rtol=1e-4, atol=1e-4 * np.abs(want_k).max())
        np.testing.assert_allclose(v, want_v, rtol=1e-4, atol=1e-4 * np.abs(want_v).max())
    with pytest.raises(KvqrsError, match="lengths"):
        layout.reconstruct(cache, np.array([0], np.int32), np.array([0], np.int32), table)
    with pytest.raises(KvqrsError, match="seq"):
        layout.reconstruct(cache, np.array([5], np.int32), np.array([3], np.int32), table)
    # no silent cast: a float, a value beyond int32 and a string are refused by name
    one = np.array([0], np.int32)
    for bad in (np.array([20.9]), np.array([2**32 + 20]), np.array(["20"])):
        with pytest.raises(KvqrsError, match="lengths: expected"):
            layout.reconstruct(cache, one, bad, table)
    with pytest.raises(KvqrsError, match="block_table: expected"):
        layout.reconstruct(cache, one, np.array([3]), table + 0.5)
    with pytest.raises(KvqrsError, match="seq: expected"):
        layout.attend(cache, np.zeros((1, Q_HEADS, D), np.float32), np.array([2**32]), np.array([3]), table, 1.0)


def test_layers_of_other_widths_share_the_largest_slot():
    """A calibration gives each layer its own widths, vLLM one slot size to every layer: the
    cache's slots are the largest layer's, and a smaller layer leaves the rest unused, with the
    same codes and attention as in slots of its own size."""
    import dataclasses

    from kvqrs.vllm.layout import paged_slot_bytes

    config = _matched_config(1)
    wide = config.calibration[1]
    widths = wide.keys.widths.copy()
    widths[: D // 4] += 1
    cal = {**config.calibration, 1: dataclasses.replace(wide, keys=dataclasses.replace(wide.keys, widths=widths))}
    config = dataclasses.replace(config, calibration=cal)
    sizes = [SlotLayout(config, layer, D).slot_bytes for layer in range(3)]
    assert sizes[1] > sizes[0] == sizes[2] and paged_slot_bytes(config, D) == sizes[1]
    own, padded = SlotLayout(config, 0, D), SlotLayout(config, 0, D, slot_bytes=sizes[1])
    lengths = [37, 20]
    c_own, table, keys, values = _fill(own, lengths)
    c_pad, _, _, _ = _fill(padded, lengths)
    pages = c_pad.reshape(*c_pad.shape[:2], -1)  # a page holds its parts one after the other
    assert not pages[..., BLOCK * sizes[0] :].any()  # the bytes past this layer's parts stay unused
    np.testing.assert_array_equal(pages[..., : BLOCK * sizes[0]], c_own.reshape(*c_own.shape[:2], -1))
    q = np.random.default_rng(1).standard_normal((2, Q_HEADS, D)).astype(np.float32)
    seq, lens = np.array([0, 1]), np.array(lengths)
    np.testing.assert_array_equal(padded.attend(c_pad, q, seq, lens, table, D**-0.5), own.attend(c_own, q, seq, lens, table, D**-0.5))
    with pytest.raises(KvqrsError, match=f"slot_bytes: layer 1 needs {sizes[1]} bytes per slot, got {sizes[0]}"):
        SlotLayout(config, 1, D, slot_bytes=sizes[0])


def test_stored_bytes_are_the_codecs():
    layout = SlotLayout(QuantConfig("qkqv", 4, "qkqv", 4), layer=0, head_dim=D)
    cache, table, keys, _ = _fill(layout, [21])
    ck = layout.codec.encode_keys(keys[0])  # (tokens, kv_heads, d): parts (tokens, kv_heads, ...)
    page = cache[table[0, 1]].reshape(KV_HEADS, -1)  # tokens 16 .. 20 sit in the second block
    for p in (p for p in layout.parts if p.side == "keys"):
        rows = page[:, BLOCK * p.offset : BLOCK * (p.offset + p.row_bytes)].reshape(KV_HEADS, BLOCK, p.row_bytes)
        want = np.ascontiguousarray(ck.parts[p.name][16:21]).view(np.uint8).reshape(5, KV_HEADS, p.row_bytes)
        np.testing.assert_array_equal(rows[:, :5].transpose(1, 0, 2), want)
    # every stored byte counted: 3-bit codes of 64 + f16 norm + 64 sign bits + f16 residual norm
    assert layout.slot_bytes == 2 * (24 + 2 + 8 + 2)
    assert layout.bits_per_element() == pytest.approx(8 * 72 / 128)


def test_padding_slots_are_skipped():
    layout = SlotLayout(QuantConfig("kqv", 4, "kqv", 4), layer=0, head_dim=D)
    cache = _cache(layout, 2)
    x = np.ones((3, KV_HEADS, D), np.float32)
    layout.write(cache, x, x, np.array([-1, 5, -1]))
    touched = np.nonzero(cache.reshape(2, KV_HEADS, -1).any(axis=(0, 1)))[0]
    assert touched.size and np.all(cache[1] == 0)  # only block 0 written


def _matched_refusals() -> list:
    """``matched`` configs a paged cache refuses, with the words of the refusal."""
    import dataclasses

    per_token = _matched_config(1)
    cal = per_token.calibration
    value_basis = {
        i: dataclasses.replace(c, values=dataclasses.replace(c.keys, mean=c.value_mean, deviations=None)) for i, c in cal.items()
    }
    classes = {i: dataclasses.replace(c, value_bits=4, value_classes=((5, 16), (3, 16))) for i, c in cal.items()}
    group = "matched keys coded in groups of tokens"
    return [
        (_matched_config(1, deviations=False), rf"{group} \(layer 0\): calibrate with `kvqrs calibrate --key-scales tokens`"),
        (QuantConfig("matched", 3, "matched", 3, calibration="random"), f"{group} share per-channel statistics.*got 'random'"),
        (QuantConfig("kqv", 4, "matched", 4, calibration=value_basis), r"value scheme 'matched': .*\(layer 0 has a value basis\)"),
        (QuantConfig("matched", 4, "matched", 4, calibration=classes), r"width classes \(layer 0\).*without --value-classes"),
        (_matched_config(1, sink_tokens=2), "sink_tokens 2: sink tokens are kept in full precision, which paged slots do not hold"),
        (_matched_config(1, group=8, value_norms="log8"), "value_norms 'log8'"),
        (_matched_config(1, residual_length=8), "residual_length 8"),
    ]


@pytest.mark.parametrize(
    "config, match",
    [
        *_matched_refusals(),
        (QuantConfig("kqv", 4, "kqv", 4, sink_tokens=1), "sink_tokens 1: sink tokens are kept in full precision"),
        (QuantConfig("kivi", 2, "kivi", 2), "KIVI keys share per-channel statistics"),
        (QuantConfig("headq", 2, "kqv", 2, bases="random"), "HeadQ needs calibrated bases"),
        (QuantConfig("kqv", 2, "a2", 2), "A\\^2 gives every token its own width"),
        (QuantConfig("kqv", 4), "values kept in full precision"),
        (QuantConfig("kqv", 4, "kqv", 4, residual_length=8), "residual_length 8"),
        (QuantConfig("kqv", 4, "kv", 4, group=8, value_norms="log8"), "value_norms 'log8': log-coded norms share an exponent"),
    ],
)
def test_schemes_without_a_fixed_token_size_are_refused(config, match):
    assert refuse_reason(config) is not None
    with pytest.raises(KvqrsError, match=match):
        SlotLayout(config, 0, D)


def test_every_paged_scheme_is_accepted():
    for s in PAGED_SCHEMES:
        assert refuse_reason(QuantConfig(s, 4, s, 4)) is None
    # matched with per-token key scales and per-token MSE values, beside another scheme too
    for config in (
        _matched_config(1),
        _matched_config(KV_HEADS),
        QuantConfig("kqv", 4, "matched", 4, calibration=_matched_config(1).calibration),
    ):
        assert refuse_reason(config) is None
        assert SlotLayout(config, 0, D).slot_bytes > 0
    assert "matched calibrated with per-token key scales" in refuse_reason(QuantConfig("kivi", 2, "kivi", 2))


@pytest.mark.parametrize("config", MATCHED)
def test_matched_slots_hold_the_codecs_bytes_and_attend_as_decoded(config):
    """``matched`` keys (token runs in ``U diag(sigma)`` around the key mean) and values (the
    MSE stage around the value mean) in slots: the bytes each KV head's encode stores, written
    by the Python encode (or the native writer, the same bytes), and the attention of the
    pages equals decode-then-attend over the same tokens."""
    layout = SlotLayout(config, layer=1, head_dim=D)
    assert layout.table_heads == config.calibration[1].keys.kv_heads
    assert sorted(p.name for p in layout.parts if p.side == "keys") == ["codes1", "codes2", "codes3", "codes5", "scales"]
    python = SlotLayout(config, layer=1, head_dim=D)
    python._writer = None  # the Python encode path (the native one, where there is one, must agree)
    lengths = [37, 20]
    cache, table, keys, values = _fill(python, lengths)
    twin = _fill(layout, lengths)[0]
    assert cache.any() and cache.tobytes() == twin.tobytes()
    codec = layout.codec
    ck = codec.encode_keys(np.ascontiguousarray(keys[0].transpose(1, 0, 2)))  # (kv_heads, tokens, d)
    page = cache[table[0, 1]].reshape(KV_HEADS, -1)  # tokens 16 .. 31 sit in the second block
    for p in (p for p in layout.parts if p.side == "keys"):
        rows = page[:, BLOCK * p.offset : BLOCK * (p.offset + p.row_bytes)].reshape(KV_HEADS, BLOCK, p.row_bytes)
        want = np.ascontiguousarray(ck.parts[p.name][:, 16:32]).view(np.uint8).reshape(KV_HEADS, BLOCK, p.row_bytes)
        np.testing.assert_array_equal(rows, want, err_msg=p.name)
    # runs of 8 x 5, 16 x 3, 16 x 2 and 8 x 1 bits + f16 scale; 4-bit value codes + f16 norm
    assert layout.slot_bytes == (5 + 6 + 4 + 1 + 2) + (32 + 2)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, Q_HEADS, D)).astype(np.float32)
    seq, lens = np.array([0, 0, 1], np.int32), np.array([37, 5, 20], np.int32)
    out = layout.attend(cache, q, seq, lens, table, scale=D**-0.5)
    g = Q_HEADS // KV_HEADS
    for t in range(3):
        k, v = (np.ascontiguousarray(x[seq[t]][: lens[t]].transpose(1, 0, 2)) for x in (keys, values))
        kd = codec.decode_keys(codec.encode_keys(k)).astype(np.float64)  # (kv_heads, n, d)
        vd = codec.decode_values(codec.encode_values(v)).astype(np.float64)
        s = np.einsum("hgd,hnd->hgn", q[t].reshape(KV_HEADS, g, D).astype(np.float64), kd) * D**-0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hgn,hnd->hgd", p / p.sum(-1, keepdims=True), vd).reshape(Q_HEADS, D)
        np.testing.assert_allclose(out[t], want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(
            out[t], _reference(layout, q[t], keys[seq[t]], values[seq[t]], lens[t]), rtol=MERGE_RTOL, atol=MERGE_RTOL
        )


def test_matched_tables_must_serve_the_caches_kv_heads():
    """A per-head calibration has 1 table or one per KV head: a cache of other KV heads is
    refused by name, nothing written; the binding refuses tables that do not divide the KV
    heads and token runs as values."""
    from kvqrs import _native

    layout = SlotLayout(_matched_config(2), layer=0, head_dim=D)
    cache = _cache(layout, 2)
    x = np.ones((2, KV_HEADS, D), np.float32)
    with pytest.raises(KvqrsError, match="calibration: layer 0's tables are per KV head of 2 heads, the cache holds 3"):
        layout.write(cache, x, x, np.array([0, 1]))
    q = np.ones((1, Q_HEADS, D), np.float32)
    with pytest.raises(KvqrsError, match="tables are per KV head of 2 heads"):
        layout.attend(cache, q, [0], [2], np.array([[0, 1]]), 0.125)
    assert not cache.any()
    keys, values = layout._binding_rows(BLOCK)
    assert (keys.mean_heads, keys.rows.basis_heads, values.mean_heads) == (2, 2, 2)
    ints = (np.array([0], np.int32), np.array([2], np.int32), np.array([0, 1], np.int32))
    geometry = (cache.reshape(-1), 2, KV_HEADS, BLOCK, BLOCK * layout.slot_bytes, *cache.strides[:2])
    with pytest.raises(KvqrsError, match=r"keys.rows.basis: 1 table or one per KV head \(a divisor of the 3 KV heads\), got 2"):
        _native.paged_decode_attention(*geometry, _native.PageRows(keys, values), q.reshape(-1), Q_HEADS, D, 0.125, *ints, 2)
    shared = SlotLayout(_matched_config(1), layer=0, head_dim=D)._binding_rows(BLOCK)[0]
    assert (shared.mean_heads, shared.rows.basis_heads) == (1, 1)
    with pytest.raises(
        KvqrsError, match="values: expected MSERows or per-token UniformRows, alone or in CentredRows .*got CentredRows of TokenRunRows"
    ):
        _native.paged_decode_attention(*geometry, _native.PageRows(shared, shared), q.reshape(-1), Q_HEADS, D, 0.125, *ints, 2)


def test_bad_input_is_a_clean_error():
    layout = SlotLayout(QuantConfig("kqv", 4, "kqv", 4), layer=0, head_dim=D)
    cache = _cache(layout, 2)
    x = np.ones((2, KV_HEADS, D), np.float32)
    with pytest.raises(KvqrsError, match="slots: expected slots below 32"):
        layout.write(cache, x, x, np.array([0, 32]))
    for bad, match in (
        ([0.0, np.nan], "slots: expected integers, got dtype float64"),
        (np.array([0, 2**64 - 1], np.uint64), "within int64"),
    ):
        with pytest.raises(KvqrsError, match=match):
            layout.write(cache, x, x, bad)
    assert not cache.any()
    with pytest.raises(KvqrsError, match="cache: expected uint8"):
        layout.write(cache.astype(np.int16), x, x, np.array([0, 1]))
    with pytest.raises(KvqrsError, match="keys, values: expected"):
        layout.write(cache, x[:, :2], x[:, :2], np.array([0, 1]))
    with pytest.raises(KvqrsError, match="keys: expected finite values, got NaN"):
        layout.write(cache, np.full_like(x, np.nan), x, np.array([0, 1]))
    with pytest.raises(KvqrsError, match="values: expected finite values, got inf"):
        layout.write(cache, x, np.where(np.arange(D) == 3, np.inf, x).astype(np.float32), np.array([0, 1]))
    # A QJL residual norm below float16's normal range: the encoder widens the part to float32,
    # which a fixed-size float16 slot cannot hold; the error names the side and the part.
    tiny = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32) * 1e-6
    with pytest.raises(KvqrsError, match=r"values: expected qjl_norms in the slot's F16, got F32 \(a norm or scale outside"):
        layout.write(cache, x, tiny, np.array([0, 1]))
    assert not cache.any()
    for bad, match in ((x.astype(np.complex64), "keys: expected a float array, got dtype complex64"), (None, "keys: .*dtype object")):
        with pytest.raises(KvqrsError, match=match):
            layout.write(cache, bad, x, np.array([0, 1]))
    assert not cache.any()
    for bad in ("0", -1, True):
        with pytest.raises(KvqrsError, match="layer: expected an integer >= 0"):
            SlotLayout(QuantConfig("kqv", 4, "kqv", 4), layer=bad, head_dim=D)
    with pytest.raises(KvqrsError, match="query_start: expected"):
        query_positions(np.array([], np.int64), np.array([], np.int64))
    layout.write(cache, x.tolist(), x.tolist(), [0, 1])  # nested lists of floats are arrays
    assert cache.any()
    cache[:] = 0
    layout.write(cache, x, x, np.array([0, 1]))
    q = np.ones((1, Q_HEADS, D), np.float32)
    table = np.array([[0, 1]], np.int32)
    with pytest.raises(KvqrsError, match="lengths: expected 1 ..= 32"):
        layout.attend(cache, q, [0], [33], table, 0.125)
    with pytest.raises(KvqrsError, match="block_table: expected block ids in 0..2"):
        layout.attend(cache, q, [0], [20], np.array([[0, 7]]), 0.125)
    with pytest.raises(KvqrsError, match="q_heads: expected a positive multiple of the 3 KV heads"):
        layout.attend(cache, np.ones((1, 4, D), np.float32), [0], [2], table, 0.125)
    with pytest.raises(KvqrsError, match="q: expected finite"):
        layout.attend(cache, np.full_like(q, np.inf), [0], [2], table, 0.125)
    assert np.isfinite(layout.attend(cache, q, [0], [2], table, 0.125)).all()
    # A step's attention error leaves its new tokens written (the docstring says so).
    cache[:] = 0
    with pytest.raises(KvqrsError, match="q: expected finite"):
        layout.step(cache, x, x, [0, 1], np.full_like(q, np.inf), [0], [2], table, 0.125)
    assert cache.any()


def test_the_paged_binding_takes_typed_per_token_rows():
    """Each side reaches ``_native.paged_decode_attention`` (through ``_native.PageRows``) as its
    row object with page places in place of arrays: rows of another layout are a KvqrsError naming the side, a
    malformed object a TypeError naming the field, never a panic."""
    from kvqrs import _native
    from kvqrs.kernels.attention import DenseRows, UniformRows

    layout = SlotLayout(QuantConfig("kqv", 4, "kqv", 4), layer=0, head_dim=D)
    cache = _cache(layout, 2)
    x = np.ones((2, KV_HEADS, D), np.float32)
    layout.write(cache, x, x, np.array([0, 1]))
    keys, values = layout._binding_rows(BLOCK)
    q = np.ones(Q_HEADS * D, np.float32)

    def attend(k, v):
        ints = (np.array([0], np.int32), np.array([2], np.int32), np.array([0, 1], np.int32))
        return _native.paged_decode_attention(
            cache.reshape(-1),
            2,
            KV_HEADS,
            BLOCK,
            BLOCK * layout.slot_bytes,
            *cache.strides[:2],
            _native.PageRows(k, v),
            q,
            Q_HEADS,
            D,
            0.125,
            *ints,
            2,
        )

    want = layout.attend(cache, q.reshape(1, Q_HEADS, D), [0], [2], np.array([[0, 1]]), 0.125).reshape(-1)
    np.testing.assert_array_equal(attend(keys, values), want)
    with pytest.raises(KvqrsError, match="values: expected MSERows or per-token UniformRows"):
        attend(keys, DenseRows((0, 4)))
    per_channel = UniformRows((0, 4), (4, 2, "float16"), (6, 2, "float16"), 4, 32, per_channel=True)
    with pytest.raises(KvqrsError, match="keys: expected MSERows, per-token UniformRows or TokenRunRows, alone or in CentredRows"):
        attend(per_channel, values)
    with pytest.raises(KvqrsError, match="keys.norms: expected stored scalars of dtype 'float16' or 'float32', got \"int8\""):
        attend(keys._replace(norms=(*keys.norms[:2], "int8")), values)
    with pytest.raises(TypeError, match="argument 'keys': failed to extract field MSERows.codes"):
        attend(keys._replace(codes="codes"), values)
    with pytest.raises(TypeError, match="argument 'values': expected a row object"):
        attend(keys, {"kind": "mse"})


@pytest.mark.parametrize("scheme, bits", [("kqv", 4), ("kv", 8), ("qkqv", 3)])
def test_the_native_slot_writer_stores_the_python_encodes_bytes(scheme, bits):
    """Schemes whose coders encode natively write their slots in one native call (encode and
    scatter, GIL released): the same bytes as encoding in Python and scattering with NumPy,
    padding slots skipped, a prefill (one longer than a span the threads code apart) and a
    decode token alike."""
    native = SlotLayout(QuantConfig(scheme, bits, scheme, bits), layer=2, head_dim=D)
    python = SlotLayout(QuantConfig(scheme, bits, scheme, bits), layer=2, head_dim=D)
    assert native._writer is not None
    python._writer = None
    rng = np.random.default_rng(5)
    caches = [_cache(native, 40), _cache(native, 40)]
    for n, scale in ((13, 1.0), (1, 3e3), (6, 1e-3), (600, 1.0)):
        keys, values = (rng.standard_normal((n, KV_HEADS, D)).astype(np.float32) * scale for _ in range(2))
        slots = rng.choice(40 * BLOCK, n, replace=False)
        slots[::4] = -1
        for layout, cache in zip((native, python), caches):
            layout.write(cache, keys, values, slots)
    assert caches[0].any() and caches[0].tobytes() == caches[1].tobytes()


def test_the_native_slot_writer_refuses_what_its_slot_cannot_hold():
    layout = SlotLayout(QuantConfig("kqv", 4, "kqv", 4), layer=0, head_dim=D)
    cache = _cache(layout, 2)
    x = np.ones((2, KV_HEADS, D), np.float32)
    with pytest.raises(KvqrsError, match="norms"):  # norms beyond float16: the slot stores float16
        layout.write(cache, x * 1e5, x, np.array([0, 1]))
    with pytest.raises(KvqrsError, match="finite"):
        layout.write(cache, x, np.where(np.arange(D) == 3, np.nan, x), np.array([0, 1]))
    assert not cache.any()  # nothing written


@pytest.mark.parametrize("scheme, bits", [("kqv", 4), ("qkqv", 3), ("block", 4)])
def test_a_step_writes_then_attends_as_the_two_calls(scheme, bits):
    """``SlotLayout.step`` (one native call where the coders encode natively: the step's slots
    written, then the batch's attention through the block table, prefill and decode tokens
    alike) gives the bytes and outputs of ``write`` then ``attend``; a refused token writes
    nothing."""
    layout = SlotLayout(QuantConfig(scheme, bits, scheme, bits), layer=1, head_dim=D)
    assert (layout._writer is not None) == (scheme != "block")
    lengths = [37, 20, 1]
    cache, table, keys, values = _fill(layout, lengths)
    twin = cache.copy()
    rng = np.random.default_rng(3)
    # the step's new tokens: a decode token of sequence 0 (its 38th), 4 prefill tokens of sequence 1
    new_k, new_v = (rng.standard_normal((5, KV_HEADS, D)).astype(np.float32) for _ in range(2))
    pos = np.array([37, 20, 21, 22, 23])
    rows = np.array([0, 1, 1, 1, 1])
    slots = table[rows, pos // BLOCK] * BLOCK + pos % BLOCK
    seq, lens = rows.astype(np.int32), (pos + 1).astype(np.int32)
    q = rng.standard_normal((5, Q_HEADS, D)).astype(np.float32)
    got = layout.step(cache, new_k, new_v, slots, q, seq, lens, table, D**-0.5)
    layout.write(twin, new_k, new_v, slots)
    want = layout.attend(twin, q, seq, lens, table, D**-0.5)
    assert cache.tobytes() == twin.tobytes() and got.tobytes() == want.tobytes()
    bad = new_k.copy()
    bad[2, 1, 7] = np.inf
    with pytest.raises(KvqrsError, match="finite"):
        layout.step(cache, bad, new_v, slots, q, seq, lens, table, D**-0.5)
    assert cache.tobytes() == twin.tobytes()


def test_slots_are_bound_by_part_name_and_a_copied_part_is_an_error(monkeypatch):
    """The layout places each part a side's rows read by its name in the codec's ``Encoded``
    (the rows built over ``PartRef`` s): every part once. A
    coder whose ``attention_rows`` copies a part raises ``TypeError``; one that puts an array
    in a part's place a ``KvqrsError`` naming the field."""
    from kvqrs.schemes.mse import MSECoder, MSEQJLCoder

    layout = SlotLayout(QuantConfig("qkqv", 3, "kv", 4), layer=0, head_dim=D)
    assert sorted((p.side, p.name) for p in layout.parts) == [
        ("keys", "codes"),
        ("keys", "norms"),
        ("keys", "qjl_norms"),
        ("keys", "qjl_signs"),
        ("values", "codes"),
        ("values", "norms"),
    ]
    rows_of = MSECoder.rows_unchecked
    monkeypatch.setattr(MSECoder, "rows_unchecked", lambda self, enc: rows_of(self, enc)._replace(codes=np.array(rows_of(self, enc).codes)))
    with pytest.raises(TypeError, match="part 'codes': a PartRef names a stored part"):
        SlotLayout(QuantConfig("kqv", 4, "kqv", 4), layer=0, head_dim=D)
    monkeypatch.undo()
    keys_of = MSEQJLCoder.attention_rows
    signs = np.zeros((1, 1, 8), np.uint8)
    monkeypatch.setattr(
        MSEQJLCoder, "attention_rows", lambda self, enc: keys_of(self, enc)._replace(qjl=keys_of(self, enc).qjl._replace(signs=signs))
    )
    with pytest.raises(KvqrsError, match=r"keys.qjl.signs: expected a stored part \(a PartRef .*\), got ndarray"):
        SlotLayout(QuantConfig("qkqv", 3, "kv", 4), layer=0, head_dim=D)


@pytest.mark.parametrize("prefix", [0, 11])
def test_prefill_attention_is_causal_over_the_decoded_rows(prefix):
    """A prompt's dense attention (the whole sequence new, or after a cached prefix) equals a
    float64 causal softmax over the same rows, GQA groups reading their KV head."""
    torch = pytest.importorskip("torch")
    from kvqrs.vllm.prefill import prefill_attention

    rng = np.random.default_rng(5)
    m = 20
    keys, values = (rng.standard_normal((KV_HEADS, prefix + m, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((m, Q_HEADS, D)).astype(np.float32)
    out = prefill_attention(torch.from_numpy(q), keys, values, D**-0.5)
    assert out.shape == (m, Q_HEADS, D) and out.dtype == torch.float32
    g = Q_HEADS // KV_HEADS
    for i in range(m):
        n = prefix + i + 1
        s = np.einsum("hgd,hnd->hgn", q[i].reshape(KV_HEADS, g, D).astype(np.float64), keys[:, :n]) * D**-0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hgn,hnd->hgd", p / p.sum(-1, keepdims=True), values[:, :n]).reshape(Q_HEADS, D)
        np.testing.assert_allclose(out[i].numpy(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="prefill"):
        prefill_attention(torch.from_numpy(q), keys[:, : m - 1], values[:, : m - 1], 1.0)
