"""Activation quantization to FP8 e4m3: q = x / s rounded to e4m3, s = absmax / 448 per row or per row and group.

What W8A8 `quant_linear` reads: the FP8 bits (uint8) and fp32 scales, one per row (per-token scaling,
scales [M, 1]) or one per row and 128 columns (`group=128`, scales [M, ceil(K/128)], as DeepSeek-V3's
block-FP8 activations). A program quantizes TM rows: per row it first finds the absmax across K, then
multiplies by the scale's reciprocal and rounds (one pass when a tile holds the whole row); per group one pass
does both.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
RN = ct.RoundingMode.RN   # IEEE divisions, so that scales and codes are NumPy's fp32 ones bit for bit
FP8_MAX = 448.0           # the largest finite e4m3 value
MIN_AMAX = 1e-12          # an all-zero row or group still gets a positive scale
GROUP = 128


@ct.function
def fp8_scale(amax):
    return ct.truediv(ct.maximum(amax, MIN_AMAX), FP8_MAX, rounding_mode=RN)


@ct.function
def saturated_fp8_bits(q):
    """q (fp32 tile) rounded to e4m3, saturated at +-FP8_MAX, as uint8 bits."""
    return ct.bitcast(ct.minimum(ct.maximum(q, -FP8_MAX), FP8_MAX).astype(ct.float8_e4m3fn), ct.uint8)


@ct.function
def fp8_bits(x, s):
    """x / s (fp32 tile, s broadcast) rounded to e4m3, saturated, as uint8 bits."""
    return saturated_fp8_bits(ct.truediv(x, s, rounding_mode=RN))


@ct.function
def fp8_bits_times(x, inv):
    """x * inv (fp32 tile, inv = 1 / scale in fp32, broadcast) rounded to e4m3, saturated, as uint8 bits: one
    multiply an element where fp8_bits divides (an IEEE division is a dozen instructions)."""
    return saturated_fp8_bits(x * inv)


@ct.function
def reciprocal(s):
    """1 / s, rounded as NumPy's fp32 division rounds (once a row or group, where the codes take a multiply)."""
    return ct.truediv(1.0, s, rounding_mode=RN)


@ct.kernel
def quantize_fp8_kernel(X, Q, S, TM: ct.Constant[int], TK: ct.Constant[int], GROUPED: ct.Constant[bool],
                        ONE_PASS: ct.Constant[bool]):
    """Q[M, K] = e4m3 bits of X * (1 / S); S [M, 1] per row or [M, ceil(K/GROUP)] per group (then TK == GROUP).
    ONE_PASS (TK >= K): each row is loaded once, its absmax and codes from the same tile."""
    sync_with_previous_kernel()
    pid = ct.bid(0)
    k_tiles = ct.cdiv(X.shape[1], TK)
    if ONE_PASS:
        x = ct.load(X, (pid, 0), (TM, TK), padding_mode=ZERO).astype(ct.float32)
        s = fp8_scale(ct.max(ct.abs(x), axis=1, keepdims=True))
        ct.store(Q, (pid, 0), fp8_bits_times(x, reciprocal(s)))
        ct.store(S, (pid, 0), s)
    elif GROUPED:
        for k in range(k_tiles):
            x = ct.load(X, (pid, k), (TM, TK), padding_mode=ZERO).astype(ct.float32)
            s = fp8_scale(ct.max(ct.abs(x), axis=1, keepdims=True))
            ct.store(Q, (pid, k), fp8_bits_times(x, reciprocal(s)))
            ct.store(S, (pid, k), s)
    else:
        amax = ct.zeros((TM, 1), dtype=ct.float32)
        for k in range(k_tiles):
            x = ct.load(X, (pid, k), (TM, TK), padding_mode=ZERO).astype(ct.float32)
            amax = ct.maximum(amax, ct.max(ct.abs(x), axis=1, keepdims=True))
        s = fp8_scale(amax)
        inv = reciprocal(s)
        for k in range(k_tiles):
            x = ct.load(X, (pid, k), (TM, TK), padding_mode=ZERO).astype(ct.float32)
            ct.store(Q, (pid, k), fp8_bits_times(x, inv))
        ct.store(S, (pid, 0), s)


# -- search space and heuristic default ---------------------------------------------------------

def _fits(c: dict, p: dict) -> bool:
    """Tiles up to 16K elements; K steps past 1024 only as one tile of the whole row (one pass over x). Tiles of
    fewer than 256 elements only one program a SM: a 1 x 128 tile with occupancy 2 or 4 never finished on an H100
    (bf16, M = 1 and 8192, K = 4096 and 14336, grouped or not; the kernel before this one's reciprocal did the
    same; M = 40, K = 1000 ran), which kept the tuner from ever finishing this op."""
    return (c["TM"] <= max(1, pow2_ceil(p["M"])) and c["TK"] <= max(128, pow2_ceil(p["K"]))
            and (c["TK"] <= 1024 or c["TK"] == pow2_ceil(p["K"]))
            and (c["TK"] == GROUP or not p["group"]) and c["TM"] * c["TK"] <= 16 * 1024
            and (c["occupancy"] == 1 or c["TM"] * c["TK"] >= 256))


