"""LayerNorm over the last dimension, any leading shape, fp32 statistics.

Each program normalises TM rows. When a row fits one tile (the usual case: hidden sizes up to
8192) it is read once and the variance is computed around the mean (two-pass, in registers);
longer rows are streamed in TN-wide tiles with per-tile mean/M2 merged by Chan's formula, then
read again to normalise.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune.compile import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import BenchCase, TunableOp
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels import arrays

ZERO = ct.PaddingMode.ZERO
MAX_GATHER_N = 8192


@ct.kernel
def layer_norm_kernel(X, W, B, Y, Rows, eps: float, TM: ct.Constant[int], TN: ct.Constant[int],
                      ONE_TILE: ct.Constant[bool], GATHER: ct.Constant[bool]):
    """Y = (X - mean) / sqrt(var + eps) * W + B over rows of X[M, N] (rows X[Rows[i]] when GATHER)."""
    pid = ct.bid(0)
    N = X.shape[1]
    cols = ct.arange(TN, dtype=ct.int32).reshape((1, TN))
    if ONE_TILE:
        if GATHER:
            rows = ct.load(Rows, (pid,), (TM,), padding_mode=ZERO).reshape((TM, 1))
            x = ct.gather(X, (rows, cols)).astype(ct.float32)
        else:
            x = ct.load(X, (pid, 0), (TM, TN), padding_mode=ZERO).astype(ct.float32)
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
            x = ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO).astype(ct.float32)
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
            x = ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO).astype(ct.float32)
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
FIELDS = ("dtype", "M", "N", "gather")


def default_config(p: dict) -> dict:
    tn = min(8192, max(256, pow2_ceil(p["N"])))
    rows = 1 if p["gather"] else max(1, min(4, 8192 // tn, pow2_ceil(p["M"])))
    return dict(TM=rows, TN=tn, occupancy=2)


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), 1, 1)


def _kernel_args(x, w, b, y, rows, eps: float, p: dict, c: dict) -> tuple:
    return (x, w, b, y, rows, float(eps), c["TM"], c["TN"], c["TN"] >= p["N"], bool(p["gather"]))


def _signature(p: dict, c: dict):
    x = ArraySpec(p["dtype"], (p["M"], p["N"]))
    w = ArraySpec(p["dtype"], (p["N"],))
    rows = ArraySpec("int32", (p["M"],) if p["gather"] else (16,))
    return [(layer_norm_kernel, _kernel_args(x, w, w, x, rows, 1e-5, p, c))]


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    rng = cupy.random.default_rng()
    x = arrays.random_array((p["M"], p["N"]), p["dtype"], dev, rng)
    w = arrays.random_array((p["N"],), p["dtype"], dev, rng)
    b = arrays.random_array((p["N"],), p["dtype"], dev, rng)
    y = arrays.empty("cupy", dev, (p["M"], p["N"]), p["dtype"])
    rows = cupy.arange(p["M"], dtype=cupy.int32)[::-1].copy() if p["gather"] else arrays.placeholder(dev, "int32", 1)
    return BenchCase(grid=lambda c: _grid(p, c), args=lambda c: _kernel_args(x, w, b, y, rows, 1e-5, p, c))


LAYER_NORM = TunableOp("layer_norm", kernel=layer_norm_kernel, fields=FIELDS, space=SPACE,
                       default=default_config, buckets={"M": pow2_bucket}, bench=_bench,
                       signature=_signature,
                       field_defaults=dict(gather=0))


def layer_norm(x, weight, bias, eps: float = 1e-5, *, rows=None, out=None):
    """LayerNorm of x over its last dimension with affine weight and bias (fp32 statistics).

    rows: optional int32 device array of row indices into x viewed as (M, N); then only those
    rows are normalised and the result is (len(rows), N) (e.g. the last token of each sequence).
    """
    x = arrays.as_device_array(x, "x")
    weight = arrays.as_device_array(weight, "weight")
    bias = arrays.as_device_array(bias, "bias")
    xi, wi, bi = arrays.info(x, "x"), arrays.info(weight, "weight"), arrays.info(bias, "bias")
    arrays.check_dtype(xi, "x", arrays.FLOAT_DTYPES)
    arrays.check_same("x", xi, "weight", wi)
    arrays.check_same("x", xi, "bias", bi)
    if not xi.shape or xi.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {xi.shape}")
    N = xi.shape[-1]
    for name, a in (("weight", wi), ("bias", bi)):
        if a.shape != (N,):
            raise ValueError(f"{name} must have shape ({N},), got {a.shape}")
        arrays.check_contiguous(a, name)
    arrays.check_contiguous(xi, "x")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    M = math.prod(xi.shape[:-1])
    out_shape = xi.shape
    if rows is not None:
        rows = arrays.as_device_array(rows, "rows")
        ri = arrays.info(rows, "rows")
        arrays.check_dtype(ri, "rows", ("int32",))
        if len(ri.shape) != 1 or ri.device != xi.device:
            raise ValueError(f"rows must be a 1-D int32 array on GPU {xi.device}, got shape {ri.shape}")
        arrays.check_contiguous(ri, "rows")
        if N > MAX_GATHER_N:
            raise ValueError(f"rows= needs a last dimension <= {MAX_GATHER_N}, got {N}")
        out_shape = (ri.shape[0], N)
    if out is None:
        out = arrays.empty(xi.kind, xi.device, out_shape, xi.dtype)
    else:
        out = arrays.check_out(out, "out", xi.kind, xi.device, out_shape, xi.dtype)
    R = out_shape[0] if rows is not None else M
    if R == 0:
        return out
    p = (xi.dtype, R, N, int(rows is not None))
    plan = LAYER_NORM.plan((xi.device,) + p)
    problem = dict(zip(FIELDS, p))
    ct.launch(arrays.stream_for(xi.kind, xi.device), _grid(problem, plan.config), plan.kernel,
              _kernel_args(x.reshape(M, N), weight, bias, out.reshape(R, N),
                           rows if rows is not None else arrays.placeholder(xi.device, "int32", 1),
                           eps, problem, plan.config))
    return out


def layer_norm_reference(x, weight, bias, eps: float = 1e-5) -> np.ndarray:
    """float64 NumPy LayerNorm over the last axis."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)
