"""Shared by tests that run code in fresh processes (the rayon pool is sized once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stdout_per_thread_count(code: str, counts: tuple[str, ...] = ("1", "4")) -> list[bytes]:
    """The stdout bytes of ``python -c code`` run from the repository root (``tests.*``
    imports work) once per ``RAYON_NUM_THREADS`` value of ``counts``, with every decode
    attention call split over the pool (``KVQRS_ATTEND_SPLIT=0``) whatever its size."""
    env = dict(os.environ, KVQRS_ATTEND_SPLIT="0")
    return [
        subprocess.run([sys.executable, "-c", code], env=dict(env, RAYON_NUM_THREADS=n), cwd=ROOT, capture_output=True, check=True).stdout
        for n in counts
    ]


def cli_refusal(args: list[str], cwd, monkeypatch, capsys) -> str:
    """Run ``kvqrs ARGS`` in this process from ``cwd`` with loading the model made an error, and
    return its stderr; the command must exit with status 2 (an argument error, raised before
    the model loads). In process, not as ``python -m kvqrs``: a fresh interpreter spends about
    10 seconds importing torch and transformers before it looks at an argument."""
    import pytest
    import torch
    from kvqrs import cli
    from kvqrs.evaluation import model as model_mod

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr(model_mod, "load", no_load)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads = torch.get_num_threads()  # the commands set torch's threads for their run
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main(args)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    return err
