"""GPU tests: skipped with the reason where no usable CUDA GPU is present."""

import numpy as np
import pytest

from tilekit.device import gpu_unavailable_reason

REASON = gpu_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if REASON:
        skip = pytest.mark.skip(reason=f"GPU test: {REASON}")
        for item in items:
            if "tests/gpu" in str(item.fspath):
                item.add_marker(skip)


TOL = {"float32": 1e-5, "tf32": 5e-4, "float16": 3e-3, "bfloat16": 1e-2}
NAN_BITS = {"float32": ("uint32", 0x7FC00000), "float16": ("uint16", 0x7E00), "bfloat16": ("uint16", 0x7FC0)}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf."""
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def rounded(ref, dtype: str) -> np.ndarray:
    """The float64 reference as the output dtype can hold it (tiny values flush to zero in fp16)."""
    from tilekit.kernels.arrays import numpy_dtype
    return np.asarray(ref, np.float64).astype(numpy_dtype(dtype)).astype(np.float64)


def host(a) -> np.ndarray:
    """Device array (CuPy or torch) -> float64 or int NumPy array."""
    import cupy
    if not isinstance(a, cupy.ndarray):
        a = cupy.from_dlpack(a)
    h = cupy.asnumpy(a)
    return h.astype(np.float64) if h.dtype.kind in "fV" or h.dtype.name == "bfloat16" else h


def poisoned(shape, dtype):
    """A CuPy array of `dtype` filled with NaN."""
    import cupy
    from tilekit.kernels.arrays import numpy_dtype
    uint, bits = NAN_BITS[dtype]
    return cupy.full(shape, bits, dtype=uint).view(numpy_dtype(dtype))


def rand(shape, dtype, scale=1.0, mean=0.0):
    """Fresh normal(mean, scale) CuPy data of `dtype`."""
    import cupy
    from tilekit.kernels.arrays import random_array
    return random_array(tuple(shape), dtype, cupy.cuda.runtime.getDevice(), cupy.random.default_rng(),
                        scale, mean)
