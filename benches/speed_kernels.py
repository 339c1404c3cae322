"""Kernel throughput against the bandwidth ceiling and the peers (part (a) of the harness).

Every row is timed on the same float32 input ``(vectors, 128)`` in one run: memcpy, the kvqrs
rotation, NumPy and torch butterflies, the ``hadamard-transform``, ``fht-cpu`` and
``ffht-unofficial`` peers, and ``kqv`` 4-bit key encode/decode through the public API. The
TurboQuant peers run in a subprocess each (``turboquant`` 0.2.0 installs into a folder of its own
because it shares the package name ``turboquant`` with ``turboquant-torch``) on fewer vectors,
next to kvqrs on the same vectors.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Any, Callable

import kvqrs
import numpy as np
import torch
from kvqrs import oracle
from kvqrs.kernels import rotation_signs
from kvqrs.schemes import KVCodec
from speed_common import best_of, gbs, table

HEAD_DIM, BITS, SEED = 128, 4, 1
ROOT = pathlib.Path(__file__).resolve().parent.parent
PEER_DIR = ROOT / ".venv" / "peers"


def numpy_butterfly(x: np.ndarray, signs: np.ndarray, work: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The randomized rotation as a NumPy radix-2 butterfly (float32, two reused buffers):
    ``H (s * x) / sqrt(d)``, the same transform as ``kvqrs.hadamard(x, seed)``."""
    n, d = x.shape
    a, b = work
    np.multiply(x, signs * np.float32(1 / math.sqrt(d)), out=a)
    h = 1
    while h < d:
        src, dst = a.reshape(n, d // (2 * h), 2, h), b.reshape(n, d // (2 * h), 2, h)
        np.add(src[:, :, 0], src[:, :, 1], out=dst[:, :, 0])
        np.subtract(src[:, :, 0], src[:, :, 1], out=dst[:, :, 1])
        a, b = b, a
        h *= 2
    return a


def torch_butterfly(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The same rotation as a plain torch butterfly (one stack per stage)."""
    n, d = x.shape
    y = x * (signs / math.sqrt(d))
    h = 1
    while h < d:
        v = y.view(n, d // (2 * h), 2, h)
        y = torch.stack((v[:, :, 0] + v[:, :, 1], v[:, :, 0] - v[:, :, 1]), dim=2)
        h *= 2
    return y.view(n, d)


def _check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Every row must compute the same rotation (a harness that times a wrong transform
    measures nothing)."""
    err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    if err > 1e-4:
        raise SystemExit(f"bench: {name} disagrees with kvqrs.hadamard (max relative error {err:.2e})")


def rotation_rows(x: np.ndarray, repeats: int, oracle_vectors: int, threads: int, notes: list[str]) -> list[tuple]:
    """``(name, how, seconds, input bytes)`` for memcpy and every rotation."""
    n, d = x.shape
    nbytes = x.nbytes
    signs = rotation_signs(SEED, d)
    sample = x[:256]
    want = kvqrs.hadamard(sample, SEED)
    buf = np.empty_like(x)
    rows: list[tuple] = [
        ("memcpy float32", "np.copyto into a reused buffer", best_of(lambda: np.copyto(buf, x), repeats), nbytes),
        ("memcpy float32 (fresh memory)", "x.copy(): pays the page faults of new memory", best_of(lambda: x.copy(), repeats), nbytes),
        ("kvqrs.hadamard (rotation)", "allocating API, rayon pool", best_of(lambda: kvqrs.hadamard(x, SEED), repeats), nbytes),
    ]
    work = (np.empty_like(x), np.empty_like(x))
    _check("numpy butterfly", numpy_butterfly(sample, signs, (np.empty_like(sample), np.empty_like(sample))), want)
    rows.append(
        (
            "NumPy butterfly",
            "float32, 2 reused buffers, 1 thread",
            best_of(lambda work=work: numpy_butterfly(x, signs, work), repeats),
            nbytes,
        )
    )
    del work
    xs = x[:oracle_vectors]
    _check("oracle.hadamard", oracle.hadamard(sample, SEED).astype(np.float32), want)
    rows.append(
        (
            f"NumPy oracle (Sylvester matmul, float64; {len(xs)} vectors)",
            "oracle.hadamard",
            best_of(lambda: oracle.hadamard(xs, SEED), max(1, repeats // 2)),
            xs.nbytes,
        )
    )
    xt, st = torch.from_numpy(x), torch.from_numpy(signs)
    _check("torch butterfly", torch_butterfly(torch.from_numpy(sample), st).numpy(), want)
    with torch.no_grad():
        rows.append(("torch butterfly", f"plain torch, threads={threads}", best_of(lambda: torch_butterfly(xt, st), repeats), nbytes))
    rows += _peer_rotations(x, sample, signs, want, buf, repeats, threads, notes)
    return rows


def _peer_rotations(x, sample, signs, want, buf, repeats, threads, notes) -> list[tuple]:
    """Rows of the installable FWHT peers (skipped with a note when one is missing). They
    compute the plain unnormalized transform (no signs, no 1/sqrt(d)): less work than kvqrs;
    checked against kvqrs on ``s * x / sqrt(d)``."""
    d = x.shape[1]
    pre = sample * signs
    scale = np.float32(1 / math.sqrt(d))
    rows = []
    reset = lambda: np.copyto(buf, x)  # noqa: E731 - untimed: each in-place run starts from x
    if importlib.util.find_spec("hadamard_transform"):
        from hadamard_transform import hadamard_transform

        _check("hadamard-transform", hadamard_transform(torch.from_numpy(pre)).numpy(), want)
        xt = torch.from_numpy(x)
        with torch.no_grad():
            rows.append(
                (
                    "hadamard-transform (peer)",
                    f"torch, normalized, no signs, threads={threads}",
                    best_of(lambda: hadamard_transform(xt), repeats),
                    x.nbytes,
                )
            )
    else:
        notes.append("hadamard-transform: not installed")
    if importlib.util.find_spec("fht_cpu"):
        import fht_cpu

        _check("fht-cpu", fht_cpu.fht(pre.copy()) * scale, want)
        rows.append(
            (
                "fht-cpu (peer)",
                f"in place on a buffer, no signs/scale, OpenMP threads={threads}",
                best_of(lambda: fht_cpu.fht(buf, num_threads=threads), repeats, reset),
                x.nbytes,
            )
        )
    else:
        notes.append("fht-cpu: not installed")
    if importlib.util.find_spec("ffht"):
        import ffht

        _check("ffht", ffht.fht(pre.copy()) * scale, want)
        rows.append(
            (
                "ffht-unofficial (peer)",
                f"fht_ in place on a buffer, no signs/scale, nthreads={threads}",
                best_of(lambda: ffht.fht_(buf, threads), repeats, reset),
                x.nbytes,
            )
        )
    else:
        notes.append("ffht-unofficial: not installed")
    return rows


def codec_rows(x: np.ndarray, repeats: int) -> list[tuple]:
    """``kqv`` 4-bit keys through ``KVCodec`` (rotation + norm + Lloyd-Max codes + packing and
    back), and the MSE kernel alone (unpacked codes)."""
    codec = KVCodec("kqv", BITS, x.shape[1], seed=SEED)
    ck = codec.encode_keys(x)
    code = kvqrs.mse_encode(x, BITS, SEED)
    return [
        ("kqv k4 encode (KVCodec.encode_keys)", "allocating API, rayon pool", best_of(lambda: codec.encode_keys(x), repeats), x.nbytes),
        ("kqv k4 decode (KVCodec.decode_keys)", "allocating API, rayon pool", best_of(lambda: codec.decode_keys(ck), repeats), x.nbytes),
        ("kvqrs.mse_encode (4 bits, no packing)", "allocating API", best_of(lambda: kvqrs.mse_encode(x, BITS, SEED), repeats), x.nbytes),
        (
            "kvqrs.mse_decode (4 bits, no packing)",
            "allocating API",
            best_of(lambda: kvqrs.mse_decode(code.codes, code.norms, BITS, x.shape[1], SEED), repeats),
            x.nbytes,
        ),
    ]


def kernel_table(rows: list[tuple]) -> str:
    ref = {name: s for name, _, s, _ in rows}
    memcpy = rows[0][3] / ref["memcpy float32"]
    numpy_bf = rows[0][3] / ref["NumPy butterfly"] if "NumPy butterfly" in ref else None
    out = []
    for name, how, s, nbytes in rows:
        rate = nbytes / s
        vs_np = f"{rate / numpy_bf:.1f}x" if numpy_bf else ""
        out.append((name, how, f"{nbytes / 4 / HEAD_DIM / s / 1e6:.2f}", f"{gbs(nbytes, s):.3f}", f"{rate / memcpy:.3f}", vs_np))
    return table(["kernel", "how", "M vectors/s", "GB/s of float32 input", "vs memcpy", "vs NumPy butterfly"], out, "llrrrr")


# -- the TurboQuant peers ---------------------------------------------------------------------

PEERS = {
    "turboquant-torch": ("turboquant", None),
    "turbo-quant-lite": ("turbo_quant_lite", None),
    "pyturboquant-cpu": ("pyturboquant_cpu", None),
    "tqai": ("tqai", None),
    "turboquant": ("turboquant", PEER_DIR / "turboquant"),
}
"""Peer -> (import name, folder it was installed into with --target, or None for .venv)."""


def _peer_codec(peer: str) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], Any], str]:
    """``(encode, decode, note)`` of one peer at 4 bits, head_dim 128, MSE (no QJL) mode."""
    if peer == "turboquant-torch":
        import turboquant as tq

        q = tq.TurboQuantMSE(HEAD_DIM, bit_width=BITS, seed=0)
        return (lambda x: q.quantize(torch.from_numpy(x))), q.dequantize, "TurboQuantMSE, torch, codes unpacked"
    if peer == "turboquant":
        if not hasattr(np, "trapz"):  # its codebook uses np.trapz, removed in NumPy 2.0
            np.trapz = np.trapezoid
        import turboquant as tq

        q = tq.TurboQuantMSE(HEAD_DIM, BITS, device="cpu", seed=0)
        return (
            (lambda x: q.quantize(torch.from_numpy(x))),
            (lambda o: q.dequantize(*o)),
            "TurboQuantMSE, torch, dense rotation (np.trapz shimmed for NumPy 2)",
        )
    if peer == "turbo-quant-lite":
        from turbo_quant_lite import TurboQuant

        q = TurboQuant(HEAD_DIM, BITS, 0)
        return q.encode_batch, (lambda o: q.decode_batch(*o)), "encode_batch/decode_batch, NumPy float64, dense rotation"
    if peer == "pyturboquant-cpu":
        import pyturboquant_cpu as pq

        return (lambda x: pq.quantize_mse(x, BITS, seed=0)), pq.dequantize_mse, "quantize_mse/dequantize_mse, NumPy float64, packs codes"
    if peer == "tqai":
        from tqai.quantizer import PolarQuantizer

        q = PolarQuantizer(HEAD_DIM, BITS, seed=0)
        return (lambda x: q.quantize(torch.from_numpy(x))), (lambda o: q.dequantize(*o)), "PolarQuantizer, torch backend"
    raise SystemExit(f"bench: unknown peer {peer!r}")


def _as_np(y: Any) -> np.ndarray:
    return y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)


