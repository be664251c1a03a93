"""RMSNorm over the last dimension (Llama's norm), optionally fused with the residual add before it.

y = x / sqrt(mean(x^2) + eps) * w with fp32 statistics. x may be a fixed-point residual stream (int64,
tiles.py: DeepSeek-V2's), read as it lies; the output then takes the weights' dtype. With a residual, the
kernel first forms s = x + residual in the residual's dtype, writes s back into the residual (the stream the next
block adds to) and normalises s: one pass where HF runs an add and a norm. Rows that fit one tile
(hidden sizes up to 8192) are read once; longer rows are read twice. The search space and default
are LayerNorm's (the same row-tiled shape of work), except that gathered rows take tiles of at most
8192 elements (a 4 x 4096 gather keeps tileiras busy for minutes).
"""

from __future__ import annotations

import importlib
import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace
from tilekit.kernels.layer_norm import as_float, check_rows, default_config
from tilekit.kernels.tiles import FIXED_DTYPE, sync_with_previous_kernel

# The layer_norm op's module (tilekit.kernels.layer_norm is the function), by the name _fits reads: renaming
# it would change the search space's digest and stale the tuned entries.
layernorm = importlib.import_module("tilekit.kernels.layer_norm")
ZERO = ct.PaddingMode.ZERO


@ct.function
def _summed(X, Res, pid, j, TM, TN, HAS_RES, FIXED):
    """Tile (pid, j) of X (decoded from fixed point when FIXED), plus Res's rounded to Res's dtype (the sum the
    residual stream keeps), in fp32."""
    x = as_float(ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO), FIXED)
    if HAS_RES:
        x = (x + ct.load(Res, (pid, j), (TM, TN), padding_mode=ZERO).astype(ct.float32)).astype(Res.dtype)
        x = x.astype(ct.float32)
    return x


