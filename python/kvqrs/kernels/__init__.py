"""The kernels of docs/kernels.md, one module each, over the native Rust implementation."""

from .absmax import AbsmaxCode, absmax_decode, absmax_encode
from .attention import (
    AttentionResult,
    CentredRows,
    ChannelRun,
    ChannelRunRows,
    DenseRows,
    MSERows,
    QJLRows,
    SideRows,
    TokenRun,
    TokenRunRows,
    UniformRows,
    decode_attention,
)
from .hadamard import hadamard, inverse_hadamard, padded_dim
from .headq import HeadQCode, headq_basis, headq_decode, headq_encode, headq_score_correction
from .lloyd_max import Codebook, lloyd_max_codebook, lloyd_max_decode, lloyd_max_encode
from .log_scalars import LogScalars, log_decode, log_encode
from .mse import MSECode, mse_decode, mse_decode_packed, mse_encode, mse_encode_packed
from .pack import pack_bits, packed_size, unpack_bits
from .qjl import QJLSketch, qjl_inner_product, qjl_sketch, qjl_vector_estimate
from .rng import gaussians, philox4x32_10, qjl_matrix, random_orthonormal_basis, rotation_signs
from .uniform import UniformCode, uniform_decode, uniform_encode

__all__ = [
    "AbsmaxCode",
    "absmax_decode",
    "absmax_encode",
    "AttentionResult",
    "CentredRows",
    "ChannelRun",
    "ChannelRunRows",
    "DenseRows",
    "MSERows",
    "QJLRows",
    "SideRows",
    "TokenRun",
    "TokenRunRows",
    "UniformRows",
    "decode_attention",
    "Codebook",
    "HeadQCode",
    "MSECode",
    "QJLSketch",
    "gaussians",
    "hadamard",
    "headq_basis",
    "headq_decode",
    "headq_encode",
    "headq_score_correction",
    "inverse_hadamard",
    "lloyd_max_codebook",
    "lloyd_max_decode",
    "lloyd_max_encode",
    "LogScalars",
    "log_decode",
    "log_encode",
    "mse_decode",
    "mse_decode_packed",
    "mse_encode",
    "mse_encode_packed",
    "pack_bits",
    "packed_size",
    "padded_dim",
    "philox4x32_10",
    "qjl_inner_product",
    "qjl_matrix",
    "qjl_sketch",
    "qjl_vector_estimate",
    "random_orthonormal_basis",
    "rotation_signs",
    "UniformCode",
    "uniform_decode",
    "uniform_encode",
    "unpack_bits",
]
