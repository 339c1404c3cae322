"""Type stubs of the private native module ``kvqrs._native`` (flat, C-contiguous arrays in and
out; the public wrappers in ``kvqrs.kernels`` restore shapes and dtypes)."""

from collections.abc import Sequence
from typing import Any, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "KvqrsError",
    "MAX_CODEBOOK_DIM",
    "MAX_STATE",
    "DTYPES",
    "__version__",
    "absmax_decode",
    "absmax_encode",
    "attend_full_precision",
    "container_read",
    "container_write",
    "decode_attention",
    "gaussians",
    "hadamard",
    "headq_decode",
    "headq_encode",
    "headq_score_correction",
    "inverse_hadamard",
    "lloyd_max_codebook",
    "lloyd_max_decode",
    "lloyd_max_encode",
    "log_decode",
    "log_encode",
    "mse_decode",
    "mse_decode_packed",
    "mse_encode",
    "mse_encode_packed",
    "mse_qjl_encode_packed",
    "pack_bits",
    "paged_decode_attention",
    "paged_reconstruct",
    "LayerStore",
    "PageRows",
    "SlotWriter",
    "philox4x32_10",
    "qjl_inner_product",
    "qjl_matrix",
    "qjl_sketch",
    "qjl_vector_estimate",
    "random_orthonormal_basis",
    "rotation_signs",
    "set_isa",
    "set_pack_path",
    "simd_available",
    "simd_info",
    "simd_level",
    "simd_summary",
    "storable",
    "uniform_decode",
    "uniform_encode",
    "unpack_bits",
    "window_append",
]

__version__: str
MAX_CODEBOOK_DIM: int
MAX_STATE: float
DTYPES: dict[str, tuple[int, int]]

class KvqrsError(ValueError): ...

_F32 = npt.NDArray[np.float32]
_F64 = npt.NDArray[np.float64]
_U8 = npt.NDArray[np.uint8]
_I32 = npt.NDArray[np.int32]
_Scalars = npt.NDArray[np.float16] | npt.NDArray[np.float32]

# The row objects of kvqrs.kernels.attention as the binding reads them (rust/py/src/rows.rs, by
# attribute name): MSERows (codes, norms, bits, seed, qjl: QJLRows(signs, norms, seed) | None),
# UniformRows (codes, scales, zeros, bits, group, per_channel, seed), DenseRows (values),
# ChannelRunRows (runs: ChannelRun(codes, scales, zeros, bits, start, stop), group, basis flat
# float32, basis_heads), TokenRunRows (runs: TokenRun(codes, bits, start, stop), scales, basis
# flat float32, basis_heads), CentredRows (rows, mean flat float32, mean_heads); SideRows (codes,
# scales, basis flat float32, bits, sign, rank, basis_heads). Each entry point puts its own
# stand-in for a stored part in place of the arrays (kvqrs.kernels.attention.binding_rows).
_Rows = Any
_Side = Any

def pack_bits(codes: _U8, count: int, bits: int) -> _U8: ...
def unpack_bits(packed: _U8, count: int, bits: int) -> _U8: ...
def hadamard(x: _F32, head_dim: int, seed: int | None = None) -> _F32: ...
def inverse_hadamard(y: _F32, head_dim: int, seed: int | None = None) -> _F32: ...
def lloyd_max_codebook(dim: int, bits: int) -> tuple[_F64, _F64, float]: ...
def lloyd_max_encode(x: _F32, dim: int, bits: int, row_len: int) -> _U8: ...
def lloyd_max_decode(codes: _U8, dim: int, bits: int) -> _F32: ...
def mse_encode(x: _F32, head_dim: int, bits: int, seed: int | None = None, scale: str = "norm") -> tuple[_U8, _Scalars]: ...
def mse_decode(codes: _U8, norms: _Scalars, head_dim: int, bits: int, seed: int | None = None) -> _F32: ...
def mse_encode_packed(x: _F32, head_dim: int, bits: int, seed: int | None = None, scale: str = "norm") -> tuple[_U8, _Scalars]: ...
def mse_decode_packed(packed: _U8, norms: _Scalars, head_dim: int, bits: int, seed: int | None = None) -> _F32: ...
def mse_qjl_encode_packed(x: _F32, head_dim: int, bits: int, seed: int, qjl_seed: int) -> tuple[_U8, _Scalars, _U8, _Scalars]: ...
def qjl_sketch(r: _F32, dim: int, m: int, seed: int) -> tuple[_U8, _Scalars]: ...
def qjl_inner_product(y: _F32, signs: _U8, norms: _Scalars, dim: int, m: int, seed: int) -> _F32: ...
def qjl_vector_estimate(signs: _U8, norms: _Scalars, dim: int, m: int, seed: int) -> _F32: ...
def headq_encode(e: _F32, basis: _F32, head_dim: int, rank: int, bits: int) -> tuple[_U8, _Scalars]: ...
def headq_decode(codes: _U8, scales: _Scalars, basis: _F32, head_dim: int, rank: int, bits: int) -> _F32: ...
def headq_score_correction(q: _F32, codes: _U8, scales: _Scalars, basis: _F32, head_dim: int, rank: int, bits: int) -> _F32: ...
def simd_level() -> str:
    """The instruction-set path the kernels use now: ``scalar``, ``avx2``, ``avx512`` or ``neon``."""

