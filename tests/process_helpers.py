"""Shared by tests that run code in fresh processes (the rayon pool is sized once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stdout_per_thread_count(code: str, counts: tuple[str, ...] = ("1", "4")) -> list[bytes]:
    """The stdout bytes of ``python -c code`` run from the repository root (``tests.*``
    imports work) once per ``RAYON_NUM_THREADS`` value of ``counts``."""
    return [
        subprocess.run(
            [sys.executable, "-c", code], env=dict(os.environ, RAYON_NUM_THREADS=n), cwd=ROOT, capture_output=True, check=True
        ).stdout
        for n in counts
    ]
