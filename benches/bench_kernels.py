"""Throughput of each kvqrs kernel against a float32 memory copy (the bandwidth ceiling) and the
NumPy oracle, measured side by side in one run on the same inputs.

Usage: .venv/bin/python benches/bench_kernels.py [--vectors N] [--head-dim D] [--bits B]
Prints vectors/s, GB/s of float32 input and the ratio to memcpy for each kernel.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Callable

import kvqrs
import numpy as np
from kvqrs import oracle


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Smallest wall time of ``repeats`` calls (seconds)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vectors", type=int, default=1 << 16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--oracle-vectors", type=int, default=1 << 10, help="the oracle is timed on fewer vectors")
    args = ap.parse_args()

    n, d, b = args.vectors, args.head_dim, args.bits
    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    code = kvqrs.mse_encode(x, b, seed=1)
    sketch = kvqrs.qjl_sketch(kvqrs.hadamard(x, 1), seed=2)
    basis = kvqrs.random_orthonormal_basis(3, d, 4)
    side = kvqrs.headq_encode(x, basis, 2)
    xs = x[: args.oracle_vectors]

    cases: list[tuple[str, Callable[[], object], int]] = [
        ("memcpy float32", lambda: x.copy(), n),
        ("pack_bits", lambda: kvqrs.pack_bits(code.codes, b), n),
        ("hadamard", lambda: kvqrs.hadamard(x, 1), n),
        ("mse_encode", lambda: kvqrs.mse_encode(x, b, seed=1), n),
        ("mse_decode", lambda: kvqrs.mse_decode(code.codes, code.norms, b, d, seed=1), n),
        ("qjl_sketch (dense S)", lambda: kvqrs.qjl_sketch(x, seed=2), n),
        ("qjl_vector_estimate", lambda: kvqrs.qjl_vector_estimate(sketch, seed=2), n),
        ("headq_encode r=4", lambda: kvqrs.headq_encode(x, basis, 2), n),
        ("headq_score_correction", lambda: kvqrs.headq_score_correction(x[:1], side, basis), n),
        ("oracle.hadamard", lambda: oracle.hadamard(xs, 1), len(xs)),
        ("oracle.mse_encode", lambda: oracle.mse_encode(xs, b, 1), len(xs)),
    ]
    print(f"kvqrs {kvqrs.__version__}, {platform.machine()}, {platform.processor() or platform.platform()}")
    print(f"{n} vectors x head_dim {d}, {b} bits; best of {args.repeats}\n")
    print("| kernel | vectors/s | GB/s of float32 input | vs memcpy |")
    print("| --- | ---: | ---: | ---: |")
    memcpy_rate = None
    for name, fn, count in cases:
        t = best_of(fn, args.repeats)
        gbs = count * d * 4 / t / 1e9
        memcpy_rate = memcpy_rate or gbs
        print(f"| {name} | {count / t:,.0f} | {gbs:.3f} | {gbs / memcpy_rate:.3f} |")


if __name__ == "__main__":
    main()
