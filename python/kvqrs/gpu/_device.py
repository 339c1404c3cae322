"""Device selection, cached pipelines, pooled buffers and the dispatch helper of the WGSL path.

A :class:`Device` wraps one wgpu adapter and its logical device. It compiles each
``(shader, entry point)`` pipeline once, keeps device-resident constants (rotation signs, QJL
matrices, codebooks) keyed by what determines them, and lends scratch buffers from a pool keyed
by usage and power-of-two capacity, so repeated calls of the same size allocate nothing.
"""

from __future__ import annotations

import math
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np

from .._arrays import KvqrsError
from . import _shaders

INSTALL_HINT = (
    "install a Vulkan, Metal or D3D12 driver; on Debian/Ubuntu without a GPU, "
    "`apt-get install mesa-vulkan-drivers libvulkan1` provides lavapipe (Vulkan on the CPU)"
)

WORKGROUP = 64
"""Invocations per workgroup of every kvqrs entry point (``WG`` in shaders/common.wgsl)."""

MAX_GROUPS_PER_DIM = 65535
"""Workgroups per grid dimension that every WebGPU device supports."""

_STORAGE = 0
_UNIFORM = 1
_POOL_BYTES = 1 << 28  # scratch memory kept for reuse; beyond it, returned buffers are dropped
_CONSTANTS = 64  # device-resident constants kept (least recently used dropped first)


def _wgpu() -> Any:
    try:
        import wgpu
    except ImportError:
        raise KvqrsError(
            "backend 'wgpu': the wgpu package is not installed; install it with `pip install 'kvqrs[gpu]'` (or `pip install wgpu`)"
        ) from None
    return wgpu


def _capacity(nbytes: int) -> int:
    return max(16, 1 << max(0, int(nbytes) - 1).bit_length())


class Device:
    """One wgpu adapter and its device, with kvqrs' caches.

    Args:
        adapter: a ``wgpu.GPUAdapter``.

    Attributes:
        adapter: the adapter.
        info: the adapter's info mapping (``device``, ``vendor``, ``backend_type``, ...).
        max_binding: the largest storage buffer binding in bytes (inputs beyond it raise).
    """

    def __init__(self, adapter: Any):
        wgpu = _wgpu()
        self._wgpu = wgpu
        self.adapter = adapter
        self.info = dict(adapter.info)
        lim = adapter.limits
        want = {
            "max-storage-buffer-binding-size": lim["max-storage-buffer-binding-size"],
            "max-buffer-size": lim["max-buffer-size"],
            "max-storage-buffers-per-shader-stage": min(16, lim["max-storage-buffers-per-shader-stage"]),
        }
        self.device = adapter.request_device_sync(required_limits=want)
        self.max_binding = int(min(want["max-storage-buffer-binding-size"], want["max-buffer-size"]))
        self._lock = threading.RLock()
        self._pipelines: dict[tuple[str, str], Any] = {}
        self._modules: dict[str, Any] = {}
        self._pool: dict[tuple[int, int], list[Any]] = {}
        self._pool_bytes = 0
        self._constants: OrderedDict[tuple, Any] = OrderedDict()

    def __repr__(self) -> str:
        return f"kvqrs.gpu.Device({self.info.get('device', '?')!r}, backend={self.info.get('backend_type', '?')!r})"

    # -- pipelines -------------------------------------------------------------------------------
    def pipeline(self, shader: str, entry: str) -> Any:
        """The compute pipeline of ``entry`` in kernel shader ``shader`` (compiled once)."""
        key = (shader, entry)
        with self._lock:
            if key not in self._pipelines:
                if shader not in self._modules:
                    self._modules[shader] = self.device.create_shader_module(label=shader, code=_shaders.source(shader))
                self._pipelines[key] = self.device.create_compute_pipeline(
                    label=f"{shader}.{entry}", layout="auto", compute={"module": self._modules[shader], "entry_point": entry}
                )
            return self._pipelines[key]

    # -- buffers ---------------------------------------------------------------------------------
    def _usage(self, kind: int) -> int:
        u = self._wgpu.BufferUsage
        if kind == _UNIFORM:
            return u.UNIFORM | u.COPY_DST
        return u.STORAGE | u.COPY_DST | u.COPY_SRC

    def _take(self, kind: int, nbytes: int) -> Any:
        cap = _capacity(nbytes)
        if kind == _STORAGE and cap > self.max_binding:
            if nbytes > self.max_binding:
                raise KvqrsError(
                    f"batch: the call needs a {nbytes}-byte device buffer, beyond this adapter's limit of {self.max_binding} bytes; split it into smaller batches"
                )
            cap = int(nbytes + 3) // 4 * 4
        with self._lock:
            free = self._pool.get((kind, cap))
            if free:
                self._pool_bytes -= cap
                return free.pop()
        return self.device.create_buffer(size=cap, usage=self._usage(kind))

    def _give(self, kind: int, buf: Any) -> None:
        with self._lock:
            if self._pool_bytes + buf.size > _POOL_BYTES:
                buf.destroy()
                return
            self._pool.setdefault((kind, buf.size), []).append(buf)
            self._pool_bytes += buf.size

    def constant(self, key: tuple, build: Callable[[], np.ndarray]) -> Any:
        """A device buffer holding ``build()`` (float32 / uint32 data), built and uploaded once
        per ``key`` (e.g. ``("qjl", seed, m, dim)``)."""
        with self._lock:
            if key in self._constants:
                self._constants.move_to_end(key)
                return self._constants[key]
        data = np.ascontiguousarray(build())
        buf = self.device.create_buffer(size=_capacity(max(data.nbytes, 4)), usage=self._usage(_STORAGE))
        if data.nbytes:
            self.device.queue.write_buffer(buf, 0, _padded(data))
        with self._lock:
            self._constants[key] = buf
            while len(self._constants) > _CONSTANTS:
                self._constants.popitem(last=False)[1].destroy()
        return buf

    def call(self) -> Call:
        """A scope for one kernel call: borrowed buffers go back to the pool on exit."""
        return Call(self)


