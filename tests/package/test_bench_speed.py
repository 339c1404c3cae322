"""Smoke test of the speed harness (benches/bench_speed.py): a --quick run of the kernel and
append sections on tiny sizes. It checks that every row runs and that every rotation the harness
times computes kvqrs' rotation (the harness exits otherwise); it asserts no speed."""

from __future__ import annotations

import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCHES = pathlib.Path(__file__).resolve().parents[2] / "benches"


@pytest.fixture
def bench_speed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHES))
    import bench_speed

    return bench_speed


def test_quick_kernels_and_append(bench_speed, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        bench_speed.main(["--quick", "--sections", "kernels", "append", "--vectors", "256", "--oracle-vectors", "64", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.startswith("machine: ")
    for row in (
        "memcpy float32",
        "kvqrs.hadamard (rotation)",
        "NumPy butterfly",
        "torch butterfly",
        "kqv k4 encode",
        "kqv k4 decode",
        "KVCodec.encode_keys, 1 token",
        "QuantizedKVCache.update, kqv k4 v4",
    ):
        assert f"| {row}" in out, row
    assert "nan" not in out and "inf" not in out.replace("info", "")


def test_quick_step(bench_speed, capsys, monkeypatch):
    import torch
    from kvqrs.hf.store import CodeStore

    # The quantized rows must time the native decode step over the codes, not the window alone
    # (a steady step's one call, or a general step's attend).
    reads = []
    for name in ("attend", "step"):
        method = getattr(CodeStore, name)
        monkeypatch.setattr(CodeStore, name, lambda self, *a, _m=method, **k: reads.append(1) or _m(self, *a, **k))
    threads = torch.get_num_threads()
    try:
        bench_speed.main(["--quick", "--sections", "step", "--threads", "1", "--residual", "16"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for row in ("dense DynamicCache + SDPA", "QuantizedKVCache kqv k4 v4 (window 16)", "QuantizedKVCache kivi k4 v4 (window 16)"):
        assert f"| 64 | {row}" in out, row
    assert len(reads) >= 2 * 20
    assert "nan" not in out and "inf" not in out.replace("info", "")


def test_butterflies_compute_the_kvqrs_rotation(bench_speed):
    import kvqrs
    import numpy as np
    import torch
    from kvqrs.kernels import rotation_signs
    from speed_kernels import numpy_butterfly, torch_butterfly

    x = np.random.default_rng(0).standard_normal((33, 128)).astype(np.float32)
    s = rotation_signs(1, 128)
    want = kvqrs.hadamard(x, 1)
    np.testing.assert_allclose(numpy_butterfly(x, s, (np.empty_like(x), np.empty_like(x))), want, atol=1e-5)
    np.testing.assert_allclose(torch_butterfly(torch.from_numpy(x), torch.from_numpy(s)).numpy(), want, atol=1e-5)


def test_forced_paths_show_in_the_machine_line(bench_speed, capsys):
    import kvqrs._native as native

    try:
        bench_speed.main(["--quick", "--sections", "append", "--isa", "scalar", "--pack-path", "scalar", "--threads", "1"])
    finally:
        native.set_isa(None)
        native.set_pack_path(None)
    line = capsys.readouterr().out.splitlines()[0]
    assert "isa scalar" in line and "float kernels scalar (set_isa)" in line, line


def test_an_unknown_isa_is_refused_by_argparse(bench_speed):
    with pytest.raises(SystemExit) as e:
        bench_speed.parse(["--isa", "sse9"])
    assert e.value.code == 2
