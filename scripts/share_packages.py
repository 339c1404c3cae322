"""Hard-link the packages two virtual environments have in common, instead of installing twice.

Usage: python scripts/share_packages.py SOURCE_VENV TARGET_VENV CONSTRAINTS

Every distribution installed in SOURCE_VENV whose version is the one CONSTRAINTS pins (pip's
``name==version`` lines) and that TARGET_VENV lacks is placed in TARGET_VENV: the files its RECORD
lists are hard-linked (same disk) or copied, and its console scripts are copied with their
``#!`` line pointing at TARGET_VENV's Python. pip then finds those pins satisfied and downloads
nothing for them. scripts/setup-vllm.sh runs this before installing vLLM's requirements, so that
torch and its CUDA libraries (about 5 GB) are stored once for .venv and .venv-vllm.

A linked file is shared: rewriting it in one environment changes the other. pip never rewrites
an installed file in place (it removes and recreates), and Python writes its caches the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from importlib.metadata import Distribution, distributions
from pathlib import Path


def canonical(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def site_packages(venv: Path) -> Path:
    """The one lib/pythonX.Y/site-packages folder of a POSIX virtual environment."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        sys.exit(f"share_packages: expected one site-packages folder in {venv}, found {len(found)}")
    return found[0]


def read_pins(constraints: Path) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line of a pip constraints file."""
    pins = {}
    for line in constraints.read_text().splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)\s*(#.*)?", line)
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def installed(site: Path) -> dict[str, Distribution]:
    return {canonical(d.metadata["Name"]): d for d in distributions(path=[str(site)])}


def place(source: Path, target: Path, source_python: str, target_python: str) -> None:
    """Link ``source`` at ``target``; a script naming the source environment's Python is copied
    with its first line rewritten instead."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() or target.is_symlink():
        return
    if target.parent.name == "bin":
        data = source.read_bytes()
        first, _, rest = data.partition(b"\n")
        if first.startswith(b"#!") and source_python.encode() in first:
            target.write_bytes(first.replace(source_python.encode(), target_python.encode()) + b"\n" + rest)
            shutil.copymode(source, target)
            return
    try:
        os.link(source, target)
    except OSError:  # another file system, or links refused: a copy is still one download fewer
        shutil.copy2(source, target)


def share(source_venv: Path, target_venv: Path, constraints: Path) -> list[str]:
    """Place the pinned distributions of ``source_venv`` that ``target_venv`` lacks; their names."""
    source_site, target_site = site_packages(source_venv), site_packages(target_venv)
    pins = read_pins(constraints)
    have = installed(target_site)
    source_python = str(source_venv.resolve() / "bin" / "python")
    target_python = str(target_venv.resolve() / "bin" / "python")
    shared = []
    for name, dist in sorted(installed(source_site).items()):
        if pins.get(name) != dist.version or name in have or dist.files is None:
            continue
        for rel in dist.files:
            source = Path(os.path.normpath(source_site / rel))  # rel may climb out: ../../../bin/x
            if not source.is_file():
                continue  # RECORD may list files a later step removed
            target = Path(os.path.normpath(target_site / rel))
            place(source, target, source_python, target_python)
        shared.append(f"{dist.metadata['Name']}=={dist.version}")
    return shared


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    shared = share(Path(argv[0]), Path(argv[1]), Path(argv[2]))
    print(f"share_packages: {len(shared)} packages linked from {argv[0]} into {argv[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
