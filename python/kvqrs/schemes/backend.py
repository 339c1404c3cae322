"""Compute backends of the schemes: which implementation of the kernels a coder composes.

A :class:`Backend` exposes the kernel functions of docs/kernels.md under their
:mod:`kvqrs.kernels` names. ``"cpu"`` is the Rust path (the default); ``"wgpu"`` is the WGSL path
of :mod:`kvqrs.gpu` on its default device; a ``kvqrs.gpu.Device`` or ``wgpu.GPUAdapter`` selects
a device explicitly. Both paths produce the same codes and formats, so a tensor encoded on one
decodes on the other.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

import numpy as np

from .. import kernels
from .._arrays import KvqrsError

KERNEL_FUNCTIONS = (
    "absmax_decode",
    "absmax_encode",
    "hadamard",
    "headq_decode",
    "headq_encode",
    "headq_score_correction",
    "inverse_hadamard",
    "lloyd_max_decode",
    "lloyd_max_encode",
    "log_decode",
    "log_encode",
    "mse_decode",
    "mse_encode",
    "pack_bits",
    "qjl_inner_product",
    "qjl_sketch",
    "qjl_vector_estimate",
    "uniform_decode",
    "uniform_encode",
    "unpack_bits",
)
"""The kernel functions every backend provides (the ones the schemes call)."""

FUSED_FUNCTIONS = ("mse_decode_packed", "mse_encode_packed")
"""Fused compositions a backend may provide natively; composed from the kernels above when not."""


def _mse_encode_packed(f: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    def encode(x: Any, bits: int, seed: int | None = None, scale: str = "norm") -> kernels.MSECode:
        code = f["mse_encode"](x, bits, seed, scale)
        return kernels.MSECode(f["pack_bits"](code.codes, bits), code.norms)

    return encode


def _mse_decode_packed(f: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    def decode(packed: Any, norms: Any, bits: int, head_dim: int, seed: int | None = None, dtype: Any = np.float32) -> Any:
        code_dim = head_dim if seed is None else kernels.padded_dim(head_dim)
        codes = f["unpack_bits"](packed, bits, code_dim)
        return f["mse_decode"](codes, norms, bits, head_dim, seed, dtype=dtype)

    return decode


_COMPOSE = {"mse_encode_packed": _mse_encode_packed, "mse_decode_packed": _mse_decode_packed}


class Backend:
    """The kernel functions of one compute path.

    Args:
        name: ``"cpu"`` or ``"wgpu"``.
        functions: one callable per name in :data:`KERNEL_FUNCTIONS`, with the signature of
            the :mod:`kvqrs.kernels` function of that name; optionally the fused ones of
            :data:`FUSED_FUNCTIONS` (composed from the kernels when absent).

    Raises:
        KvqrsError: a kernel function is missing.
    """

    hadamard: Callable[..., Any]
    headq_decode: Callable[..., Any]
    headq_encode: Callable[..., Any]
    headq_score_correction: Callable[..., Any]
    inverse_hadamard: Callable[..., Any]
    lloyd_max_decode: Callable[..., Any]
    lloyd_max_encode: Callable[..., Any]
    log_decode: Callable[..., Any]
    log_encode: Callable[..., Any]
    mse_decode: Callable[..., Any]
    mse_decode_packed: Callable[..., Any]
    mse_encode: Callable[..., Any]
    mse_encode_packed: Callable[..., Any]
    pack_bits: Callable[..., Any]
    qjl_inner_product: Callable[..., Any]
    qjl_sketch: Callable[..., Any]
    qjl_vector_estimate: Callable[..., Any]
    uniform_decode: Callable[..., Any]
    uniform_encode: Callable[..., Any]
    unpack_bits: Callable[..., Any]

    def __init__(self, name: str, functions: dict[str, Callable[..., Any]]):
        missing = [k for k in KERNEL_FUNCTIONS if k not in functions]
        if missing:
            raise KvqrsError(f"functions: backend {name!r} lacks the kernel functions {missing}")
        self.name = name
        for k in KERNEL_FUNCTIONS:
            setattr(self, k, functions[k])
        for k in FUSED_FUNCTIONS:
            setattr(self, k, functions[k] if k in functions else _COMPOSE[k](functions))

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


CPU = Backend("cpu", {k: inspect.unwrap(getattr(kernels, k)) for k in KERNEL_FUNCTIONS + FUSED_FUNCTIONS})
"""The Rust path (:mod:`kvqrs.kernels`), without the torch adapter: the coders hand the kernels
NumPy arrays, and a one-token append pays no argument scan."""

_gpu_backends: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()


def get_backend(backend: Any = "cpu") -> Backend:
    """Resolve ``backend``: ``"cpu"``, ``"wgpu"``, a :class:`Backend`, a ``kvqrs.gpu.Device``
    or a ``wgpu.GPUAdapter``.

    Raises:
        KvqrsError: an unknown name, or (for the WGSL path) wgpu missing or no adapter; the
            message says what to install.
    """
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str) and backend == "cpu":
        return CPU
    if isinstance(backend, str) and backend != "wgpu":
        raise KvqrsError(f"backend: expected 'cpu', 'wgpu', a kvqrs.gpu.Device or a wgpu.GPUAdapter, got {backend!r}")
    from .. import gpu

    dev = gpu.device(backend)
    if dev not in _gpu_backends:
        _gpu_backends[dev] = Backend("wgpu", {k: functools.partial(getattr(gpu, k), device=dev) for k in KERNEL_FUNCTIONS})
    return _gpu_backends[dev]
