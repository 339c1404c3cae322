"""The speed harness: kvqrs side by side with a float32 memory copy, the NumPy oracle, torch and
the installable peers, in one run on the same inputs. Prints Markdown tables headed
by the machine they were measured on.

Sections (``--sections``, all by default):

- ``kernels``: the rotation and ``kqv`` 4-bit key encode/decode at ``--vectors`` x 128 float32
  (2^20: 512 MiB, more than a 480 MiB L3, so main memory is measured) against memcpy, a NumPy
  butterfly, the NumPy oracle, torch, ``hadamard-transform``, ``fht-cpu`` and ``ffht``;
- ``peers``: the TurboQuant peers' 4-bit quantize/dequantize against kvqrs on ``--peer-vectors``
  vectors (they run at ~0.1 GB/s, so fewer vectors keep the run short);
- ``append``: the Python-to-Rust overhead of appending one token, and cache updates;
- ``step``: one layer's decode step (update + attention) at ``--contexts`` cached tokens, back to
  back and with the CPU caches cold (as inside ``generate``), dense against ``QuantizedKVCache``;
- ``generate``: ``model.generate`` tokens/s on SmolLM2-135M at ``--contexts`` tokens of context,
  dense ``DynamicCache`` against ``QuantizedKVCache``;
- ``scoreboard``: every speed and memory target of ``QuantizedKVCache`` beside its measured
  value and bound (``speed_scoreboard``), for ``kqv`` 4/4, ``kivi`` 4/4 and the ``4bit`` preset,
  torch threads as ``fastest_threads`` chooses them.

Usage: ``bash scripts/bench.sh`` (installs the peers, then runs this), or
``.venv/bin/python benches/bench_speed.py [--quick] [--sections kernels peers append step generate]``.
``--quick`` is a smoke run on tiny sizes (seconds); the full run takes about 10-15 minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model is a local GGUF file
# torch's OpenMP threads (GNU libgomp) spin on their cores for a while after each parallel region
# by default; on a small CPU kvqrs' native attention, which runs between torch's regions, then
# waits for a core. Passive waits (read once, when torch loads OpenMP) give the core back; every
# row of a run, dense included, runs under the same policy. `--omp-wait default` keeps libgomp's
# (and so does an import of this module after torch: the runtime has read its policy by then).
_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--omp-wait", default="passive")
if "torch" not in sys.modules and _early.parse_known_args()[0].omp_wait == "passive":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion progress bar
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5: past_key_values renamed

import numpy as np  # noqa: E402 (after the environment settings above)
import torch  # noqa: E402 (after the environment settings above)
from speed_common import machine  # noqa: E402 (after the environment settings above)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of the harness")
    ap.add_argument(
        "--omp-wait",
        choices=["passive", "default"],
        default="passive",
        help="torch's OpenMP wait policy for every row: passive (OMP_WAIT_POLICY=PASSIVE unless set; the default) or libgomp's default (spin, then sleep)",
    )
    ap.add_argument(
        "--sections",
        nargs="+",
        default=["kernels", "peers", "append", "step", "generate", "scoreboard"],
        choices=["kernels", "peers", "append", "step", "generate", "scoreboard"],
    )
    ap.add_argument("--calibration", help="the 4bit preset's calibration file for the scoreboard (default: a small one fitted once)")
    ap.add_argument("--vectors", type=int, default=None, help="vectors of head_dim 128 for the kernels (default 2^20)")
    ap.add_argument("--oracle-vectors", type=int, default=None, help="vectors for the float64 oracle (default 2^16)")
    ap.add_argument("--peer-vectors", type=int, default=None, help="vectors for the TurboQuant peers (default 2^16)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per row, best kept (default 5)")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch / OpenMP threads of every row (default: all CPUs; the scoreboard: as fastest_threads chooses)",
    )
    ap.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="cached tokens of the step and generate sections (default 1024 4096 16384)"
    )
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens timed per generation (default 32)")
    ap.add_argument("--residual", type=int, default=128, help="QuantizedKVCache full-precision window (step and generate)")
    ap.add_argument(
        "--isa",
        choices=["scalar", "avx2", "avx512", "neon"],
        help="run kvqrs' float kernels on this path instead of the dispatched one (kvqrs._native.set_isa; e.g. avx2 on an AVX-512 machine)",
    )
    ap.add_argument(
        "--pack-path",
        choices=["scalar", "shift", "bmi2"],
        help="bit packing and unpacking on this path instead of the dispatched one (kvqrs._native.set_pack_path)",
    )
    ap.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = {
        "vectors": 1 << (12 if q else 20),
        "oracle_vectors": 1 << (10 if q else 16),
        "peer_vectors": 1 << (10 if q else 16),
        "repeats": 1 if q else 5,
        "contexts": [64] if q else [1024, 4096, 16384],
        "new_tokens": 4 if q else 32,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def _set_paths(isa: str | None, pack_path: str | None) -> None:
    """Force kvqrs' float-kernel isa and pack path for this process (the machine line then
    shows them); a path this CPU lacks exits with the binding's message."""
    import kvqrs._native as native

    try:
        if isa is not None:
            native.set_isa(isa)
        if pack_path is not None:
            native.set_pack_path(pack_path)
    except Exception as e:  # the binding's KvqrsError: the CPU lacks the path
        sys.exit(f"bench_speed: {e}")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    given_threads, args.threads = args.threads, args.threads or os.cpu_count()
    torch.set_num_threads(args.threads)
    if args.peer_worker:
        from speed_kernels import peer_worker

        return peer_worker(args.peer_worker, args.peer_vectors, args.repeats, args.threads)
    start = time.perf_counter()
    _set_paths(args.isa, args.pack_path)
    print(machine(args.threads), flush=True)
    if "kernels" in args.sections:
        from speed_kernels import codec_rows, kernel_table, rotation_rows

        notes: list[str] = []
        x = np.random.default_rng(0).standard_normal((args.vectors, 128)).astype(np.float32)
        rows = rotation_rows(x, args.repeats, args.oracle_vectors, args.threads, notes) + codec_rows(x, args.repeats)
        del x
        print(
            f"\n### Kernels: {args.vectors} vectors x head_dim 128 float32 ({args.vectors * 512 / 2**20:.0f} MiB), best of {args.repeats}\n"
        )
        print(kernel_table(rows))
        for n in notes:
            print(f"\nnote: {n}")
    if "peers" in args.sections:
        from speed_kernels import quantizer_table

        print(f"\n### TurboQuant peers: {args.peer_vectors} vectors x 128, 4 bits, best of {args.repeats}\n")
        print(quantizer_table(args.peer_vectors, args.repeats, args.threads), flush=True)
    if "append" in args.sections:
        from speed_append import append_table

        print("\n### Appending one token (kqv, head_dim 128; cache rows: SmolLM2-135M's layer shape)\n")
        print(append_table([256] if args.quick else [1024, 4096], args.quick), flush=True)
    if "step" in args.sections:
        from speed_step import step_table

        print(
            "\n### One layer's decode step (update + attention; 3 KV heads x 3 query heads, head_dim 64), "
            "median of calls back to back (warm) and after writing 64 MiB (cold)\n"
        )
        # --quick: still enough tokens that the cache codes some beyond its window
        print(step_table([4 * args.residual] if args.quick else args.contexts, args.quick, args.residual), flush=True)
    if "generate" in args.sections:
        from speed_generate import generation_table

        rounds = 1 if args.quick else 2
        print(
            f"\n### model.generate on SmolLM2-135M (float32): {args.new_tokens} greedy tokens after the prompt, torch threads={args.threads}, best of {rounds} interleaved rounds\n"
        )
        generation_table(args.contexts, args.new_tokens, args.residual, rounds)
    if "scoreboard" in args.sections:
        from speed_scoreboard import scoreboard

        print("\n### Scoreboard: QuantizedKVCache in model.generate (SmolLM2-135M float32) against its targets\n")
        rounds = 1 if args.quick else 2
        print(scoreboard(args.contexts, args.new_tokens, args.residual, rounds, given_threads, args.calibration), flush=True)
    print(f"\n(harness run: {time.perf_counter() - start:.0f} s; {machine(args.threads).split('; ')[0].split(', ')[-1]} at the end)")


if __name__ == "__main__":
    sys.exit(main())