def _padded(data: np.ndarray) -> memoryview:
    raw = memoryview(np.ascontiguousarray(data)).cast("B")
    if len(raw) % 4:
        raw = memoryview(bytes(raw) + b"\0" * (4 - len(raw) % 4))
    return raw


def _param_bytes(values: Sequence[Any]) -> bytes:
    out = b""
    for v in values:
        if isinstance(v, (float, np.floating)):
            out += struct.pack("<f", float(np.float32(v)))
        else:
            out += struct.pack("<I", int(v))
    return out + b"\0" * (-len(out) % 16)


class Call:
    """Buffers and queued dispatches of one kernel call (use as a context manager)."""

    def __init__(self, dev: Device):
        self.dev = dev
        self._borrowed: list[tuple[int, Any]] = []
        self._encoder: Any = None

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc: Any) -> None:
        for kind, buf in self._borrowed:
            self.dev._give(kind, buf)
        self._borrowed.clear()

    def _borrow(self, kind: int, nbytes: int) -> Any:
        buf = self.dev._take(kind, nbytes)
        self._borrowed.append((kind, buf))
        return buf

    def upload(self, data: np.ndarray) -> Any:
        """A storage buffer holding ``data`` (padded to whole 4-byte words)."""
        raw = _padded(data)
        buf = self._borrow(_STORAGE, max(len(raw), 4))
        if len(raw):
            self.dev.device.queue.write_buffer(buf, 0, raw)
        return buf

    def empty(self, nbytes: int) -> Any:
        """A scratch storage buffer of at least ``nbytes`` bytes (contents undefined)."""
        return self._borrow(_STORAGE, max(int(nbytes) + (-int(nbytes) % 4), 4))

    def dispatch(self, shader: str, entry: str, items: int, params: Sequence[Any], bind: dict[int, Any]) -> None:
        """Queue ``entry`` of ``shader`` over ``items`` invocations (common.wgsl's 2-D grid).

        ``params`` are the fields of the shader's uniform ``Params`` after ``items`` (ints are
        u32, NumPy float32 / Python floats are f32); ``bind`` maps binding numbers to buffers.
        """
        if items <= 0:
            return
        dev = self.dev
        pipe = dev.pipeline(shader, entry)
        ubytes = _param_bytes([items, *params])
        ubuf = self._borrow(_UNIFORM, len(ubytes))
        dev.device.queue.write_buffer(ubuf, 0, ubytes)
        entries = [{"binding": 0, "resource": {"buffer": ubuf}}]
        entries += [{"binding": b, "resource": {"buffer": buf}} for b, buf in sorted(bind.items())]
        group = dev.device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
        groups = math.ceil(items / WORKGROUP)
        gx = min(groups, MAX_GROUPS_PER_DIM)
        gy = math.ceil(groups / gx)
        if gy > MAX_GROUPS_PER_DIM:
            raise KvqrsError(f"batch: the call needs {items} invocations, beyond one dispatch; split it into smaller batches")
        if self._encoder is None:
            self._encoder = dev.device.create_command_encoder()
        cp = self._encoder.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, group)
        cp.dispatch_workgroups(gx, gy, 1)
        cp.end()

    def submit(self) -> None:
        """Submit the queued dispatches (reads do this themselves)."""
        if self._encoder is not None:
            self.dev.device.queue.submit([self._encoder.finish()])
            self._encoder = None

    def read(self, buf: Any, dtype: Any, count: int) -> np.ndarray:
        """Run everything queued, then copy the first ``count`` items of ``buf`` back."""
        self.submit()
        dt = np.dtype(dtype)
        nbytes = dt.itemsize * int(count)
        if nbytes == 0:
            return np.zeros(0, dtype=dt)
        size = nbytes + (-nbytes % 4)
        raw = self.dev.device.queue.read_buffer(buf, 0, size)
        return np.frombuffer(raw, dtype=np.uint8, count=nbytes).view(dt).copy()


