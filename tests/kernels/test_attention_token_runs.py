"""Fused decode attention over :class:`TokenRunRows` keys (docs/kernels.md section 11): per-token
symmetric codes in runs of columns of a (not necessarily orthonormal) basis, one scale per token.

The kernel's output, log-sum-exp and probabilities are compared with a float64 reference that
decodes the keys by the definition in this file (``x_hat = z_hat B^T``, ``z_hat_i =
level(bits, code_i) * s_t``), and with :func:`kvqrs.oracle.decode_attention`.

Tolerances, as the other layouts' (tests/kernels/test_attention.py): probabilities within
``TOL (1 + L)`` relative, the log-sum-exp within ``TOL (1 + L)``, outputs within ``TOL (1 + L)``
of the largest ``|v|``, ``TOL = 1e-5``, where ``L = scale * max_j sum_c (|q| |B|)_c |z_hat_jc|``
bounds the absolute terms of a float32 logit computed in the basis (``q' = q B``, then
``q' . z_hat``; with a non-orthonormal basis this is the bound, not ``sum_i |q_i| |k_hat_ji|``,
which cancellation in ``k_hat`` can make smaller).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import KvqrsError, _native, oracle
from kvqrs.hf.store import StorePart
from kvqrs.kernels import CentredRows, DenseRows, TokenRun, TokenRunRows, decode_attention, pack_bits, packed_size
from kvqrs.kernels.attention import binding_rows, reads_natively

from tests.process_helpers import stdout_per_thread_count

TOL = 1e-5
PROB_ATOL = 1e-30


def levels(bits: int) -> np.ndarray:
    """``(2c - L) / L`` for every code c, ``L = 2^bits - 1``: one float32 division each."""
    top = (1 << bits) - 1
    return (2 * np.arange(top + 1) - top).astype(np.float32) / np.float32(top)


def coordinates(keys: TokenRunRows, codes: list[np.ndarray], d: int) -> np.ndarray:
    """``z_hat`` float64 ``(..., T, d)`` from the unpacked codes of each run."""
    scales = np.asarray(keys.scales).astype(np.float64)
    z = np.zeros((*scales.shape, d))
    for run, c in zip(keys.runs, codes):
        z[..., run.start : run.stop] = levels(run.bits)[c].astype(np.float64) * scales[..., None]
    return z


def per_head(basis: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """The basis of each leading index ``(*lead, d, d)`` (head i uses basis ``i % B``)."""
    b = np.asarray(basis, np.float64)
    if b.ndim == 2:
        return np.broadcast_to(b, (*lead, *b.shape))
    heads = int(np.prod(lead))
    return np.stack([b[i % b.shape[0]] for i in range(heads)]).reshape(*lead, *b.shape[1:])


class Problem:
    """Queries ``(..., rows, d)``, token-run keys, dense values and their unpacked codes."""

    def __init__(self, q, keys, values, codes, scale):
        self.q, self.keys, self.values, self.codes, self.scale = q, keys, values, codes, scale

    @property
    def d(self) -> int:
        return self.q.shape[-1]

    def reference(self):
        """float64 ``(out, lse, probs, L)`` by the definition."""
        lead = self.q.shape[:-2]
        z = coordinates(self.keys, self.codes, self.d)
        b = per_head(self.keys.basis, lead)
        k = z @ np.swapaxes(b, -1, -2)
        q = self.q.astype(np.float64)
        s = self.scale * (q @ np.swapaxes(k, -1, -2))
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        p = e / e.sum(-1, keepdims=True)
        lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
        # |q| |B| per column, dotted with |z_hat|: the float32 logit's absolute terms.
        qb = np.abs(q) @ np.abs(b)
        big = self.scale * (qb @ np.swapaxes(np.abs(z), -1, -2)).max(-1)
        return p @ np.asarray(self.values.values, np.float64), lse, p, big


@st.composite
def token_run_problems(draw, max_tokens: int = 600):
    """1-3 runs of 1..8 bits (widths that are and are not multiples of 8, gaps between runs
    and at the ends), 1..max_tokens tokens, 1-4 query rows, 1-3 KV heads (with or without a
    batch axis), float16 or float32 scales, one basis per head or one shared."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = draw(st.sampled_from([4, 8, 12, 17, 24, 40, 64]))
    lead = (draw(st.integers(1, 3)),) if draw(st.booleans()) else (2, draw(st.integers(1, 3)))
    t = draw(st.integers(1, max_tokens))
    rows = draw(st.integers(1, 4))
    runs, codes, at = [], [], draw(st.integers(0, 1))
    for _ in range(draw(st.integers(1, 3))):
        if at >= d:
            break
        stop = draw(st.integers(at + 1, d))
        bits = draw(st.integers(1, 8))
        c = rng.integers(0, 2**bits, size=(*lead, t, stop - at)).astype(np.uint8)
        runs.append(TokenRun(pack_bits(c, bits), bits, at, stop))
        codes.append(c)
        at = stop + draw(st.integers(0, 2))
    dtype = draw(st.sampled_from([np.float16, np.float32]))
    scales = (np.abs(rng.standard_normal((*lead, t))) * draw(st.sampled_from([0.01, 1.0, 10.0]))).astype(dtype)
    sigma = 1.0 + np.abs(rng.standard_normal(d))
    shape = (d, d) if draw(st.booleans()) else (lead[-1], d, d)
    basis = (rng.standard_normal(shape) / math.sqrt(d) * sigma).astype(np.float32)
    q = (rng.standard_normal((*lead, rows, d)) * draw(st.sampled_from([0.3, 1.0, 3.0]))).astype(np.float32)
    values = DenseRows(rng.standard_normal((*lead, t, d)).astype(np.float32))
    scale = draw(st.sampled_from([None, 0.5]))
    keys = TokenRunRows(tuple(runs), scales, basis)
    return Problem(q, keys, values, codes, 1.0 / math.sqrt(d) if scale is None else scale)


