"""kvqrs.gpu's device selection, caches and shader files: ``device("wgpu")`` / an explicit
adapter, the error when no adapter exists (naming what to install), pipelines and buffers
reused across calls, and every shader shipped inside the installed package (found through
importlib.resources) with its header, identical to the repository's top-level shaders/."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import kvqrs
import numpy as np
import pytest
from kvqrs import gpu
from kvqrs.gpu import _device
from kvqrs.schemes import KVCodec, get_backend

from tests.gpu.gpu_helpers import requires_adapter

REPO_SHADERS = Path(__file__).resolve().parents[2] / "shaders"
PIECES = ["common.wgsl", "philox.wgsl"]


# -- shaders shipped with the package (no adapter needed) --------------------------------------


def test_installed_package_ships_every_shader():
    root = resources.files("kvqrs").joinpath("shaders")
    names = {p.name for p in root.iterdir()}
    for name in [f"{k}.wgsl" for k in gpu.KERNEL_SHADERS] + PIECES:
        assert name in names, f"{name} is not shipped in kvqrs/shaders"
        assert root.joinpath(name).read_text(encoding="utf-8") == gpu.read_shader(name)
    assert sorted(names & set(gpu.shader_files())) == gpu.shader_files()


@pytest.mark.skipif(not REPO_SHADERS.is_dir(), reason="running from an installed wheel without the repository's shaders/")
def test_top_level_shaders_are_the_single_source():
    for path in REPO_SHADERS.glob("*.wgsl"):
        assert gpu.read_shader(path.name) == path.read_text(encoding="utf-8")
    assert sorted(p.name for p in REPO_SHADERS.glob("*.wgsl")) == gpu.shader_files()


@pytest.mark.parametrize("name", gpu.KERNEL_SHADERS)
def test_kernel_shader_headers(name):
    text = gpu.read_shader(f"{name}.wgsl")
    assert text.startswith("// kvqrs:requires common.wgsl")
    for word in ("Bindings (group 0):", "Entry point", "grid"):
        assert word in text, f"{name}.wgsl header lacks {word!r}"
    # Every declared binding is listed in the header.
    for binding, var in re.findall(r"@binding\((\d+)\) var<[^>]+> (\w+)", text):
        assert re.search(rf"//\s+{binding}\s+\w+.*\b{var}\b", text) or (binding == "0" and "uniform  Params" in text), (
            f"{name}.wgsl: binding {binding} ({var}) not in the header"
        )


def test_composed_source_prepends_the_pieces():
    src = gpu.source("rng")
    assert src.index("fn item_index") < src.index("fn philox4x32_10") < src.index("fn signs(")
    with pytest.raises(kvqrs.KvqrsError, match="shader: expected one of"):
        gpu.source("nope")


def test_missing_shader_file_is_a_clear_error():
    with pytest.raises(kvqrs.KvqrsError, match="missing from the installed kvqrs package"):
        gpu.read_shader("nope.wgsl")


# -- device selection --------------------------------------------------------------------------


def test_no_adapter_is_a_clear_error(monkeypatch):
    wgpu = pytest.importorskip("wgpu")
    monkeypatch.setattr(_device, "_default", None)
    monkeypatch.setattr(wgpu.gpu, "request_adapter_sync", lambda **kw: None)
    with pytest.raises(kvqrs.KvqrsError, match="no GPU adapter is available.*mesa-vulkan-drivers libvulkan1"):
        gpu.device("wgpu")
    with pytest.raises(kvqrs.KvqrsError, match="no GPU adapter"):
        KVCodec("kqv", 4, 64, backend="wgpu")
    assert "no GPU adapter" in gpu.unavailable_reason()

    def boom(**kw):
        raise RuntimeError("Request adapter failed")

    monkeypatch.setattr(wgpu.gpu, "request_adapter_sync", boom)
    with pytest.raises(kvqrs.KvqrsError, match="Request adapter failed.*lavapipe"):
        gpu.device()


def test_missing_wgpu_package_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "wgpu":
            raise ImportError("no wgpu")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(_device, "_default", None)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(kvqrs.KvqrsError, match=r"pip install 'kvqrs\[gpu\]'"):
        gpu.device("wgpu")


@pytest.mark.parametrize("bad", ["cuda", 3, None])
def test_bad_device_or_backend_argument(bad):
    with pytest.raises(kvqrs.KvqrsError, match="device: expected 'wgpu'|backend: expected"):
        gpu.device(bad) if bad != "cuda" else get_backend(bad)


@requires_adapter
def test_default_and_explicit_devices():
    dev = gpu.device("wgpu")
    assert gpu.device() is dev and gpu.device(dev) is dev
    assert "device" in dev.info and repr(dev).startswith("kvqrs.gpu.Device(")
    adapter = next(iter(gpu.iter_adapters()))
    other = gpu.device(adapter)
    assert isinstance(other, gpu.Device) and other is not dev
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    np.testing.assert_array_equal(gpu.hadamard(x, 3, device=other), kvqrs.hadamard(x, 3))
    codec = KVCodec("kqv", 3, 64, backend=other)
    assert codec.backend.name == "wgpu" and get_backend(other) is codec.backend


@requires_adapter
def test_pipelines_and_buffers_are_reused(monkeypatch):
    dev = gpu.device()
    x = np.random.default_rng(1).standard_normal((40, 128)).astype(np.float32)
    gpu.mse_encode(x, 4, 9)  # compile and fill the pool
    pipelines = dict(dev._pipelines)
    created = []
    real_create = dev.device.create_buffer
    monkeypatch.setattr(dev.device, "create_buffer", lambda **kw: created.append(kw) or real_create(**kw))
    got = gpu.mse_encode(x, 4, 9)
    assert created == [], "a repeated call of the same size allocated new buffers"
    assert dev._pipelines == pipelines
    np.testing.assert_array_equal(got.codes, gpu.mse_encode(x, 4, 9).codes)


@requires_adapter
def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 6, 64)
    y = gpu.hadamard(x.to(torch.float16), 5)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float16 and y.shape == (2, 6, 64)
    np.testing.assert_array_equal(y.numpy(), kvqrs.hadamard(x.to(torch.float16).numpy(), 5))
    packed = gpu.pack_bits(torch.randint(0, 8, (3, 10), dtype=torch.uint8), 3)
    assert isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8
    code = gpu.uniform_encode(x, 4, 32)
    assert isinstance(code.codes, torch.Tensor) and isinstance(code.scales, torch.Tensor)
    out = gpu.uniform_decode(code)
    np.testing.assert_array_equal(
        out.numpy(), kvqrs.uniform_decode(kvqrs.UniformCode(*(v.numpy() if hasattr(v, "numpy") else v for v in code)))
    )


@requires_adapter
def test_batches_beyond_the_binding_limit_raise(monkeypatch):
    dev = gpu.device()
    monkeypatch.setattr(dev, "max_binding", 1024)
    with pytest.raises(kvqrs.KvqrsError, match="batch: the call needs a 4096-byte device buffer.*split it"):
        gpu.hadamard(np.ones((16, 64), np.float32), 1)