def simd_available() -> list[str]:
    """The paths this CPU supports, scalar first, fastest last."""

def set_isa(name: str | None = None) -> None:
    """Force a path for the whole process (``None``: back to the default, the fastest one, or
    scalar when ``KVQRS_FORCE_SCALAR=1`` was set at import). Every path gives identical bytes;
    this exists for tests and benchmarks."""

def set_pack_path(name: str | None = None) -> None:
    """Force the bit-packing path (``scalar``, ``bmi2`` or ``shift``) for the whole process
    (``None``: back to the default chosen from the CPU, see ``simd_info``). Applies under a SIMD
    isa; under ``scalar`` an unset path stays scalar. Every path gives identical bytes. Raises
    ``KvqrsError`` (a ``ValueError``) for an unknown name or a path this CPU cannot run."""

def simd_info() -> dict[str, Any]:
    """The dispatch state now, as a dict:

    - ``vendor`` (str, cpuid vendor or ``unknown``), ``family`` and ``model`` (int, display
      values, 0 off x86_64), ``brand`` (str, may be empty);
    - ``features``: ``{name: bool}`` for avx2, bmi2, avx512f, avx512bw, avx512vl, f16c, fma
      (``neon`` on aarch64);
    - ``isa`` (str, the active path), ``isas`` (list[str], supported), ``pack_paths``
      (list[str], supported pack paths);
    - ``primitives``: ``{"pack" | "unpack" | "float kernels": {"path": str, "reason": str}}``.
    """

def simd_summary() -> str:
    """``simd_info`` on one line: ``vendor fam 0x.. model 0x.. | isa .. | pack/unpack ..
    (reason) | float kernels .. (reason)`` (``pack .. | unpack ..`` when their paths differ)."""

def philox4x32_10(counter: Sequence[int], key: Sequence[int]) -> Sequence[int]: ...
def rotation_signs(seed: int, dim: int) -> _F32: ...
def gaussians(seed: int, stream: int, count: int) -> _F32: ...
def random_orthonormal_basis(seed: int, head_dim: int, rank: int) -> _F32: ...
def qjl_matrix(seed: int, m: int, dim: int) -> _F32: ...
def uniform_encode(x: _F32, n: int, group: int, bits: int) -> tuple[_U8, _Scalars, _Scalars]: ...
def uniform_decode(codes: _U8, scales: _Scalars, zeros: _Scalars, n: int, group: int, bits: int) -> _F32: ...
def absmax_encode(x: _F32, widths: _U8) -> tuple[_U8, npt.NDArray[np.float16]]: ...
def absmax_decode(codes: _U8, scales: npt.NDArray[np.float16], widths: _U8) -> _F32: ...
def log_encode(values: _F32, n: int, group: int) -> tuple[_U8, _U8]: ...
def log_decode(codes: _U8, exps: _U8, n: int, group: int) -> _F32: ...
def window_append(dst_k: _F32, dst_v: _F32, cap: int, at: int, k: _F32, v: _F32) -> bool: ...
def storable(x: npt.NDArray[np.float32]) -> bool: ...
def attend_full_precision(
    q: _F32,
    heads: int,
    rows: int,
    head_dim: int,
    scale: float,
    tokens: int,
    sink_keys: _F32,
    sink_values: _F32,
    sinks: int,
    window_keys: _F32,
    window_values: _F32,
    room: int,
    start: int,
    window: int,
    mask: _F32 | None,
    batch: int,
) -> tuple[_F32, _F32]: ...
def container_write(sections: list[tuple[str, int, list[int], bytes]]) -> bytes: ...
def container_read(data: bytes) -> list[tuple[str, int, list[int], bytes]]: ...
def decode_attention(
    q: _F32,
    # arrays flat and checked (kvqrs.kernels.attention.binding_rows / binding_side)
    keys: _Rows,
    values: _Rows,
    side: _Side | None,
    heads: int,
    rows: int,
    tokens: int,
    head_dim: int,
    scale: float,
    probs: bool,
) -> tuple[_F32, _F32, _F32]: ...
def paged_decode_attention(
    cache: _U8,
    blocks: int,
    kv_heads: int,
    block_size: int,
    page_bytes: int,
    block_stride: int,
    head_stride: int,
    rows: PageRows,
    q: _F32,
    q_heads: int,
    head_dim: int,
    scale: float,
    seq: _I32,
    lengths: _I32,
    block_table: _I32,
    table_width: int,
) -> _F32: ...
def paged_reconstruct(
    cache: _U8,
    blocks: int,
    kv_heads: int,
    block_size: int,
    page_bytes: int,
    block_stride: int,
    head_stride: int,
    rows: PageRows,
    head_dim: int,
    seq: _I32,
    lengths: _I32,
    block_table: _I32,
    table_width: int,
) -> tuple[_F32, _F32]: ...

