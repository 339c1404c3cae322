"""The operator-matched codec (``matched``): transform coding of keys in score space and of
values in read-out space, with bit widths from reverse water-filling.

Keys are score objects: a key error ``e`` changes the logit of query ``q`` by ``q . e``, so its
expected cost is ``e^T E[q q^T] e``. Values are read-out objects: an error ``e`` reaches the
model as ``W_o e`` (the output projection of the heads of the group), cost ``e^T W_o^T W_o e``.
Both are weighted MSEs ``e^T W e``. In the eigenbasis ``U`` of the weight ``W`` (eigenvalues
``lambda_i``), coordinate ``i`` of the centred vector has variance ``sigma_i^2`` and costs
``lambda_i * sigma_i^2`` per unit of relative error, so the widths come from reverse
water-filling on those products (Cover and Thomas, Elements of Information Theory, 2nd ed.,
theorem 10.3.3): a coordinate no query reads gets 0 bits.

Write path, per (layer, KV head): ``y = (x - mu) U`` (``mu`` the calibrated mean), then every
coordinate is quantized along tokens with the KIVI kernel (asymmetric min-max uniform over
groups of ``group`` tokens, Liu et al. 2024 eq. 1-2) at its own width; coordinates of equal
width are packed together. Read path: ``x_hat = y_hat U^T + mu``. The key mean is
softmax-null (every logit of a query shifts by ``q . mu``), the value mean is added once to the
output (the probabilities sum to one); both cost no storage.

Calibration (:class:`MatchedBasis`, one per layer and side) comes from a calibration text
(:func:`fit_basis`); nothing in it is a constant fitted to one model: the widths follow from the
measured statistics and the bit budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import layout as lay
from .._arrays import KvqrsError, contiguous_float32
from ..kernels.attention import CentredRows, ChannelRun, ChannelRunRows, MSERows
from ..kernels.uniform import UniformCode
from .backend import CPU, Backend
from .base import Coder, Encoded, as_float_array, check_encoded, check_head_dim, split_shape
from .mse import decoded_scores

MAX_WIDTH = 8
KEY_SCALES = ("groups", "tokens")  # how matched keys store their scales (fit_basis's ``scales``)
TOKEN_SCALE_BYTES = 2  # the float16 absmax scale each per-token key stores (scales="tokens")


@dataclass(frozen=True)
class MatchedBasis:
    """Calibrated transform of one layer and side (keys or values).

    Attributes:
        mean: float32 ``(kv_heads, d)``, the mean subtracted before coding.
        basis: float32 ``(kv_heads, d, d)``, orthonormal columns ordered by importance (column
            ``i`` of every head gets width ``widths[i]``).
        widths: uint8 ``(d,)``, non-increasing code widths in bits (0..8), shared by the heads of
            the layer so that every head stores the same layout.
        deviations: None: each coordinate is coded along tokens in KIVI groups (per-channel
            scales). float32 ``(kv_heads, d)``, positive: the calibrated standard deviation
            ``sigma_i`` of each column's coordinate; each token is then coded on its own
            (:class:`~kvqrs.schemes.matched_tokens.MatchedTokenCoder`: ``y_i / sigma_i`` under
            one float16 absmax scale per token), a fixed size per token.
    """

    mean: np.ndarray
    basis: np.ndarray
    widths: np.ndarray
    deviations: np.ndarray | None = None

    def __post_init__(self) -> None:
        m, b, w = np.asarray(self.mean), np.asarray(self.basis), np.asarray(self.widths)
        if b.ndim != 3 or b.shape[1] != b.shape[2]:
            raise KvqrsError(f"basis: expected (kv_heads, d, d), got shape {b.shape}")
        h, d = b.shape[0], b.shape[1]
        if m.shape != (h, d):
            raise KvqrsError(f"mean: expected shape {(h, d)}, got {m.shape}")
        if w.shape != (d,) or w.dtype.kind not in "ui" or (w < 0).any() or (w > MAX_WIDTH).any():
            raise KvqrsError(f"widths: expected ({d},) integers in 0..{MAX_WIDTH}, got shape {w.shape} dtype {w.dtype}")
        if (np.diff(w.astype(int)) > 0).any():
            raise KvqrsError("widths: expected non-increasing widths (columns ordered by importance)")
        if not (np.isfinite(m).all() and np.isfinite(b).all()):
            raise KvqrsError("basis: mean and basis must be finite")
        gram = np.einsum("hdi,hdj->hij", b.astype(np.float64), b.astype(np.float64))
        err = float(np.abs(gram - np.eye(d)).max()) if d else 0.0
        if err > 1e-3:
            raise KvqrsError(f"basis: columns must be orthonormal, |U^T U - I| = {err:.3g}")
        object.__setattr__(self, "mean", m.astype(np.float32))
        object.__setattr__(self, "basis", b.astype(np.float32))
        object.__setattr__(self, "widths", w.astype(np.uint8))
        if self.deviations is not None:
            s = np.asarray(self.deviations)
            if s.shape != (h, d) or s.dtype.kind not in "uif" or not np.isfinite(s).all() or (s <= 0).any():
                raise KvqrsError(f"deviations: expected positive finite (kv_heads, d) = {(h, d)}, got shape {s.shape} dtype {s.dtype}")
            object.__setattr__(self, "deviations", s.astype(np.float32))

    @property
    def kv_heads(self) -> int:
        return self.basis.shape[0]

    @property
    def head_dim(self) -> int:
        return self.basis.shape[1]

    def width_runs(self) -> list[tuple[int, int, int]]:
        """``(width, start, stop)`` of each run of equal nonzero widths (columns ``start:stop``)."""
        runs, w = [], self.widths
        i = 0
        while i < len(w):
            j = i
            while j < len(w) and w[j] == w[i]:
                j += 1
            if w[i] > 0:
                runs.append((int(w[i]), i, j))
            i = j
        return runs

    def code_bits(self) -> float:
        """Average code bits per coordinate (the water-filling budget, before scales)."""
        return float(self.widths.astype(int).sum()) / max(self.head_dim, 1)

    @property
    def permutation(self) -> np.ndarray | None:
        """int ``(kv_heads, d)`` channel order when every head's basis is a permutation of the
        channels (``transform="channels"``), so that ``basis[h][:, i] = e_{perm[h, i]}``; else None."""
        b = self.basis
        if not (np.isin(b, (0.0, 1.0)).all() and (b.sum(axis=1) == 1).all() and (b.sum(axis=2) == 1).all()):
            return None
        return np.argmax(b, axis=1)

    @property
    def nbytes(self) -> int:
        """Bytes this side information takes stored: the mean, the widths, and the basis (a
        channel permutation as one byte per channel when it is one, else float32)."""
        perm = self.permutation
        dev = 0 if self.deviations is None else self.deviations.nbytes
        return int(self.mean.nbytes + self.widths.nbytes + dev + (self.basis.nbytes if perm is None else perm.size))


def uniform_distortion(y: np.ndarray, group: int, backend: Backend = CPU) -> np.ndarray:
    """Measured MSE of the KIVI quantizer on calibration coordinates.

    Args:
        y: float32 ``(rows, n)``: each row one coordinate's values along tokens.
        group: tokens per group.

    Returns:
        float64 ``(rows, MAX_WIDTH + 1)``: entry ``[i, b]`` is the mean squared error of row ``i``
        coded at ``b`` bits (``b = 0``: the coordinate reconstructs as 0, the centred mean).
    """
    out = np.empty((y.shape[0], MAX_WIDTH + 1))
    out[:, 0] = np.mean(y.astype(np.float64) ** 2, axis=1)
    for b in range(1, MAX_WIDTH + 1):
        code = backend.uniform_encode(y, b, group)
        y_hat = backend.uniform_decode(code)
        out[:, b] = np.mean((y.astype(np.float64) - y_hat) ** 2, axis=1)
    return out


def absmax_distortion(z: np.ndarray, backend: Backend = CPU) -> np.ndarray:
    """Measured MSE of the per-token absmax quantizer on calibration coordinates.

    Args:
        z: float32 ``(n, d)``: ``n`` tokens of ``d`` coordinates, each divided by its standard
            deviation (the quantizer's input, :func:`~kvqrs.kernels.absmax.absmax_encode`).

    Returns:
        float64 ``(d, MAX_WIDTH + 1)``: entry ``[i, b]`` is the mean squared error of coordinate
        ``i`` when every coordinate is coded at ``b`` bits (``b = 0``: reconstructed as 0).
    """
    z = contiguous_float32(z)
    out = np.empty((z.shape[1], MAX_WIDTH + 1))
    out[:, 0] = np.mean(z.astype(np.float64) ** 2, axis=0)
    for b in range(1, MAX_WIDTH + 1):
        z_hat = backend.absmax_decode(backend.absmax_encode(z, np.full(z.shape[1], b, np.uint8)))
        out[:, b] = np.mean((z.astype(np.float64) - z_hat) ** 2, axis=0)
    return out


def coordinate_deviations(y: np.ndarray) -> np.ndarray:
    """Standard deviation of each centred coordinate, ``(d,)`` from ``y`` ``(n, d)``, floored at
    1e-3 of the largest, so that no coordinate's ``y_i / sigma_i`` can leave float16's range
    for the absmax scale on keys like the calibration's."""
    sd = np.sqrt(np.mean(np.asarray(y, dtype=np.float64) ** 2, axis=0))
    return np.maximum(sd, 1e-3 * max(float(sd.max(initial=0.0)), 1e-30))


def water_fill(cost: np.ndarray, total_bits: int) -> np.ndarray:
    """Integer reverse water-filling: widths ``(n,)`` with ``sum == total_bits`` (or as near as
    ``n * MAX_WIDTH`` allows) that greedily minimise ``sum_i cost[i, width_i]``.

    ``cost`` ``(n, MAX_WIDTH + 1)`` is each coordinate's weighted distortion at every width. A
    step spends one or two bits on the coordinate with the largest distortion drop per bit, so a
    width whose single step does not pay (1-bit min-max codes can be worse than none) is
    skipped over. The result is sorted non-increasing when ``cost`` rows are in importance order.
    """
    n = cost.shape[0]
    w = np.zeros(n, dtype=int)
    left = int(min(total_bits, n * MAX_WIDTH))
    while left > 0:
        best, pick, step = -np.inf, -1, 1
        for s in (1, 2):
            if s > left:
                continue
            ok = w + s <= MAX_WIDTH
            gain = np.where(ok, (cost[np.arange(n), w] - cost[np.arange(n), np.minimum(w + s, MAX_WIDTH)]) / s, -np.inf)
            i = int(np.argmax(gain))
            if gain[i] > best:
                best, pick, step = gain[i], i, s
        if pick < 0 or not np.isfinite(best):
            break
        w[pick] += step
        left -= step
    return w


def token_code_bytes(widths: Any) -> int:
    """Code bytes one token's per-token keys store (:class:`~kvqrs.schemes.matched_tokens.MatchedTokenCoder`)
    under the integer widths ``(d,)`` (0..8), in any order: the coordinates of equal width
    ``b > 0`` form one run packed into ``ceil(count_b * b / 8)`` whole bytes. The float16 scale
    (:data:`TOKEN_SCALE_BYTES`) comes on top."""
    counts = np.bincount(np.asarray(widths, dtype=np.int64).reshape(-1), minlength=MAX_WIDTH + 1)
    return int(sum(-(-int(counts[b]) * b // 8) for b in range(1, len(counts))))


def water_fill_bytes(cost: np.ndarray, code_bytes: int) -> np.ndarray:
    """Integer reverse water-filling under a byte budget: widths ``(n,)`` whose packed per-token
    codes (:func:`token_code_bytes`, each run of equal width padded to whole bytes) fit in
    ``code_bytes``, chosen greedily as :func:`water_fill` does (a step spends one or two bits on
    the coordinate with the largest distortion drop per bit), among the steps whose padded
    bytes still fit, until no step fits. A step that fills a run's padding costs no byte, so
    the bits lost to padding are as few as the greedy order allows.

    Args:
        cost: float ``(n, MAX_WIDTH + 1)`` each coordinate's weighted distortion at every width.
        code_bytes: the bytes one token's codes may take (0 or more).

    Returns:
        int ``(n,)`` widths 0..8 with ``token_code_bytes(widths) <= code_bytes``.

    Raises:
        KvqrsError: ``code_bytes`` negative or ``cost`` not ``(n, MAX_WIDTH + 1)``.
    """
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2 or cost.shape[1] != MAX_WIDTH + 1:
        raise KvqrsError(f"cost: expected (n, {MAX_WIDTH + 1}), got shape {cost.shape}")
    if int(code_bytes) < 0:
        raise KvqrsError(f"code_bytes: expected 0 or more bytes, got {code_bytes}")
    n = cost.shape[0]
    rows, w = np.arange(n), np.zeros(n, dtype=np.int64)
    counts = np.zeros(MAX_WIDTH + 1, dtype=np.int64)
    counts[0] = n
    padded = lambda c, b: -(-c * b // 8)  # noqa: E731  bytes of a run of c coordinates at width b
    used = 0
    while True:
        best, pick, step, spent = -np.inf, -1, 1, 0
        for s in (1, 2):
            up = np.minimum(w + s, MAX_WIDTH)
            delta = padded(counts[w] - 1, w) - padded(counts[w], w) + padded(counts[up] + 1, up) - padded(counts[up], up)
            ok = (w + s <= MAX_WIDTH) & (used + delta <= int(code_bytes))
            gain = np.where(ok, (cost[rows, w] - cost[rows, up]) / s, -np.inf)
            i = int(np.argmax(gain)) if n else -1
            if i >= 0 and gain[i] > best:
                best, pick, step, spent = gain[i], i, s, int(delta[i])
        if pick < 0 or not np.isfinite(best):
            return w
        counts[w[pick]] -= 1
        w[pick] += step
        counts[w[pick]] += 1
        used += spent


def allocate_layers(cost: Any, bits: Any, budget: float) -> np.ndarray:
    """Per-layer choice among coding options at an average bit budget (a multiple-choice
    knapsack solved greedily on the measured trade-off, as :func:`water_fill` does within a
    layer): start every layer at its cheapest option, then repeatedly move the layer whose
    next dearer option buys the largest drop in cost per extra bit, while the average stays
    within ``budget``.

    Args:
        cost: ``(layers, options)`` measured model distortion of coding layer ``l`` alone with
            option ``o`` (for instance the KL of the next-token distribution on calibration
            text; sensitivities add up for small distortions).
        bits: ``(layers, options)`` stored bits per element of that option, every byte counted.
        budget: the average bits per element over the layers (every layer holds as many
            elements).

    Returns:
        int ``(layers,)`` the chosen option of each layer.

    Raises:
        KvqrsError: shapes differ, NaN, or even the cheapest options exceed the budget.
    """
    c, b = np.asarray(cost, dtype=np.float64), np.asarray(bits, dtype=np.float64)
    if c.ndim != 2 or c.shape != b.shape or c.shape[1] == 0:
        raise KvqrsError(f"cost, bits: expected two (layers, options) arrays of one shape, got {c.shape} and {b.shape}")
    if not (np.isfinite(c).all() and np.isfinite(b).all()):
        raise KvqrsError("cost, bits: expected finite values")
    if not np.isfinite(budget):
        raise KvqrsError(f"budget: expected a finite number of bits per element, got {budget}")
    layers = np.arange(c.shape[0])
    pick = np.argmin(b, axis=1)
    total, limit = b[layers, pick].sum(), float(budget) * c.shape[0]
    if total > limit + 1e-9:
        raise KvqrsError(f"budget: {budget} bits per element is below the cheapest options' average {total / c.shape[0]:.4f}")
    while True:
        extra = b - b[layers, pick][:, None]
        gain = np.where(
            (extra > 0) & (total + extra <= limit + 1e-9), (c[layers, pick][:, None] - c) / np.where(extra > 0, extra, 1), -np.inf
        )
        flat = int(np.argmax(gain))
        layer, option = divmod(flat, c.shape[1])
        if not np.isfinite(gain[layer, option]) or gain[layer, option] <= 0:
            return pick
        total += extra[layer, option]
        pick[layer] = option


def fit_basis(
    samples: Any, bits: float, group: int, weight: Any = None, backend: Backend = CPU, transform: str = "eigen", scales: str = "groups"
) -> MatchedBasis:
    """Fit the transform and the widths of one layer and side from calibration vectors.

    Args:
        samples: ``(kv_heads, n, d)`` calibration keys or values (post-RoPE keys, as cached).
        bits: average code bits per coordinate (``0 < bits <= 8``; the scales add
            ``32 / group`` bits per coded coordinate on top).
        group: tokens per scale group of the KIVI kernel.
        weight: ``(kv_heads, d, d)`` symmetric positive semi-definite error weight: the second
            moment ``E[q q^T]`` of the calibration queries of each GQA group for keys, the
            output projection's ``W_o^T W_o`` for values; None: plain MSE (the KLT of the
            centred vectors).
        transform: ``"eigen"``: the eigenbasis of ``weight`` (of the centred covariance when
            ``weight`` is None); ``"channels"``: the identity (the cached channels themselves,
            ``lambda_i`` the weight's diagonal): nothing per layer to store but the mean and
            the widths, which a self-calibrating cache pays per sequence.
        scales: ``"groups"``: each coordinate coded along tokens in KIVI groups of ``group``
            tokens; ``"tokens"``: each token coded on its own, ``y_i / sigma_i`` under one
            float16 absmax scale per token (the result carries the deviations ``sigma``; the
            widths are water-filled on that quantizer's measured distortions).

    Returns:
        :class:`MatchedBasis`: columns ordered by ``lambda_i * sigma_i^2`` (weight eigenvalue
        times the centred variance along that eigenvector), widths from :func:`water_fill` on the
        weighted distortions the KIVI kernel measures on ``samples`` (the same widths for every
        head: the distortions of the columns of equal rank are summed over heads).

    Raises:
        KvqrsError: bad shapes, too few samples (``n < 2``), NaN/Inf, or ``bits`` out of range.
    """
    return fit_bases(samples, (bits,), group, weight, backend, transform, scales)[0]


def fit_bases(
    samples: Any,
    bits: Sequence[float],
    group: int,
    weight: Any = None,
    backend: Backend = CPU,
    transform: str = "eigen",
    scales: str = "groups",
) -> list[MatchedBasis]:
    """:func:`fit_basis` at each average width of ``bits`` (one :class:`MatchedBasis` each, in
    order), from one transform and one measurement of the distortions: each equals
    ``fit_basis(samples, b, ...)``. Raises as :func:`fit_basis` does, for any width of ``bits``."""
    for b in bits:
        if not 0 < float(b) <= MAX_WIDTH:
            raise KvqrsError(f"bits: expected 0 < bits <= {MAX_WIDTH} average code bits, got {b}")
    mean, bases, devs, cost = _fit_costs(samples, group, weight, backend, transform, scales)
    d = cost.shape[0]
    return [_ordered_basis(mean, bases, devs, water_fill(cost, int(round(float(b) * d)))) for b in bits]


def fit_bases_bytes(
    samples: Any, code_bytes: Sequence[int], weight: Any = None, backend: Backend = CPU, transform: str = "eigen"
) -> list[MatchedBasis]:
    """Per-token keys (``scales="tokens"``) fitted as :func:`fit_basis` does, but at a byte
    budget instead of an average width: for each entry of ``code_bytes`` (the bytes one token's
    packed codes may take, the float16 scale not included), the widths come from
    :func:`water_fill_bytes`, so that every run's padding to whole bytes is counted and
    ``token_code_bytes(result.widths) <= code_bytes``. One transform and one measurement of the
    distortions serve every budget.

    Args:
        samples: ``(kv_heads, n, d)`` calibration keys; weight, backend, transform: as
            :func:`fit_basis`.
        code_bytes: integer budgets, each 0..d (8 bits per coordinate at most).

    Returns:
        one :class:`MatchedBasis` (with ``deviations``) per budget, in order.

    Raises:
        KvqrsError: as :func:`fit_basis`, or a budget that is not an integer in 0..d.
    """
    for c in code_bytes:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
            raise KvqrsError(f"code_bytes: expected integer bytes 0 or more, got {c!r}")
    mean, bases, devs, cost = _fit_costs(samples, 1, weight, backend, transform, "tokens")
    for c in code_bytes:
        if c > cost.shape[0]:
            raise KvqrsError(f"code_bytes: expected at most d = {cost.shape[0]} bytes (8 bits per coordinate), got {c}")
    return [_ordered_basis(mean, bases, devs, water_fill_bytes(cost, int(c))) for c in code_bytes]


def _fit_costs(
    samples: Any, group: int, weight: Any, backend: Backend, transform: str, scales: str
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray]:
    """The transform and the measured distortions :func:`fit_bases` water-fills: the mean
    float64 ``(kv_heads, d)``, each head's basis ``(d, d)`` (columns by importance), each
    head's deviations ``(d,)`` (``scales="tokens"``; else an empty list), and the weighted
    distortions float64 ``(d, MAX_WIDTH + 1)`` summed over heads. Raises as :func:`fit_basis`."""
    x = np.asarray(as_float_array(samples, "samples"), dtype=np.float64)
    if x.ndim != 3 or x.shape[1] < 2:
        raise KvqrsError(f"samples: expected (kv_heads, n >= 2, d), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise KvqrsError("samples: calibration vectors must be finite")
    h, n, d = x.shape
    mean = x.mean(axis=1)
    xc = x - mean[:, None]
    cov = second_moment(xc)
    bases, cost = [], np.zeros((d, MAX_WIDTH + 1))
    if transform not in ("eigen", "channels"):
        raise KvqrsError(f"transform: expected 'eigen' or 'channels', got {transform!r}")
    if scales not in KEY_SCALES:
        raise KvqrsError(f"scales: expected one of {KEY_SCALES}, got {scales!r}")
    devs = []
    for i in range(h):
        wi = None
        if weight is not None:
            wi = np.asarray(weight[i], dtype=np.float64)
            if wi.shape != (d, d) or not np.isfinite(wi).all():
                raise KvqrsError(f"weight: expected finite (kv_heads, {d}, {d}), got head {i} of shape {wi.shape}")
        if transform == "channels":
            u, lam = np.eye(d), np.ones(d) if wi is None else np.clip(np.diag(wi), 0.0, None)
        elif wi is None:
            lam_c, u = np.linalg.eigh(cov[i])
            lam = np.ones(d)
        else:
            lam, u = np.linalg.eigh((wi + wi.T) / 2)
            lam = np.clip(lam, 0.0, None)
        var = np.einsum("di,de,ei->i", u, cov[i], u)
        order = np.argsort(-(lam * var), kind="stable")
        u, lam = u[:, order], lam[order]
        bases.append(u)
        if scales == "groups":
            y = (xc[i] @ u).T.astype(np.float32)  # (d, n): each coordinate along tokens
            cost += lam[:, None] * uniform_distortion(y, group, backend)
        else:
            y = xc[i] @ u  # (n, d): each token's coordinates
            sd = coordinate_deviations(y)
            devs.append(sd)
            cost += (lam * sd**2)[:, None] * absmax_distortion((y / sd).astype(np.float32), backend)
    return mean, bases, devs, cost


def _ordered_basis(mean: np.ndarray, bases: list[np.ndarray], devs: list[np.ndarray], widths: np.ndarray) -> MatchedBasis:
    """The :class:`MatchedBasis` of :func:`_fit_costs`' transform under ``widths`` ``(d,)``."""
    # Ties in importance across heads can leave the pooled widths out of order: sort them with
    # their columns (every head's column i keeps width i's rank).
    perm = np.argsort(-widths, kind="stable")
    basis = np.stack(bases)[:, :, perm]
    dev = np.stack(devs)[:, perm].astype(np.float32) if devs else None
    return MatchedBasis(mean.astype(np.float32), basis.astype(np.float32), widths[perm].astype(np.uint8), dev)


def query_moment(query: Any, kv_heads: int) -> np.ndarray:
    """Second moment ``E[q q^T]`` of the queries of each GQA group, float64 ``(kv_heads, d, d)``.

    Args:
        query: ``(q_heads, n, d)`` or ``(batch, q_heads, n, d)`` post-RoPE queries; query heads
            ``h * g .. h * g + g - 1`` read KV head ``h`` (``g = q_heads / kv_heads``).
        kv_heads: KV heads of the layer.

    Raises:
        KvqrsError: ``q_heads`` not a multiple of ``kv_heads``, or a wrong rank.
    """
    q = np.asarray(as_float_array(query, "query"), dtype=np.float64)
    if q.ndim == 3:
        q = q[None]
    if q.ndim != 4 or kv_heads < 1 or q.shape[1] % kv_heads:
        raise KvqrsError(f"query: expected (batch, q_heads, n, d) with q_heads a multiple of {kv_heads} kv_heads, got shape {q.shape}")
    b, qh, n, d = q.shape
    g = q.reshape(b, kv_heads, qh // kv_heads, n, d).transpose(1, 0, 2, 3, 4).reshape(kv_heads, -1, d)
    return second_moment(g)


def second_moment(x: np.ndarray) -> np.ndarray:
    """``(1 / n) sum_t x_t x_t^T`` per leading index: float64 ``(h, d, d)`` from ``(h, n, d)``
    (zeros when ``n = 0``), one BLAS product per head."""
    x = np.asarray(x, dtype=np.float64)
    return np.matmul(x.transpose(0, 2, 1), x) / max(x.shape[1], 1)


def fit_layer(
    moment: Any,
    keys: Any,
    values: Any,
    key_bits: float,
    group: int,
    value_bits: float | None = None,
    transform: str = "eigen",
    backend: Backend = CPU,
) -> MatchedCalibration:
    """One layer's ``matched`` calibration from its statistics.

    Args:
        moment: ``(kv_heads, d, d)`` second moment of the queries of each GQA group
            (:func:`query_moment`): the score-space error weight of the keys.
        keys, values: ``(kv_heads, n, d)`` calibration keys and values (post-RoPE, as cached).
        key_bits: average key code bits per coordinate.
        group: tokens per scale group.
        value_bits: None: values keep the per-token rotated Lloyd-Max stage (only their mean is
            fitted); a budget: values are transform-coded in the KLT of their centred covariance
            (:func:`fit_basis` unweighted) at that average code width.
        transform: the key transform (:func:`fit_basis`): ``"eigen"`` or ``"channels"``.

    Raises:
        KvqrsError: as :func:`fit_basis`.
    """
    v = np.asarray(as_float_array(values, "values"), dtype=np.float64)
    if v.ndim != 3:
        raise KvqrsError(f"values: expected (kv_heads, n, d), got shape {v.shape}")
    vbasis = None if value_bits is None else fit_basis(v, value_bits, group, None, backend)
    vmean = v.mean(axis=1) if vbasis is None else vbasis.mean
    return MatchedCalibration(fit_basis(keys, key_bits, group, moment, backend, transform), vmean, vbasis)


def _rows_times(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``x @ m`` (rows ``(..., T, d)`` times ``(..., d, e)``) in float64, rounded once to
    float32: every row's result is the same whatever the number of rows (a float32 BLAS
    product rounds differently for 1 row and for many, so a streamed cache would store other
    codes than a one-shot encode)."""
    return np.matmul(x.astype(np.float64), m.astype(np.float64)).astype(np.float32)


class MatchedCoder(Coder):
    """Transform coder of one layer and side (see the module docstring).

    Args:
        head_dim: d.
        calibration: the layer's :class:`MatchedBasis` for this side.
        group: tokens per scale group (KIVI kernel); chunks joined into a growing cache must hold
            whole groups.
        scheme, kind: labels recorded in the encoded tensors.
        backend: the kernels' compute path.

    Stored per coded coordinate (width ``b > 0``) and ``T`` tokens: ``ceil(T * b / 8)`` code
    bytes and a 16-bit scale and zero point per group; coordinates of width 0 store nothing.
    """

    fused = True  # attention_rows below (Coder.fused)

    def __init__(self, head_dim: int, calibration: MatchedBasis, group: int, scheme: str, kind: str, backend: Backend = CPU):
        if not isinstance(calibration, MatchedBasis):
            raise KvqrsError(f"calibration: expected a MatchedBasis for the {kind}, got {type(calibration).__name__}")
        if calibration.head_dim != head_dim:
            raise KvqrsError(f"calibration: fitted for head_dim {calibration.head_dim}, codec head_dim is {head_dim}")
        self.head_dim, self.cal, self.group, self.scheme, self.kind = head_dim, calibration, group, scheme, kind
        self.k = backend
        self.runs = calibration.width_runs()
        self.params = {
            "group": group,
            "widths": ",".join(str(int(w)) for w in calibration.widths),
            "fingerprint": _fingerprint(calibration),
        }

    # -- layout --------------------------------------------------------------------------
    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """For each run of coordinates ``lo .. hi - 1`` of width ``b > 0``: ``codes<b>``
        ``(..., hi - lo, packed(T, b))`` and ``scales<b>``, ``zeros<b>`` ``(..., hi - lo,
        ceil(T / group))``, tokens along the last axis (chunks join and are cut at whole groups
        and bytes)."""
        lead, t, _ = split_shape(shape)
        out: lay.Layout = {}
        for b, lo, hi in self.runs:
            rows = lay.uniform_channels(lead, t, hi - lo, b, self.group)
            out.update({f"{name}{b}": part for name, part in rows.items()})
        return out

    # -- transform -------------------------------------------------------------------------
    def heads(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean ``(..., H or 1, 1, d)`` and basis ``(..., H, d, d)`` broadcast against ``x``
        ``(..., H, T, d)``; a single calibrated head also serves inputs without a head axis."""
        h = self.cal.kv_heads
        if x.ndim >= 3 and x.shape[-3] == h:
            return self.cal.mean[:, None, :], self.cal.basis
        if h == 1:
            return self.cal.mean[0][None, :], self.cal.basis[0]
        raise KvqrsError(f"{self.kind}: expected shape (..., {h} kv_heads, tokens, {self.head_dim}) for this calibration, got {x.shape}")

    def encode(self, x: Any) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        mean, basis = self.heads(x)
        y = np.swapaxes(_rows_times(x.astype(np.float32) - mean, basis), -1, -2)  # (..., d, T): coordinates along tokens
        y = contiguous_float32(y)
        parts = {}
        t = x.shape[-2]
        for b, lo, hi in self.runs:
            rows = y[..., lo:hi, :]
            if t == 0:
                empty = (*rows.shape[:-1], 0)
                parts.update(
                    {
                        f"codes{b}": np.zeros(empty, np.uint8),
                        f"scales{b}": np.zeros(empty, np.float16),
                        f"zeros{b}": np.zeros(empty, np.float16),
                    }
                )
                continue
            code = self.k.uniform_encode(rows, b, self.group)
            parts.update({f"codes{b}": self.k.pack_bits(code.codes, b), f"scales{b}": code.scales, f"zeros{b}": code.zeros})
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def coordinates(self, enc: Encoded) -> np.ndarray:
        """The decoded transform coordinates ``y_hat`` float32 ``(..., T, d)`` (0 where the width is 0)."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        t, d = enc.shape[-2], self.head_dim
        y = np.zeros((*enc.shape[:-2], d, t), np.float32)
        if t:
            for b, lo, hi in self.runs:
                codes = self.k.unpack_bits(enc.parts[f"codes{b}"], b, t)
                y[..., lo:hi, :] = self.k.uniform_decode(UniformCode(codes, enc.parts[f"scales{b}"], enc.parts[f"zeros{b}"], self.group, b))
        return np.swapaxes(y, -1, -2)

    def decode(self, enc: Encoded) -> np.ndarray:
        """``x_hat = y_hat U^T + mu``, float32 ``(..., T, d)``."""
        y = self.coordinates(enc)
        mean, basis = self.heads(y)
        return _rows_times(y, np.swapaxes(basis, -1, -2)) + mean

    def scores(self, q: np.ndarray, enc: Encoded) -> np.ndarray:
        return decoded_scores(q, self.decode(enc))

    def attention_rows(self, enc: Encoded) -> CentredRows:
        """The stored runs as the fused attention kernel reads them, keys or values alike
        (codes stay packed): :class:`~kvqrs.kernels.attention.ChannelRunRows` (one
        :class:`~kvqrs.kernels.attention.ChannelRun` per run of equal width, the basis
        ``(kv_heads, d, d)`` or ``(d, d)``) in :class:`~kvqrs.kernels.attention.CentredRows` with
        the mean ``(kv_heads, d)`` or ``(d,)``. As keys the kernel scores ``(q U) . y_hat`` (the
        mean's ``q . mu`` is left out of the logits, where the softmax ignores it, and enters
        only the log-sum-exp); as values it sums ``p_j y_hat_j`` and rotates the sum once.

        Raises:
            KvqrsError: ``enc`` not encoded by this coder (scheme, side, group, widths or
                calibration), or a head axis that does not match the calibration's heads.
        """
        check_encoded(enc, self.scheme, self.kind, self.params)
        runs = tuple(
            ChannelRun(enc.parts[f"codes{b}"], enc.parts[f"scales{b}"], enc.parts[f"zeros{b}"], b, lo, hi) for b, lo, hi in self.runs
        )
        basis = _head_table(self.cal.basis, enc.shape, self.kind)
        mean = _head_table(self.cal.mean, enc.shape, self.kind)
        return CentredRows(ChannelRunRows(runs, self.group, basis, enc.shape[-2]), mean)


def _head_table(table: np.ndarray, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """A calibrated per-head table (``(kv_heads, ...)``) for a tensor of ``shape``
    ``(..., H, T, d)``: all of it when ``H`` is the calibration's heads, head 0's table when the
    calibration has one head (it serves every head, as in encoding)."""
    h = table.shape[0]
    if len(shape) >= 3 and shape[-3] == h:
        return table
    if h == 1:
        return table[0]
    raise KvqrsError(f"{kind}: expected shape (..., {h} kv_heads, tokens, {shape[-1]}) for this calibration, got {shape}")


def _fingerprint(cal: MatchedBasis) -> str:
    """A short digest of the calibration, recorded with the codes so that codes are never
    decoded under another calibration."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for a in (cal.mean, cal.basis, cal.widths) if cal.deviations is None else (cal.mean, cal.basis, cal.widths, cal.deviations):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def calibration_fingerprint(cal: MatchedCalibration) -> str:
    """Digest of a whole layer calibration (key transform, value mean, value transform)."""
    parts = [_fingerprint(cal.keys), _fingerprint(cal.values) if cal.values is not None else "-"]
    parts.append(__import__("hashlib").blake2b(cal.value_mean.tobytes(), digest_size=8).hexdigest())
    parts.append(str(cal.value_bits))
    if cal.value_classes is not None:
        parts.append(str(cal.value_classes))
    return ":".join(parts)


def bits_per_element(cal: MatchedBasis, group: int, tokens: int) -> float:
    """Stored bits per element of ``tokens`` tokens coded with ``cal`` (codes, scales and zero
    points; the mean and basis are per-layer constants, not per-token storage)."""
    if tokens <= 0:
        return 0.0
    bits = 0
    for b, lo, hi in cal.width_runs():
        bits += (hi - lo) * (8 * math.ceil(tokens * b / 8) + 32 * math.ceil(tokens / group))
    return bits / (tokens * cal.head_dim)


@dataclass(frozen=True)
class MatchedCalibration:
    """What the ``matched`` scheme calibrates per layer.

    Attributes:
        keys: the key transform and widths (:func:`fit_basis` with the queries' second moment).
        value_mean: float32 ``(kv_heads, d)``: subtracted before the value code, added back once
            to the attention output.
        values: None: values take the rotated Lloyd-Max stage per token at the config's value
            width (:class:`MatchedValueCoder`). A :class:`MatchedBasis` (its mean equal to
            ``value_mean``): values are transform-coded like keys (:class:`MatchedCoder`), in
            the eigenbasis of their read-out weight with water-filled widths.
        value_bits: this layer's Lloyd-Max value width (1..8), overriding the config's (a
            per-layer allocation, :func:`allocate_layers`); None: the config's.
        value_classes: None, or the per-token width classes of the values (``((width, count),
            ...)`` per chunk of the config's ``group`` tokens, mean width ``value_bits``):
            tokens are ordered by A^2 importance (:mod:`kvqrs.schemes.width_classes`), fitted by
            :func:`kvqrs.hf.calibration.fit_value_classes`.
    """

    keys: MatchedBasis
    value_mean: np.ndarray
    values: MatchedBasis | None = None
    value_bits: int | None = None
    value_classes: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keys, MatchedBasis):
            raise KvqrsError(f"keys: expected a MatchedBasis, got {type(self.keys).__name__}")
        vm = np.asarray(self.value_mean, dtype=np.float32)
        if vm.shape != self.keys.mean.shape or not np.isfinite(vm).all():
            raise KvqrsError(f"value_mean: expected finite shape {self.keys.mean.shape}, got {vm.shape}")
        if self.values is not None:
            if not isinstance(self.values, MatchedBasis):
                raise KvqrsError(f"values: expected a MatchedBasis or None, got {type(self.values).__name__}")
            if self.values.mean.shape != vm.shape or not np.array_equal(self.values.mean, vm):
                raise KvqrsError("values: the value basis's mean must equal value_mean")
        object.__setattr__(self, "value_mean", vm)
        if self.value_bits is not None:
            if (
                isinstance(self.value_bits, bool)
                or not isinstance(self.value_bits, (int, np.integer))
                or not 1 <= self.value_bits <= MAX_WIDTH
            ):
                raise KvqrsError(f"value_bits: expected None or an integer width 1..{MAX_WIDTH}, got {self.value_bits!r}")
            object.__setattr__(self, "value_bits", int(self.value_bits))
        if self.value_classes is not None:
            from .width_classes import check_classes

            classes = check_classes(self.value_classes)
            chunk = sum(c for _, c in classes)
            if self.values is not None or self.value_bits is None or sum(b * c for b, c in classes) != self.value_bits * chunk:
                raise KvqrsError(
                    f"value_classes: expected classes of mean width value_bits ({self.value_bits}) for per-token values, got {classes}"
                )
            object.__setattr__(self, "value_classes", classes)

    @property
    def nbytes(self) -> int:
        """Bytes of this calibration stored (means, bases, widths: :attr:`MatchedBasis.nbytes`):
        side information a self-calibrated cache holds per sequence."""
        vbytes = self.value_mean.nbytes if self.values is None else self.values.nbytes
        return int(self.keys.nbytes + vbytes)


def head_mean(mean: np.ndarray, x: np.ndarray, kind: str) -> np.ndarray:
    """A calibration's per-KV-head mean ``(kv_heads, d)`` shaped to broadcast against ``x``
    ``(..., kv_heads, tokens, d)`` (or any ``(..., tokens, d)`` with one head's mean)."""
    h = mean.shape[0]
    if x.ndim >= 3 and x.shape[-3] == h:
        return mean[:, None, :]
    if h == 1:
        return mean[0]
    raise KvqrsError(f"{kind}: expected shape (..., {h} kv_heads, tokens, {mean.shape[-1]}) for this calibration, got {x.shape}")


class MatchedValueCoder(Coder):
    """Values of the ``matched`` scheme: the calibrated value mean removed (it is added back once
    to the output, since the probabilities sum to one), then the rotated Lloyd-Max MSE stage
    (``||x - mu||`` + b-bit codes per token): per-token codes, since the read-out weights
    tokens, and a shared mean is the one structure every token repeats. ``scale``, ``norms``,
    ``norm_group``: what each token stores and how, as :class:`~kvqrs.schemes.mse.MSECoder`."""

    fused = True  # attention_rows below (Coder.fused)

    def __init__(
        self,
        head_dim: int,
        bits: int,
        seed: int,
        mean: np.ndarray,
        scheme: str,
        kind: str,
        backend: Backend = CPU,
        scale: str = "norm",
        norms: str = "float",
        norm_group: int | None = None,
    ):
        from .mse import MSECoder

        self.head_dim, self.bits, self.scheme, self.kind, self.k = head_dim, bits, scheme, kind, backend
        self.mean = np.asarray(mean, dtype=np.float32)
        self.mse = MSECoder(head_dim, bits, seed, scheme, kind, backend, scale, norms, norm_group)
        digest = __import__("hashlib").blake2b(self.mean.tobytes(), digest_size=8).hexdigest()
        self.params = {**self.mse.params, "mean": digest}

    def _mean(self, x: np.ndarray) -> np.ndarray:
        return head_mean(self.mean, x, self.kind)

    def encode(self, x: Any) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        enc = self.mse.encode(x.astype(np.float32) - self._mean(x))
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, enc.parts, self.params)

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """The MSE stage's parts (``codes``, ``norms``)."""
        return self.mse.layout(shape)

    def decode(self, enc: Encoded) -> np.ndarray:
        check_encoded(enc, self.scheme, self.kind, self.params)
        y = self.mse.decode_unchecked(enc)
        return y + self._mean(y)

    def attention_rows(self, enc: Encoded) -> CentredRows:
        """The MSE stage's rows (:class:`~kvqrs.kernels.attention.MSERows`, codes packed) in
        :class:`~kvqrs.kernels.attention.CentredRows` with the value mean ``(kv_heads, d)`` or
        ``(d,)``: the kernel adds the mean once to the output (the probabilities sum to one).

        Raises:
            KvqrsError: ``enc`` not encoded by this coder, or a head axis that does not match
                the calibration's heads.
        """
        check_encoded(enc, self.scheme, self.kind, self.params)
        rows: MSERows = self.mse.rows_unchecked(enc)
        return CentredRows(rows, _head_table(self.mean, enc.shape, self.kind))


def random_calibration(head_dim: int, bits: int, seed: int) -> MatchedCalibration:
    """The random-basis control of the ``matched`` scheme: one seeded random orthonormal basis
    (:func:`kvqrs.kernels.rng.random_orthonormal_basis`) shared by every KV head, zero means,
    and widths ``bits + 1`` on the first quarter of the columns, ``bits - 1`` on the last
    quarter and ``bits`` between (the same average; several width runs, as a fitted layout has).
    Nothing is learned from data: it measures what calibration adds, and lets tests run the
    scheme without a model."""
    from ..kernels.rng import random_orthonormal_basis

    if not 1 <= int(bits) <= MAX_WIDTH - 1:
        raise KvqrsError(f"bits: the random matched control takes 1..{MAX_WIDTH - 1} bits, got {bits}")
    q = head_dim // 4
    widths = np.full(head_dim, int(bits))
    if q:
        widths[:q] += 1
        widths[head_dim - q :] -= 1
    basis = random_orthonormal_basis(seed, head_dim, head_dim)[None]
    zeros = np.zeros((1, head_dim), np.float32)
    return MatchedCalibration(MatchedBasis(zeros, basis, widths), zeros)
