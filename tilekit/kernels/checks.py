"""Checking an op on the GPU against its float64 reference: fresh random inputs, NaN-poisoned outputs,
and an error bound on the whole output and on every row, so that one wrong row cannot hide in a
global norm. Used by the GPU tests and by each op module's `python -m tilekit.kernels.<op>`."""

from __future__ import annotations

import numpy as np

from tilekit.autotune.arrays import numpy_dtype, random_array

TOL = {"float32": 1e-5, "tf32": 5e-4, "float16": 3e-3, "bfloat16": 1e-2}
ROW_SLACK = 4.0        # a row may be this many times worse than the tolerance of the whole output
NAN_BITS = {"float32": ("uint32", 0x7FC00000), "float16": ("uint16", 0x7E00), "bfloat16": ("uint16", 0x7FC0)}


def rand(shape, dtype: str, scale: float = 1.0, mean: float = 0.0):
    """Fresh normal(mean, scale) CuPy data of `dtype` on the current GPU."""
    import cupy
    return random_array(tuple(shape), dtype, cupy.cuda.runtime.getDevice(), cupy.random.default_rng(),
                        scale, mean)


def poisoned(shape, dtype: str):
    """A CuPy array of `dtype` filled with NaN."""
    import cupy
    uint, bits = NAN_BITS[dtype]
    return cupy.full(shape, bits, dtype=uint).view(numpy_dtype(dtype))


def host(a) -> np.ndarray:
    """Device array (CuPy or torch) -> float64 (or integer) NumPy array."""
    import cupy
    if not isinstance(a, cupy.ndarray):
        a = cupy.from_dlpack(a)
    h = cupy.asnumpy(a)
    return h.astype(np.float64) if h.dtype.kind in "fV" or h.dtype.name == "bfloat16" else h


def rounded(ref, dtype: str) -> np.ndarray:
    """The float64 reference as the output dtype can hold it (tiny values flush to zero in fp16)."""
    return np.asarray(ref, np.float64).astype(numpy_dtype(dtype)).astype(np.float64)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or infinity anywhere in out gives inf."""
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def row_errors(out, ref) -> np.ndarray:
    """Relative error of each row (last axis) of out; a row's reference norm is floored at 1e-3 of
    the typical row norm, so rows that are nearly zero are judged on an absolute scale."""
    out = np.asarray(out, np.float64).reshape(-1, max(np.shape(out)[-1] if np.ndim(out) else 1, 1))
    ref = np.asarray(ref, np.float64).reshape(out.shape)
    diff = np.linalg.norm(np.where(np.isfinite(out), out - ref, np.inf), axis=1)
    norms = np.linalg.norm(ref, axis=1)
    floor = max(1e-3 * float(np.sqrt(np.mean(norms ** 2))), 1e-30)
    return diff / np.maximum(norms, floor)


def assert_close(out, ref, tol: float, what: str = "") -> float:
    """Raise AssertionError unless out matches ref within `tol` overall and within ROW_SLACK * tol in
    every row; returns the overall relative error."""
    err = rel_err(out, ref)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol:g}"
    rows = row_errors(out, ref)
    worst = int(np.argmax(rows)) if rows.size else 0
    assert not rows.size or rows[worst] < ROW_SLACK * tol, (
        f"{what}: row {worst} has relative error {rows[worst]:.3g} >= {ROW_SLACK * tol:g} "
        f"(whole output {err:.3g})")
    return err