# kvqrs.hf.store.StorePart objects (name, dtype name, widen, outer, inner, num, den), read by
# attribute; dtypes cross by their NumPy names ("uint8", "float16", "float32", ...).
_PartSpec = Any
_Part = tuple[str, Sequence[int], _U8]

@final
class PageRows:
    """Both sides' rows of a paged cache layer, read once: each part's (offset, row_bytes) or
    (offset, row_bytes, dtype name) in a page, in MSERows, per-token UniformRows or TokenRunRows,
    alone or in CentredRows (kvqrs.vllm.layout)."""

    def __new__(cls, keys: _Rows, values: _Rows) -> PageRows: ...

@final
class SlotWriter:
    """A paged cache layer's slot writer (kvqrs.vllm.layout.SlotLayout)."""

    def __new__(cls, keys: Any, values: Any, parts: Sequence[tuple[int, str, int, int, str]], head_dim: int) -> SlotWriter: ...
    def write(
        self,
        cache: _U8,
        blocks: int,
        kv_heads: int,
        block_size: int,
        block_stride: int,
        head_stride: int,
        keys: _F32,
        values: _F32,
        slots: npt.NDArray[np.int64],
    ) -> None: ...
    def step(
        self,
        cache: _U8,
        blocks: int,
        kv_heads: int,
        block_size: int,
        block_stride: int,
        head_stride: int,
        new_keys: _F32,
        new_values: _F32,
        slots: npt.NDArray[np.int64],
        rows: PageRows,
        q: _F32,
        q_heads: int,
        head_dim: int,
        scale: float,
        seq: _I32,
        lengths: _I32,
        block_table: _I32,
        table_width: int,
    ) -> _F32: ...
    @property
    def slot_bytes(self) -> int: ...

@final
class LayerStore:
    """Growable per-part buffers of one cache layer (kvqrs.hf.store.CodeStore)."""

    def __new__(cls, parts: Sequence[_PartSpec]) -> LayerStore: ...
    @property
    def tokens(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def has_rows(self) -> bool: ...
    @property
    def has_encoders(self) -> bool: ...
    def names(self) -> list[str]: ...
    def nbytes(self) -> int: ...
    def capacity_nbytes(self) -> int: ...
    def append(self, chunk: Sequence[_Part], tokens: int) -> None: ...
    def keep(self, lo: int, hi: int) -> None: ...
    def clear(self) -> None: ...
    def select(self, index: Sequence[int]) -> None: ...
    def part(self, name: str) -> tuple[str, list[int], _U8]: ...
    def sections(self, prefix: str) -> list[tuple[str, int, list[int], bytes]]: ...
    @staticmethod
    def from_sections(
        parts: Sequence[_PartSpec], sections: Sequence[tuple[str, int, Sequence[int], bytes]], prefix: str, tokens: int
    ) -> LayerStore: ...
    # part names in place of arrays (kvqrs.hf.store.CodeStore)
    def set_rows(self, keys: _Rows, values: _Rows, side: _Side | None = None) -> None: ...
    # kvqrs.hf.store.NativeEncoder objects (head_dim, bits, seed, qjl_seed), read by attribute
    def set_encoders(self, keys: Any, values: Any) -> None: ...
    def encode_append(self, k: _F32, v: _F32, tokens: int, k_start: int = 0, v_start: int = 0) -> None: ...
    def attend(
        self,
        q: _F32,
        heads: int,
        rows: int,
        head_dim: int,
        scale: float,
        tokens: int,
        sink_keys: _F32,
        sink_values: _F32,
        sinks: int,
        window_keys: _F32,
        window_values: _F32,
        room: int,
        start: int,
        window: int,
        mask: _F32 | None,
        batch: int,
    ) -> tuple[_F32, _F32]: ...
    def step(
        self,
        q: _F32,
        heads: int,
        rows: int,
        head_dim: int,
        scale: float,
        tokens: int,
        sink_keys: _F32,
        sink_values: _F32,
        sinks: int,
        window_keys: _F32,
        window_values: _F32,
        room: int,
        lo: int,
        hi: int,
        new_keys: _F32,
        new_values: _F32,
        flush: int,
        mask: _F32 | None,
        batch: int,
    ) -> tuple[_F32, _F32] | None: ...
