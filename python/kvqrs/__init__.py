"""kvqrs: KV-cache quantization kernels and studies.

Kernels (SPEC section 2, docs/kernels.md): bit packing, the randomized Walsh-Hadamard rotation,
Lloyd-Max codebooks for the sphere marginal, the norm-and-direction MSE stage, the QJL sign
sketch and the HeadQ side code. All run in Rust (``kvqrs._native``); ``kvqrs.oracle`` holds
their float64 NumPy references.
"""

from ._native import KvqrsError, __version__
from .kernels import (
    Codebook,
    HeadQCode,
    MSECode,
    QJLSketch,
    hadamard,
    headq_basis,
    headq_decode,
    headq_encode,
    headq_score_correction,
    inverse_hadamard,
    lloyd_max_codebook,
    lloyd_max_decode,
    lloyd_max_encode,
    mse_decode,
    mse_decode_packed,
    mse_encode,
    mse_encode_packed,
    pack_bits,
    packed_size,
    padded_dim,
    qjl_inner_product,
    qjl_sketch,
    qjl_vector_estimate,
    random_orthonormal_basis,
    unpack_bits,
    UniformCode,
    uniform_decode,
    uniform_encode,
)
from . import oracle
from .kernels import rng

__all__ = [
    "Codebook",
    "HeadQCode",
    "KvqrsError",
    "MSECode",
    "QJLSketch",
    "__version__",
    "hadamard",
    "headq_basis",
    "headq_decode",
    "headq_encode",
    "headq_score_correction",
    "inverse_hadamard",
    "lloyd_max_codebook",
    "lloyd_max_decode",
    "lloyd_max_encode",
    "mse_decode",
    "mse_decode_packed",
    "mse_encode",
    "mse_encode_packed",
    "pack_bits",
    "packed_size",
    "padded_dim",
    "qjl_inner_product",
    "qjl_sketch",
    "qjl_vector_estimate",
    "random_orthonormal_basis",
    "oracle",
    "rng",
    "unpack_bits",
    "UniformCode",
    "uniform_decode",
    "uniform_encode",
]
