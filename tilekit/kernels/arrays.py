"""Device arrays in, device arrays out: validation, allocation and streams for CuPy and torch.

Ops accept CuPy arrays and torch CUDA tensors and return the same kind. Anything else that
speaks ``__cuda_array_interface__`` or DLPack is viewed through CuPy (zero-copy) and answered
with CuPy arrays. Host arrays are refused with an error that names the argument.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
INT_DTYPES = ("int32", "int64")


@dataclass(frozen=True)
class Info:
    """What an op needs to know about one array argument."""

    kind: str                 # "torch" or "cupy"
    dtype: str                # "bfloat16", "float16", "float32", "int32", ...
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    device: int
    ptr: int


@functools.cache
def _torch_dtypes() -> dict:
    import torch
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
            torch.int32: "int32", torch.int64: "int64", torch.float64: "float64", torch.uint8: "uint8"}


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_device_array(x, name: str):
    """`x` itself if it is a CuPy array or a torch CUDA tensor, else a zero-copy CuPy view of it."""
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
    if _is_torch(x):
        if not x.is_cuda:
            raise TypeError(f"{name} must be on a CUDA device, got a torch tensor on {x.device}")
        return x
    if type(x).__module__.split(".")[0] == "numpy" or isinstance(x, (list, tuple, int, float)):
        raise TypeError(f"{name} must be a CUDA device array (CuPy array or torch CUDA tensor), "
                        f"got host data of type {type(x).__name__}")
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__"):
        try:
            return cupy.from_dlpack(x)
        except Exception as e:
            raise TypeError(f"{name} must be a CUDA device array; DLPack import failed: {e}") from None
    raise TypeError(f"{name} must be a CUDA device array (CuPy array or torch CUDA tensor), "
                    f"got {type(x).__name__}")


def info(x, name: str) -> Info:
    """Describe a device array (already passed through as_device_array)."""
    if _is_torch(x):
        dtype = _torch_dtypes().get(x.dtype, str(x.dtype))
        return Info("torch", dtype, tuple(x.shape), tuple(x.stride()), x.device.index, x.data_ptr())
    itemsize = x.dtype.itemsize
    return Info("cupy", x.dtype.name, x.shape, tuple(s // itemsize for s in x.strides),
                x.device.id, x.data.ptr)


def check_dtype(a: Info, name: str, allowed: tuple[str, ...]) -> None:
    if a.dtype not in allowed:
        raise TypeError(f"{name} has dtype {a.dtype}; supported: {', '.join(allowed)}")


def check_same(name_a: str, a: Info, name_b: str, b: Info, *, dtype: bool = True) -> None:
    """Same device (and dtype) for two arguments."""
    if a.device != b.device:
        raise ValueError(f"{name_b} is on GPU {b.device} but {name_a} is on GPU {a.device}")
    if dtype and a.dtype != b.dtype:
        raise TypeError(f"{name_b} has dtype {b.dtype} but {name_a} has dtype {a.dtype}; they must match")


def check_last_contiguous(a: Info, name: str) -> None:
    if a.shape and a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {a.strides[-1]})")


def check_contiguous(a: Info, name: str) -> None:
    step = 1
    for n, s in zip(reversed(a.shape), reversed(a.strides)):
        if n > 1 and s != step:
            raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")
        step *= n


def numpy_dtype(name: str):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def empty(kind: str, device: int, shape: tuple[int, ...], dtype: str):
    """Uninitialised array of `kind` on `device`."""
    if kind == "torch":
        import torch
        inverse = {v: k for k, v in _torch_dtypes().items()}
        return torch.empty(shape, dtype=inverse[dtype], device=f"cuda:{device}")
    import cupy
    with cupy.cuda.Device(device):
        return cupy.empty(shape, dtype=numpy_dtype(dtype))


def check_out(out, name: str, kind: str, device: int, shape: tuple[int, ...], dtype: str):
    """Validate a caller-provided output array; returns it as a device array."""
    out = as_device_array(out, name)
    o = info(out, name)
    if o.device != device:
        raise ValueError(f"{name} is on GPU {o.device}, the inputs on GPU {device}")
    if o.shape != tuple(shape):
        raise ValueError(f"{name} has shape {o.shape}, expected {tuple(shape)}")
    if o.dtype != dtype:
        raise TypeError(f"{name} has dtype {o.dtype}, expected {dtype}")
    check_contiguous(o, name)
    return out


def stream_for(kind: str, device: int):
    """The caller's current stream: torch's for torch tensors, CuPy's otherwise."""
    if kind == "torch":
        import torch
        return torch.cuda.current_stream(device)
    import cupy
    return cupy.cuda.get_current_stream(device)


def stream_handle(stream) -> int:
    """The raw cudaStream_t of a torch or CuPy stream (0 for the legacy default stream)."""
    return stream.cuda_stream if hasattr(stream, "cuda_stream") else stream.ptr


_scratch: dict[tuple, tuple] = {}


def scratch(owner: str, device: int, stream: int, specs: tuple[tuple[tuple[int, ...], str], ...],
            zeroed: bool = False) -> tuple:
    """Reusable CuPy work arrays, one set per (owner, device, stream, specs): streams never share.

    `specs` lists (shape, dtype) pairs; `zeroed` arrays are zero-filled once at creation (kernels that
    need zeros must leave them zeroed)."""
    key = (owner, device, stream, specs, zeroed)
    found = _scratch.get(key)
    if found is None:
        import cupy
        with cupy.cuda.Device(device):
            make = cupy.zeros if zeroed else cupy.empty
            found = _scratch.setdefault(key, tuple(make(shape, dtype=numpy_dtype(dt)) for shape, dt in specs))
    return found


def release_scratch(stream: int) -> None:
    """Forget every work array of `stream` (its owner has synchronized it and drops its graphs)."""
    for key in [k for k in list(_scratch) if k[2] == stream]:
        _scratch.pop(key, None)


@functools.cache
def placeholder(device: int, dtype: str, ndim: int):
    """A tiny array passed where an optional kernel argument is absent (never read)."""
    import cupy
    with cupy.cuda.Device(device):
        return cupy.zeros((16,) * ndim, dtype=numpy_dtype(dtype))


def random_array(shape: tuple[int, ...], dtype: str, device: int, rng, scale: float = 1.0,
                 mean: float = 0.0):
    """Fresh normal(mean, scale) CuPy data of `dtype` (bf16 made by rounding fp32 on the device)."""
    import cupy
    with cupy.cuda.Device(device):
        x = rng.standard_normal(shape, dtype=cupy.float32) * scale + mean
        if dtype == "bfloat16":
            bits = x.view(cupy.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16   # round to nearest even
            return rounded.astype(cupy.uint16).view(numpy_dtype("bfloat16"))
        return x.astype(numpy_dtype(dtype))
