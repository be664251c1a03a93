"""Correctness checks: relative error of an output against its anchor's output, in float64.

Outputs may be CuPy arrays or torch tensors of any float dtype; bf16 is read as raw bits and
widened by a shift, so no library needs bf16 arithmetic. Large outputs (logits) are reduced in
chunks to keep the float64 temporaries small.
"""

from __future__ import annotations

import math
import sys

CHUNK = 1 << 24                  # elements per float64 chunk (128 MB)
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
MODEL_TOLERANCE = 5e-2           # bf16 logits of two whole models


def bf16_bits_to_f64(bits, xp):
    """uint16 bf16 bit patterns -> float64 (bf16 is the top half of a float32)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32).astype(xp.float64)


def to_f64(chunk, is_bf16: bool, xp):
    return bf16_bits_to_f64(chunk, xp) if is_bf16 else chunk.astype(xp.float64)


def rel_error_flat(a, a_bf16: bool, b, b_bf16: bool, xp, chunk: int = CHUNK) -> float:
    """||a - b|| / ||b|| over 1-D arrays in float64; inf when a holds a NaN or an infinity."""
    if a.size != b.size:
        raise ValueError(f"output has {a.size} elements, its reference {b.size}")
    num = den = 0.0
    for s in range(0, a.size, chunk):
        x = to_f64(a[s:s + chunk], a_bf16, xp)
        y = to_f64(b[s:s + chunk], b_bf16, xp)
        if not bool(xp.isfinite(x).all()):
            return math.inf
        num += float(((x - y) ** 2).sum())
        den += float((y * y).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def _flat_cupy(a):
    """(1-D CuPy array of a's elements, is_bf16); bf16 comes back as its uint16 bits."""
    import cupy
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.detach().contiguous()
        if a.dtype == torch.bfloat16:
            return cupy.from_dlpack(a.view(torch.int16)).view(cupy.uint16).reshape(-1), True
        return cupy.from_dlpack(a).reshape(-1), False
    if a.dtype.name == "bfloat16":
        return cupy.ascontiguousarray(a.view(cupy.uint16)).reshape(-1), True
    return cupy.ascontiguousarray(a).reshape(-1), False


def rel_error(out, ref) -> float:
    """Relative error of a device array `out` against `ref` (CuPy or torch, same element count)."""
    import cupy
    a, a16 = _flat_cupy(out)
    b, b16 = _flat_cupy(ref)
    return rel_error_flat(a, a16, b, b16, cupy)


def leading_agreement(a, b) -> int:
    """How many leading entries two token sequences share."""
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n
