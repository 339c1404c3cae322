"""Keys of the ``matched`` codec with a fixed size per token.

The calibrated transform of :mod:`kvqrs.schemes.matched` (``y = (k - mu) U``, columns ordered by
score-space importance, widths from reverse water-filling), with each token coded on its own
instead of each coordinate along groups of tokens: coordinate ``i`` is divided by its calibrated
standard deviation ``sigma_i``, and the token's coded coordinates share one float16 absmax scale
(:func:`~kvqrs.kernels.absmax.absmax_encode`: ``z_i = y_i / sigma_i``, ``s = max |z_i|``, ``b_i``-bit
symmetric uniform codes of ``z_i / s`` with both endpoints as levels). A token's codes depend on
that token alone, so every token stores the same bytes whatever comes before or after it: what
vLLM's paged slots and a cache's newest, partial group need. The cost is one 16-bit scale per
token (``16 / d`` bits per element) where KIVI groups pay ``32 / group`` per coded coordinate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import layout as lay
from .._arrays import KvqrsError
from ..kernels.absmax import AbsmaxCode
from ..kernels.attention import CentredRows, TokenRun, TokenRunRows
from .backend import CPU, Backend
from .base import Encoded, as_float_array, check_encoded, check_head_dim, split_shape
from .matched import MatchedBasis, MatchedCoder, _head_table, _rows_times, head_mean


class MatchedTokenCoder(MatchedCoder):
    """Per-token keys in a calibrated basis (see the module docstring).

    Args:
        head_dim: d.
        calibration: the layer's :class:`~kvqrs.schemes.matched.MatchedBasis` for this side,
            with ``deviations`` (:func:`~kvqrs.schemes.matched.fit_basis` with
            ``scales="tokens"``).
        scheme, kind: labels recorded in the encoded tensors.
        backend: the kernels' compute path.

    Stored per token: for each run of coordinates ``lo .. hi - 1`` of width ``b > 0``,
    ``ceil((hi - lo) * b / 8)`` bytes of packed codes, and one float16 scale; coordinates of
    width 0 store nothing. The fused decode attention reads the codes (:meth:`attention_rows`).
    """

    fused = True  # attention_rows below (Coder.fused)

    def __init__(self, head_dim: int, calibration: MatchedBasis, scheme: str, kind: str, backend: Backend = CPU):
        if not isinstance(calibration, MatchedBasis) or calibration.deviations is None:
            raise KvqrsError(f"calibration: per-token matched {kind} need a MatchedBasis with deviations (fit_basis(..., scales='tokens'))")
        super().__init__(head_dim, calibration, 1, scheme, kind, backend)
        self.params = {**self.params, "scales": "tokens"}
        del self.params["group"]
        # B = U diag(sigma) per head: x_hat = z_hat B^T + mu, and q . x_hat = (q B) . z_hat + q . mu.
        self.scaled_basis = (calibration.basis * calibration.deviations[:, None, :]).astype(np.float32)

    def layout(self, shape: tuple[int, ...]) -> lay.Layout:
        """``codes<b>`` uint8 ``(..., T, ceil((hi - lo) * b / 8))`` for each run of width ``b``,
        and ``scales`` ``(..., T)`` (float16): one entry per token, cut anywhere."""
        lead, t, _ = split_shape(shape)
        rows = lay.token_runs(lead, t, [(hi - lo, b) for b, lo, hi in self.runs])
        out: lay.Layout = {f"codes{b}": rows[f"runs[{i}].codes"] for i, (b, _, _) in enumerate(self.runs)}
        out["scales"] = rows["scales"]
        return out

    def _deviations(self, y: np.ndarray) -> np.ndarray:
        return head_mean(self.cal.deviations, y, self.kind)

    def encode(self, x: Any) -> Encoded:
        x = as_float_array(x, self.kind)
        check_head_dim(x, self.head_dim, self.kind)
        mean, basis = self.heads(x)
        y = _rows_times(x.astype(np.float32) - mean, basis)  # (..., T, d)
        z = y / self._deviations(y)
        try:
            code = self.k.absmax_encode(z, self.cal.widths)
        except KvqrsError:
            overflow = self._scale_overflow(z)
            if overflow is None:
                raise
            raise overflow from None
        parts = {f"codes{b}": self.k.pack_bits(code.codes[..., lo:hi], b) for b, lo, hi in self.runs}
        parts["scales"] = code.scales
        return Encoded(self.scheme, self.kind, x.shape, x.dtype, parts, self.params)

    def _scale_overflow(self, z: np.ndarray) -> KvqrsError | None:
        """The error naming the tokens of ``z`` ``(..., T, d)`` whose scale the absmax kernel
        refuses (largest coded ``|z_i|`` at or above 65520, float16 infinity once rounded) by
        their index (batch, head, token), or None when there is none."""
        if not np.isfinite(z).all():  # the kernel's own error names the non-finite value
            return None
        a = np.abs(np.where(self.cal.widths > 0, z, 0)).max(axis=-1, initial=0.0)
        bad = np.argwhere(a >= 65520)
        if bad.size == 0:
            return None
        names = ["token", "head", "batch"][: a.ndim][::-1]
        names = [f"axis {i}" for i in range(a.ndim - len(names))] + names
        where = [", ".join(f"{n} {int(i)}" for n, i in zip(names, idx)) for idx in bad[:3]]
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        first = float(a[tuple(bad[0])])
        noun = self.kind[:-1] if self.kind.endswith("s") else self.kind
        return KvqrsError(
            f"{self.kind}: the {noun} at ({'), ('.join(where)}){more} of {self.kind} shape {(*z.shape[:-1], self.head_dim)} "
            f"overflows its float16 per-token scale: its largest coded coordinate over the calibrated deviation, "
            f"|y_i / sigma_i|, is {first:.6g} (expected below 65520, float16's largest finite value being 65504); "
            f"the calibration's deviations are far below these {self.kind}' spread: recalibrate on data like them"
        )

    def coordinates(self, enc: Encoded) -> np.ndarray:
        """The decoded transform coordinates ``y_hat = z_hat * sigma`` float32 ``(..., T, d)``
        (0 where the width is 0)."""
        check_encoded(enc, self.scheme, self.kind, self.params)
        codes = np.zeros((*enc.shape[:-1], self.head_dim), np.uint8)
        for b, lo, hi in self.runs:
            codes[..., lo:hi] = self.k.unpack_bits(enc.parts[f"codes{b}"], b, hi - lo)
        z = self.k.absmax_decode(AbsmaxCode(codes, np.asarray(enc.parts["scales"], np.float16), self.cal.widths))
        return z * self._deviations(z)

    def attention_rows(self, enc: Encoded) -> CentredRows:
        """The stored runs as the fused attention kernel reads them (codes stay packed):
        :class:`~kvqrs.kernels.attention.TokenRunRows` (one
        :class:`~kvqrs.kernels.attention.TokenRun` per run of equal width, the per-token scales,
        the basis ``U diag(sigma)`` ``(kv_heads, d, d)`` or ``(d, d)``) in
        :class:`~kvqrs.kernels.attention.CentredRows` with the mean. The kernel scores
        ``(q U diag(sigma)) . z_hat`` (the mean's ``q . mu`` enters only the log-sum-exp);
        keys only.

        Raises:
            KvqrsError: ``enc`` not encoded by this coder, or a head axis that does not match
                the calibration's heads.
        """
        check_encoded(enc, self.scheme, self.kind, self.params)
        runs = tuple(TokenRun(enc.parts[f"codes{b}"], b, lo, hi) for b, lo, hi in self.runs)
        basis = _head_table(self.scaled_basis, enc.shape, self.kind)
        mean = _head_table(self.cal.mean, enc.shape, self.kind)
        return CentredRows(TokenRunRows(runs, enc.parts["scales"], basis), mean)
