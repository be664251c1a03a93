"""Device arrays in, device arrays out: what the launch path knows about arrays, and nothing more.

Ops accept CuPy arrays and torch CUDA tensors and return the same kind. Anything else that speaks
``__cuda_array_interface__`` or DLPack is viewed through CuPy (zero-copy). Host arrays are refused
with an error that names the argument. A `MetaArray` has a dtype, shape and strides but no memory:
a dry run of a model's step code passes them to the ops, which record their problems.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
INT_DTYPES = ("int32", "int64")
BYTE_DTYPES = ("int8", "uint8")           # quantized weights and activations (FP8 as its uint8 bits)
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class Info:
    """What an op's validation needs to know about one array argument."""

    kind: str                 # "torch", "cupy" or "meta"
    dtype: str                # "bfloat16", "float16", "float32", "int32", ...
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    device: int               # -1 for dry-run MetaArrays


@dataclass(frozen=True)
class ArraySpec:
    """An array argument as an op declares it for a problem: what the JIT sees of it (dtype, shape,
    element strides, alignment), its role, and for integer inputs the values a benchmark may use."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None   # None: C-contiguous
    role: str = "in"                         # in | out | absent (placeholder) | scratch | zeros (scratch)
    high: int | None = None                  # integer inputs: benchmark values in [0, high)
    signed: bool = False                     # ... with bit 7 set at random too (8-bit codes of either sign)
    fill: int | None = None                  # integer inputs: benchmark value everywhere
    values: tuple | None = None              # inputs: the benchmark's exact contents (offsets, parameters)
    aligned16: bool = True                   # allocations are 256-byte aligned

    def element_strides(self) -> tuple[int, ...]:
        return self.strides if self.strides is not None else contiguous_strides(self.shape)


def absent(dtype: str, ndim: int) -> ArraySpec:
    """The placeholder passed where an optional array argument is not given (never read)."""
    return ArraySpec(dtype, (16,) * ndim, role="absent")


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class MetaArray:
    """dtype, shape and element strides without memory: transpose and basic indexing follow NumPy's
    rules for views; a reshape always gives a contiguous array (a view of a contiguous array, else
    what NumPy's copy would be).

    On device -1 (a dry run) ops record their problem with the default config; on a device index
    they also choose the config as for a real array of that device, and launch nothing (tests)."""

    __slots__ = ("dtype", "shape", "strides", "device")

    def __init__(self, shape, dtype: str, strides=None, device: int = -1):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.device = device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        if -1 in shape:
            known = math.prod(n for n in shape if n != -1)
            shape = tuple(self.size // max(known, 1) if n == -1 else n for n in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {shape}")
        return MetaArray(shape, self.dtype, device=self.device)   # a view of a contiguous array, or a copy

    def __add__(self, other):
        """An elementwise sum (with a scalar offset): a new contiguous array of this shape and dtype."""
        return MetaArray(self.shape, self.dtype, device=self.device)

    def transpose(self, *axes):
        axes = tuple(axes[0]) if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = axes or tuple(reversed(range(self.ndim)))
        return MetaArray([self.shape[a] for a in axes], self.dtype, [self.strides[a] for a in axes], self.device)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        shape, strides = [], []
        for axis, (n, s) in enumerate(zip(self.shape, self.strides)):
            i = index[axis] if axis < len(index) else slice(None)
            if isinstance(i, slice):
                start, stop, step = i.indices(n)
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
            elif not -n <= int(i) < n:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {n}")
        return MetaArray(shape, self.dtype, strides, self.device)

    def __repr__(self):
        return f"MetaArray({self.shape}, {self.dtype}, strides={self.strides})"


# -- recognising arrays ---------------------------------------------------------------------------

@functools.cache
def _torch_dtypes() -> dict:
    import torch
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
            torch.int32: "int32", torch.int64: "int64", torch.float64: "float64", torch.int8: "int8",
            torch.uint8: "uint8"}


def _is_torch(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_device_array(x, name: str):
    """`x` itself if it is a CuPy array, torch CUDA tensor or MetaArray, else a zero-copy CuPy view."""
    if isinstance(x, MetaArray):
        return x
    if _is_torch(x):
        if not x.is_cuda:
            raise TypeError(f"{name} must be on a CUDA device, got a torch tensor on {x.device}")
        return x
    if type(x).__module__.split(".")[0] == "numpy" or isinstance(x, (list, tuple, int, float)):
        raise TypeError(f"{name} must be a CUDA device array (CuPy array or torch CUDA tensor), "
                        f"got host data of type {type(x).__name__}")
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
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
    if isinstance(x, MetaArray):
        return Info("meta", x.dtype, x.shape, x.strides, x.device)
    if _is_torch(x):
        dtype = _torch_dtypes().get(x.dtype, str(x.dtype))
        return Info("torch", dtype, tuple(x.shape), tuple(x.stride()), x.device.index)
    itemsize = x.dtype.itemsize
    return Info("cupy", x.dtype.name, x.shape, tuple(s // itemsize for s in x.strides), x.device.id)


class NotADeviceArray(Exception):
    """signature() met an object the launch path does not take as it is."""


_cupy_ndarray: type | None = None
_torch_tensor: type | None = None


def signature(a):
    """What an argument's launch plan depends on: None, or (dtype, shape, strides, device) of an array.

    The plan-cache hot path: exact-type checks first; anything else goes through _other_signature."""
    t = type(a)
    if t is _cupy_ndarray:
        return a.dtype, a.shape, a.strides, a.data.device_id
    if t is _torch_tensor:
        return a.dtype, a.shape, a.stride(), a.get_device()
    if a is None:
        return None
    return _other_signature(a)


def _other_signature(a):
    global _cupy_ndarray, _torch_tensor
    if isinstance(a, MetaArray):
        return MetaArray, a.dtype, a.shape, a.strides, a.device
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        _torch_tensor = torch.Tensor
        return a.dtype, a.shape, a.stride(), a.get_device()
    if _cupy_ndarray is None and type(a).__module__.startswith("cupy"):
        import cupy
        _cupy_ndarray = cupy.ndarray
    if _cupy_ndarray is not None and isinstance(a, _cupy_ndarray):
        return a.dtype, a.shape, a.strides, a.data.device_id
    raise NotADeviceArray(type(a).__name__)


# -- checks shared by the ops' validation ---------------------------------------------------------

def checked_positive(value, name: str) -> float:
    """A scalar argument (eps, scale) as a float; ValueError naming it unless it is a positive finite number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_dtype(a: Info, name: str, allowed: tuple[str, ...]) -> None:
    if a.dtype not in allowed:
        raise TypeError(f"{name} has dtype {a.dtype}; supported: {', '.join(allowed)}")


def check_same(name_a: str, a: Info, name_b: str, b: Info, *, dtype: bool = True) -> None:
    """Same device (and dtype) for two arguments."""
    if a.device != b.device:
        raise ValueError(f"{name_b} is on GPU {b.device} but {name_a} is on GPU {a.device}")
    if dtype and a.dtype != b.dtype:
        raise TypeError(f"{name_b} has dtype {b.dtype} but {name_a} has dtype {a.dtype}; they must match")


def check_bias(bias: Info, x: Info, n: int) -> None:
    """An optional linear bias: x's device and dtype, shape (n,), contiguous."""
    check_same("x", x, "bias", bias)
    if bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {bias.shape}")
    check_contiguous(bias, "bias")


def check_last_contiguous(a: Info, name: str) -> None:
    if a.shape and a.shape[-1] > 1 and a.strides[-1] != 1 and 0 not in a.shape:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {a.strides[-1]})")


