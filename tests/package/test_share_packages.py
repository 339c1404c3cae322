"""scripts/share_packages.py: the packages .venv and .venv-vllm pin alike are stored once."""

from __future__ import annotations

import importlib.util
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("share_packages", ROOT / "scripts" / "share_packages.py")
share_packages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(share_packages)


def _venv(root: pathlib.Path) -> pathlib.Path:
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (root / "bin").mkdir()
    return site


def _install(site: pathlib.Path, venv: pathlib.Path, name: str, version: str, script: bool = False) -> None:
    """A wheel-installed distribution: a module, its dist-info (METADATA, RECORD) and maybe a
    console script whose ``#!`` names the environment's Python."""
    module = name.replace("-", "_")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    (site / f"{module}.py").write_text(f"VERSION = {version!r}\n")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    files = [f"{module}.py", f"{info.name}/METADATA", f"{info.name}/RECORD"]
    if script:
        (venv / "bin" / module).write_text(f"#!{venv.resolve()}/bin/python\nimport {module}\n")
        os.chmod(venv / "bin" / module, 0o755)
        files.append(f"../../../bin/{module}")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))


def test_pinned_packages_are_linked_and_scripts_rewritten(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    src_site, dst_site = _venv(src), _venv(dst)
    _install(src_site, src, "torch-like", "2.13.0", script=True)
    _install(src_site, src, "other-version", "1.0")
    _install(src_site, src, "unpinned", "3.0")
    _install(src_site, src, "present", "1.0")
    _install(dst_site, dst, "present", "0.9")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("# pins\ntorch_like==2.13.0\nother-version==2.0\npresent==1.0\n")

    shared = share_packages.share(src, dst, constraints)

    assert shared == ["torch-like==2.13.0"]
    assert os.path.samefile(src_site / "torch_like.py", dst_site / "torch_like.py")  # one copy on disk
    assert (dst_site / "torch_like-2.13.0.dist-info" / "METADATA").is_file()
    script = dst / "bin" / "torch_like"
    assert script.read_text().splitlines()[0] == f"#!{dst.resolve()}/bin/python"
    assert os.access(script, os.X_OK) and not os.path.samefile(script, src / "bin" / "torch_like")
    assert not (dst_site / "other_version.py").exists() and not (dst_site / "unpinned.py").exists()
    assert (dst_site / "present-0.9.dist-info").is_dir() and not (dst_site / "present-1.0.dist-info").exists()


def test_read_pins_takes_exact_pins_only(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("Torch==2.13.0\nnvidia_cublas == 13.1 # comment\nnumpy>=2\n# x==1\nsix==1.16.0; python_version<'4'\n")
    assert share_packages.read_pins(path) == {"torch": "2.13.0", "nvidia-cublas": "13.1"}
