"""Locating and composing the WGSL sources.

The single source of truth is the repository's top-level ``shaders/`` directory; the package
reaches it as ``kvqrs/shaders`` (a symlink in the source tree, a real directory inside the
wheel), found through :mod:`importlib.resources` so that an installed wheel works too.
WGSL has no ``#include``: each kernel file names the shared pieces it needs on a first line
``// kvqrs:requires common.wgsl philox.wgsl`` and :func:`source` prepends them.
"""

from __future__ import annotations

import functools
from importlib import resources

from .._arrays import KvqrsError

KERNEL_SHADERS = ("rng", "pack", "hadamard", "lloyd_max", "mse", "qjl", "headq", "uniform", "log_scalars", "absmax")
"""One shader per kernel (``<name>.wgsl``); ``common.wgsl`` and ``philox.wgsl`` are pieces."""

_REQUIRES = "// kvqrs:requires "


def shader_files() -> list[str]:
    """Names of the ``.wgsl`` files shipped with the installed package."""
    root = resources.files("kvqrs").joinpath("shaders")
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".wgsl"))


def read_shader(filename: str) -> str:
    """Text of one ``.wgsl`` file of the installed package.

    Raises:
        KvqrsError: the file is not shipped (a broken installation).
    """
    path = resources.files("kvqrs").joinpath("shaders", filename)
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise KvqrsError(
            f"shaders: {filename} is missing from the installed kvqrs package (expected it in kvqrs/shaders/); reinstall kvqrs"
        ) from None


@functools.cache
def source(name: str) -> str:
    """The complete WGSL module of kernel ``name``: its required pieces, then the kernel."""
    if name not in KERNEL_SHADERS:
        raise KvqrsError(f"shader: expected one of {KERNEL_SHADERS}, got {name!r}")
    text = read_shader(f"{name}.wgsl")
    first = text.splitlines()[0] if text else ""
    pieces = first[len(_REQUIRES) :].split() if first.startswith(_REQUIRES) else []
    return "\n".join([*(read_shader(p) for p in pieces), text])
