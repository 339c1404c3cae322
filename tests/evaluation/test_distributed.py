"""The study and the evaluation on Ray (``kvqrs.evaluation.distributed``): a local two-CPU Ray
cluster started by this module; the distributed rows, report files and command-line output equal
the serial run's, the work runs in the cluster's worker processes, and bad addresses or a missing
Ray are clean errors."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import ray
from kvqrs import KvqrsError
from kvqrs.evaluation.distributed import connect, map_actors, map_chunks
from kvqrs.evaluation.report import write_report
from kvqrs.evaluation.study import StudyConfig, run_study

GRID = StudyConfig(
    schemes=("kv", "qkqv", "kivi"), bits=(2, 4), distributions=("gaussian", "heavy-3"), head_dims=(64,), seeds=3, tokens=64, n_queries=8
)
PERMUTATIONS = 19
CLI_TIMEOUT_S = 300
# The one line of a study summary that measures time rather than results.
SECONDS = re.compile(r"\d+ samples in [0-9.]+ s\.")


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of this machine with two CPUs (its GCS, raylet and workers are processes of
    their own, so other processes can connect to it by address); shut down after the module."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, logging_level="error", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _pid_of(pause: float, items: list) -> list:
    time.sleep(pause)
    return [(x, os.getpid()) for x in items]


class _Echo:
    def __init__(self, offset: int):
        self.offset = offset

    def add(self, x: int) -> tuple[int, int]:
        return x + self.offset, os.getpid()


def test_map_chunks_keeps_order_and_runs_on_workers(cluster):
    chunks = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(6)]
    out = map_chunks(cluster, _pid_of, chunks, shared=(0.2,), progress=False)
    assert [x for x, _ in out] == list(range(18))
    pids = {p for _, p in out}
    assert os.getpid() not in pids and len(pids) == 2  # both of the cluster's CPUs took tasks


def test_map_actors_keeps_order(cluster):
    out = map_actors(cluster, _Echo, (100,), list(range(7)), "add", count=2, cpus=1, progress=False, desc="")
    assert [x for x, _ in out] == [100 + i for i in range(7)]
    assert os.getpid() not in {p for _, p in out}
    with pytest.raises(KvqrsError, match="at least one worker"):
        map_actors(cluster, _Echo, (0,), [1], "add", count=0, cpus=1, progress=False, desc="")


def test_task_errors_reach_the_caller(cluster):
    bad = StudyConfig(schemes=("kv",), bits=(2,), distributions=("nope",), head_dims=(64,), seeds=1, tokens=16, n_queries=4)
    with pytest.raises(KvqrsError, match=r"^distribution: expected one of .* got 'nope'$"):  # the worker's error, not Ray's wrapper
        run_study(bad, progress=False, ray=cluster)


def test_study_on_ray_equals_serial(cluster, tmp_path):
    serial, t_serial = run_study(GRID, progress=False)
    distributed, t_ray = run_study(GRID, progress=False, ray=cluster)
    assert len(serial) == len(GRID.cells()) * GRID.seeds
    assert distributed == serial  # same rows, same order, every float bit for bit
    a = write_report(serial, tmp_path / "serial", GRID, t_serial, permutations=PERMUTATIONS)
    b = write_report(distributed, tmp_path / "ray", GRID, t_ray, permutations=PERMUTATIONS)
    for name in ("samples.csv", "samples.json", "pairwise.csv"):
        assert (a.parent / name).read_bytes() == (b.parent / name).read_bytes(), name
    assert SECONDS.search(a.read_text())
    assert SECONDS.sub("", a.read_text()) == SECONDS.sub("", b.read_text())


def _study_cli(out: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvqrs", "study", "--schemes", "kv", "kivi", "--bits", "2", "3", "--distributions", "gaussian"]
    cmd += ["--head-dims", "64", "--seeds", "3", "--tokens", "32", "--queries", "4", "--permutations", "9", "--no-progress", "--brief"]
    return subprocess.run([*cmd, "--out", str(out), *extra], capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=out.parent)


def test_cli_study_on_ray_equals_serial(cluster, tmp_path):
    address = cluster.get_runtime_context().gcs_address
    serial = _study_cli(tmp_path / "serial")
    distributed = _study_cli(tmp_path / "ray", "--ray", address)
    assert serial.returncode == 0, serial.stderr[-2000:]
    assert distributed.returncode == 0, distributed.stderr[-2000:]
    assert f"ray: 2 CPUs on 1 node(s) at {address}" in distributed.stdout
    for name in ("samples.csv", "samples.json", "pairwise.csv"):
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes(), name


def test_cli_bad_address_is_a_clean_error(tmp_path):
    env = {**os.environ, "RAY_ADDRESS": ""}
    cmd = [sys.executable, "-m", "kvqrs", "study", "--seeds", "1", "--schemes", "kv", "--ray", "127.0.0.1:9", "--out", str(tmp_path / "x")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env=env, cwd=tmp_path)
    assert res.returncode == 2
    assert "kvqrs study: error: --ray: no Ray cluster at '127.0.0.1:9'" in res.stderr
    assert "Traceback" not in res.stderr


def test_malformed_address_is_a_clean_error():
    with pytest.raises(KvqrsError, match="expected 'auto', 'local', HOST:PORT"):
        connect("somewhere")


def test_missing_ray_is_a_clean_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ModuleNotFoundError
    with pytest.raises(KvqrsError, match=r"pip install 'kvqrs\[ray\]'"):
        connect("auto")


# --- the evaluation -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvqrs.evaluation import model as model_mod
    from kvqrs.evaluation import text

    try:
        model_mod.model_dir()
    except KvqrsError as e:
        pytest.skip(f"SmolLM2 model not available: {e}")
    from tests.evaluation.test_eval import PARAGRAPHS

    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text("\n".join(PARAGRAPHS * 2) + "\n", encoding="utf-8")
    return text.from_file(p)


def test_eval_on_ray_equals_serial(cluster, model32, eval_inputs):
    from kvqrs.evaluation.model_eval import default_rows, run_eval
    from kvqrs.hf.attention import _STATE

    model, tok = model32
    wanted = ("dense", "kqv k2", "kqv k2 v2", "headq(kqv) k2")

    def rows():
        return [r for r in default_rows() if r.name in wanted]

    try:
        serial = run_eval(model, tok, eval_inputs, rows(), window=32, windows=1, calib_windows=1, progress=False)
        distributed = run_eval(
            model, tok, eval_inputs, rows(), window=32, windows=1, calib_windows=1, progress=False, ray=cluster, threads=1
        )
    finally:
        _STATE.set(None)  # run_eval's cache bytes leave the cache installed (see test_eval.py)
    assert [r["row"] for r in serial["rows"]] == ["dense", "headq(kqv) k2", "kqv k2", "kqv k2 v2"]  # by budget
    assert distributed == serial  # every row's perplexity, KL, top-1 and bytes, bit for bit
