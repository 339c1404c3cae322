"""Fuzz the compressed-cache reader (``kvqrs.format.loads``, Rust container + Python meta) for a
stated time: mutate valid containers of every scheme (bit flips, byte overwrites, insertions,
deletions, truncations, spliced headers, random bytes) and require that each input either loads
or raises ``KvqrsError``; anything else (another exception, a crash) is a finding.

One input per distinct error message (numbers stripped) is kept as the corpus that seeds the
regression test ``tests/schemes/test_format.py::test_fuzz_corpus``:

    python benches/fuzz_format.py --seconds 120 --corpus tests/corpus/format
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import random
import re
import sys
import time

import kvqrs
import numpy as np
from kvqrs import format as fmt
from kvqrs.schemes import KVCodec


def seeds() -> list[bytes]:
    """Valid containers: keys and values of every scheme, small shapes."""
    x = np.random.default_rng(0).standard_normal((1, 2, 33, 40)).astype(np.float32)
    out = []
    for scheme in ("kv", "kqv", "qkqv", "kivi", "block", "headq"):
        c = KVCodec(scheme, 3, 40, seed=1, basis="random" if scheme == "headq" else None)
        out += [fmt.dumps(c.encode_keys(x)), fmt.dumps(c.encode_values(x))]
    return out


def mutate(data: bytes, rng: random.Random, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 16))):
        op = rng.randrange(7)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3:
            del b[i : i + rng.randrange(1, 9)]
        elif op == 4:
            del b[i:]
        elif op == 5:
            other = rng.choice(pool)
            j = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[j:])
        else:
            b[i : i + 8] = rng.choice((0, 0xFF, 0x7F)).to_bytes(1, "little") * 8
    return bytes(b)


def signature(e: Exception) -> str:
    """The error's kind: its message with quoted names, shapes and numbers stripped."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'", "S", str(e))
    return re.sub(r"\d+", "N", re.sub(r"\[[^\]]*\]|\{[^}]*\}|\([^)]*\)", "[..]", text))[:90]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=pathlib.Path, help="folder to write one input per distinct error into")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    pool = seeds()
    kept: dict[str, bytes] = {}
    runs = loaded = 0
    findings = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        data = mutate(rng.choice(pool), rng, pool) if rng.random() < 0.97 else bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        runs += 1
        try:
            fmt.loads(data)
            loaded += 1
            if data not in pool:  # a changed input must not load (every byte is checksummed)
                findings.append((data, "loaded although changed"))
        except kvqrs.KvqrsError as e:
            kept.setdefault(signature(e), data)
        except Exception as e:
            findings.append((data, repr(e)))
    print(
        f"fuzz_format: {runs} inputs in {args.seconds:.0f} s, {loaded} loaded (unchanged or equivalent), "
        f"{runs - loaded} rejected with KvqrsError ({len(kept)} distinct messages), {len(findings)} findings"
    )
    for data, err in findings[:10]:
        print(f"  FINDING {err} on {len(data)} bytes: {data[:48].hex()}...")
    if args.corpus:
        args.corpus.mkdir(parents=True, exist_ok=True)
        for data in kept.values():
            (args.corpus / f"{hashlib.sha256(data).hexdigest()[:16]}.bin").write_bytes(data)
        for data, _ in findings:
            (args.corpus / f"finding-{hashlib.sha256(data).hexdigest()[:16]}.bin").write_bytes(data)
        print(f"corpus: {len(kept) + len(findings)} inputs written to {args.corpus}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