def check_contiguous(a: Info, name: str) -> None:
    if 0 in a.shape:                   # an empty array has no layout to speak of
        return
    step = 1
    for n, s in zip(reversed(a.shape), reversed(a.strides)):
        if n > 1 and s != step:
            raise ValueError(f"{name} must be C-contiguous (shape {a.shape}, strides {a.strides})")
        step *= n


def check_rows(a: Info, name: str) -> None:
    """Rows of the last dimension that view as one (rows, N) array without a copy, as a padded-row
    buffer's [..., :N] slice does: contiguous within a row, leading dimensions that merge (each
    stride the next one's times its size), and rows that do not overlap."""
    check_last_contiguous(a, name)
    lead = [(n, s) for n, s in zip(a.shape[:-1], a.strides[:-1]) if n > 1]
    if 0 in a.shape or not lead:
        return
    if any(s != s2 * n2 for (_, s), (n2, s2) in zip(lead, lead[1:])) or lead[-1][1] < a.shape[-1]:
        raise ValueError(f"{name} must be rows of its last dimension that view as one 2-D array (shape "
                         f"{a.shape}, strides {a.strides}): contiguous rows, padded or not, in C order")


def check_out(o: Info, name: str, like: Info, shape: tuple[int, ...], dtype: str | None = None,
              contiguous: bool = True) -> None:
    """A caller-provided output: same kind and device as `like`, the expected shape and dtype."""
    dtype = dtype or like.dtype
    if o.kind != like.kind:
        raise TypeError(f"{name} is a {o.kind} array but the inputs are {like.kind} arrays")
    if o.device != like.device:
        raise ValueError(f"{name} is on GPU {o.device}, the inputs on GPU {like.device}")
    if o.shape != tuple(shape):
        raise ValueError(f"{name} has shape {o.shape}, expected {tuple(shape)}")
    if o.dtype != dtype:
        raise TypeError(f"{name} has dtype {o.dtype}, expected {dtype}")
    (check_contiguous if contiguous else check_last_contiguous)(o, name)