def check(pr: Problem, got) -> None:
    out, lse, p, big = pr.reference()
    bound = 1.0 + big
    vmax = np.abs(pr.values.values).max(axis=(-1, -2))[..., None]
    np.testing.assert_array_less(np.abs(got.lse - lse), TOL * bound)
    np.testing.assert_array_less(np.abs(got.probs - p), TOL * bound[..., None] * p + PROB_ATOL)
    np.testing.assert_array_less(np.abs(got.out - out).max(-1), TOL * bound * vmax)


@settings(max_examples=60, deadline=None)
@given(pr=token_run_problems())
def test_token_run_keys_match_the_float64_reference_and_the_oracle(pr):
    got = decode_attention(pr.q, pr.keys, pr.values, scale=pr.scale, probs=True)
    assert got.out.dtype == np.float32 and got.out.shape == pr.q.shape
    check(pr, got)
    o, lse, p = oracle.decode_attention(pr.q, pr.keys.spec(), pr.values.spec(), scale=pr.scale)
    bound = 1.0 + pr.reference()[3]
    np.testing.assert_array_less(np.abs(got.lse - lse), TOL * bound)
    np.testing.assert_array_less(np.abs(got.probs - p), TOL * bound[..., None] * p + PROB_ATOL)


@settings(max_examples=20, deadline=None)
@given(pr=token_run_problems(max_tokens=80), data=st.data())
def test_a_key_mean_enters_the_log_sum_exp_only(pr, data):
    """Around a mean (``CentredRows``): the same probabilities and output, the log-sum-exp
    shifted by ``scale * q . mean`` (so it merges exactly with a part whose logits hold the
    mean)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    d, lead = pr.d, pr.q.shape[:-2]
    mean = (rng.standard_normal((lead[-1], d) if data.draw(st.booleans()) else (d,)) * 3).astype(np.float32)
    bare = decode_attention(pr.q, pr.keys, pr.values, scale=pr.scale, probs=True)
    got = decode_attention(pr.q, CentredRows(pr.keys, mean), pr.values, scale=pr.scale, probs=True)
    assert got.probs.tobytes() == bare.probs.tobytes() and got.out.tobytes() == bare.out.tobytes()
    mu = per_head(mean[..., None], lead)[..., 0] if mean.ndim == 2 else np.broadcast_to(mean, (*lead, d))
    mu = np.asarray(mu, np.float64)
    q = pr.q.astype(np.float64)
    qmu = pr.scale * np.einsum("...rd,...d->...r", q, mu)
    big = 1.0 + pr.reference()[3] + pr.scale * np.einsum("...rd,...d->...r", np.abs(q), np.abs(mu))
    np.testing.assert_array_less(np.abs(got.lse - (bare.lse.astype(np.float64) + qmu)), TOL * big)
    _, lse, _ = oracle.decode_attention(pr.q, CentredRows(pr.keys, mean).spec(), pr.values.spec(), scale=pr.scale)
    np.testing.assert_array_less(np.abs(got.lse - lse), TOL * big)


def _problem(lead=(2,), t=9, d=12, rows=2):
    rng = np.random.default_rng(0)
    c0 = rng.integers(0, 8, size=(*lead, t, 5)).astype(np.uint8)
    c1 = rng.integers(0, 2, size=(*lead, t, 4)).astype(np.uint8)
    runs = (TokenRun(pack_bits(c0, 3), 3, 0, 5), TokenRun(pack_bits(c1, 1), 1, 7, 11))
    keys = TokenRunRows(runs, np.ones((*lead, t), np.float16), np.eye(d, dtype=np.float32))
    q = rng.standard_normal((*lead, rows, d)).astype(np.float32)
    return q, keys, DenseRows(rng.standard_normal((*lead, t, d)).astype(np.float32))


def test_bad_token_runs_raise_kvqrs_errors_naming_the_argument():
    q, keys, values = _problem()
    r0, r1 = keys.runs
    cases = [
        (keys._replace(runs=(r1, r0)), r"keys.runs\[1\]: expected columns 11 <= start < stop <= 12"),
        (keys._replace(runs=(r0, r1._replace(stop=13))), r"keys.runs\[1\]: expected columns 5 <= start < stop <= 12 .* got 7..13"),
        (keys._replace(runs=(r0, r1._replace(start=4))), r"keys.runs\[1\]: expected columns 5 <= start"),
        (keys._replace(runs=(r0._replace(bits=0), r1)), r"keys.runs\[0\].bits"),
        (keys._replace(runs=(r0._replace(bits=9), r1)), r"keys.runs\[0\].bits"),
        (keys._replace(runs=(r0._replace(codes=r0.codes[..., :-1]), r1)), r"keys.runs\[0\].codes"),
        (keys._replace(runs=(r0, r1._replace(codes=r1.codes.astype(np.float32)))), r"keys.runs\[1\].codes"),
        (keys._replace(runs=(r0, ("codes", 1, 7, 11))), r"keys.runs\[1\]: expected a TokenRun, got tuple"),
        (keys._replace(scales=keys.scales[..., :-1]), "keys: expected the values' 9 tokens, got 8"),
        (keys._replace(scales=keys.scales[..., None]), r"keys: expected leading shape \(2,\)"),
        (keys._replace(scales=keys.scales.astype(np.uint8)), "keys.scales"),
        (keys._replace(scales=-keys.scales), "keys.scales"),
        (keys._replace(scales=np.full_like(keys.scales, np.nan)), "keys.scales"),
        (keys._replace(basis=np.eye(11, dtype=np.float32)), r"keys.basis: expected shape \(12, 12\) or \(2 kv_heads, 12, 12\)"),
        (keys._replace(basis=np.stack([np.eye(12, dtype=np.float32)] * 3)), "keys.basis"),
        (keys._replace(basis=np.full((12, 12), np.inf, np.float32)), "keys.basis"),
        (CentredRows(keys, np.zeros(11, np.float32)), "keys.mean"),
    ]
    for bad, match in cases:
        with pytest.raises(KvqrsError, match=match):
            decode_attention(q, bad, values)
    # A key layout: refused as values, alone or around a mean.
    for v in (keys, CentredRows(keys, np.zeros(12, np.float32))):
        with pytest.raises(KvqrsError, match="values: expected value rows; TokenRunRows .* are a key layout"):
            decode_attention(q, values, v)
    # Keys of another token count than the values.
    with pytest.raises(KvqrsError, match="keys: expected the values' 8 tokens, got 9"):
        decode_attention(q, keys, DenseRows(values.values[..., :8, :]))
    with pytest.raises(KvqrsError, match="keys: expected leading shape"):
        decode_attention(q[None], keys, DenseRows(values.values[None]))


def test_no_tokens_and_no_runs():
    """No tokens is an error (as for every layout); no runs at all scores every token 0."""
    q, keys, values = _problem(t=0)
    with pytest.raises(KvqrsError, match="at least one token"):
        decode_attention(q, keys, values)
    q, keys, values = _problem()
    got = decode_attention(q, keys._replace(runs=()), values, probs=True)
    np.testing.assert_allclose(got.probs, 1.0 / 9, rtol=1e-6)
    np.testing.assert_allclose(got.lse, math.log(9), rtol=1e-6)


def test_the_spec_and_layout_name_every_part():
    q, keys, values = _problem(lead=(1, 2), t=5)
    parts = keys.layout((1, 2), 5, 12)
    assert {n: (p.shape, p.dtype) for n, p in parts.items()} == {
        "runs[0].codes": ((1, 2, 5, packed_size(5, 3)), "uint8"),
        "runs[1].codes": ((1, 2, 5, packed_size(4, 1)), "uint8"),
        "scales": ((1, 2, 5), "scalar"),
    }
    spec = keys.spec()
    assert spec["kind"] == "token_runs" and [r["start"] for r in spec["runs"]] == [0, 7]
    assert reads_natively(keys) and reads_natively(CentredRows(keys, np.zeros(12, np.float32)))


def test_token_runs_do_not_depend_on_the_thread_count():
    """Above the work from which heads and chunks run on the pool: one thread gives the bytes of
    four."""
    script = (
        "import numpy as np, sys\n"
        "from kvqrs.kernels import DenseRows, TokenRun, TokenRunRows, decode_attention, pack_bits\n"
        "rng = np.random.default_rng(5)\n"
        "t, d = 1300, 64\n"
        "c = [rng.integers(0, 2**b, size=(2, 4, t, w)).astype(np.uint8) for b, w in ((4, 16), (3, 21), (8, 20))]\n"
        "runs = (TokenRun(pack_bits(c[0], 4), 4, 0, 16), TokenRun(pack_bits(c[1], 3), 3, 16, 37), TokenRun(pack_bits(c[2], 8), 8, 40, 60))\n"
        "keys = TokenRunRows(runs, rng.random((2, 4, t)).astype(np.float16), rng.standard_normal((4, d, d)).astype(np.float32))\n"
        "v = DenseRows(rng.standard_normal((2, 4, t, d)).astype(np.float32))\n"
        "q = rng.standard_normal((2, 4, 6, d)).astype(np.float32)\n"
        "r = decode_attention(q, keys, v, probs=True)\n"
        "sys.stdout.buffer.write(r.out.tobytes() + r.lse.tobytes() + r.probs.tobytes())\n"
    )
    outs = stdout_per_thread_count(script)
    assert outs[0] == outs[1] and len(outs[0]) > 0


def _as_part(a: np.ndarray) -> tuple[str, list[int], np.ndarray]:
    a = np.ascontiguousarray(a)
    return a.dtype.name, list(a.shape), a.reshape(-1).view(np.uint8)


@pytest.mark.parametrize("centred", [False, True])
def test_a_layer_store_binds_token_runs_by_name_and_attends_like_the_kernel(centred):
    """A native layer store holding the runs' codes, the scales and dense values as parts
    (appended in two chunks, so each head's rows have room after them) reads
    ``TokenRunRows`` bound to the parts by name, and its attend gives the kernel's bits on
    the compact arrays."""
    b, h, d, rows = 1, 2, 12, 3
    chunks = [_problem(lead=(b, h), t=t, d=d, rows=rows) for t in (7, 5)]
    keys = chunks[0][1]
    parts = [
        StorePart("keys.runs[0].codes", "uint8", False, [b, h], [packed_size(5, 3)], 1, 1),
        StorePart("keys.runs[1].codes", "uint8", False, [b, h], [packed_size(4, 1)], 1, 1),
        StorePart("keys.scales", "float16", True, [b, h], [], 1, 1),
        StorePart("values.fp", "float32", False, [b, h], [d], 1, 1),
    ]
    store = _native.LayerStore(parts)
    for _, k, v in chunks:
        arrays = [k.runs[0].codes, k.runs[1].codes, k.scales, v.values]
        store.append([_as_part(a) for a in arrays], v.values.shape[-2])
    t = store.tokens
    assert t == 12
    mean = np.linspace(-1, 1, d, dtype=np.float32)
    named = TokenRunRows(
        tuple(r._replace(codes=f"keys.runs[{i}].codes") for i, r in enumerate(keys.runs)), "keys.scales", np.eye(d, dtype=np.float32)
    )
    named = CentredRows(named, mean) if centred else named
    store.set_rows(binding_rows(named, "keys", (b, h), d, lambda p, _: p), DenseRows("values.fp"))
    q = np.random.default_rng(3).standard_normal((b, h, rows, d)).astype(np.float32)
    none = np.zeros(0, np.float32)
    out, lse = store.attend(q.reshape(-1), b * h, rows, d, 0.3, 1, none, none, 0, none, none, 0, 0, 0, None, b)
    cat = lambda f: np.concatenate([f(c) for c in chunks], axis=-2 if f(chunks[0]).ndim > 3 else -1)  # noqa: E731
    compact = TokenRunRows(
        tuple(r._replace(codes=cat(lambda c, i=i: c[1].runs[i].codes)) for i, r in enumerate(keys.runs)),
        cat(lambda c: c[1].scales),
        np.eye(d, dtype=np.float32),
    )
    values = DenseRows(cat(lambda c: c[2].values))
    want = decode_attention(q, CentredRows(compact, mean) if centred else compact, values, scale=0.3)
    assert out.tobytes() == want.out.reshape(-1).tobytes()
    assert lse.tobytes() == want.lse.reshape(-1).tobytes()
    # As values: refused by the store as by the kernel.
    with pytest.raises(KvqrsError, match="values: per-token runs in a basis .* are a key layout"):
        store.set_rows(DenseRows("values.fp"), binding_rows(named, "keys", (b, h), d, lambda p, _: p))
