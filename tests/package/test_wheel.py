"""The installable artefacts: ``maturin build --release`` makes an abi3 wheel that, installed into
a fresh virtual environment (not the editable install), passes the kernel, scheme, format and
determinism suites and answers ``python -m kvqrs --version``; ``maturin sdist`` builds too.

The fresh environment gets its third-party dependencies (numpy, scipy, hypothesis, pytest,
ml_dtypes) from this environment's site-packages through a ``.pth`` line placed after its own
site-packages, so nothing is downloaded and kvqrs itself can only come from the wheel."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUITES = [
    "kernels/test_rng.py",
    "kernels/test_pack.py",
    "kernels/test_hadamard.py",
    "kernels/test_lloyd_max.py",
    "kernels/test_mse.py",
    "kernels/test_qjl.py",
    "kernels/test_headq.py",
    "kernels/test_uniform.py",
    "schemes/test_schemes.py",
    "schemes/test_format.py",
    "package/test_determinism.py",
    "package/test_api.py",
]
BUILD_TIMEOUT_S = 1800  # a cold release build on two cores


def _maturin() -> list[str]:
    exe = shutil.which("maturin", path=str(pathlib.Path(sys.executable).parent))
    if exe is None:
        pytest.skip("maturin is not installed in this environment")
    return [exe]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheels")
    proc = subprocess.run(
        [*_maturin(), "build", "--release", "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("kvqrs-*.whl")
    return whl


def test_wheel_is_abi3_and_ships_everything(wheel):
    assert "-abi3-" in wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("kvqrs/_native") for n in names)
    for needed in ("kvqrs/py.typed", "kvqrs/_native.pyi", "kvqrs/format.py", "kvqrs/oracle.py"):
        assert needed in names, needed


def test_suite_passes_against_the_installed_wheel(wheel, tmp_path):
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], check=True, timeout=600)
    fresh_site = pathlib.Path(
        subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
    )
    (fresh_site / "zz_kvqrs_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    tests = tmp_path / "tests"
    shutil.copytree(ROOT / "tests", tests, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
    where = subprocess.check_output([str(py), "-c", "import kvqrs; print(kvqrs.__file__)"], text=True, cwd=tmp_path).strip()
    assert where.startswith(str(fresh_site)), f"kvqrs imported from {where}, not from the wheel"
    version = subprocess.run([str(py), "-m", "kvqrs", "--version"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("kvqrs ")
    proc = subprocess.run(
        [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *[str(tests / s) for s in SUITES]],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout.splitlines()[-1] and "failed" not in proc.stdout.splitlines()[-1]


def test_sdist_builds(tmp_path):
    proc = subprocess.run([*_maturin(), "sdist", "-o", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sdist,) = tmp_path.glob("kvqrs-*.tar.gz")
    import tarfile

    names = tarfile.open(sdist).getnames()
    assert any(n.endswith("rust/core/src/format.rs") for n in names) and any(n.endswith("pyproject.toml") for n in names)
