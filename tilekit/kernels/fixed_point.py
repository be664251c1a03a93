"""The fixed-point residual stream: int64 arrays holding value * 2**32.

With few rows (a decode step), a projection whose output is added to the residual is split over
many programs, each owning a slice of the reduction, and every program adds its partial sum into
the residual in place with an atomic add. Integer additions commute exactly, so the result is the
same bit for bit whatever order the programs finish in (float atomics would not be), and 32
fraction bits resolve 2.3e-10 on a range of +-2**31, far finer than the fp32 the partial sums are
computed in. Kernels read the stream through `from_fixed` and write it through `to_fixed`.
"""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

FIXED_DTYPE = "int64"
ONE = 4294967296.0           # 2**32: the fixed-point value of 1.0


@ct.function
def to_fixed(t):
    """An fp32 tile as fixed point (int64, truncated to a multiple of 2**-32)."""
    return (t * ONE).astype(ct.int64)


@ct.function
def from_fixed(t):
    """A fixed-point tile as fp32."""
    return t.astype(ct.float32) * (1.0 / ONE)


@ct.function
def add_fixed(Acc, rows, cols, t):
    """Acc[rows, cols] += t (fp32 tile) atomically; indices outside Acc are skipped. Relaxed order:
    nothing reads Acc before the kernel ends."""
    ct.atomic_add(Acc, (rows, cols), to_fixed(t), memory_order=ct.MemoryOrder.RELAXED)


def fixed_to_float(a) -> np.ndarray:
    """A host copy of a fixed-point array as float64 (exact below 2**21)."""
    return np.asarray(a, np.int64).astype(np.float64) / ONE


def float_to_fixed(a) -> np.ndarray:
    """float values as an int64 fixed-point host array (rounded to the nearest 2**-32)."""
    return np.rint(np.asarray(a, np.float64) * ONE).astype(np.int64)