_default: Device | None = None
_default_lock = threading.Lock()


def _request_adapter() -> Any:
    wgpu = _wgpu()
    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    except Exception as e:  # wgpu raises RuntimeError-like errors when nothing is found
        raise KvqrsError(f"wgpu: no GPU adapter is available ({e}); {INSTALL_HINT}") from None
    if adapter is None:
        raise KvqrsError(f"wgpu: no GPU adapter is available; {INSTALL_HINT}")
    return adapter


def device(which: Any = "wgpu") -> Device:
    """Select the device of the WGSL path.

    Args:
        which: ``"wgpu"`` (the default: wgpu's high-performance adapter, created once and shared),
            a ``wgpu.GPUAdapter`` to use explicitly, or a :class:`Device` (returned as is).

    Returns:
        :class:`Device`.

    Raises:
        KvqrsError: wgpu is not installed, no adapter exists (the message says what to
            install), or ``which`` is none of the above.
    """
    global _default
    if isinstance(which, Device):
        return which
    if isinstance(which, str):
        if which != "wgpu":
            raise KvqrsError(f"device: expected 'wgpu', a wgpu.GPUAdapter or a kvqrs.gpu.Device, got {which!r}")
        with _default_lock:
            if _default is None:
                _default = Device(_request_adapter())
            return _default
    wgpu = _wgpu()
    if isinstance(which, wgpu.GPUAdapter):
        return Device(which)
    raise KvqrsError(f"device: expected 'wgpu', a wgpu.GPUAdapter or a kvqrs.gpu.Device, got {type(which).__name__}")


def unavailable_reason() -> str | None:
    """None when the default device can be created, else the reason it cannot (for skips)."""
    try:
        device("wgpu")
    except KvqrsError as e:
        return str(e)
    return None


def iter_adapters() -> Iterator[Any]:
    """Every adapter wgpu can enumerate (for choosing one explicitly)."""
    yield from _wgpu().gpu.enumerate_adapters_sync()
