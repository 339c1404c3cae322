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


def run_study(config: StudyConfig, progress: bool = True) -> tuple[list[dict], float]:
    """Run every cell x seed; returns the per-sample rows and the wall time in seconds."""
    from tqdm import tqdm

    jobs = [(c, s) for c in config.cells() for s in range(config.seeds)]
    start = time.perf_counter()
    rows = [run_sample(c, s, config.tokens, config.n_queries) for c, s in tqdm(jobs, desc="study", unit="sample", disable=not progress)]
    return rows, time.perf_counter() - start


def run_model_study(config: StudyConfig, captured, progress: bool = True) -> tuple[list[dict], float]:
    """Every scheme x n of ``config`` on every captured head (:mod:`.capture`); the row's
    ``seed`` is the head index (``layer * kv_heads + kv_head``), which also seeds the codec;
    HeadQ calibrates on the same head's queries from the calibration text."""
    from tqdm import tqdm

    d = captured.heads[0].keys.shape[-1]
    jobs = [
        (Cell(s, n, captured.heads[0].distribution, d), i) for i in range(len(captured.heads)) for n in config.bits for s in config.schemes
    ]
    start = time.perf_counter()
    rows = [
        measure(c, i, captured.heads[i], make_codec(c, i, captured.calibration_queries[i]))
        for c, i in tqdm(jobs, desc="model heads", unit="sample", disable=not progress)
    ]
    return rows, time.perf_counter() - start
