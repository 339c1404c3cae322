"""The synthetic study: scheme x n x distribution x head_dim over many seeds, with a
progress bar, written as a report folder by :mod:`kvqrs.evaluation.report`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from .sample import Cell, make_codec, measure, run_sample

STUDY_SCHEMES = ("kv", "kqv", "qkqv", "kivi", "headq")


@dataclass(frozen=True)
class StudyConfig:
    """Grid and sizes of a study run."""

    schemes: tuple[str, ...] = STUDY_SCHEMES
    bits: tuple[int, ...] = (2, 3, 4)
    distributions: tuple[str, ...] = ("gaussian", "heavy-8", "heavy-3", "heavy-1.05", "lowrank-4", "focused-1")
    head_dims: tuple[int, ...] = (64, 128, 256, 512, 1024)
    seeds: int = 16
    tokens: int = 1024
    n_queries: int = 64
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick(cls) -> StudyConfig:
        """A grid that finishes in under two minutes on two cores."""
        return cls(
            distributions=("gaussian", "heavy-3", "lowrank-4", "focused-1"),
            head_dims=(64, 128),
            seeds=16,
            tokens=256,
            n_queries=32,
        )

    def cells(self) -> list[Cell]:
        return [Cell(s, n, dist, d) for dist, d, n, s in itertools.product(self.distributions, self.head_dims, self.bits, self.schemes)]


def run_study(config: StudyConfig, progress: bool = True, ray=None) -> tuple[list[dict], float]:
    """Run every cell x seed; returns the per-sample rows (cell-major, seeds in order) and the
    wall time in seconds. ``ray``: a connected ``ray`` module (:func:`.distributed.connect`) to
    run one task per cell on the cluster; the rows are the same as the serial run's."""
    from tqdm import tqdm

    start = time.perf_counter()
    if ray is not None:
        from .distributed import map_chunks

        chunks = [[(c, s) for s in range(config.seeds)] for c in config.cells()]
        rows = map_chunks(ray, _samples, chunks, shared=(config.tokens, config.n_queries), progress=progress, desc="study")
        return rows, time.perf_counter() - start
    jobs = [(c, s) for c in config.cells() for s in range(config.seeds)]
    rows = _samples(config.tokens, config.n_queries, tqdm(jobs, desc="study", unit="sample", disable=not progress))
    return rows, time.perf_counter() - start


def _samples(tokens: int, n_queries: int, jobs) -> list[dict]:
    return [run_sample(c, s, tokens, n_queries) for c, s in jobs]


def run_model_study(config: StudyConfig, captured, progress: bool = True, ray=None) -> tuple[list[dict], float]:
    """Every scheme x n of ``config`` on every captured head (:mod:`.capture`); the row's
    ``seed`` is the head index (``layer * kv_heads + kv_head``), which also seeds the codec;
    HeadQ calibrates on the same head's queries from the calibration text. ``ray``: as in
    :func:`run_study`, one task per head, the captured heads sent to the cluster once."""
    from tqdm import tqdm

    d = captured.heads[0].keys.shape[-1]
    cells = [Cell(s, n, captured.heads[0].distribution, d) for n in config.bits for s in config.schemes]
    start = time.perf_counter()
    if ray is not None:
        from .distributed import map_chunks

        chunks = [[(c, i) for c in cells] for i in range(len(captured.heads))]
        rows = map_chunks(ray, _head_samples, chunks, shared=(captured,), progress=progress, desc="model heads")
        return rows, time.perf_counter() - start
    jobs = [(c, i) for i in range(len(captured.heads)) for c in cells]
    rows = _head_samples(captured, tqdm(jobs, desc="model heads", unit="sample", disable=not progress))
    return rows, time.perf_counter() - start


def _head_samples(captured, jobs) -> list[dict]:
    return [measure(c, i, captured.heads[i], make_codec(c, i, captured.calibration_queries[i])) for c, i in jobs]