@ct.kernel
def rms_norm_kernel(X, Res, W, Y, Rows, eps: float, TM: ct.Constant[int], TN: ct.Constant[int],
                    ONE_TILE: ct.Constant[bool], GATHER: ct.Constant[bool], HAS_RES: ct.Constant[bool],
                    FIXED: ct.Constant[bool]):
    """Y = S / sqrt(mean(S^2) + eps) * W over rows of S = X (+ Res, stored back to Res when HAS_RES);
    rows X[Rows[i]] when GATHER; X in fixed point when FIXED."""
    sync_with_previous_kernel()
    pid = ct.bid(0)
    N = X.shape[1]
    if ONE_TILE:
        if GATHER:
            rows = ct.load(Rows, (pid,), (TM,), padding_mode=ZERO).reshape((TM, 1))
            x = as_float(ct.gather(X, (rows, ct.arange(TN, dtype=ct.int32).reshape((1, TN)))), FIXED)
        else:
            x = _summed(X, Res, pid, 0, TM, TN, HAS_RES, FIXED)
            if HAS_RES:
                ct.store(Res, (pid, 0), x.astype(Res.dtype))
        rstd = ct.rsqrt(ct.sum(x * x, axis=1, keepdims=True) / N + eps)
        w = ct.load(W, (0,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
        ct.store(Y, (pid, 0), (x * rstd * w).astype(Y.dtype))
    else:
        squares = ct.zeros((TM, 1), dtype=ct.float32)
        for j in range(ct.cdiv(N, TN)):
            x = _summed(X, Res, pid, j, TM, TN, HAS_RES, FIXED)
            squares = squares + ct.sum(x * x, axis=1, keepdims=True)
        rstd = ct.rsqrt(squares / N + eps)
        for j in range(ct.cdiv(N, TN)):
            x = _summed(X, Res, pid, j, TM, TN, HAS_RES, FIXED)      # read again: Res is only written here
            if HAS_RES:
                ct.store(Res, (pid, j), x.astype(Res.dtype))
            w = ct.load(W, (j,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
            ct.store(Y, (pid, j), (x * rstd * w).astype(Y.dtype))


def _fits(c: dict, p: dict) -> bool:
    return layernorm.SPACE.constraint(c, p) and (not p["gather"] or c["TM"] * c["TN"] <= 8192)


SPACE = SearchSpace(_fits, **layernorm.SPACE.params)


def _arrays(p: dict) -> dict:
    """x holds rows_in rows; M rows are normalised (all of them, or those named by `rows`)."""
    M, N, dt = p["M"], p["N"], p["dtype"]
    x = ArraySpec(FIXED_DTYPE, (p["rows_in"], N), high=1 << 33) if p["fixed"] else ArraySpec(dt, (p["rows_in"], N))
    return {"x": x, "w": ArraySpec(dt, (N,)),
            "res": ArraySpec(dt, (M, N), role="out") if p["res"] else absent(dt, 2),
            "y": ArraySpec(dt, (M, N), role="out"),
            "rows": ArraySpec("int32", (M,), high=p["rows_in"]) if p["gather"] else absent("int32", 1)}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TN"] >= p["N"], bool(p["gather"]), bool(p["res"]), bool(p["fixed"]))


def _bind(a: list, flags: tuple) -> Binding:
    x, w, res, rows, out = a
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES + (FIXED_DTYPE,))
    arrays.check_dtype(w, "weight", arrays.FLOAT_DTYPES)
    fixed = x.dtype == FIXED_DTYPE
    arrays.check_same("x", x, "weight", w, dtype=not fixed)
    if not x.shape or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    N = x.shape[-1]
    if w.shape != (N,):
        raise ValueError(f"weight must have shape ({N},), got {w.shape}")
    arrays.check_contiguous(w, "weight")
    if len(x.shape) == 2 and res is None and rows is None:
        arrays.check_last_contiguous(x, "x")      # rows of a wider buffer (DeepSeek-V2's latent) load as tiles
    else:
        arrays.check_contiguous(x, "x")
    M = math.prod(x.shape[:-1])
    out_shape = x.shape
    flat = None if len(x.shape) == 2 else (M, N)
    views = {"x": (0, flat), "w": (1, None)}
    if res is not None:
        if fixed:
            raise ValueError("residual needs a float x (a fixed-point x is the residual stream itself)")
        if rows is not None:
            raise ValueError("residual and rows cannot be combined (the residual stream keeps every row)")
        arrays.check_same("x", x, "residual", res)
        if res.shape != x.shape:
            raise ValueError(f"residual must have x's shape {x.shape}, got {res.shape}")
        arrays.check_contiguous(res, "residual")
        views["res"] = (2, flat)
    if rows is not None:
        check_rows(rows, x)
        out_shape = (rows.shape[0], N)
        views["rows"] = (3, None)
    if out is not None:
        arrays.check_out(out, "out", x, out_shape, w.dtype)
    R = out_shape[0] if rows is not None else M
    views["y"] = (4, None if len(out_shape) == 2 else (R, N))
    return Binding(problem=dict(dtype=w.dtype, M=R, N=N, gather=int(rows is not None), res=int(res is not None),
                                fixed=int(fixed), rows_in=M),
                   arrays=views, output=(4, arrays.allocator(x.kind, x.device, out_shape, w.dtype)),
                   returns=4, scalars={"eps": (0, None)})


RMS_NORM = Op(
    "rms_norm", args=("x", "weight", "residual", "rows", "out"), optional=("residual", "rows", "out"),
    key=dict(dtype=None, M=pow2_bucket, N=None, gather=None, res=None, fixed=None),
    extras=dict(rows_in=lambda p: p["M"]),
    space=SPACE, default=default_config, arrays=_arrays, scalars=lambda p: {"eps": 1e-5},
    launches=(Launch(rms_norm_kernel, _grid, ("x", "res", "w", "y", "rows", "eps"), _constants),),
    bind=_bind, choices=dict(gather=(0, 1), res=(0, 1), fixed=(0, 1)), cli_defaults=dict(gather=0, res=0, fixed=0))


def rms_norm(x, weight, eps: float = 1e-6, *, residual=None, rows=None, out=None):
    """RMSNorm of x over its last dimension: x / sqrt(mean(x^2) + eps) * weight (fp32 statistics). x is a float
    array of the weight's dtype, or a fixed-point residual stream (int64, tiles.py; the output then has the
    weight's dtype). A 2-D x may be rows of a wider array (any row stride) unless residual or rows is given.

    residual: an array of x's shape; then s = x + residual is formed, written into residual (in
    place: the residual stream after the add) and s is normalised. rows: optional int32 device
    array of row indices into x viewed as (M, N); only those rows are normalised, giving
    (len(rows), N). Returns an array of x's kind, or writes into `out`.
    """
    return RMS_NORM((x, weight, residual, rows, out), (), (arrays.checked_positive(eps, "eps"),))


def rms_norm_reference(x, weight, eps: float) -> np.ndarray:
    """float64 RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


if __name__ == "__main__":
    from tilekit.kernels.rms_norm import rms_norm, rms_norm_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand, rounded
    for shape, dtype in [((8, 128, 2048), "bfloat16"), ((3, 4096), "float32"), ((5, 20000), "float16")]:
        x, r, w = rand(shape, dtype, 2.0, 0.5), rand(shape, dtype), rand(shape[-1:], dtype)
        y = rms_norm(x, w, 1e-5, out=poisoned(shape, dtype))
        err = assert_close(host(y), rms_norm_reference(host(x), host(w), 1e-5), TOL[dtype], f"{shape} {dtype}")
        s = rounded(host(x) + host(r), dtype)
        y = rms_norm(x, w, 1e-5, residual=r, out=poisoned(shape, dtype))
        assert np.array_equal(host(r), s), f"rms_norm {shape} {dtype}: the residual sum differs"
        assert_close(host(y), rms_norm_reference(s, host(w), 1e-5), TOL[dtype], f"{shape} {dtype} residual")
        print(f"rms_norm {shape} {dtype}: ok, relative error {err:.2e}; fused residual add exact")
