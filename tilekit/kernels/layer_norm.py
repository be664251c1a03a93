"""LayerNorm over the last dimension, any leading shape, fp32 statistics.

x may be the fixed-point residual stream of a decode step (int64, see tiles.py); the output
then takes the weights' dtype. Each program normalises TM rows. When a row fits one tile (the usual
case: hidden sizes up to 8192) it is read once and the variance is computed around the mean
(two-pass, in registers); longer rows are streamed in TN-wide tiles with per-tile mean/M2 merged by
Chan's formula, then read again to normalise.
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
from tilekit.kernels.tiles import FIXED_DTYPE, from_fixed, sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
MAX_GATHER_N = 8192


@ct.function
def as_float(x, FIXED):
    """An input tile as fp32: decoded from fixed point when FIXED."""
    if FIXED:
        return from_fixed(x)
    return x.astype(ct.float32)


@ct.kernel
def layer_norm_kernel(X, W, B, Y, Rows, eps: float, TM: ct.Constant[int], TN: ct.Constant[int],
                      ONE_TILE: ct.Constant[bool], GATHER: ct.Constant[bool], FIXED: ct.Constant[bool]):
    """Y = (X - mean) / sqrt(var + eps) * W + B over rows of X[M, N] (rows X[Rows[i]] when GATHER;
    X in fixed point when FIXED)."""
    sync_with_previous_kernel()
    pid = ct.bid(0)
    N = X.shape[1]
    cols = ct.arange(TN, dtype=ct.int32).reshape((1, TN))
    if ONE_TILE:
        if GATHER:
            rows = ct.load(Rows, (pid,), (TM,), padding_mode=ZERO).reshape((TM, 1))
            x = as_float(ct.gather(X, (rows, cols)), FIXED)
        else:
            x = as_float(ct.load(X, (pid, 0), (TM, TN), padding_mode=ZERO), FIXED)
        mean = ct.sum(x, axis=1, keepdims=True) / N
        centered = ct.where(cols < N, x - mean, 0.0)
        var = ct.sum(centered * centered, axis=1, keepdims=True) / N
        w = ct.load(W, (0,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
        b = ct.load(B, (0,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
        y = centered * ct.rsqrt(var + eps) * w + b
        ct.store(Y, (pid, 0), y.astype(Y.dtype))
    else:
        count = ct.zeros((TM, 1), dtype=ct.float32)
        mean = ct.zeros((TM, 1), dtype=ct.float32)
        m2 = ct.zeros((TM, 1), dtype=ct.float32)
        for j in range(ct.cdiv(N, TN)):
            x = as_float(ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO), FIXED)
            valid = (cols + j * TN) < N
            n_j = ct.minimum(N - j * TN, TN) * 1.0
            mean_j = ct.sum(x, axis=1, keepdims=True) / n_j
            centered = ct.where(valid, x - mean_j, 0.0)
            m2_j = ct.sum(centered * centered, axis=1, keepdims=True)
            total = count + n_j
            delta = mean_j - mean
            mean = mean + delta * (n_j / total)
            m2 = m2 + m2_j + delta * delta * (count * n_j / total)
            count = total
        rstd = ct.rsqrt(m2 / N + eps)
        for j in range(ct.cdiv(N, TN)):
            x = as_float(ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO), FIXED)
            w = ct.load(W, (j,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
            b = ct.load(B, (j,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
            ct.store(Y, (pid, j), ((x - mean) * rstd * w + b).astype(Y.dtype))


def _fits(c: dict, p: dict) -> bool:
    """A row in one tile when it fits (one read of x); long rows stream through 2K-8K wide tiles."""
    n = pow2_ceil(p["N"])
    width_ok = c["TN"] == max(256, n) if n <= 8192 else (c["TN"] >= 2048 and not p["gather"])
    return width_ok and c["TM"] <= max(1, pow2_ceil(p["M"])) and c["TM"] * min(c["TN"], n) <= 16384


SPACE = SearchSpace(_fits, TM=(1, 2, 4, 8, 16), TN=(256, 512, 1024, 2048, 4096, 8192),
                    occupancy=(2, 4, 8))


def default_config(p: dict) -> dict:
    tn = min(8192, max(256, pow2_ceil(p["N"])))
    rows = 1 if p["gather"] else max(1, min(4, 8192 // tn, pow2_ceil(p["M"])))
    return dict(TM=rows, TN=tn, occupancy=2)


def _arrays(p: dict) -> dict:
    """x holds rows_in rows; M rows are normalised (all of them, or those named by `rows`)."""
    M, N, dt = p["M"], p["N"], p["dtype"]
    x = ArraySpec(FIXED_DTYPE, (p["rows_in"], N), high=1 << 33) if p["fixed"] else ArraySpec(dt, (p["rows_in"], N))
    return {"x": x, "w": ArraySpec(dt, (N,)), "b": ArraySpec(dt, (N,)),
            "y": ArraySpec(dt, (M, N), role="out"),
            "rows": ArraySpec("int32", (M,), high=p["rows_in"]) if p["gather"] else absent("int32", 1)}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TN"] >= p["N"], bool(p["gather"]), bool(p["fixed"]))


def check_rows(rows, x) -> None:
    """Validate the row indices a norm gathers from x: 1-D int32 on x's GPU, x's rows short enough."""
    arrays.check_dtype(rows, "rows", ("int32",))
    if len(rows.shape) != 1 or rows.device != x.device:
        raise ValueError(f"rows must be a 1-D int32 array on GPU {x.device}, got shape {rows.shape}")
    arrays.check_contiguous(rows, "rows")
    if x.shape[-1] > MAX_GATHER_N:
        raise ValueError(f"rows= needs a last dimension <= {MAX_GATHER_N}, got {x.shape[-1]}")


def _bind(a: list, flags: tuple) -> Binding:
    x, w, b, rows, out = a
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES + (FIXED_DTYPE,))
    arrays.check_dtype(w, "weight", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "weight", w, dtype=x.dtype != FIXED_DTYPE)
    arrays.check_same("weight", w, "bias", b)
    if not x.shape or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    N = x.shape[-1]
    for name, v in (("weight", w), ("bias", b)):
        if v.shape != (N,):
            raise ValueError(f"{name} must have shape ({N},), got {v.shape}")
        arrays.check_contiguous(v, name)
    arrays.check_contiguous(x, "x")
    M = math.prod(x.shape[:-1])
    out_shape = x.shape
    if rows is not None:
        check_rows(rows, x)
        out_shape = (rows.shape[0], N)
    if out is not None:
        arrays.check_out(out, "out", x, out_shape, w.dtype)
    R = out_shape[0] if rows is not None else M
    views = {"x": (0, None if len(x.shape) == 2 else (M, N)), "w": (1, None), "b": (2, None),
             "y": (4, None if len(out_shape) == 2 else (R, N))}
    if rows is not None:
        views["rows"] = (3, None)
    return Binding(problem=dict(dtype=w.dtype, M=R, N=N, gather=int(rows is not None),
                                fixed=int(x.dtype == FIXED_DTYPE), rows_in=M),
                   arrays=views, output=(4, arrays.allocator(x.kind, x.device, out_shape, w.dtype)),
                   returns=4, scalars={"eps": (0, None)})


LAYER_NORM = Op(
    "layer_norm", args=("x", "weight", "bias", "rows", "out"), optional=("rows", "out"),
    key=dict(dtype=None, M=pow2_bucket, N=None, gather=None, fixed=None), extras=dict(rows_in=lambda p: p["M"]),
    space=SPACE, default=default_config, arrays=_arrays, scalars=lambda p: {"eps": 1e-5},
    launches=(Launch(layer_norm_kernel, _grid, ("x", "w", "b", "y", "rows", "eps"), _constants),),
    bind=_bind, choices=dict(gather=(0, 1), fixed=(0, 1)), cli_defaults=dict(gather=0, fixed=0))


def layer_norm(x, weight, bias, eps: float = 1e-5, *, rows=None, out=None):
    """LayerNorm of x over its last dimension with affine weight and bias (fp32 statistics).

    x is a float array of the weights' dtype, or a fixed-point residual (int64, tiles.py);
    the output has the weights' dtype. rows: optional int32 device array of row indices into x
    viewed as (M, N); then only those rows are normalised and the result is (len(rows), N) (e.g. the
    last token of each sequence).
    """
    return LAYER_NORM((x, weight, bias, rows, out), (), (arrays.checked_positive(eps, "eps"),))


def layer_norm_reference(x, weight, bias, eps: float = 1e-5) -> np.ndarray:
    """float64 NumPy LayerNorm over the last axis."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)


if __name__ == "__main__":
    from tilekit.kernels.layer_norm import layer_norm, layer_norm_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for shape, dtype in [((8, 128, 768), "bfloat16"), ((3, 1600), "float32"), ((5, 20000), "float16")]:
        x, w, b = rand(shape, dtype, 2.0, 0.5), rand(shape[-1:], dtype), rand(shape[-1:], dtype)
        y = layer_norm(x, w, b, out=poisoned(shape, dtype))
        err = assert_close(host(y), layer_norm_reference(host(x), host(w), host(b)), TOL[dtype], f"{shape} {dtype}")
        print(f"layer_norm {shape} {dtype}: ok, relative error {err:.2e}")
