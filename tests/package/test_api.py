"""The public surface: exports, the error type, the type stubs against the runtime, and that no
Rust panic ever reaches Python whatever the native functions are handed."""

from __future__ import annotations

import ast
import inspect
import pathlib
import subprocess
import sys
from collections import namedtuple

import kvqrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvqrs import _native

# A declared part of a native LayerStore, read by attribute (kvqrs.hf.store.StorePart, without torch).
_StorePart = namedtuple("_StorePart", "name dtype widen outer inner num den")

STUB = pathlib.Path(kvqrs.__file__).with_name("_native.pyi")


def _stub_functions() -> dict[str, list[str]]:
    tree = ast.parse(STUB.read_text())
    return {node.name: [a.arg for a in node.args.args] for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_export_resolves():
    for name in kvqrs.__all__:
        assert getattr(kvqrs, name) is not None, name


def test_error_is_a_value_error_named_for_the_package():
    assert issubclass(kvqrs.KvqrsError, ValueError)
    assert kvqrs.KvqrsError.__module__ == "kvqrs"


def test_package_ships_type_information():
    assert STUB.is_file()
    assert STUB.with_name("py.typed").is_file()


def test_stub_matches_native_functions_and_parameters():
    stub = _stub_functions()
    runtime = {name: obj for name, obj in vars(_native).items() if callable(obj) and not isinstance(obj, type) and not name.startswith("_")}
    assert set(stub) == set(runtime), f"stub-only {set(stub) - set(runtime)}, runtime-only {set(runtime) - set(stub)}"
    for name, params in stub.items():
        got = list(inspect.signature(runtime[name]).parameters)
        assert got == params, f"{name}: runtime {got} vs stub {params}"


def test_version_matches_and_module_runs():
    out = subprocess.run([sys.executable, "-m", "kvqrs", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"kvqrs {kvqrs.__version__}"


def test_one_dtype_table_for_rust_and_python():
    """``kvqrs._native.DTYPES`` (the core's dtype enum: name -> (container code, bytes)) is the
    table the container format and the cache's saved sections read, and its sizes are NumPy's
    and torch's."""
    import torch
    from kvqrs import _native
    from kvqrs import format as fmt
    from kvqrs.hf import persist
    from kvqrs.hf.store import TORCH_CODES

    table = _native.DTYPES
    assert sorted(code for code, _ in table.values()) == list(range(len(table)))
    for name, (code, size) in table.items():
        if name == "utf-8":
            assert (code, size) == (fmt._UTF8, 1) == (persist._UTF8, 1)
            continue
        assert fmt._DTYPES[name] == code
        assert getattr(torch, name).itemsize == size
    assert {str(t).removeprefix("torch."): c for t, c in TORCH_CODES.items()} == {
        n: table[n][0] for n in ("float16", "float32", "float64", "bfloat16")
    }
    assert {c: n for n, (c, _) in table.items() if n.startswith(("float", "bfloat"))} == persist._FLOAT_CODES


def test_unsupported_dtypes_name_the_argument():
    with pytest.raises(kvqrs.KvqrsError, match=r"x: expected a float16, bfloat16, float32 or float64 array, got dtype int64"):
        kvqrs.hadamard(np.arange(8))
    with pytest.raises(kvqrs.KvqrsError, match=r"x: .*complex128"):
        kvqrs.mse_encode(np.ones(8, dtype=complex), 2)


# Arbitrary arguments straight into the native module: only KvqrsError / TypeError /
# OverflowError may come out. A pyo3 PanicException derives from BaseException, so it would
# escape the `except Exception` below and fail the test.
_sizes = st.integers(min_value=0, max_value=300) | st.sampled_from([2**31, 2**40, 2**63 - 1])
_f32 = st.integers(0, 600).map(lambda n: np.linspace(-3, 3, n, dtype=np.float32))
_u8 = st.integers(0, 600).map(lambda n: (np.arange(n) % 7).astype(np.uint8))
_norms = st.integers(0, 40).map(lambda n: np.ones(n, dtype=np.float16))


@settings(max_examples=500)
@given(
    fn=st.sampled_from(
        [
            lambda a, b, c, n, s: _native.pack_bits(b, a, s % 10),
            lambda a, b, c, n, s: _native.unpack_bits(b, a, s % 10),
            lambda a, b, c, n, s: _native.hadamard(c, a, s),
            lambda a, b, c, n, s: _native.inverse_hadamard(c, a, s),
            lambda a, b, c, n, s: _native.lloyd_max_codebook(a, s % 10),
            lambda a, b, c, n, s: _native.lloyd_max_encode(c, a, s % 10, a),
            lambda a, b, c, n, s: _native.lloyd_max_decode(b, a, s % 10),
            lambda a, b, c, n, s: _native.mse_encode(c, a, s % 10, s),
            lambda a, b, c, n, s: _native.mse_decode(b, n, a, s % 10, None),
            lambda a, b, c, n, s: _native.qjl_sketch(c, a, s % 300 + 1, s),
            lambda a, b, c, n, s: _native.mse_qjl_encode_packed(c, a, s % 10, s, s >> 1),
            # Buffers that alias each other or the new tokens (a borrow conflict) included.
            lambda a, b, c, n, s: _native.window_append(
                c, c if s % 2 else c.copy(), a, s % 9, c.reshape(1, 1, 1, -1), (c if s % 3 else c.copy()).reshape(1, 1, -1, 1)
            ),
            lambda a, b, c, n, s: _native.LayerStore([_StorePart("keys.codes", "uint8", False, [1], [8], 1, 1)]).encode_append(
                c.reshape(1, 1, -1, 1), c.reshape(1, 1, 1, -1), a
            ),
            lambda a, b, c, n, s: _native.qjl_inner_product(c, b, n, a, s % 300, s),
            lambda a, b, c, n, s: _native.qjl_vector_estimate(b, n, a, s % 300, s),
            lambda a, b, c, n, s: _native.headq_encode(c, c, a, s % 9, s % 10),
            lambda a, b, c, n, s: _native.headq_decode(b, n, c, a, s % 9, s % 10),
            lambda a, b, c, n, s: _native.headq_score_correction(c, b, n, c, a, s % 9, s % 10),
            lambda a, b, c, n, s: _native.absmax_encode(c, b[: s % 40]),
            lambda a, b, c, n, s: _native.absmax_decode(b, n, b[: s % 40]),
            lambda a, b, c, n, s: _native.random_orthonormal_basis(s, a, s % 9),
            lambda a, b, c, n, s: _native.qjl_matrix(s, a, s % 300),
            lambda a, b, c, n, s: _native.rotation_signs(s, a),
            lambda a, b, c, n, s: _native.gaussians(s, 1, a),
            lambda a, b, c, n, s: _native.decode_attention(
                c,
                {
                    "kind": ["mse", "uniform_tokens", "uniform_channels", "dense"][s % 4],
                    "codes": b,
                    "norms": n,
                    "scales": n,
                    "zeros": n,
                    "values": c,
                    "bits": s % 10,
                    "group": s % 40,
                    "seed": s if s % 3 else None,
                },
                {"kind": "dense", "values": c},
                {"codes": b, "scales": n, "basis": c, "basis_heads": s % 3, "rank": s % 5, "bits": s % 9, "sign": 1.0} if s % 2 else None,
                a % 7,
                s % 5,
                s % 7,
                a,
                1.0,
                bool(s % 2),
            ),
            # Never a valid path name, so the process-wide setting stays as it is.
            lambda a, b, c, n, s: _native.set_isa(f"isa{s}"),
        ]
    ),
    a=_sizes,
    b=_u8,
    c=_f32,
    n=_norms,
    s=st.integers(0, 2**64 - 1),
)
def test_native_functions_never_panic(fn, a, b, c, n, s):
    try:
        fn(a, b, c, n, s)
    except (kvqrs.KvqrsError, TypeError, OverflowError):
        pass


# Findings of the newcomer review: each of these used to return infinities, cast silently or
# raise something other than KvqrsError.
def test_results_that_overflow_the_output_dtype_raise():
    with pytest.raises(kvqrs.KvqrsError, match=r"result: expected values that fit the output dtype float16"):
        kvqrs.hadamard(np.full((1, 2), 60000, np.float16))
    x = np.full((1, 128), 3e18, np.float32)
    with pytest.raises(kvqrs.KvqrsError, match="float32"):
        kvqrs.qjl_inner_product(x, kvqrs.qjl_sketch(x, seed=1), seed=1)
    code = kvqrs.mse_encode(np.full((1, 128), 1e5, np.float32), 4, seed=1)
    with pytest.raises(kvqrs.KvqrsError, match="float16"):
        kvqrs.mse_decode(code.codes, code.norms, 4, 128, seed=1, dtype=np.float16)


def test_large_finite_rows_rotate_without_overflow():
    y = kvqrs.hadamard(np.full((1, 128), 1e37, np.float32), 1)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(np.linalg.norm(y.astype(np.float64)), 1e37 * np.sqrt(128), rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, bool, complex, object, None, "bogus"])
def test_output_dtype_must_be_a_float(dtype):
    code = kvqrs.mse_encode(np.ones((2, 64), np.float32), 2, seed=1)
    with pytest.raises(kvqrs.KvqrsError, match="dtype: expected float16, bfloat16, float32 or float64"):
        kvqrs.mse_decode(code.codes, code.norms, 2, 64, seed=1, dtype=dtype)


def test_ragged_and_foreign_inputs_raise_kvqrs_errors():
    with pytest.raises(kvqrs.KvqrsError, match="^x: expected an array"):
        kvqrs.hadamard([[1.0, 2.0], [3.0]])
    with pytest.raises(kvqrs.KvqrsError, match="sketch: expected a QJLSketch"):
        kvqrs.qjl_vector_estimate(None, 1)
    sk = kvqrs.qjl_sketch(np.ones((2, 16), np.float32), seed=1)
    with pytest.raises(kvqrs.KvqrsError, match="sketch.dim"):
        kvqrs.qjl_vector_estimate(sk._replace(dim=-1), 1)
    with pytest.raises(kvqrs.KvqrsError, match="codebook: expected a Codebook"):
        kvqrs.lloyd_max_decode(np.zeros(4, np.uint8), (128, 4))
    with pytest.raises(kvqrs.KvqrsError, match="count"):
        kvqrs.packed_size(-1, 4)
    with pytest.raises(kvqrs.KvqrsError, match="bits"):
        kvqrs.packed_size(3, 99)
    with pytest.raises(kvqrs.KvqrsError, match="head_dim <= 4096"):
        kvqrs.headq_basis(np.ones((1, 8192), np.float32), 1)


@pytest.mark.parametrize("args", [["selfcheck", "--head-dims", "1"], ["selfcheck", "--bits", "9"], ["selfcheck", "--vectors", "0"]])
def test_cli_reports_bad_arguments_without_a_traceback(args):
    out = subprocess.run([sys.executable, "-m", "kvqrs", *args], capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "error:" in out.stderr


# Second newcomer review: bad input to the scheme, metric and study layers.
def test_scheme_layer_rejects_inconsistent_input():
    from kvqrs.schemes import KVCodec

    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, 4, 40, 64)).astype(np.float32)
    q = rng.standard_normal((2, 8, 3, 64)).astype(np.float32)
    c = KVCodec("kqv", 4, 64)
    ck = c.encode_keys(k)
    with pytest.raises(kvqrs.KvqrsError, match="cv: expected values with the keys' heads and tokens"):
        c.attention(q, ck, c.encode_values(k[:, :2]))
    with pytest.raises(kvqrs.KvqrsError, match="cv: expected values with the keys' heads and tokens"):
        c.attention(q, ck, c.encode_values(k[..., :10, :]))
    with pytest.raises(kvqrs.KvqrsError, match="value_scheme: this codec keeps values in full precision"):
        KVCodec("kqv", 3, 64, value_scheme="none").attention(q, ck, None)
    cv = c.encode_values(k)
    with pytest.raises(kvqrs.KvqrsError, match=r"ck: expected encoded keys, got encoded values \(keys and values swapped\?\)"):
        c.attention(q, cv, ck)
    with pytest.raises(kvqrs.KvqrsError, match="cv: expected encoded values, got NoneType"):
        c.attention(q, ck, None)
    for bad, shown in ((float("nan"), "NaN"), (float("inf"), "inf"), (-0.5, "-0.5")):
        with pytest.raises(kvqrs.KvqrsError, match=f"scale: expected a finite positive logit scale, got {shown}$"):
            c.fused_attention(q[:, :4], ck, cv, scale=bad)
    with pytest.raises(kvqrs.KvqrsError, match="scale: expected a finite positive number, got 'a'"):
        c.fused_attention(q[:, :4], ck, cv, scale="a")
    with pytest.raises(kvqrs.KvqrsError, match="n: expected 0 <= n <= 40"):
        c.slice_tokens(ck, 100)
    with pytest.raises(kvqrs.KvqrsError, match=r"q: expected finite values, got nan at index \(0, 0, 0, 0\)"):
        c.scores(np.full_like(q, np.nan), ck)
    with pytest.raises(kvqrs.KvqrsError, match="basis: expected an array, None or 'random'"):
        KVCodec("headq", 2, 64, basis="rand")
    with pytest.raises(kvqrs.KvqrsError, match="n >= rank"):
        KVCodec("headq", 2, 64).calibrate(rng.standard_normal((2, 64)))
    kv = KVCodec("kivi", 2, 64)
    with pytest.raises(kvqrs.KvqrsError, match="whole groups of 32"):
        kv.concat([kv.encode_keys(k[..., :33, :]), kv.encode_keys(k[..., 33:, :])])
    a2 = KVCodec("kqv", 2, 64, value_scheme="a2")
    w = np.ones((2, 4, 40))
    w[1, 2, 3] = np.nan
    with pytest.raises(kvqrs.KvqrsError, match=r"weights: expected finite non-negative importances, got nan at index \(1, 2, 3\)"):
        a2.encode_values(k, weights=w)


def test_metrics_reject_bad_input():
    from kvqrs import metrics as M

    with pytest.raises(kvqrs.KvqrsError, match="NaN"):
        M.kl_divergence(np.full((2, 5), np.nan), np.zeros((2, 5)))
    with pytest.raises(kvqrs.KvqrsError, match="tokens >= 1"):
        M.kl_divergence(np.zeros((2, 0)), np.zeros((2, 0)))
    p = np.full((3, 8), 1 / 8)
    with pytest.raises(kvqrs.KvqrsError, match="k: expected an integer >= 1"):
        M.topk_recall(p, p, k=-1)
    with pytest.raises(kvqrs.KvqrsError, match="p_hat: expected the shape"):
        M.topk_recall(p, p[:, :5], k=3)
    with pytest.raises(kvqrs.KvqrsError, match="x_hat: expected the shape"):
        M.snr_db(np.ones((10, 8)), 2 * np.ones(8))
    with pytest.raises(kvqrs.KvqrsError, match="confidence"):
        M.mean_ci([1, 2, 3], confidence=1.5)
    with pytest.raises(kvqrs.KvqrsError, match="permutations"):
        M.energy_distance(np.ones((3, 2)), np.zeros((3, 2)), permutations=-1)


@pytest.mark.parametrize("kwargs", [{"outlier_channels": -1}, {"outlier_scale": np.nan}, {"noise": np.nan}, {"sharpness": np.inf}])
def test_synthetic_rejects_bad_parameters(kwargs):
    from kvqrs.synthetic import generate

    with pytest.raises(kvqrs.KvqrsError):
        generate("heavy-3", tokens=8, n_queries=2, head_dim=16, seed=0, **kwargs)
    with pytest.raises(kvqrs.KvqrsError, match="after '-'"):
        generate("heavy-", tokens=8, n_queries=2, head_dim=16, seed=0)


@pytest.mark.parametrize("args", [["study", "--quick", "--seeds", "0"], ["study", "--quick", "--permutations", "-1"]])
def test_study_cli_rejects_non_positive_counts(args):
    out = subprocess.run([sys.executable, "-m", "kvqrs", *args], capture_output=True, text=True)
    assert out.returncode == 2 and "expected a positive integer" in out.stderr and "Traceback" not in out.stderr