def numpy_dtype(name: str):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- allocation and streams ----------------------------------------------------------------------

def allocator(kind: str, device: int, shape: tuple[int, ...], dtype: str,
              axes: tuple[int, ...] | None = None) -> Callable[[], object]:
    """A function returning a new uninitialised array of `kind` on `device` (transposed by `axes`)."""
    if kind == "meta":
        def make():
            return MetaArray(shape, dtype, device=device)
    elif kind == "torch":
        import torch
        inverse = {v: k for k, v in _torch_dtypes().items()}
        make = functools.partial(torch.empty, shape, dtype=inverse[dtype], device=torch.device("cuda", device))
    else:
        import cupy
        dt, get_device = numpy_dtype(dtype), cupy.cuda.runtime.getDevice

        def make():
            if get_device() == device:
                return cupy.empty(shape, dt)
            with cupy.cuda.Device(device):
                return cupy.empty(shape, dt)
    if axes is None:
        return make
    if kind == "torch":
        return lambda: make().permute(*axes)
    return lambda: make().transpose(*axes)


def new_like(x, name: str, shape: tuple[int, ...], dtype: str):
    """A new uninitialised array of the kind (CuPy, torch) and device of the device array `x`, for the outputs an
    op with several of them allocates when the caller passes none."""
    a = info(as_device_array(x, name), name)
    return allocator(a.kind, a.device, shape, dtype)()


def stream_getter(kind: str, device: int) -> Callable[[], int]:
    """A function returning the raw handle of the caller's current stream on `device`: torch's for
    torch tensors, CuPy's otherwise."""
    if kind == "meta":
        return lambda: 0
    if kind == "torch":
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return functools.partial(raw, device)
        return lambda: torch.cuda.current_stream(device).cuda_stream
    import cupy
    get = cupy.cuda.get_current_stream
    return lambda: get(device).ptr


_slot_lock = threading.Lock()
_slots: dict[tuple, int] = {}
_slot_specs: list[tuple[int, tuple[ArraySpec, ...]]] = []     # slot -> (device, specs)
_scratch: dict[tuple, tuple] = {}


def scratch_slot(owner: str, device: int, specs: tuple[ArraySpec, ...]) -> int:
    """A small int naming one set of work arrays (owner, device, specs), so the hot path hashes ints."""
    with _slot_lock:
        slot = _slots.get((owner, device, specs))
        if slot is None:
            slot = _slots[owner, device, specs] = len(_slot_specs)
            _slot_specs.append((device, specs))
        return slot


