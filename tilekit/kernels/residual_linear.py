"""Residual projection: residual += x @ W + bias, added in place into a fixed-point residual stream.

A decode step's attention output projection and MLP down projection make a few rows from weights
of megabytes, with too few column tiles to keep every SM streaming weights (gpt2-xl's 1600 output
columns are 25 tiles of 64). Here SPLIT_K programs share each output tile, each multiplying its
slice of K and adding its partial sum into the residual with an integer atomic add
(tiles.py): no reduction step, no arrival counter, and the same bits in any order.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import FIXED_DTYPE, add_fixed, sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def residual_linear_kernel(X, W, Bias, Acc, TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                           SPLIT_K: ct.Constant[int], HAS_BIAS: ct.Constant[bool]):
    """Acc[M, N] += X[M, K] @ W[K, N] + Bias, Acc in fixed point; program bid(0) = tile * SPLIT_K + split
    sums K tiles split*per_split.. of output tile `tile` (split 0 adds the bias)."""
    sync_with_previous_kernel()
    tile = ct.bid(0) // SPLIT_K
    split = ct.bid(0) % SPLIT_K
    tiles_n = ct.cdiv(Acc.shape[1], TN)
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    k_tiles = ct.cdiv(X.shape[1], TK)
    per_split = ct.cdiv(k_tiles, SPLIT_K)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(split * per_split, ct.minimum(k_tiles, (split + 1) * per_split)):
        a = ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO)
        b = ct.load(W, (k, pid_n), (TK, TN), padding_mode=ZERO)
        acc = ct.mma(a, b, acc)
    if HAS_BIAS:
        first = ct.where(split == 0, 1.0, 0.0)
        acc = acc + first * ct.load(Bias, (pid_n,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
    rows = (ct.arange(TM, dtype=ct.int32) + pid_m * TM).reshape((TM, 1))
    cols = (ct.arange(TN, dtype=ct.int32) + pid_n * TN).reshape((1, TN))
    add_fixed(Acc, rows, cols, acc)


# -- search space and heuristic default ---------------------------------------------------------

def _row_tile(p: dict) -> int:
    """Rows per tile: every row in one tile up to 128 rows (16 at least, the matrix units' minimum)."""
    return min(128, max(16, pow2_ceil(p["M"])))


def _fits(c: dict, p: dict) -> bool:
    item = 4 if p["dtype"] == "float32" else 2
    return (c["TM"] == _row_tile(p)
            and c["TN"] <= max(32, pow2_ceil(p["N"])) and c["TK"] <= max(64, pow2_ceil(p["K"]))
            and c["SPLIT_K"] <= ct.cdiv(p["K"], c["TK"])
            and (c["TM"] + c["TN"]) * c["TK"] * item <= 48 * 1024)


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TN=(32, 64, 128), TK=(64, 128, 256),
                    SPLIT_K=(1, 2, 4, 8, 16), occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """The H100 prototype's winner for one row and 1600 or 768 columns (docs/results/fixed-point-decode.txt)."""
    tk = min(128, max(64, pow2_ceil(p["K"])))
    k_tiles = ct.cdiv(p["K"], tk)
    split = 8 if p["M"] <= 4 else 4 if p["M"] <= 16 else 1
    # fp32 products run on FMA units with the tiles in registers: 16x64x128 spills 1.3 KB a thread, 16x32x128
    # 0.2 KB (sm_90; docs/results/fp32-tiles-sm90.txt)
    tn = 32 if p["dtype"] == "float32" else min(64, max(32, pow2_ceil(p["N"])))
    return dict(TM=_row_tile(p), TN=tn, TK=tk, SPLIT_K=min(split, 1 << (k_tiles.bit_length() - 1)), occupancy=1)


def _arrays(p: dict) -> dict:
    M, N, K, dt = p["M"], p["N"], p["K"], p["dtype"]
    return {"x": ArraySpec(dt, (M, K)), "w": ArraySpec(dt, (K, N)),
            "bias": ArraySpec(dt, (N,)) if p["bias"] else absent(dt, 1),
            "residual": ArraySpec(FIXED_DTYPE, (M, N), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]) * ct.cdiv(p["N"], c["TN"]) * c["SPLIT_K"], 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], c["SPLIT_K"], bool(p["bias"]))


def _bind(a: list, flags: tuple) -> Binding:
    residual, x, w, bias = a
    arrays.check_dtype(residual, "residual", (FIXED_DTYPE,))
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "weight", w)
    arrays.check_same("x", x, "residual", residual, dtype=False)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    if len(w.shape) != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [in, out] = ({x.shape[-1]}, N), got shape {w.shape}")
    K, N = w.shape
    M = math.prod(x.shape[:-1])
    if residual.shape != x.shape[:-1] + (N,):
        raise ValueError(f"residual must have shape {x.shape[:-1] + (N,)}, got {residual.shape}")
    for name, v in (("residual", residual), ("x", x), ("weight", w)):
        arrays.check_contiguous(v, name)
    views = {"residual": (0, None if len(residual.shape) == 2 else (M, N)),
             "x": (1, None if len(x.shape) == 2 else (M, K)), "w": (2, None)}
    if bias is not None:
        arrays.check_bias(bias, x, N)
        views["bias"] = (3, None)
    return Binding(problem=dict(dtype=x.dtype, M=M, N=N, K=K, bias=int(bias is not None)), arrays=views,
                   returns=0)


RESIDUAL_LINEAR = Op(
    "residual_linear", args=("residual", "x", "weight", "bias"), optional=("bias",),
    key=dict(dtype=None, M=pow2_bucket, N=None, K=None, bias=None), space=SPACE, default=default_config,
    arrays=_arrays, launches=(Launch(residual_linear_kernel, _grid, ("x", "w", "bias", "residual"), _constants),),
    bind=_bind, choices=dict(bias=(0, 1)), cli_defaults=dict(bias=1))


# -- public function ---------------------------------------------------------------------------

def residual_linear(residual, x, weight, bias=None):
    """residual += x @ weight + bias in place, over the last dimension of x; returns residual.

    residual is a fixed-point (int64) array of x's leading shape and N columns (tiles.py);
    weight is [in, out] (GPT-2's Conv1D layout).
    """
    return RESIDUAL_LINEAR((residual, x, weight, bias))


def residual_linear_reference(residual, x, weight, bias=None) -> np.ndarray:
    """float64 NumPy residual + x @ weight + bias (residual given as float values)."""
    y = np.asarray(residual, np.float64) + np.asarray(x, np.float64) @ np.asarray(weight, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


if __name__ == "__main__":
    from tilekit.kernels.residual_linear import residual_linear, residual_linear_reference  # the package's op
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, rand
    from tilekit.kernels.tiles import fixed_to_float, float_to_fixed
    for M, N, K, dtype in [(1, 1600, 6400, "bfloat16"), (5, 1031, 72, "float32"), (300, 200, 136, "float16")]:
        start = float_to_fixed(host(rand((M, N), "float32")))
        residual = cupy.asarray(start)
        x, w, b = rand((M, K), dtype), rand((K, N), dtype, 1 / math.sqrt(K)), rand((N,), dtype)
        residual_linear(residual, x, w, b)
        added = fixed_to_float(cupy.asnumpy(residual)) - fixed_to_float(start)     # exact in float64
        err = assert_close(added, residual_linear_reference(0.0, host(x), host(w), host(b)), TOL[dtype],
                           f"residual_linear {M}x{N}x{K}")
        print(f"residual_linear M{M} N{N} K{K} {dtype}: ok, relative error {err:.2e}")
