"""The WGSL compute-shader path: every kernel of docs/kernels.md as a shader in the
repository's ``shaders/`` directory (shipped inside the package as ``kvqrs/shaders``),
dispatched with wgpu-py.

The functions here mirror :mod:`kvqrs.kernels` (same names, arguments, results, validation and
errors), plus a keyword-only ``device=`` (a :class:`Device`, a ``wgpu.GPUAdapter`` or ``"wgpu"``,
the default). They take NumPy arrays or torch tensors (results come back as tensors on the
input's device). Codes and packed bytes equal the Rust path's; see docs/kernels.md section 10
for what is bit-exact and what has a tolerance (the float32 norm).

Example::

    import kvqrs.gpu as g
    dev = g.device("wgpu")                  # KvqrsError naming what to install if no adapter
    code = g.mse_encode(x, bits=4, seed=7)  # decodable by kvqrs.mse_decode, and vice versa
    codec = kvqrs.schemes.KVCodec("kqv", 4, 128, backend="wgpu")

Needs the ``wgpu`` package (``pip install 'kvqrs[gpu]'``) and a WebGPU adapter: any Vulkan,
Metal or D3D12 driver, or Mesa's lavapipe on the CPU (``mesa-vulkan-drivers``, ``libvulkan1``).
"""

from __future__ import annotations

from ._device import Device, device, iter_adapters, unavailable_reason
from ._shaders import KERNEL_SHADERS, read_shader, shader_files, source
from .absmax import AbsmaxCode, absmax_decode, absmax_encode
from .hadamard import hadamard, inverse_hadamard, padded_dim
from .headq import HeadQCode, headq_basis, headq_decode, headq_encode, headq_score_correction
from .lloyd_max import Codebook, lloyd_max_codebook, lloyd_max_decode, lloyd_max_encode
from .log_scalars import LogScalars, log_decode, log_encode
from .mse import MSECode, mse_decode, mse_encode
from .pack import pack_bits, packed_size, unpack_bits
from .qjl import QJLSketch, qjl_inner_product, qjl_sketch, qjl_vector_estimate
from .rng import gaussians, philox4x32_10, philox_blocks, qjl_matrix, random_orthonormal_basis, rotation_signs
from .uniform import UniformCode, uniform_decode, uniform_encode

__all__ = [
    "AbsmaxCode",
    "Codebook",
    "Device",
    "HeadQCode",
    "KERNEL_SHADERS",
    "LogScalars",
    "MSECode",
    "QJLSketch",
    "UniformCode",
    "absmax_decode",
    "absmax_encode",
    "device",
    "gaussians",
    "hadamard",
    "headq_basis",
    "headq_decode",
    "headq_encode",
    "headq_score_correction",
    "inverse_hadamard",
    "iter_adapters",
    "lloyd_max_codebook",
    "lloyd_max_decode",
    "lloyd_max_encode",
    "log_decode",
    "log_encode",
    "mse_decode",
    "mse_encode",
    "pack_bits",
    "packed_size",
    "padded_dim",
    "philox4x32_10",
    "philox_blocks",
    "qjl_inner_product",
    "qjl_matrix",
    "qjl_sketch",
    "qjl_vector_estimate",
    "random_orthonormal_basis",
    "read_shader",
    "rotation_signs",
    "shader_files",
    "source",
    "unavailable_reason",
    "uniform_decode",
    "uniform_encode",
    "unpack_bits",
]
