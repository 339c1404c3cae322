"""Throughput of each WGSL shader (kvqrs.gpu, through wgpu-py) against the Rust path on the same
inputs, measured side by side in one run.

Usage: .venv/bin/python benches/bench_shaders.py [--vectors N] [--head-dim D] [--bits B]
Prints a Markdown table: vectors/s and GB/s of float32 input (vectors * head_dim * 4 bytes) for
each kernel on both paths, and the WGSL/Rust ratio. Every timing includes what a caller pays:
validation, the upload, the dispatches and the read-back (pipelines, constants and the buffer
pool are warmed by one untimed call). On lavapipe (Mesa's Vulkan on the CPU) this measures the
shaders on the CPU cores, not a GPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvqrs
from bench_kernels import best_of
from kvqrs import gpu


def cases(x: np.ndarray, b: int) -> list[tuple[str, Callable[[object], object]]]:
    """(name, fn(module)) pairs: ``fn`` runs one kernel call of ``module`` (kvqrs or kvqrs.gpu)."""
    d = x.shape[-1]
    code = kvqrs.mse_encode(x, b, seed=1)
    sketch = kvqrs.qjl_sketch(x, seed=2)
    basis = kvqrs.random_orthonormal_basis(3, d, 4)
    side = kvqrs.headq_encode(x, basis, 2)
    cb = kvqrs.lloyd_max_codebook(d, b)
    unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
    packed = kvqrs.pack_bits(code.codes, b)
    ucode = kvqrs.uniform_encode(x, b, 32)
    y = kvqrs.hadamard(x, 1)  # rotated rows (padded to a power of two) for the inverse
    return [
        ("pack_bits", lambda m: m.pack_bits(code.codes, b)),
        ("unpack_bits", lambda m: m.unpack_bits(packed, b, code.codes.shape[-1])),
        ("hadamard", lambda m: m.hadamard(x, 1)),
        ("inverse_hadamard", lambda m: m.inverse_hadamard(y, 1, d)),
        ("lloyd_max_encode", lambda m: m.lloyd_max_encode(unit, cb)),
        ("mse_encode", lambda m: m.mse_encode(x, b, seed=1)),
        ("mse_decode", lambda m: m.mse_decode(code.codes, code.norms, b, d, seed=1)),
        ("qjl_sketch (dense S)", lambda m: m.qjl_sketch(x, seed=2)),
        ("qjl_vector_estimate", lambda m: m.qjl_vector_estimate(sketch, seed=2)),
        ("qjl_inner_product (1 query)", lambda m: m.qjl_inner_product(x[:1], sketch, seed=2)),
        ("headq_encode r=4", lambda m: m.headq_encode(x, basis, 2)),
        ("headq_score_correction (1 query)", lambda m: m.headq_score_correction(x[:1], side, basis)),
        ("uniform_encode g=32", lambda m: m.uniform_encode(x, b, 32)),
        ("uniform_decode g=32", lambda m: m.uniform_decode(ucode)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", type=int, default=1 << 14)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    n, d, b = args.vectors, args.head_dim, args.bits
    if n < 1 or d < 2 or not 1 <= b <= 8:
        ap.error(f"expected --vectors >= 1, --head-dim >= 2 and --bits in 1..8, got {n}, {d}, {b}")
    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    dev = gpu.device("wgpu")
    info = dev.info
    print(f"kvqrs {kvqrs.__version__}, {platform.machine()}, {platform.processor() or platform.platform()}")
    print(f"WGSL adapter: {info.get('device')} ({info.get('backend_type')}, {info.get('adapter_type')}, {info.get('description')})")
    print(f"{n} vectors x head_dim {d}, {b} bits; best of {args.repeats}\n")
    print("| kernel | Rust vectors/s | Rust GB/s | WGSL vectors/s | WGSL GB/s | WGSL / Rust |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, fn in cases(x, b):
        fn(gpu)  # warm: compile the pipelines, upload the constants, fill the buffer pool
        t_rust = best_of(lambda fn=fn: fn(kvqrs), args.repeats)
        t_wgsl = best_of(lambda fn=fn: fn(gpu), args.repeats)
        gb = n * d * 4 / 1e9
        print(f"| {name} | {n / t_rust:,.0f} | {gb / t_rust:.3f} | {n / t_wgsl:,.0f} | {gb / t_wgsl:.3f} | {t_rust / t_wgsl:.2f} |")


if __name__ == "__main__":
    main()