def scratch(slot: int, stream: int) -> tuple:
    """The CuPy work arrays of `slot` for `stream` and the calling thread: neither streams nor threads
    sharing a stream handle ever share them. `zeros` specs are zeroed once, on `stream`, at creation
    (the kernels that use them leave them zeroed). Work arrays of threads that have ended are dropped
    whenever new ones are made."""
    key = (slot, stream, threading.get_ident())
    found = _scratch.get(key)
    if found is None:
        import cupy
        device, specs = _slot_specs[slot]
        alive = {t.ident for t in threading.enumerate()}
        for old in [k for k in list(_scratch) if k[2] not in alive]:
            _scratch.pop(old, None)
        with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream):
            found = _scratch.setdefault(key, tuple(
                (cupy.zeros if s.role == "zeros" else cupy.empty)(s.shape, dtype=numpy_dtype(s.dtype))
                for s in specs))
    return found


def release_scratch(stream: int) -> None:
    """Forget every work array of `stream` (its owner has synchronized it and drops its graphs)."""
    for key in [k for k in list(_scratch) if k[1] == stream]:
        _scratch.pop(key, None)


def release_all_scratch() -> None:
    """Forget every stream's work arrays and the placeholders (at exit, before CuPy and cuTile are torn down)."""
    _scratch.clear()
    placeholder.cache_clear()


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


def bench_array(spec: ArraySpec, device: int, rng):
    """A CuPy array for `spec` in a benchmark: random inputs (integers within their bounds), empty
    outputs and scratch, zeroed `zeros` scratch, a placeholder for an absent argument; strided specs
    are views of a buffer just large enough."""
    import cupy
    if spec.role == "absent":
        return placeholder(device, spec.dtype, len(spec.shape))
    strides = spec.element_strides()
    extent = 1 + sum((n - 1) * s for n, s in zip(spec.shape, strides)) if all(spec.shape) else 0
    with cupy.cuda.Device(device):
        if spec.role != "in":
            flat = (cupy.zeros if spec.role == "zeros" else cupy.empty)((extent,), numpy_dtype(spec.dtype))
        elif spec.fill is not None:
            flat = cupy.full((extent,), spec.fill, numpy_dtype(spec.dtype))
        elif spec.values is not None:
            flat = cupy.asarray(spec.values, numpy_dtype(spec.dtype))
        elif spec.dtype in INT_DTYPES + BYTE_DTYPES:
            flat = rng.integers(0, spec.high or 1, extent)
            if spec.signed:
                flat |= rng.integers(0, 2, extent) << 7
            flat = flat.astype(numpy_dtype(spec.dtype))
        else:
            flat = random_array((extent,), spec.dtype, device, rng)
        item = ITEMSIZE[spec.dtype]
        return cupy.lib.stride_tricks.as_strided(flat, spec.shape, tuple(s * item for s in strides))


POISON_BYTE = 0x4D     # every byte of an output before a run whose outputs are compared (bf16 2.1e8, fp16 21.2)


def array_module(a):
    """numpy for a NumPy array, else cupy."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


def poison(a) -> None:
    """Fill an array with POISON_BYTE bytes (through an unsigned view of its item size: any dtype)."""
    item = a.dtype.itemsize
    a.view(np.dtype(f"uint{8 * item}")).fill(int.from_bytes(bytes([POISON_BYTE]) * item, "little"))


def as_float64(a):
    """An array's values as float64 (bfloat16 through its bits; integers and FP8 codes as numbers)."""
    xp = array_module(a)
    if a.dtype == numpy_dtype("bfloat16"):
        a = (xp.ascontiguousarray(a).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float64)


def relative_difference(a, b) -> float:
    """||a - b|| / ||b|| over positions finite in both; inf where a non-finite value differs (NaN matches NaN)."""
    xp = array_module(a)
    x, y = as_float64(a), as_float64(b)
    finite = xp.isfinite(x) & xp.isfinite(y)
    same = (x == y) | (xp.isnan(x) & xp.isnan(y))
    if bool(xp.any(~finite & ~same)):
        return math.inf
    x, y = xp.where(finite, x, 0.0), xp.where(finite, y, 0.0)
    diff = float(xp.linalg.norm(x - y))
    return diff / max(float(xp.linalg.norm(y)), 1e-30) if diff else 0.0


def agreement_tolerance(dtype) -> float:
    """Relative difference two correct configs' outputs of `dtype` stay within: 16-bit roundings of sums taken in
    another order; fp32 sums in another order; integers (codes, ids, fixed point) all but equal."""
    return 2e-2 if str(dtype) in ("bfloat16", "float16") else 1e-3
