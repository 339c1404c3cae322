"""Decode attention from a compressed cache against torch SDPA over a dense cache, side by side in
one run on the same inputs: one query token, 9 query heads over 3 KV heads (GQA),
head_dim 64 (SmolLM2-135M's attention), at 4k and 32k cached tokens.

Rows: ``torch.nn.functional.scaled_dot_product_attention`` over a float32 and a bfloat16 cache
(``enable_gqa``: no key copied per query head), ``KVCodec.fused_attention`` from 4-bit codes for
several schemes (the whole call: argument checks, the Rust kernel, reshapes), the bare kernel
``kvqrs.kernels.decode_attention`` on prebuilt rows, and the decode-based reference
``KVCodec.attention(fused=False)`` (decode keys and values, then softmax) for ``kqv`` and
``matched``. A second table times, per scheme, encoding and decoding the keys and values (one
call each) beside the fused and the decode-based attention. ``matched`` runs its seeded
random-basis calibration (``random_calibration``: 4 bits on average in runs of 5, 4 and 3 bits,
groups of ``--matched-group`` tokens; values by the 4-bit Lloyd-Max stage around a mean): the
same layout and work as a fitted calibration of that budget. The machine's
last-level cache is large, so every row cycles through enough copies of its cache (``--cycle-mib``
of cache data) that each call reads main memory, as a decoder with many layers does.

Usage: .venv/bin/python benches/bench_attention.py [--tokens 4096 32768] [--cycle-mib 1024]
Prints a Markdown table: microseconds per call and the speed-up over SDPA float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
from kvqrs.kernels import decode_attention
from kvqrs.schemes import KVCodec
from kvqrs.schemes.base import Encoded
from kvqrs.schemes.matched import random_calibration

Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
REFERENCE_SCHEMES = ("kqv", "matched")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_codec(scheme: str, matched_group: int) -> KVCodec:
    """The 4-bit codec of a row (``matched``: the seeded random-basis calibration)."""
    if scheme == "matched":
        cal = random_calibration(HEAD_DIM, 4, 1)
        return KVCodec("matched", 4, HEAD_DIM, seed=1, value_scheme="matched", group=matched_group, calibration=cal)
    return KVCodec(scheme, 4, HEAD_DIM, seed=1)


def timed(fns: list[Callable[[], Any]], passes: int) -> float:
    """Median over ``passes`` of the mean seconds per call when calling every ``fns[i]`` once
    in turn (each on its own copy of the cache)."""
    fns[0]()  # warm-up: codebooks, sketch matrices, thread pools
    per_pass = []
    for _ in range(passes):
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        per_pass.append((time.perf_counter() - t0) / len(fns))
    return statistics.median(per_pass)


def copies(nbytes: int, cycle_mib: int) -> int:
    """Copies of a cache of ``nbytes`` that together exceed ``cycle_mib`` MiB."""
    return max(1, -(-cycle_mib * 2**20 // max(nbytes, 1)))


def copy_encoded(enc: Encoded) -> Encoded:
    return Encoded(enc.scheme, enc.kind, enc.shape, enc.dtype, {k: np.array(v, copy=True) for k, v in enc.parts.items()}, enc.params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--cycle-mib", type=int, default=1024, help="cache data cycled through per row (beyond the LLC)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--schemes", nargs="+", default=["kv", "kqv", "kivi", "qkqv", "matched"])
    ap.add_argument("--matched-group", type=int, default=128, help="tokens per scale group of the matched rows")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"machine: {cpu_model()}, nproc {os.cpu_count()}, load average {load}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), kvqrs rayon pool: RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'default')}"
    )
    print(
        f"shape: {Q_HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, 1 query token; "
        f"each row cycles through >= {args.cycle_mib} MiB of cache\n"
    )
    rows: list[tuple[int, str, float, int]] = []
    codec_rows: list[tuple[int, str, float, float, float, float | None]] = []
    for t in args.tokens:
        k = rng.standard_normal((1, KV_HEADS, t, HEAD_DIM)).astype(np.float32)
        v = rng.standard_normal((1, KV_HEADS, t, HEAD_DIM)).astype(np.float32)
        q = rng.standard_normal((1, Q_HEADS, 1, HEAD_DIM)).astype(np.float32)
        qt = torch.from_numpy(q)
        for name, dtype in (("SDPA float32 cache", torch.float32), ("SDPA bfloat16 cache", torch.bfloat16)):
            kt, vt = torch.from_numpy(k).to(dtype), torch.from_numpy(v).to(dtype)
            n = copies(2 * kt.numel() * kt.element_size(), args.cycle_mib)
            caches = [(kt.clone(), vt.clone()) for _ in range(n)]
            qd = qt.to(dtype)
            with torch.no_grad():
                fns = [
                    lambda kk=kk, vv=vv, qd=qd: torch.nn.functional.scaled_dot_product_attention(qd, kk, vv, enable_gqa=True)
                    for kk, vv in caches
                ]
                rows.append((t, name, timed(fns, args.passes), 2 * kt.numel() * kt.element_size()))
            del caches, fns
        for scheme in args.schemes:
            codec = make_codec(scheme, args.matched_group)
            ck, cv = codec.encode_keys(k), codec.encode_values(v)
            enc = timed([lambda codec=codec, k=k, v=v: (codec.encode_keys(k), codec.encode_values(v))], args.passes)
            dec = timed([lambda codec=codec, ck=ck, cv=cv: (codec.decode_keys(ck), codec.decode_values(cv))], args.passes)
            n = copies(ck.nbytes + cv.nbytes, args.cycle_mib)
            caches = [(copy_encoded(ck), copy_encoded(cv)) for _ in range(n)]
            fns = [lambda a=a, b=b, codec=codec, q=q: codec.fused_attention(q, a, b) for a, b in caches]
            label = f"fused {scheme} k4 v{4 if scheme not in ('kqv', 'qkqv') else '3+QJL'}"
            fused = timed(fns, args.passes)
            rows.append((t, label, fused, ck.nbytes + cv.nbytes))
            if scheme == args.schemes[0]:
                prepared = [codec.fused_rows(a, b) for a, b in caches]
                qg = q.reshape(1, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
                fns = [lambda r=r, qg=qg: decode_attention(qg, r[0], r[1], side=r[2]) for r in prepared]
                rows.append((t, f"  bare kernel ({scheme})", timed(fns, args.passes), ck.nbytes + cv.nbytes))
                del prepared
            ref = None
            if scheme in REFERENCE_SCHEMES:
                ref = timed([lambda codec=codec, q=q, ck=ck, cv=cv: codec.attention(q, ck, cv, fused=False)], max(1, args.passes // 2))
                rows.append((t, f"decode-based reference ({scheme})", ref, ck.nbytes + cv.nbytes))
            codec_rows.append((t, label[len("fused ") :], enc, dec, fused, ref))
            del caches, fns

    print("| tokens | method | cache MiB | us / call | vs SDPA fp32 | vs SDPA bf16 |")
    print("| ---: | :--- | ---: | ---: | ---: | ---: |")
    for t in args.tokens:
        base = {name: s for tt, name, s, _ in rows if tt == t}
        for tt, name, s, nbytes in rows:
            if tt != t:
                continue
            r32, r16 = base["SDPA float32 cache"] / s, base["SDPA bfloat16 cache"] / s
            print(f"| {t} | {name} | {nbytes / 2**20:.2f} | {s * 1e6:.0f} | {r32:.2f}x | {r16:.2f}x |")

    print("\nper scheme, one call each on the same keys and values (us): encode and decode keys + values,")
    print("fused attention (cycling through cache copies as above), decode-based attention (decode, then softmax)\n")
    print("| tokens | scheme | encode K+V | decode K+V | fused attention | decode-based attention |")
    print("| ---: | :--- | ---: | ---: | ---: | ---: |")
    for t, name, enc, dec, fused, ref in codec_rows:
        refs = "-" if ref is None else f"{ref * 1e6:.0f}"
        print(f"| {t} | {name} | {enc * 1e6:.0f} | {dec * 1e6:.0f} | {fused * 1e6:.0f} | {refs} |")


if __name__ == "__main__":
    main()
