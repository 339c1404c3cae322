"""Adapters between caller arrays and the native kernels.

The native module takes flat, C-contiguous float32/uint8 arrays. Everything here validates the
caller's input, makes at most one explicit contiguous float32 staging copy, and restores the
caller's leading shape and float dtype on the way out.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union

import numpy as np

from ._native import KvqrsError

__all__ = [
    "KvqrsError",
    "as_array",
    "as_float_rows",
    "as_code_rows",
    "as_scalars",
    "check_bits",
    "check_finite_output",
    "check_out_dtype",
    "check_seed",
    "check_positive_int",
    "first_nonfinite",
    "restore",
    "is_tensor",
    "numpy_to_torch",
    "tensors_in_out",
    "torch_to_numpy",
]

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

    Array = Union[np.ndarray, torch.Tensor]
    """What the public functions take and return: a NumPy array, or a torch tensor (any device)."""
    DTypeLike = Union[npt.DTypeLike, torch.dtype]
    """An output dtype: a NumPy dtype or its name, or a torch float dtype."""

GRAD_WARNING = (
    "{arg}: the tensor requires grad, but kvqrs computes outside autograd: the result is detached "
    "and no gradient flows back through it (pass tensor.detach() to silence this warning)"
)
"""kvqrs' kernels are not differentiable (integer codes, searches, Rust): a tensor that requires
grad is detached, with this :class:`UserWarning` (once per call site, Python's default filter)."""

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    # str(dtype) runs NumPy's Python-level name machinery (microseconds): memoized, since it sits
    # on the path of every kernel call, one-token cache appends included.
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES.setdefault(dtype, str(dtype))
    return name


def as_array(x: Any, arg: str) -> np.ndarray:
    """``x`` as a NumPy array; torch tensors go through :func:`torch_to_numpy`."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):  # a tensor, without importing torch
        return torch_to_numpy(x, arg)
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:
        raise KvqrsError(f"{arg}: expected an array, got {type(x).__name__} that NumPy cannot convert ({e})") from None


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside the kvqrs package (where a warning belongs)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "kvqrs":
        frame, level = frame.f_back, level + 1
    return level


def warn_if_grad(t: Any, arg: str) -> None:
    """Warn (:data:`GRAD_WARNING`) when ``t`` requires grad: it is about to be detached."""
    if getattr(t, "requires_grad", False):
        warnings.warn(GRAD_WARNING.format(arg=arg), UserWarning, stacklevel=_caller_stacklevel())


def torch_to_numpy(t: Any, arg: str = "x") -> np.ndarray:
    """A CPU NumPy array holding a torch tensor's values in its own dtype: bfloat16 becomes
    ml_dtypes' bfloat16 (same bits: NumPy has no bfloat16 of its own), and tensors on another
    device are copied, which ``np.asarray`` refuses. A tensor that requires grad is detached with
    a warning (:data:`GRAD_WARNING`)."""
    import torch

    warn_if_grad(t, arg)
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError:
            raise KvqrsError(f"{arg}: a bfloat16 tensor needs ml_dtypes (pip install ml_dtypes), or pass tensor.float()") from None
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _bfloat16(arg: str) -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise KvqrsError(f"{arg}: bfloat16 needs ml_dtypes (pip install ml_dtypes)") from None
    return ml_dtypes.bfloat16


def first_nonfinite(arr: np.ndarray, arg: str) -> None:
    """Raise :class:`KvqrsError` naming the first NaN or infinity of ``arr`` by its index in
    the caller's array (the kernels only see flattened, possibly transposed rows)."""
    if arr.size and not np.isfinite(arr).all():
        pos = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        raise KvqrsError(f"{arg}: expected finite values, got {arr[pos]} at index {pos}")


def check_out_dtype(dtype: Any, arg: str = "dtype") -> np.dtype:
    """Return ``dtype`` (a NumPy dtype, its name, or a torch float dtype) as a NumPy dtype if it
    is float16, bfloat16, float32 or float64, else raise."""
    if type(dtype).__module__ == "torch" and str(dtype).startswith("torch."):
        dtype = str(dtype)[len("torch.") :]
        if dtype == "bfloat16":
            dtype = _bfloat16(arg)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise KvqrsError(f"{arg}: expected float16, bfloat16, float32 or float64, got {dtype!r}") from None
    if dtype is None or _dtype_name(dt) not in _FLOAT_NAMES:
        raise KvqrsError(f"{arg}: expected float16, bfloat16, float32 or float64, got {dtype!r}")
    return dt


def check_bits(bits: Any, arg: str = "bits", low: int = 1, high: int = 8) -> int:
    """Return ``bits`` as an int in ``low..high`` or raise :class:`KvqrsError`."""
    if isinstance(bits, bool):
        raise KvqrsError(f"{arg}: expected an integer bit width in {low}..{high}, got bool {bits}")
    try:
        b = operator.index(bits)
    except TypeError:
        raise KvqrsError(f"{arg}: expected an integer bit width in {low}..{high}, got {bits!r}") from None
    if not low <= b <= high:
        raise KvqrsError(f"{arg}: expected a bit width in {low}..{high}, got {b}")
    return b


def check_positive_int(value: Any, arg: str, minimum: int = 1) -> int:
    """Return ``value`` as an int >= ``minimum`` or raise :class:`KvqrsError`."""
    if isinstance(value, bool):
        raise KvqrsError(f"{arg}: expected an integer >= {minimum}, got bool {value}")
    try:
        v = operator.index(value)
    except TypeError:
        raise KvqrsError(f"{arg}: expected an integer >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise KvqrsError(f"{arg}: expected an integer >= {minimum}, got {v}")
    return v


def check_seed(seed: Any, arg: str = "seed", optional: bool = True) -> int | None:
    """Return a seed in ``[0, 2**64)`` (or None when allowed), else raise :class:`KvqrsError`."""
    if seed is None:
        if optional:
            return None
        raise KvqrsError(f"{arg}: expected an integer seed in [0, 2**64), got None")
    if isinstance(seed, bool):
        raise KvqrsError(f"{arg}: expected an integer seed in [0, 2**64), got bool {seed}")
    try:
        s = operator.index(seed)
    except TypeError:
        raise KvqrsError(f"{arg}: expected an integer seed in [0, 2**64), got {seed!r}") from None
    if not 0 <= s < 2**64:
        raise KvqrsError(f"{arg}: expected an integer seed in [0, 2**64), got {s}")
    return s


def as_float_rows(x: Any, arg: str, min_dim: int = 1) -> tuple[np.ndarray, tuple[int, ...], int, np.dtype]:
    """Validate a float array of rows along the last axis.

    Returns ``(flat float32 C-contiguous, leading shape, row length, caller dtype)``.
    Accepts float16, bfloat16 (ml_dtypes), float32 and float64, any leading shape and strided
    views; raises :class:`KvqrsError` for other dtypes, 0-d input or a row length < ``min_dim``.
    """
    arr = as_array(x, arg)
    if _dtype_name(arr.dtype) not in _FLOAT_NAMES:
        raise KvqrsError(f"{arg}: expected a float16, bfloat16, float32 or float64 array, got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise KvqrsError(f"{arg}: expected an array of shape (..., head_dim), got a scalar")
    dim = arr.shape[-1]
    if dim < min_dim:
        raise KvqrsError(f"{arg}: expected a last axis of length >= {min_dim}, got shape {arr.shape}")
    if arr.dtype == np.float64 and arr.size:
        with np.errstate(invalid="ignore"):
            big = np.isfinite(arr) & (np.abs(arr) > np.finfo(np.float32).max)
        if big.any():
            pos = tuple(int(p) for p in np.unravel_index(int(np.argmax(big)), arr.shape))
            raise KvqrsError(f"{arg}: expected values within the float32 range (|x| <= 3.4e38), got {arr[pos]} at index {pos}")
    flat = contiguous_float32(arr).reshape(-1)
    return flat, tuple(arr.shape[:-1]), dim, arr.dtype


_BLOCK = 64  # columns per copied block: a block of a transposed view's rows stays in cache


def contiguous_float32(arr: np.ndarray) -> np.ndarray:
    """``np.ascontiguousarray(arr, float32)``, the same values; a view whose last axis is the
    slow one (rows laid out as columns, as per-channel key groups read tokens) is copied in
    blocks of columns: numpy's strided copy of a transpose walks memory a column at a time
    (10x slower for a 32k-token layer)."""
    if arr.flags.c_contiguous or arr.ndim < 2 or arr.shape[-1] <= 4 * _BLOCK or abs(arr.strides[-1]) <= abs(arr.strides[-2]):
        return np.ascontiguousarray(arr, dtype=np.float32)
    out = np.empty(arr.shape, np.float32)
    for s in range(0, arr.shape[-1], _BLOCK):
        out[..., s : s + _BLOCK] = arr[..., s : s + _BLOCK]
    return out


def as_code_rows(codes: Any, arg: str, bits: int | None = None) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Validate an integer code array; returns ``(flat uint8, leading shape, row length)``.

    Codes of any integer dtype are accepted if every value lies in ``[0, 2**bits)`` (``[0, 256)``
    when ``bits`` is None); nothing is wrapped or truncated silently.
    """
    arr = as_array(codes, arg)
    if arr.dtype.kind not in "ui":
        raise KvqrsError(f"{arg}: expected an integer array (uint8 codes), got dtype {arr.dtype}")
    if arr.ndim == 0:
        raise KvqrsError(f"{arg}: expected an array of shape (..., count), got a scalar")
    limit = 256 if bits is None else 1 << bits
    if arr.size and arr.dtype != np.uint8:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            pos = np.unravel_index(int(np.argmax(arr == bad)), arr.shape)
            raise KvqrsError(f"{arg}: code {bad} at index {tuple(int(p) for p in pos)} does not fit (expected 0 <= code < {limit})")
    flat = np.ascontiguousarray(arr, dtype=np.uint8).reshape(-1)
    return flat, tuple(arr.shape[:-1]), arr.shape[-1]


def as_scalars(values: Any, arg: str, leading: tuple[int, ...]) -> np.ndarray:
    """Validate stored scalars (norms, scales): float16 or float32, one per row of ``leading``."""
    arr = np.asarray(values)
    if arr.dtype not in (np.float16, np.float32):
        raise KvqrsError(f"{arg}: expected float16 or float32 stored scalars, got dtype {arr.dtype}")
    if arr.shape != leading:
        raise KvqrsError(f"{arg}: expected shape {leading} (one per row), got {arr.shape}")
    return np.ascontiguousarray(arr).reshape(-1)


def restore(flat: np.ndarray, leading: tuple[int, ...], cols: int, dtype: np.dtype | None = None, finite: bool = False) -> np.ndarray:
    """Reshape a flat native result to ``(*leading, cols)`` and cast to ``dtype`` if given.

    ``finite=True`` says the native kernel already refuses non-finite results (it checks each
    row while it is in cache), so only a cast is scanned: a full scan of a large output costs
    about a third of a decode."""
    out = flat.reshape(*leading, cols)
    if dtype is not None and out.dtype != dtype:
        with np.errstate(over="ignore"):
            out = out.astype(dtype)
    elif finite:
        return out
    return check_finite_output(out)


def check_finite_output(out: np.ndarray, what: str = "result", hint: str = "choose a wider dtype, e.g. dtype=np.float32") -> np.ndarray:
    """Raise instead of returning infinities: a finite input whose result does not fit the
    output dtype (e.g. float16 beyond 65504, or float32 beyond 3.4e38) is an error."""
    if out.size and not np.isfinite(out).all():
        pos = tuple(int(p) for p in np.unravel_index(int(np.argmax(~np.isfinite(out))), out.shape))
        raise KvqrsError(f"{what}: expected values that fit the output dtype {out.dtype}, got {out[pos]} at index {pos} ({hint})")
    return out


# -- torch tensors in and out ----------------------------------------------------------------------


def numpy_to_torch(a: np.ndarray, like: Any, float_dtype: bool = False) -> Any:
    """``a`` as a tensor on ``like``'s device, in ``a``'s own dtype (ml_dtypes' bfloat16 becomes
    ``torch.bfloat16``, bit for bit), or in ``like``'s float dtype when ``float_dtype`` and ``a``
    holds floats."""
    import torch

    a = np.ascontiguousarray(a)
    if _dtype_name(a.dtype) == "bfloat16":
        out = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        out = torch.from_numpy(a)
    if float_dtype and out.is_floating_point() and out.dtype != like.dtype:
        out = out.to(dtype=like.dtype)
    return out.to(device=like.device)


def _to_numpy(v: Any, arg: str) -> Any:
    if is_tensor(v):
        return torch_to_numpy(v, arg)
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a code tuple (MSECode, QJLSketch, ...)
        return type(v)(*(_to_numpy(x, arg) for x in v))
    return v


def _to_torch(v: Any, like: Any, float_dtype: bool) -> Any:
    if isinstance(v, np.ndarray):
        return numpy_to_torch(v, like, float_dtype)
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return type(v)(*(_to_torch(x, like, False) for x in v))
    return v


def _first_tensor(values: Any) -> Any:
    for v in values:
        if is_tensor(v):
            return v
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def tensors_in_out(keep_dtype: bool = False) -> Callable[[F], F]:
    """Let a NumPy-facing function take torch tensors: tensors (also inside code tuples such as
    :class:`~kvqrs.MSECode`) are staged to NumPy (:func:`torch_to_numpy`), and array results come
    back as tensors on the first tensor argument's device, in the dtype the NumPy path returns
    (the caller's dtype for transforms, ``dtype=`` for decoders); with ``keep_dtype``, float
    results take the first tensor's float dtype. NumPy calls pass straight through."""

    def wrap(fn: F) -> F:
        names = list(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if "torch" not in sys.modules:
                return fn(*args, **kwargs)
            like = _first_tensor([*args, *kwargs.values()])
            if like is None:
                return fn(*args, **kwargs)
            staged = [_to_numpy(a, names[i] if i < len(names) else "x") for i, a in enumerate(args)]
            out = fn(*staged, **{k: _to_numpy(v, k) for k, v in kwargs.items()})
            return _to_torch(out, like, keep_dtype)

        return inner  # type: ignore[return-value]

    return wrap
