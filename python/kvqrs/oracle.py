"""Plain NumPy reference ("oracle") for every kvqrs kernel.

Written straight from the kernel definitions in ``docs/kernels.md`` for clarity, not
speed. Arithmetic is float64 unless a docstring says otherwise; the few places where the kernel
convention fixes float32 rounding (the section 8 dot products behind the QJL signs and the HeadQ
projections, the MSE division ``u = y / norm``, the HeadQ code formula, boundaries and centroids
rounded to float32) follow that convention exactly, so that codes can be compared bit for bit
wherever the documented arithmetic allows it.

Every function takes rows along the last axis with any leading shape; rows are flattened to
``(rows, d)`` internally and the leading shape is restored on output.

Section references: "kernels.md §x" is section x of ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import scipy.linalg
from scipy.special import betaincc, betaincinv, betaln

__all__ = [
    "philox4x32_10",
    "random_words",
    "rotation_signs",
    "gaussians",
    "qjl_matrix",
    "random_orthonormal_basis",
    "padded_dim",
    "pack_bits",
    "unpack_bits",
    "hadamard",
    "inverse_hadamard",
    "lloyd_max_codebook",
    "lloyd_max_encode",
    "lloyd_max_decode",
    "store_scalars",
    "vector_norm",
    "mse_encode",
    "mse_least_squares_scale",
    "mse_preserve_norm_scale",
    "mse_decode",
    "qjl_sketch",
    "qjl_inner_product",
    "qjl_vector_estimate",
    "headq_encode",
    "headq_decode",
    "headq_score_correction",
    "headq_basis",
    "uniform_encode",
    "uniform_decode",
    "absmax_encode",
    "absmax_decode",
    "decode_rows",
    "decode_attention",
]

# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = np.uint64(0xD2511F53)
_PHILOX_M1 = np.uint64(0xCD9E8D57)
_PHILOX_W0 = np.uint64(0x9E3779B9)
_PHILOX_W1 = np.uint64(0xBB67AE85)

# Stream tags (kernels.md §1).
STREAM_SIGNS = 1
STREAM_QJL = 2
STREAM_BASIS = 3


def _as_rows(x, dtype) -> tuple[np.ndarray, tuple[int, ...]]:
    """Return ``(x reshaped to (rows, d) with the given dtype, leading shape)``."""
    x = np.asarray(x, dtype=dtype)
    if x.ndim == 0:
        raise ValueError("expected an array with at least one axis (rows along the last axis)")
    lead = x.shape[:-1]
    return x.reshape(math.prod(lead), x.shape[-1]), lead


def _check_seed(seed) -> int:
    seed = operator.index(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an unsigned 64-bit integer, got {seed}")
    return seed


def _check_bits(bits) -> int:
    bits = operator.index(bits)
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    return bits


def _check_dim(dim, name="head_dim", minimum=2) -> int:
    dim = operator.index(dim)
    if dim < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {dim}")
    return dim


def _fixed_order_sum(products: np.ndarray) -> np.ndarray:
    """Sum ``products`` over the last axis in the fixed order of kernels.md §8.

    Eight accumulators of the products' dtype; accumulator ``j`` adds the terms ``i = j (mod 8)``
    in increasing ``i``; result ``((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))``. Every
    addition is a separate, correctly rounded operation in the products' dtype.
    """
    n = products.shape[-1]
    acc = np.zeros(products.shape[:-1] + (8,), dtype=products.dtype)
    for start in range(0, n, 8):
        block = products[..., start : start + 8]
        acc[..., : block.shape[-1]] += block
    a = [acc[..., j] for j in range(8)]
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def _dot_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 dot products of kernels.md §8: ``a (rows, n)``, ``b (cols, n)`` -> ``(rows, cols)``.

    Each product ``a_i * b_i`` is rounded to float32 (no fused multiply-add), then summed with
    :func:`_fixed_order_sum` in float32.
    """
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    out = np.empty((a.shape[0], b.shape[0]), dtype=np.float32)
    chunk = max(1, (1 << 22) // max(1, b.shape[0] * a.shape[1]))  # bound temporary memory
    for r0 in range(0, a.shape[0], chunk):
        products = a[r0 : r0 + chunk, None, :] * b[None, :, :]  # float32 * float32 -> float32
        out[r0 : r0 + chunk] = _fixed_order_sum(products)
    return out


# --------------------------------------------------------------------------------------------
# kernels.md §1: the seeded generator
# --------------------------------------------------------------------------------------------


def _to_u32(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == np.uint32:
        return arr
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > _MASK32):
        raise ValueError(f"{name} entries must lie in [0, 2^32)")
    return arr.astype(np.uint32)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10 block function (kernels.md §1, Random123 constants).

    ``counter``: uint32 ``(..., 4)``; ``key``: uint32 ``(..., 2)``; the leading shapes broadcast.
    Returns uint32 ``(..., 4)``. The 32x32 -> 64-bit products are formed in uint64 (exact, since
    both factors are below 2^32) and split into high and low words.
    """
    counter = _to_u32(counter, "counter")
    key = _to_u32(key, "key")
    if counter.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ValueError("counter must have last axis 4 and key last axis 2")
    lead = np.broadcast_shapes(counter.shape[:-1], key.shape[:-1])
    mask = np.uint64(_MASK32)
    c = [np.broadcast_to(counter[..., i], lead).astype(np.uint64) for i in range(4)]
    k0 = np.broadcast_to(key[..., 0], lead).astype(np.uint64)
    k1 = np.broadcast_to(key[..., 1], lead).astype(np.uint64)
    for rnd in range(10):
        if rnd > 0:  # nine key bumps, between consecutive rounds
            k0 = (k0 + _PHILOX_W0) & mask
            k1 = (k1 + _PHILOX_W1) & mask
        prod0 = _PHILOX_M0 * c[0]
        prod1 = _PHILOX_M1 * c[2]
        hi0, lo0 = prod0 >> np.uint64(32), prod0 & mask
        hi1, lo1 = prod1 >> np.uint64(32), prod1 & mask
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(c, axis=-1).astype(np.uint32)


def random_words(seed: int, stream: int, start: int, count: int) -> np.ndarray:
    """uint32 words ``word(seed, stream, index)`` for ``index`` in ``[start, start + count)``.

    kernels.md §1 "Streams": block = index // 4, lane = index % 4,
    counter = (block & 0xffffffff, block >> 32, stream, 0), key = (seed & 0xffffffff, seed >> 32).
    Returns uint32 ``(count,)``.
    """
    seed = _check_seed(seed)
    stream = operator.index(stream)
    start = operator.index(start)
    count = operator.index(count)
    if not 0 <= stream <= _MASK32:
        raise ValueError(f"stream must be a 32-bit tag, got {stream}")
    if start < 0 or count < 0 or start + count > 2**64:
        raise ValueError("word indices must lie in [0, 2^64)")
    if count == 0:
        return np.zeros(0, dtype=np.uint32)
    first_block, last_block = start // 4, (start + count - 1) // 4
    blocks = np.arange(first_block, last_block + 1, dtype=np.uint64)
    counter = np.stack(
        [
            blocks & np.uint64(_MASK32),
            blocks >> np.uint64(32),
            np.full(blocks.shape, stream, dtype=np.uint64),
            np.zeros(blocks.shape, dtype=np.uint64),
        ],
        axis=-1,
    ).astype(np.uint32)
    key = np.array([seed & _MASK32, seed >> 32], dtype=np.uint32)
    words = philox4x32_10(counter, key).reshape(-1)  # word index first_block*4 + position
    offset = start - 4 * first_block
    return words[offset : offset + count].copy()


def rotation_signs(seed: int, dim: int) -> np.ndarray:
    """Rotation sign vector (kernels.md §1 "Signs"): float64 ``(dim,)`` of +-1.

    ``sign_i = +1`` if the top bit of ``word(seed, 1, i)`` is 0, else ``-1``.
    """
    dim = operator.index(dim)
    words = random_words(seed, STREAM_SIGNS, 0, dim)
    return np.where((words >> np.uint32(31)) == 0, 1.0, -1.0)


def gaussians(seed: int, stream: int, count: int) -> np.ndarray:
    """Box-Muller Gaussians ``e = 0 .. count-1`` of a stream (kernels.md §1 "Gaussians").

    Entry ``e`` uses words ``2e`` (u1) and ``2e + 1`` (u2); evaluated in float64 and rounded to
    float32. Returns float32 ``(count,)``.
    """
    count = operator.index(count)
    words = random_words(seed, stream, 0, 2 * count)
    w1 = (words[0::2] >> np.uint32(8)).astype(np.float64)
    w2 = (words[1::2] >> np.uint32(8)).astype(np.float64)
    u1 = (w1 + 0.5) * 2.0**-24  # in (0, 1)
    u2 = w2 * 2.0**-24  # in [0, 1)
    g = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return g.astype(np.float32)


def qjl_matrix(seed: int, m: int, dim: int) -> np.ndarray:
    """QJL matrix ``S`` (kernels.md §1): float32 ``(m, dim)``, entry ``(i, j)`` is Gaussian
    ``e = i * dim + j`` of stream 2 (``dim`` is ``d'``)."""
    m = operator.index(m)
    dim = operator.index(dim)
    if m < 1 or dim < 1:
        raise ValueError("m and dim must be positive")
    return gaussians(seed, STREAM_QJL, m * dim).reshape(m, dim)


def random_orthonormal_basis(seed: int, head_dim: int, rank: int) -> np.ndarray:
    """Seeded random orthonormal basis (HeadQ control; kernels.md §1): float32 ``(head_dim, rank)``.

    Entry ``(i, j)`` is Gaussian ``e = i * rank + j`` of stream 3, converted to float64 and
    orthonormalised by modified Gram-Schmidt over the columns in order (each column: subtract its
    projections on the earlier finished columns one at a time, then divide by its norm), then
    rounded to float32.
    """
    head_dim = operator.index(head_dim)
    rank = operator.index(rank)
    if not 1 <= rank <= head_dim:
        raise ValueError(f"rank must be in 1..head_dim ({head_dim}), got {rank}")
    a = gaussians(seed, STREAM_BASIS, head_dim * rank).reshape(head_dim, rank).astype(np.float64)
    q = np.zeros_like(a)
    for j in range(rank):
        v = a[:, j].copy()
        for k in range(j):
            v -= np.dot(q[:, k], v) * q[:, k]
        q[:, j] = v / np.linalg.norm(v)
    return q.astype(np.float32)


# --------------------------------------------------------------------------------------------
# kernels.md §0 / §2: dimensions and bit packing
# --------------------------------------------------------------------------------------------


def padded_dim(head_dim: int) -> int:
    """``d'``: the next power of two >= ``head_dim`` (kernels.md §0)."""
    head_dim = operator.index(head_dim)
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return 1 << (head_dim - 1).bit_length()


def pack_bits(codes, bits) -> np.ndarray:
    """Pack ``m`` codes of ``bits`` bits per row (docs/kernels.md section 2).

    ``codes``: integer ``(..., m)`` with ``0 <= code < 2^bits``; returns uint8
    ``(..., ceil(m * bits / 8))``. Code ``i`` occupies bits ``i*bits .. i*bits+bits-1`` of the
    row's little-endian bit stream (bit 0 = LSB of byte 0); unused high bits of the last byte are 0.
    Out-of-range codes or ``bits`` raise ``ValueError`` naming the first bad position.
    """
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    if not (np.issubdtype(codes.dtype, np.integer) or codes.dtype == np.bool_):
        raise ValueError(f"codes must be integers, got dtype {codes.dtype}")
    rows, lead = _as_rows(codes, np.int64)
    bad = (rows < 0) | (rows >= 2**bits)
    if bad.any():
        pos = np.unravel_index(int(np.argmax(bad.reshape(-1))), codes.shape)
        raise ValueError(f"code {int(codes[pos])} at position {tuple(int(p) for p in pos)} does not fit in {bits} bits")
    n, m = rows.shape
    nbytes = (m * bits + 7) // 8
    out = np.zeros((n, nbytes), dtype=np.uint8)
    for i in range(m):  # code i, bit k -> stream bit p = i*bits + k
        for k in range(bits):
            p = i * bits + k
            bit = ((rows[:, i] >> k) & 1).astype(np.uint8)
            out[:, p // 8] |= bit << np.uint8(p % 8)
    return out.reshape(lead + (nbytes,))


def unpack_bits(packed, bits, count) -> np.ndarray:
    """Exact inverse of :func:`pack_bits` (docs/kernels.md section 2).

    ``packed``: uint8 ``(..., ceil(count * bits / 8))``; returns uint8 ``(..., count)``. The unused
    high bits of the last byte are ignored.
    """
    bits = _check_bits(bits)
    count = operator.index(count)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    packed = np.asarray(packed)
    if not np.issubdtype(packed.dtype, np.integer):
        raise ValueError(f"packed must be bytes (uint8), got dtype {packed.dtype}")
    rows, lead = _as_rows(packed, np.int64)
    if rows.size and (rows.min() < 0 or rows.max() > 255):
        raise ValueError("packed entries must be bytes in [0, 255]")
    nbytes = (count * bits + 7) // 8
    if rows.shape[1] != nbytes:
        raise ValueError(f"expected {nbytes} bytes per row for {count} codes of {bits} bits, got {rows.shape[1]}")
    out = np.zeros((rows.shape[0], count), dtype=np.int64)
    for i in range(count):
        for k in range(bits):
            p = i * bits + k
            bit = (rows[:, p // 8] >> (p % 8)) & 1
            out[:, i] |= bit << k
    return out.astype(np.uint8).reshape(lead + (count,))


# --------------------------------------------------------------------------------------------
# docs/kernels.md section 3 / kernels.md §3: randomized Walsh-Hadamard rotation
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _sylvester(dim: int) -> np.ndarray:
    h = scipy.linalg.hadamard(dim).astype(np.float64)  # Sylvester construction, symmetric
    h.setflags(write=False)
    return h


def hadamard(x, seed: int | None) -> np.ndarray:
    """Randomized Walsh-Hadamard rotation ``R x`` (docs/kernels.md section 3), float64.

    ``x``: ``(..., d)``; returns float64 ``(..., d')``: zero-pad to ``d' = padded_dim(d)``,
    multiply by the signs of ``seed`` (skipped when ``seed is None``), multiply by the explicit
    Sylvester matrix ``H_{d'}`` and by ``1/sqrt(d')``.
    """
    rows, lead = _as_rows(x, np.float64)
    d = rows.shape[1]
    dp = padded_dim(d)
    padded = np.zeros((rows.shape[0], dp), dtype=np.float64)
    padded[:, :d] = rows
    if seed is not None:
        padded *= rotation_signs(_check_seed(seed), dp)
    y = padded @ _sylvester(dp) / math.sqrt(dp)  # H is symmetric: (H v)^T = v^T H
    return y.reshape(lead + (dp,))


def inverse_hadamard(y, seed: int | None, head_dim: int) -> np.ndarray:
    """Inverse rotation ``R^T y`` (docs/kernels.md section 3), float64.

    ``y``: ``(..., d')`` with ``d' = padded_dim(head_dim)``; returns float64 ``(..., head_dim)``:
    multiply by ``H_{d'} / sqrt(d')``, then by the signs (skipped when ``seed is None``), keep the
    first ``head_dim`` coordinates.
    """
    rows, lead = _as_rows(y, np.float64)
    head_dim = operator.index(head_dim)
    dp = padded_dim(head_dim)
    if rows.shape[1] != dp:
        raise ValueError(f"expected last axis {dp} (= padded_dim({head_dim})), got {rows.shape[1]}")
    x = rows @ _sylvester(dp) / math.sqrt(dp)
    if seed is not None:
        x *= rotation_signs(_check_seed(seed), dp)
    return x[:, :head_dim].reshape(lead + (head_dim,))


# --------------------------------------------------------------------------------------------
# docs/kernels.md section 4 / kernels.md §4: Lloyd-Max codebook for the sphere marginal
# --------------------------------------------------------------------------------------------


class _SphereMarginal:
    """Coordinate of a uniform unit vector in R^D: density (1 - x^2)^(a-1) / B(1/2, a), a = (D-1)/2."""

    def __init__(self, dim: int):
        self.dim = dim
        self.a = (dim - 1) / 2.0
        self.log_beta = betaln(0.5, self.a)

    def tail(self, x):
        """P(X > x) = 1 - I_{(1+x)/2}(a, a), via betaincc (accurate in the tail)."""
        return betaincc(self.a, self.a, (1.0 + np.asarray(x)) / 2.0)

    def upper_moment(self, x):
        """integral_x^1 t f(t) dt = (1 - x^2)^a / (2 a B(1/2, a)), in log space (no underflow)."""
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(divide="ignore"):  # x = 1 gives log(0) = -inf -> exp = 0
            return np.exp(self.a * np.log1p(-x * x) - math.log(2.0 * self.a) - self.log_beta)

    def density(self, x):
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(divide="ignore"):
            return np.exp((self.a - 1.0) * np.log1p(-x * x) - self.log_beta)

    def intervals(self, cent):
        """Positive-half intervals [lo_i, hi_i] for ascending positive centroids (boundaries are
        midpoints; the first interval starts at 0, the last ends at 1)."""
        mids = (cent[:-1] + cent[1:]) / 2.0
        lo = np.concatenate([[0.0], mids])
        hi = np.concatenate([mids, [1.0]])
        return lo, hi

    def lloyd_step(self, cent):
        """One Lloyd update of the positive-half centroids: conditional means of the intervals.
        Returns (new centroids, interval probabilities, first moments)."""
        lo, hi = self.intervals(cent)
        p = self.tail(lo) - self.tail(hi)
        m1 = self.upper_moment(lo) - self.upper_moment(hi)
        return m1 / p, p, m1

    def newton_step(self, cent):
        """Newton step on F(c) = lloyd_step(c) - c (tridiagonal Jacobian, analytic derivatives:
        d mean/d lo = f(lo) (mean - lo) / p, d mean/d hi = f(hi) (hi - mean) / p, and each
        midpoint moves by 1/2 of either neighbouring centroid). Used only to accelerate the
        Lloyd iteration; the fixed point is the same."""
        new, p, _ = self.lloyd_step(cent)
        lo, hi = self.intervals(cent)
        n = cent.size
        d_lo = self.density(lo) * (new - lo) / p
        d_hi = self.density(hi) * (hi - new) / p
        jac = -np.eye(n)
        for i in range(n):
            if i > 0:  # lo_i = (c_{i-1} + c_i) / 2
                jac[i, i - 1] += 0.5 * d_lo[i]
                jac[i, i] += 0.5 * d_lo[i]
            if i < n - 1:  # hi_i = (c_i + c_{i+1}) / 2
                jac[i, i] += 0.5 * d_hi[i]
                jac[i, i + 1] += 0.5 * d_hi[i]
        return cent - np.linalg.solve(jac, new - cent)


def _valid_positive_centroids(cent) -> bool:
    return bool(np.all(np.isfinite(cent)) and cent[0] > 0.0 and cent[-1] < 1.0 and np.all(np.diff(cent) > 0))


@functools.cache
def _lloyd_max_cached(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    dist = _SphereMarginal(dim)
    levels = 2**bits
    half = levels // 2

    if bits == 1:
        # Closed form: c = E[x | x > 0] = (1 / (2 a B)) / (1/2) = 1 / (a B(1/2, a)).
        c = math.exp(-math.log(dist.a) - dist.log_beta)
        cent_pos = np.array([c])
    else:
        # Companding start: centroids at the quantiles (i + 1/2) / L of f^(1/3), which is the same
        # family with (a' - 1) = (a - 1) / 3; positive half only (the codebook is symmetric).
        a3 = (dist.a + 2.0) / 3.0
        q = (np.arange(half, levels) + 0.5) / levels
        cent_pos = 2.0 * betaincinv(a3, a3, q) - 1.0
        for _ in range(100_000):
            new, _, _ = dist.lloyd_step(cent_pos)
            change = np.max(np.abs(new - cent_pos))
            cent_pos = new
            if change < 1e-13:
                break
            # Acceleration (plain Lloyd needs ~1e5 iterations at 8 bits): try a Newton step and
            # keep it only if it gives valid centroids with a smaller Lloyd residual.
            try:
                with np.errstate(all="ignore"):
                    trial = dist.newton_step(cent_pos)
                    if _valid_positive_centroids(trial):
                        trial_res = np.max(np.abs(dist.lloyd_step(trial)[0] - trial))
                        res = np.max(np.abs(dist.lloyd_step(cent_pos)[0] - cent_pos))
                        if trial_res < res:
                            cent_pos = trial
            except np.linalg.LinAlgError:
                pass
        else:  # pragma: no cover - would indicate a bug
            raise RuntimeError(f"Lloyd-Max iteration did not converge for dim={dim}, bits={bits}")

    _, p, m1 = dist.lloyd_step(cent_pos)
    distortion = 1.0 / dim - 2.0 * float(np.sum(m1 * m1 / p))  # both halves

    centroids = np.concatenate([-cent_pos[::-1], cent_pos])
    boundaries = (centroids[:-1] + centroids[1:]) / 2.0
    boundaries[half - 1] = 0.0  # the middle boundary is exactly 0
    centroids.setflags(write=False)
    boundaries.setflags(write=False)
    return centroids, boundaries, distortion


def lloyd_max_codebook(dim: int, bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    """MSE-optimal scalar quantizer for a coordinate of a uniform unit vector in R^dim
    (docs/kernels.md section 4).

    Returns ``(centroids, boundaries, distortion)``: float64 ascending arrays of length ``2^bits``
    and ``2^bits - 1`` (symmetric; boundaries are midpoints, the middle one is 0) and the
    per-coordinate MSE ``D_b = 1/dim - sum_i m1_i^2 / p_i``. Lloyd iteration on the positive half
    from a companding start (quantiles of ``f^(1/3)``) until the largest centroid change is below
    1e-13, accelerated by safeguarded Newton steps on the same fixed-point equation; ``bits = 1``
    is the closed form ``+-E[x | x > 0]``. Cached per ``(dim, bits)``; the arrays are read-only.
    """
    dim = _check_dim(dim, "dim")
    bits = _check_bits(bits)
    return _lloyd_max_cached(dim, bits)


def lloyd_max_encode(x, boundaries) -> np.ndarray:
    """Codebook encode (kernels.md §4): ``code = #{j : float32(boundary_j) <= float32(x)}``
    (a value equal to a boundary goes up). ``x`` any shape; returns uint8 of the same shape."""
    b32 = np.asarray(boundaries, dtype=np.float64).astype(np.float32)
    if b32.size > 255:
        raise ValueError("at most 255 boundaries (8-bit codes)")
    x32 = np.asarray(x).astype(np.float32)
    return np.searchsorted(b32, x32, side="right").astype(np.uint8)


def lloyd_max_decode(codes, centroids) -> np.ndarray:
    """Codebook decode (kernels.md §4): ``centroids_f32[code]`` (centroids rounded to float32),
    returned as float64 with the shape of ``codes``."""
    c32 = np.asarray(centroids, dtype=np.float64).astype(np.float32)
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() >= c32.size):
        raise ValueError(f"codes must lie in [0, {c32.size})")
    return c32.astype(np.float64)[codes.astype(np.int64)]


# --------------------------------------------------------------------------------------------
# docs/kernels.md section 5 / kernels.md §5, §8: stored scalars, norms and the MSE stage
# --------------------------------------------------------------------------------------------

_F16_MIN_NORMAL = 2.0**-14
_F16_MAX = 65504.0


def store_scalars(values) -> np.ndarray:
    """Storage rule for per-vector scalars (kernels.md §5 step 5, docs/kernels.md section 5).

    ``values`` (any shape) are taken as float32. Each value that is zero or whose absolute value
    lies in ``[2^-14, 65504)`` is rounded to float16; the result is float16 when every value is,
    otherwise float32 holding the rest unrounded (per-value rounding: chunked storage joins to
    the same values as one call).
    """
    v = np.asarray(values, dtype=np.float32)
    mag = np.abs(v.astype(np.float64))
    fits = (mag == 0.0) | ((mag >= _F16_MIN_NORMAL) & (mag < _F16_MAX))  # NaN fails the test
    with np.errstate(over="ignore"):  # values beyond float16 are discarded by the where
        half = v.astype(np.float16)
    if bool(np.all(fits)):
        return half
    return np.where(fits, half.astype(np.float32), v)


def vector_norm(x) -> np.ndarray:
    """Euclidean norm of each row (kernels.md §8 squared norm): float64 ``(...)``.

    float64 sum of ``float64(x_i)^2`` in the fixed eight-accumulator order, then sqrt in float64
    (not rounded to float32; callers that store it round it themselves).
    """
    rows, lead = _as_rows(x, np.float64)
    return np.sqrt(_fixed_order_sum(rows * rows)).reshape(lead)


def mse_encode(x, bits, seed: int | None, scale: str = "norm") -> tuple[np.ndarray, np.ndarray]:
    """Norm-and-direction encode (docs/kernels.md section 5).

    ``x``: ``(..., d)``, taken as float32. Returns ``codes`` uint8 ``(..., d')`` and ``norms``
    ``(...)`` as returned by :func:`store_scalars`. With ``seed is None`` there is no rotation and
    ``d' = d``; otherwise ``d' = padded_dim(d)`` and the ``(d', bits)`` codebook is used.
    ``norm = float32(||x||)``; ``u = float32(y / norm)`` (y rotated in float64); zero rows give
    ``u = 0`` (codes of 0.0) and norm 0.

    ``scale="least_squares"`` stores, instead of the norm, the least-squares scale of the decoded
    direction ``r = mse_decode(codes, 1)`` (float64): ``s = (x . r) / (r . r)``, the minimiser of
    ``||x - s r||^2`` (0 when ``x . r <= 0``), rounded to float32 and stored likewise;
    ``scale="preserve_norm"`` stores ``s = norm / ||r||`` (:func:`mse_preserve_norm_scale`), so
    that the decoded row keeps the norm.
    """
    bits = _check_bits(bits)
    rows, lead = _as_rows(np.asarray(x, dtype=np.float32), np.float32)
    _check_dim(rows.shape[1])
    norms32 = vector_norm(rows).astype(np.float32)
    y = rows.astype(np.float64) if seed is None else hadamard(rows, seed)
    dp = y.shape[1]
    _, boundaries, _ = lloyd_max_codebook(dp, bits)
    denom = norms32.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(denom > 0, y / np.where(denom > 0, denom, 1.0), 0.0).astype(np.float32)
    codes = lloyd_max_encode(u, boundaries)
    if scale == "least_squares":
        norms32 = mse_least_squares_scale(rows, codes, bits, seed).astype(np.float32)
    elif scale == "preserve_norm":
        norms32 = mse_preserve_norm_scale(norms32, codes, bits, rows.shape[1], seed).astype(np.float32)
    elif scale != "norm":
        raise ValueError(f"scale must be 'norm', 'least_squares' or 'preserve_norm', got {scale!r}")
    return codes.reshape(lead + (dp,)), store_scalars(norms32.reshape(lead))


def mse_least_squares_scale(x, codes, bits, seed: int | None) -> np.ndarray:
    """The least-squares row scale of docs/kernels.md section 5: float64 ``(...)``.

    ``x`` ``(..., d)`` (taken as float32) and its codes ``(..., d')``; with ``r`` the decoded
    direction ``mse_decode(codes, 1)`` (float64), ``s = (x . r) / (r . r)``, the minimiser of
    ``||x - s r||^2``; 0 when ``x . r <= 0`` (a zero row).
    """
    rows, lead = _as_rows(np.asarray(x, dtype=np.float32), np.float64)
    codes = np.asarray(codes)
    r = mse_decode(codes.reshape(rows.shape[0], codes.shape[-1]), np.ones(rows.shape[0]), bits, rows.shape[1], seed)
    num = (rows * r).sum(-1)
    den = (r * r).sum(-1)
    ok = (num > 0) & (den > 0)
    return np.where(ok, num / np.where(ok, den, 1.0), 0.0).reshape(lead)


def mse_preserve_norm_scale(norms, codes, bits, head_dim: int, seed: int | None) -> np.ndarray:
    """The norm-preserving row scale of docs/kernels.md section 5: float64 ``(...)``.

    ``norms`` ``(...)`` the rows' float32 norms, ``codes`` ``(..., d')`` their codes; with ``r``
    the decoded direction ``mse_decode(codes, 1)`` (float64), ``s = norm / ||r||`` (``norm`` when
    ``r = 0``), so that the decode ``s r`` has the row's norm. The Lloyd-Max centroids are
    conditional means: ``||r|| < 1`` on average, and the plain norm shrinks the decoded rows.
    """
    n = np.asarray(norms, dtype=np.float64).reshape(-1)
    codes = np.asarray(codes)
    r = mse_decode(codes.reshape(n.shape[0], codes.shape[-1]), np.ones(n.shape[0]), bits, head_dim, seed)
    rn = np.sqrt((r * r).sum(-1))
    return np.where(rn > 0, n / np.where(rn > 0, rn, 1.0), n).reshape(np.shape(norms))


def mse_decode(codes, norms, bits, head_dim, seed) -> np.ndarray:
    """Norm-and-direction decode (docs/kernels.md section 5): float64 ``(..., head_dim)``.

    ``codes`` uint8 ``(..., d')`` (``d' = head_dim`` without rotation, else
    ``padded_dim(head_dim)``), ``norms`` ``(...)``. Returns
    ``norm * inverse_hadamard(centroids_f32[codes], seed, head_dim)``.
    """
    bits = _check_bits(bits)
    head_dim = _check_dim(head_dim)
    rows, lead = _as_rows(codes, np.int64)
    dp = head_dim if seed is None else padded_dim(head_dim)
    if rows.shape[1] != dp:
        raise ValueError(f"expected {dp} codes per row, got {rows.shape[1]}")
    norms = np.asarray(norms).astype(np.float32).astype(np.float64).reshape(-1)
    if norms.shape[0] != rows.shape[0]:
        raise ValueError("norms must have the leading shape of codes")
    centroids, _, _ = lloyd_max_codebook(dp, bits)
    c = lloyd_max_decode(rows, centroids)
    y = c if seed is None else inverse_hadamard(c, seed, head_dim)
    return (y * norms[:, None]).reshape(lead + (head_dim,))


# --------------------------------------------------------------------------------------------
# docs/kernels.md section 6 / kernels.md §6: QJL sign sketch
# --------------------------------------------------------------------------------------------


def qjl_sketch(r, seed, m: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """QJL sign sketch of residual rows (docs/kernels.md section 6).

    ``r``: ``(..., d')``, already in the rotated domain (no padding here), taken as float32.
    ``S = qjl_matrix(seed, m, d')`` (``m`` defaults to ``d'``); ``t = S r`` with the float32
    fixed-order dot products of kernels.md §8. Returns ``sign_bits`` uint8 ``(..., m)``
    (unpacked, ``1`` where ``t_i < 0``, so ``sign(0) = +1``) and ``norms`` ``(...)`` stored as in
    :func:`store_scalars`.
    """
    rows, lead = _as_rows(np.asarray(r, dtype=np.float32), np.float32)
    dp = rows.shape[1]
    m = dp if m is None else operator.index(m)
    s = qjl_matrix(_check_seed(seed), m, dp)
    t = _dot_f32(rows, s)  # (rows, m)
    sign_bits = (t < 0).astype(np.uint8)
    norms32 = vector_norm(rows).astype(np.float32)
    return sign_bits.reshape(lead + (m,)), store_scalars(norms32.reshape(lead))


def _check_sign_bits(sign_bits) -> np.ndarray:
    b = np.asarray(sign_bits)
    if b.size and not np.all((b == 0) | (b == 1)):
        raise ValueError("sign_bits must be unpacked bits in {0, 1}")
    return b


def qjl_inner_product(y, sign_bits, norms, seed) -> np.ndarray:
    """QJL inner-product estimates (docs/kernels.md section 6), float64.

    ``y`` ``(..., ny, d')``, ``sign_bits`` ``(..., nr, m)``, ``norms`` ``(..., nr)``; the leading
    shapes broadcast. Returns ``(..., ny, nr)``:
    ``sqrt(pi/2) / m * ||r_j|| * sum_i (S y_i)_i' * sigma_ji'`` with ``sigma = 1 - 2 b``.
    """
    y = np.asarray(y, dtype=np.float64)
    b = _check_sign_bits(sign_bits)
    m, dp = b.shape[-1], y.shape[-1]
    s = qjl_matrix(_check_seed(seed), m, dp).astype(np.float64)
    sigma = 1.0 - 2.0 * b.astype(np.float64)  # (..., nr, m)
    sy = y @ s.T  # (..., ny, m)
    norms = np.asarray(norms).astype(np.float32).astype(np.float64)
    k = math.sqrt(math.pi / 2.0) / m
    return k * (sy @ np.swapaxes(sigma, -1, -2)) * norms[..., None, :]


def qjl_vector_estimate(sign_bits, norms, seed, dim) -> np.ndarray:
    """QJL vector estimate ``r_hat = sqrt(pi/2) / m * ||r|| * S^T sigma`` (docs/kernels.md section 6), float64 ``(..., dim)`` where ``dim`` is ``d'`` (the columns of ``S``).

    ``sign_bits`` uint8 ``(..., m)`` in {0, 1}; ``norms`` ``(...)``.
    """
    b = _check_sign_bits(sign_bits)
    rows, lead = _as_rows(b, np.float64)
    m = rows.shape[1]
    dim = operator.index(dim)
    s = qjl_matrix(_check_seed(seed), m, dim).astype(np.float64)
    sigma = 1.0 - 2.0 * rows
    norms = np.asarray(norms).astype(np.float32).astype(np.float64).reshape(-1)
    k = math.sqrt(math.pi / 2.0) / m
    return (k * norms[:, None] * (sigma @ s)).reshape(lead + (dim,))


# --------------------------------------------------------------------------------------------
# docs/kernels.md section 7 / kernels.md §7: HeadQ side code
# --------------------------------------------------------------------------------------------


def _check_basis(basis) -> np.ndarray:
    u = np.asarray(basis, dtype=np.float32)
    if u.ndim != 2 or u.shape[1] > u.shape[0]:
        raise ValueError(f"basis must be (d, r) with r <= d, got shape {u.shape}")
    return u


def headq_encode(e, basis, bits) -> tuple[np.ndarray, np.ndarray]:
    """HeadQ side-code encode (docs/kernels.md section 7).

    ``e``: residual rows ``(..., d)`` taken as float32; ``basis``: ``U`` float32 ``(d, r)``.
    ``p = U^T e`` (float32 fixed-order dot products, §8); ``h = (2^bits - 1) / 2``;
    ``scale = float32(max|p| / h)`` stored by :func:`store_scalars` and the stored ``s`` used for
    ``code_i = clamp(floor(p_i / s + h + 0.5), 0, 2^bits - 1)`` (float32 arithmetic; all codes
    ``2^(bits-1)`` when ``s = 0``). Returns ``codes`` uint8 ``(..., r)`` and ``scales`` ``(...)``.
    """
    bits = _check_bits(bits)
    u = _check_basis(basis)
    rows, lead = _as_rows(np.asarray(e, dtype=np.float32), np.float32)
    if rows.shape[1] != u.shape[0]:
        raise ValueError(f"e has last axis {rows.shape[1]}, basis has {u.shape[0]} rows")
    p = _dot_f32(rows, u.T)  # (rows, r) float32
    h = np.float32((2**bits - 1) / 2)
    scale32 = (np.max(np.abs(p), axis=1) / h).astype(np.float32)
    scales = store_scalars(scale32.reshape(lead))
    s = scales.astype(np.float32).reshape(-1, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (p / np.where(s > 0, s, np.float32(1))) + h  # float32
        t = t + np.float32(0.5)
    codes = np.clip(np.floor(t), 0, 2**bits - 1)
    codes = np.where(s > 0, codes, 2 ** (bits - 1)).astype(np.uint8)
    return codes.reshape(lead + (u.shape[1],)), scales


def _headq_z(codes, scales, bits) -> np.ndarray:
    """z_i = s * (code_i - h) in float64 (exact): codes (..., r), scales (...) -> (..., r)."""
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() >= 2**bits):
        raise ValueError(f"codes must lie in [0, 2^{bits})")
    h = (2**bits - 1) / 2.0
    s = np.asarray(scales).astype(np.float32).astype(np.float64)
    return s[..., None] * (codes.astype(np.float64) - h)


def headq_decode(codes, scales, basis, bits) -> np.ndarray:
    """HeadQ side-code decode ``U z`` (kernels.md §7, for tests): float64 ``(..., d)``.

    ``codes`` uint8 ``(..., r)``, ``scales`` ``(...)``, ``basis`` ``(d, r)``.
    """
    u = _check_basis(basis).astype(np.float64)
    z = _headq_z(codes, scales, bits)
    return z @ u.T


def headq_score_correction(q, basis, codes, scales, bits) -> np.ndarray:
    """HeadQ score correction ``sum_i (U^T q)_i z_i`` (docs/kernels.md section 7), float64.

    ``q`` ``(..., nq, d)``, ``codes`` ``(..., nk, r)``, ``scales`` ``(..., nk)``; leading shapes
    broadcast. Returns ``(..., nq, nk)`` (not divided by ``sqrt(d)``; the caller does that).
    """
    u = _check_basis(basis).astype(np.float64)
    z = _headq_z(codes, scales, bits)  # (..., nk, r)
    uq = np.asarray(q, dtype=np.float64) @ u  # (..., nq, r)
    return uq @ np.swapaxes(z, -1, -2)


def headq_basis(queries, rank) -> np.ndarray:
    """HeadQ basis from calibration queries (docs/kernels.md section 7): float32 ``(d, rank)``.

    ``queries`` ``(..., d)`` (all rows pooled, n rows): the top-``rank`` eigenvectors, by
    descending eigenvalue, of the uncentred second moment ``Q^T Q / n`` (float64); each column's
    sign is fixed so that its largest-magnitude entry (first one on ties) is positive.
    """
    rows, _ = _as_rows(queries, np.float64)
    n, d = rows.shape
    rank = operator.index(rank)
    if n == 0 or not 1 <= rank <= d:
        raise ValueError(f"need at least one query and 1 <= rank <= {d}")
    moment = rows.T @ rows / n
    evals, evecs = np.linalg.eigh(moment)  # ascending
    top = evecs[:, np.argsort(evals, kind="stable")[::-1][:rank]]
    pivot = top[np.argmax(np.abs(top), axis=0), np.arange(rank)]
    top = top * np.where(pivot < 0, -1.0, 1.0)
    return top.astype(np.float32)


# --------------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Uniform asymmetric quantizer (KIVI; kernels.md section 9)
# --------------------------------------------------------------------------------------------


def uniform_encode(x, bits, group) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min-max uniform quantization of consecutive groups (kernels.md section 9).

    ``x`` (..., n) -> codes uint8 (..., n), scales and zero points (..., ceil(n / group)) as
    stored by :func:`store_scalars`. Codes use the stored scale and zero point, in float32.
    """
    b = _check_bits(bits)
    rows, lead = _as_rows(x, np.float32)
    n = rows.shape[1]
    starts = list(range(0, n, group))
    lo = np.stack([rows[:, s : s + group].min(axis=1) for s in starts], axis=1) if n else np.zeros((len(rows), 0), np.float32)
    hi = np.stack([rows[:, s : s + group].max(axis=1) for s in starts], axis=1) if n else lo
    top = np.float32(2**b - 1)
    scales = store_scalars((hi - lo) / top)
    zeros = store_scalars(lo + np.float32(0.0))  # a -0.0 minimum is stored as +0.0 (one byte pattern)
    s32 = scales.astype(np.float32)
    z32 = zeros.astype(np.float32)
    codes = np.zeros(rows.shape, dtype=np.uint8)
    for j, s in enumerate(starts):
        block = rows[:, s : s + group]
        sj = s32[:, j : j + 1]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(sj > 0, (block - z32[:, j : j + 1]) / np.where(sj > 0, sj, 1), np.float32(0))
        codes[:, s : s + group] = np.clip(np.floor(t.astype(np.float32) + np.float32(0.5)), 0, top)
    g = len(starts)
    return codes.reshape(*lead, n), scales.reshape(*lead, g), zeros.reshape(*lead, g)


def uniform_decode(codes, scales, zeros, bits, group) -> np.ndarray:
    """``zero + scale * code`` per group (kernels.md section 9); float64 (..., n)."""
    _check_bits(bits)
    c = np.asarray(codes)
    n = c.shape[-1]
    idx = np.arange(n) // group
    s = np.asarray(scales, dtype=np.float64)[..., idx]
    z = np.asarray(zeros, dtype=np.float64)[..., idx]
    return z + s * c.astype(np.float64)


# --------------------------------------------------------------------------------------------
# Log-coded scalars (kernels.md section 13)
# --------------------------------------------------------------------------------------------

LOG_BIAS = 127
LOG_EXP_MIN = 16
LOG_EXP_MAX = 254
LOG_ZERO = 255


def log_encode(values, group) -> tuple[np.ndarray, np.ndarray]:
    """8-bit log codes of non-negative scalars along the last axis (kernels.md section 13).

    ``values`` (..., n) -> codes uint8 (..., n) and exponent bytes uint8 (..., ceil(n / group)).
    The grid index ``r = floor(16 log2 v + 0.5)`` is computed in float64 (the kernels read it
    from the float32 bits); zero and subnormal values have none.
    """
    rows, lead = _as_rows(values, np.float32)
    n = rows.shape[1]
    g = -(-n // group)
    v = rows.astype(np.float64)
    has = v >= 2.0**-126
    with np.errstate(divide="ignore"):
        r = np.where(has, np.floor(16 * np.log2(np.where(has, v, 1.0)) + 0.5), 0).astype(np.int64)
    exps = np.zeros((rows.shape[0], g), np.int64)
    codes = np.full(rows.shape, LOG_ZERO, np.int64)
    for j in range(g):
        sl = slice(j * group, (j + 1) * group)
        rg, hg = r[:, sl], has[:, sl]
        largest = np.where(hg, rg, np.iinfo(np.int64).min).max(axis=1)
        b = np.where(hg.any(axis=1), np.clip(largest // 16 + LOG_BIAS, LOG_EXP_MIN, LOG_EXP_MAX), LOG_BIAS)
        exps[:, j] = b
        c = (16 * (b - LOG_BIAS) + 15)[:, None] - rg
        code = np.where(c <= 254, np.maximum(c, 0), np.where(c <= 270, 254, LOG_ZERO))
        codes[:, sl] = np.where(hg, code, LOG_ZERO)
    return codes.astype(np.uint8).reshape(*lead, n), exps.astype(np.uint8).reshape(*lead, g)


def log_decode(codes, exps, group) -> np.ndarray:
    """``2^(k / 16)``, ``k = 16 (b - 127) + 15 - c`` (code 255: 0) per value (kernels.md section
    13); float64 (..., n), each value exactly a float32."""
    c = np.asarray(codes).astype(np.int64)
    n = c.shape[-1]
    b = np.asarray(exps).astype(np.int64)[..., np.arange(n) // group]
    k = 16 * (b - LOG_BIAS) + 15 - c
    levels = np.exp2((k % 16) / 16.0).astype(np.float32).astype(np.float64)
    return np.where(c == LOG_ZERO, 0.0, np.ldexp(levels, k // 16))


# --------------------------------------------------------------------------------------------
# Symmetric per-row absmax codes (kernels.md section 14)
# --------------------------------------------------------------------------------------------


def _absmax_widths(widths) -> np.ndarray:
    w = np.asarray(widths)
    if w.ndim != 1 or w.dtype.kind not in "ui" or w.size == 0 or w.min() < 0 or w.max() > 8:
        raise ValueError(f"widths must be a non-empty 1-D integer array of bit widths in 0..8, got {w!r}")
    return w.astype(np.int64)


def absmax_encode(x, widths) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-row absmax codes (kernels.md section 14).

    ``x`` (..., d), ``widths`` (d,) in 0..8 -> codes uint8 (..., d) and float16 scales (...).
    ``a`` is the largest ``|x_i|`` over the coded coordinates (those of width > 0), rounded to
    float16 by NumPy (round to nearest even; ValueError if that overflows); the codes are
    ``clamp(floor(((x / s + 1) / 2) (2^w - 1) + 0.5), 0, 2^w - 1)`` in float64 (0 when ``s =
    0`` for ``u``; 0 in the uncoded coordinates).
    """
    w = _absmax_widths(widths)
    rows, lead = _as_rows(x, np.float32)
    if rows.shape[1] != w.size:
        raise ValueError(f"x: last axis {rows.shape[1]} != len(widths) {w.size}")
    if not np.isfinite(rows).all():
        raise ValueError("x: expected finite values")
    coded = w > 0
    a = np.where(coded, np.abs(rows), 0).max(axis=1, initial=0).astype(np.float32)
    with np.errstate(over="ignore"):
        scales = a.astype(np.float16)
    if not np.isfinite(scales).all():
        raise ValueError("x: absmax scale overflows float16")
    s = scales.astype(np.float64)[:, None]
    top = (2.0**w - 1)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(s > 0, rows.astype(np.float64) / np.where(s > 0, s, 1), 0.0)
    t = ((u + 1) * 0.5) * top
    codes = np.where(coded, np.clip(np.floor(t + 0.5), 0, top), 0).astype(np.uint8)
    return codes.reshape(*lead, w.size), scales.reshape(lead)


def absmax_decode(codes, scales, widths) -> np.ndarray:
    """``((2 code - L) / L) s`` per coded coordinate, ``L = 2^w - 1``, 0 in the others
    (kernels.md section 14); float64 (..., d)."""
    w = _absmax_widths(widths)
    c = np.asarray(codes).astype(np.int64)
    top = 2**w - 1
    if np.any(c > top):
        raise ValueError("codes: a code exceeds 2^w - 1")
    s = np.asarray(scales, dtype=np.float16).astype(np.float64)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(top > 0, (2 * c - top) / np.where(top > 0, top, 1), 0.0)
    return levels * s


# --------------------------------------------------------------------------------------------
# Fused decode attention (kernels.md section 11), from this module's own decoders
# --------------------------------------------------------------------------------------------


def decode_rows(spec, head_dim) -> np.ndarray:
    """Decode one side of a coded cache described by a spec dict, float64 ``(..., T, head_dim)``.

    ``spec["kind"]``: ``"mse"`` (``codes`` packed ``(..., T, bytes)``, ``norms``, ``bits``,
    ``seed`` or None, optional ``qjl_signs`` packed ``(..., T, ceil(d'/8))``, ``qjl_norms``,
    ``qjl_seed``: the QJL vector estimate of the rotated residual is added before the inverse
    rotation); ``"uniform_tokens"`` (``codes`` ``(..., T, bytes)``, ``scales``, ``zeros``
    ``(..., T, groups)``, ``bits``, ``group``, ``seed`` or None: rotated coordinates);
    ``"uniform_channels"`` (KIVI keys: ``codes`` ``(..., head_dim, bytes)``, ``scales``,
    ``zeros`` ``(..., head_dim, groups)``; T from ``tokens``); ``"dense"`` (``values``);
    ``"channel_runs"`` (the ``matched`` scheme: ``runs``, a list of dicts with ``codes``
    ``(..., stop - start, bytes)``, ``scales``, ``zeros`` ``(..., stop - start, groups)``,
    ``bits``, ``start``, ``stop``; ``group``, ``tokens``, ``basis`` ``(d, d)`` or ``(B, d, d)``
    where flattened head i uses basis ``i % B``: ``y_hat U^T`` with ``y_hat`` 0 in the columns
    of no run); ``"token_runs"`` (the fixed-size ``matched`` keys: ``runs``, a list of dicts
    with ``codes`` ``(..., T, bytes)``, ``bits``, ``start``, ``stop``; ``scales`` ``(..., T)``,
    ``basis`` as above: ``z_hat B^T`` with ``z_hat_i = ((2c - L) / L) * scales_t`` in float32
    for code ``c``, ``L = 2^bits - 1``, 0 in the columns of no run); ``"centred"`` (``rows``,
    another spec, plus ``mean`` ``(d,)`` or ``(B, d)``).
    """
    kind = spec["kind"]
    d = _check_dim(head_dim)
    if kind == "dense":
        return np.asarray(spec["values"], dtype=np.float64)
    if kind == "centred":
        x = decode_rows(spec["rows"], d)
        return x + _per_head(np.asarray(spec["mean"], dtype=np.float32).astype(np.float64), x.shape[:-2], 1)[..., None, :]
    if kind == "channel_runs":
        t = operator.index(spec["tokens"])
        lead = None
        y = None
        for run in spec["runs"]:
            codes = unpack_bits(run["codes"], run["bits"], t)
            part = np.swapaxes(uniform_decode(codes, run["scales"], run["zeros"], run["bits"], spec["group"]), -1, -2)
            if y is None:
                lead = part.shape[:-2]
                y = np.zeros((*lead, t, d))
            y[..., run["start"] : run["stop"]] = part
        if y is None:
            raise ValueError("channel_runs: the oracle needs at least one run to know the leading shape")
        u = _per_head(np.asarray(spec["basis"], dtype=np.float32).astype(np.float64), lead, 2)
        return y @ np.swapaxes(u, -1, -2)
    if kind == "token_runs":
        scales = np.asarray(spec["scales"]).astype(np.float64)
        lead, t = scales.shape[:-1], scales.shape[-1]
        z = np.zeros((*lead, t, d))
        for run in spec["runs"]:
            b, lo, hi = _check_bits(run["bits"]), run["start"], run["stop"]
            top = (1 << b) - 1
            levels = ((2 * np.arange(top + 1) - top).astype(np.float32) / np.float32(top)).astype(np.float64)
            z[..., lo:hi] = levels[unpack_bits(run["codes"], b, hi - lo)]
        u = _per_head(np.asarray(spec["basis"], dtype=np.float32).astype(np.float64), lead, 2)
        return (z * scales[..., None]) @ np.swapaxes(u, -1, -2)
    bits = _check_bits(spec["bits"])
    seed = spec.get("seed")
    cd = d if seed is None else padded_dim(d)
    if kind == "mse":
        codes = unpack_bits(spec["codes"], bits, cd)
        x = mse_decode(codes, spec["norms"], bits, d, seed)
        if spec.get("qjl_signs") is not None:
            signs = unpack_bits(spec["qjl_signs"], 1, cd)
            r_hat = qjl_vector_estimate(signs, spec["qjl_norms"], spec["qjl_seed"], cd)
            x = x + inverse_hadamard(r_hat, seed, d)
        return x
    if kind == "uniform_tokens":
        codes = unpack_bits(spec["codes"], bits, cd)
        y = uniform_decode(codes, spec["scales"], spec["zeros"], bits, spec["group"])
        return y if seed is None else inverse_hadamard(y, seed, d)
    if kind == "uniform_channels":
        codes = unpack_bits(spec["codes"], bits, operator.index(spec["tokens"]))
        return np.swapaxes(uniform_decode(codes, spec["scales"], spec["zeros"], bits, spec["group"]), -1, -2)
    raise ValueError(f"unknown rows kind {kind!r}")


def _per_head(table: np.ndarray, lead: tuple[int, ...], ndim: int) -> np.ndarray:
    """A per-head table (``ndim`` axes, or a leading axis of ``B`` tables for the last axis of
    ``lead``, flattened head i using table ``i % B``) broadcast to ``(*lead, *table axes)``."""
    if table.ndim == ndim:
        return np.broadcast_to(table, (*lead, *table.shape))
    heads = int(np.prod(lead)) if lead else 1
    picked = np.stack([table[i % table.shape[0]] for i in range(heads)]) if heads else np.zeros((0, *table.shape[1:]))
    return picked.reshape(*lead, *table.shape[1:])


def decode_attention(q, keys, values, side=None, scale=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention of query rows over a coded cache, float64 (kernels.md section 11).

    ``q`` ``(..., rows, d)``; ``keys`` / ``values`` spec dicts as in :func:`decode_rows` with
    the same leading shape ``(...)``; ``side`` an optional HeadQ dict (``codes`` packed
    ``(..., T, bytes)``, ``scales`` ``(..., T)``, ``basis`` ``(d, r)`` or ``(B, d, r)`` where
    flattened head i uses basis ``i % B``, ``bits``, ``sign``). Logits
    ``scale * (q . k_hat + sign * (U^T q) . z)`` (``scale = 1/sqrt(d)`` by default), where
    ``k_hat`` is the decode of the keys except that a QJL residual enters through
    :func:`qjl_inner_product` with the rotated query (the estimator the kernel evaluates; equal
    to ``q . R^T r_hat`` in exact arithmetic). Returns ``(out (..., rows, d), lse (..., rows),
    probs (..., rows, T))``.
    """
    q = np.asarray(q, dtype=np.float32).astype(np.float64)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kspec = dict(keys)
    if kspec["kind"] == "uniform_channels":
        kspec["tokens"] = np.asarray(
            values["norms"]
            if values["kind"] == "mse"
            else values["scales"][..., 0]
            if values["kind"] != "dense"
            else values["values"][..., 0]
        ).shape[-1]
    qjl = kspec.pop("qjl_signs", None) if kspec["kind"] == "mse" else None
    k = decode_rows(kspec, d)
    s = q @ np.swapaxes(k, -1, -2)
    if qjl is not None:
        cd = padded_dim(d)
        rq = hadamard(q, kspec["seed"])
        s = s + qjl_inner_product(rq, unpack_bits(qjl, 1, cd), kspec["qjl_norms"], kspec["qjl_seed"])
    if side is not None:
        basis = np.asarray(side["basis"], dtype=np.float32)
        r = basis.shape[-1]
        codes = unpack_bits(side["codes"], side["bits"], r)
        lead = q.shape[:-2]
        qf = q.reshape(-1, *q.shape[-2:])
        cf = codes.reshape(-1, *codes.shape[-2:])
        sf = np.asarray(side["scales"]).reshape(-1, codes.shape[-2])
        bases = [basis] * len(qf) if basis.ndim == 2 else [basis[i % basis.shape[0]] for i in range(len(qf))]
        corr = np.stack([headq_score_correction(qf[i], bases[i], cf[i], sf[i], side["bits"]) for i in range(len(qf))])
        s = s + side["sign"] * corr.reshape(*lead, *corr.shape[-2:])
    s = scale * s
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    p = e / z
    v = decode_rows(values, d)
    return p @ v, (m + np.log(z))[..., 0], p


if __name__ == "__main__":
    import time

    # Philox known answers (kernels.md §1).
    got = philox4x32_10(np.zeros(4, np.uint32), np.zeros(2, np.uint32))
    assert [hex(v) for v in got] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c", "0x9b00dbd8"], got
    ones = np.uint32(_MASK32)
    got = philox4x32_10(np.full(4, ones), np.full(2, ones))
    assert [hex(v) for v in got] == ["0x408f276d", "0x41c83b0e", "0xa20bc7c6", "0x6d5451fd"], got
    w = random_words(7, 2, 0, 12)
    assert np.array_equal(random_words(7, 2, 5, 6), w[5:11])
    print("philox: ok")

    # Codebook sanity (docs/kernels.md section 4): dim * D_b at dim 128.
    expected = {1: 0.36, 2: 0.117, 3: 0.034, 4: 0.0093}
    for b, ref in expected.items():
        c, bd, dist = lloyd_max_codebook(128, b)
        assert abs(128 * dist - ref) / ref < 0.03, (b, 128 * dist)
        assert np.allclose(c, -c[::-1]) and bd[2 ** (b - 1) - 1] == 0.0
        print(f"codebook dim=128 bits={b}: dim*D_b = {128 * dist:.5f}")
    t0 = time.perf_counter()
    _, _, dist8 = lloyd_max_codebook(1024, 8)
    print(f"codebook dim=1024 bits=8: dim*D_b = {1024 * dist8:.4e} ({time.perf_counter() - t0:.2f}s)")

    # Pack / unpack round trip (kernels.md §2).
    rng = np.random.default_rng(0)
    for b in range(1, 9):
        codes = rng.integers(0, 2**b, size=(3, 2, 37))
        packed = pack_bits(codes, b)
        assert packed.shape == (3, 2, (37 * b + 7) // 8)
        assert np.array_equal(unpack_bits(packed, b, 37), codes)
    assert np.array_equal(pack_bits([1, 0, 3, 2], 2), [0b10110001])
    print("pack/unpack: ok")

    # Hadamard orthogonality (kernels.md §3).
    x = rng.standard_normal((4, 5, 100))
    y = hadamard(x, 42)
    assert y.shape == (4, 5, 128)
    assert np.allclose(vector_norm(y), vector_norm(x))
    assert np.allclose(inverse_hadamard(y, 42, 100), x)
    r = hadamard(np.eye(64), 3)
    assert np.allclose(r @ r.T, np.eye(64))
    print("hadamard: ok")