def peer_worker(peer: str, vectors: int, repeats: int, threads: int) -> None:
    """Run in a subprocess: time one peer's encode and decode, print JSON."""
    torch.set_num_threads(threads)
    x = np.random.default_rng(0).standard_normal((vectors, HEAD_DIM)).astype(np.float32)
    enc, dec, note = _peer_codec(peer)
    with torch.no_grad():
        code = enc(x)
        y = _as_np(dec(code)).reshape(x.shape)
        res = {
            "encode_s": best_of(lambda: enc(x), repeats),
            "decode_s": best_of(lambda: dec(code), repeats),
            "rel_mse": float(np.sum((y - x) ** 2) / np.sum(x**2)),
            "note": note,
        }
    print(json.dumps(res))


def _run_peer(peer: str, vectors: int, repeats: int, threads: int) -> dict:
    module, folder = PEERS[peer]
    env = dict(os.environ)
    if folder is not None:
        if not folder.is_dir():
            return {"error": f"not installed ({folder} missing)"}
        env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    elif importlib.util.find_spec(module) is None:
        return {"error": "not installed"}
    cmd = [
        sys.executable,
        str(pathlib.Path(__file__).with_name("bench_speed.py")),
        "--peer-worker",
        peer,
        "--peer-vectors",
        str(vectors),
        "--repeats",
        str(repeats),
        "--threads",
        str(threads),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"failed: {last[:160]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def quantizer_table(vectors: int, repeats: int, threads: int) -> str:
    """kvqrs ``kqv`` 4-bit keys against each TurboQuant peer at 4-bit MSE on the same vectors."""
    x = np.random.default_rng(0).standard_normal((vectors, HEAD_DIM)).astype(np.float32)
    codec = KVCodec("kqv", BITS, HEAD_DIM, seed=SEED)
    ck = codec.encode_keys(x)
    y = codec.decode_keys(ck)
    ours = {
        "encode_s": best_of(lambda: codec.encode_keys(x), repeats),
        "decode_s": best_of(lambda: codec.decode_keys(ck), repeats),
        "rel_mse": float(np.sum((y - x) ** 2) / np.sum(x**2)),
    }
    rows = [
        (
            "kvqrs kqv k4 (KVCodec)",
            f"{gbs(x.nbytes, ours['encode_s']):.3f}",
            f"{gbs(x.nbytes, ours['decode_s']):.3f}",
            "1.0x",
            "1.0x",
            f"{ours['rel_mse']:.4f}",
            "packed 4-bit codes + float16 norm",
        )
    ]
    for peer in PEERS:
        r = _run_peer(peer, vectors, repeats, threads)
        if "error" in r:
            rows.append((peer, "", "", "", "", "", r["error"]))
            continue
        rows.append(
            (
                peer,
                f"{gbs(x.nbytes, r['encode_s']):.3f}",
                f"{gbs(x.nbytes, r['decode_s']):.3f}",
                f"{r['encode_s'] / ours['encode_s']:.0f}x",
                f"{r['decode_s'] / ours['decode_s']:.0f}x",
                f"{r['rel_mse']:.4f}",
                r["note"],
            )
        )
    return table(
        [
            "quantizer (4 bits, head_dim 128)",
            "encode GB/s",
            "decode GB/s",
            "kvqrs encode speed-up",
            "kvqrs decode speed-up",
            "relative MSE",
            "notes",
        ],
        rows,
        "lrrrrrl",
    )