SPACE = SearchSpace(_fits, TM=(1, 2, 4, 8, 16, 32), TK=(128, 256, 512, 1024, 2048, 4096, 8192, 16384),
                    occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    """A whole row per tile up to K = 16384 (one pass over x), else K steps of 1024; as many rows as keep 16K
    elements a tile, at most 32; two programs a SM (one below 256 elements, see _fits). The fastest at
    occupancy 2 of every tile on an H100 for 8192 rows: K 4096 4 x 4096 (52.9 us, 64% of the copy bandwidth),
    K 14336 1 x 16384 (144.4 us, 82%; two passes of 1024 took 171 us, the first default's 16 x 1024 221 us)."""
    tk = GROUP if p["group"] else (max(128, pow2_ceil(p["K"])) if p["K"] <= 16384 else 1024)
    tm = min(max(1, pow2_ceil(p["M"])), 16 * 1024 // tk, 32)
    return dict(TM=tm, TK=tk, occupancy=1 if tm * tk < 256 else 2)


def _groups(p: dict) -> int:
    return ct.cdiv(p["K"], GROUP) if p["group"] else 1


def _arrays(p: dict) -> dict:
    M, K = p["M"], p["K"]
    return {"x": ArraySpec(p["dtype"], (M, K)), "q": ArraySpec("uint8", (M, K), role="out"),
            "s": ArraySpec("float32", (M, _groups(p)), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TK"], bool(p["group"]), c["TK"] >= p["K"])


def _bind(a: list, flags: tuple) -> Binding:
    x, q, s = a
    (group,) = flags
    if group not in (None, GROUP):
        raise ValueError(f"group must be None (one scale per row) or {GROUP}, got {group!r}")
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    arrays.check_contiguous(x, "x")
    M, K = math.prod(x.shape[:-1]), x.shape[-1]
    groups = ct.cdiv(K, GROUP) if group else 1
    for name, out, shape, dtype in (("out", q, x.shape, "uint8"), ("scale", s, x.shape[:-1] + (groups,), "float32")):
        arrays.check_out(out, name, x, shape, dtype)
    return Binding(problem=dict(dtype=x.dtype, M=M, K=K, group=int(bool(group))),
                   arrays={"x": (0, (M, K)), "q": (1, (M, K)), "s": (2, (M, groups))})


QUANTIZE_FP8 = Op(
    "quantize_fp8", args=("x", "out", "scale"), key=dict(dtype=None, M=pow2_bucket, K=None, group=None),
    space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(quantize_fp8_kernel, _grid, ("x", "q", "s"), _constants),), bind=_bind,
    choices=dict(group=(0, 1)), cli_defaults=dict(group=0))


# -- public function ---------------------------------------------------------------------------

def quantize_fp8(x, out, scale, *, group: int | None = None):
    """Quantize x (bf16/fp16/fp32) to FP8 e4m3 bits in `out` (uint8, x's shape) with fp32 scales in `scale`
    (x's leading shape + (1,), or + (ceil(K/128),) with group=128): x ~ e4m3(out) * scale. Returns (out, scale)."""
    QUANTIZE_FP8((x, out, scale), (group,))
    return out, scale


def quantize_fp8_reference(x, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 bits as uint8, fp32 scales) computed in fp32 as the kernel does."""
    import ml_dtypes
    x = np.asarray(x, np.float32)
    K = x.shape[-1]
    width = group or K
    pad = -K % width
    blocks = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*x.shape[:-1], -1, width)
    s = np.maximum(np.abs(blocks).max(-1, keepdims=True), np.float32(MIN_AMAX)) / np.float32(FP8_MAX)
    q = np.clip(blocks * (np.float32(1) / s), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(*x.shape[:-1], -1)[..., :K].view(np.uint8), s[..., 0]


def fp8_codes(x, scale) -> np.ndarray:
    """e4m3 codes (uint8) of x (B, H, T, D) with per-head scales (H,), computed in fp32 as the kernels do."""
    import ml_dtypes
    s = np.asarray(scale, np.float32).reshape(1, -1, 1, 1)
    return np.clip(np.asarray(x, np.float32) / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def fp8_values(codes, scale) -> np.ndarray:
    """float64 values of e4m3 codes (B, H, T, D) with per-head scales (H,)."""
    import ml_dtypes
    return np.asarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float64) \
        * np.asarray(scale, np.float64).reshape(1, -1, 1, 1)


if __name__ == "__main__":
    import cupy

    from tilekit.kernels.checks import host, rand
    from tilekit.kernels.quantize_fp8 import quantize_fp8, quantize_fp8_reference  # the package's op
    for M, K, group in [(1, 4096, None), (300, 1100, GROUP), (5, 72, None)]:
        x = rand((M, K), "bfloat16")
        q, s = cupy.empty((M, K), cupy.uint8), cupy.empty((M, -(-K // GROUP) if group else 1), cupy.float32)
        quantize_fp8(x, q, s, group=group)
        ref_q, ref_s = quantize_fp8_reference(host(x), group)
        assert np.array_equal(host(s), ref_s) and np.mean(host(q) != ref_q) < 1e-3, f"quantize_fp8 {M}x{K} {group}"
        print(f"quantize_fp8 M{M} K{K} group {group}: ok")
