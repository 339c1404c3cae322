"""Seeded synthetic attention heads (docs/evaluation.md): ``gaussian``, ``heavy``, ``lowrank``, ``focused``.

Each generator returns queries ``(n_queries, d)``, keys and values ``(tokens, d)`` as float32,
from ``numpy.random.default_rng(seed)`` (data, not a kernel's random object, so NumPy's PCG64 is
the documented source). Distribution names may carry a parameter: ``heavy-3`` (Student-t with
nu = 3), ``lowrank-8`` (rank 8), ``focused-2`` (each query aimed at 2 keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._arrays import KvqrsError, check_positive_int, check_seed

DISTRIBUTIONS = ("gaussian", "heavy", "lowrank", "focused")
DEFAULTS = {"heavy": 3.0, "lowrank": 4.0, "focused": 1.0}


@dataclass(frozen=True)
class Head:
    """One synthetic attention head."""

    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    distribution: str


def parse(name: str) -> tuple[str, float | None]:
    """Split ``"heavy-1.05"`` into ``("heavy", 1.05)``; raises :class:`KvqrsError` if unknown."""
    base, dash, arg = name.partition("-")
    if dash and not arg:
        raise KvqrsError(f"distribution: expected a number after '-', got {name!r}")
    if base not in DISTRIBUTIONS:
        raise KvqrsError(f"distribution: expected one of {DISTRIBUTIONS} (optionally '-<param>'), got {name!r}")
    if not arg:
        return base, DEFAULTS.get(base)
    if base == "gaussian":
        raise KvqrsError(f"distribution: gaussian takes no parameter, got {name!r}")
    try:
        value = float(arg)
    except ValueError:
        raise KvqrsError(f"distribution: expected a number after '-', got {name!r}") from None
    if not np.isfinite(value):
        raise KvqrsError(f"distribution: expected a finite parameter, got {name!r}")
    if base in ("lowrank", "focused") and value != int(value):
        raise KvqrsError(f"distribution: {base} takes an integer parameter, got {name!r}")
    return base, value


def _student_t(rng: np.random.Generator, nu: float, shape: tuple[int, ...]) -> np.ndarray:
    # Unit variance where it exists (nu > 2); below that the raw t (infinite variance).
    x = rng.standard_t(nu, size=shape)
    return x * np.sqrt((nu - 2) / nu) if nu > 2 else x


def generate(
    name: str,
    *,
    tokens: int,
    n_queries: int,
    head_dim: int,
    seed: int,
    outlier_channels: int = 4,
    outlier_scale: float = 8.0,
    noise: float = 0.05,
    sharpness: float = 6.0,
) -> Head:
    """Draw one head.

    - ``gaussian``: i.i.d. N(0, 1) queries, keys and values.
    - ``heavy-nu``: keys and values with i.i.d. Student-t(nu) coordinates (nu from 8 down to
      1.05), ``outlier_channels`` key channels scaled by ``outlier_scale`` (the outlier channels
      of real keys); Gaussian queries.
    - ``lowrank-r``: ``K = Z W^T / sqrt(r)`` and ``V`` likewise, rank r, plus ``noise`` N(0, 1);
      Gaussian queries.
    - ``focused-f``: Gaussian keys and values; each query is ``(sharpness / sqrt(d)) * sum of f
      random keys + N(0, 1)``, so its logit on those keys is about ``sharpness`` above the rest
      (low-entropy attention).

    Raises:
        KvqrsError: unknown distribution or non-positive sizes, nu <= 1, rank < 1.
    """
    if not isinstance(name, str):
        raise KvqrsError(f"distribution: expected a name such as 'heavy-3', got {name!r}")
    base, param = parse(name)
    channels = check_positive_int(outlier_channels, "outlier_channels", minimum=0)
    for arg, value in (("outlier_scale", outlier_scale), ("noise", noise), ("sharpness", sharpness)):
        if not (isinstance(value, (int, float)) and np.isfinite(value) and abs(value) < 1e6):
            raise KvqrsError(f"{arg}: expected a finite number of moderate size, got {value!r}")
    t = check_positive_int(tokens, "tokens")
    nq = check_positive_int(n_queries, "n_queries")
    d = check_positive_int(head_dim, "head_dim", minimum=2)
    rng = np.random.default_rng(check_seed(seed, optional=False))
    q = rng.standard_normal((nq, d))
    if base == "gaussian":
        k, v = rng.standard_normal((t, d)), rng.standard_normal((t, d))
    elif base == "heavy":
        if param is None or param <= 1.0:
            raise KvqrsError(f"distribution: heavy needs nu > 1 (finite mean), got {name!r}")
        k, v = _student_t(rng, param, (t, d)), _student_t(rng, param, (t, d))
        k[:, rng.choice(d, size=min(channels, d), replace=False)] *= outlier_scale
    elif base == "lowrank":
        r = int(param or 0)
        if not 1 <= r <= d:
            raise KvqrsError(f"distribution: lowrank needs 1 <= rank <= head_dim, got {name!r}")
        k = rng.standard_normal((t, r)) @ rng.standard_normal((d, r)).T / np.sqrt(r) + noise * rng.standard_normal((t, d))
        v = rng.standard_normal((t, r)) @ rng.standard_normal((d, r)).T / np.sqrt(r) + noise * rng.standard_normal((t, d))
    else:  # focused
        f = int(param or 0)
        if not 1 <= f <= t:
            raise KvqrsError(f"distribution: focused needs 1 <= keys per query <= tokens, got {name!r}")
        k, v = rng.standard_normal((t, d)), rng.standard_normal((t, d))
        targets = np.stack([rng.choice(t, size=f, replace=False) for _ in range(nq)])
        q = q + (sharpness / np.sqrt(d)) * k[targets].sum(axis=1)
    return Head(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), name)
