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


@ct.kernel
def layer_norm_kernel(X, W, B, Y, eps: float, TM: ct.Constant[int], TN: ct.Constant[int],
                      ONE_TILE: ct.Constant[bool]):
    """Y = (X - mean) / sqrt(var + eps) * W + B over rows of X[M, N]."""
    pid = ct.bid(0)
    N = X.shape[1]
    cols = ct.arange(TN, dtype=ct.int32).reshape((1, TN))
    if ONE_TILE:
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
    n = pow2_ceil(p["N"])
    return (c["TN"] <= max(256, n) and c["TM"] <= max(1, pow2_ceil(p["M"]))
            and c["TM"] * min(c["TN"], n) <= 16384)


SPACE = SearchSpace(_fits, TM=(1, 2, 4, 8, 16), TN=(256, 512, 1024, 2048, 4096, 8192),
                    occupancy=(1, 2, 4))
FIELDS = ("dtype", "M", "N")


def default_config(p: dict) -> dict:
    tn = min(8192, max(256, pow2_ceil(p["N"])))
    return dict(TM=max(1, min(4, 8192 // tn, pow2_ceil(p["M"]))), TN=tn, occupancy=2)


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), 1, 1)


def _kernel_args(x, w, b, y, eps: float, p: dict, c: dict) -> tuple:
    return (x, w, b, y, float(eps), c["TM"], c["TN"], c["TN"] >= p["N"])


def _signature(p: dict, c: dict):
    x = ArraySpec(p["dtype"], (p["M"], p["N"]))
    w = ArraySpec(p["dtype"], (p["N"],))
    return [(layer_norm_kernel, _kernel_args(x, w, w, x, 1e-5, p, c))]


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    rng = cupy.random.default_rng()
    x = arrays.random_array((p["M"], p["N"]), p["dtype"], dev, rng)
    w = arrays.random_array((p["N"],), p["dtype"], dev, rng)
    b = arrays.random_array((p["N"],), p["dtype"], dev, rng)
    y = arrays.empty("cupy", dev, (p["M"], p["N"]), p["dtype"])
    return BenchCase(grid=lambda c: _grid(p, c), args=lambda c: _kernel_args(x, w, b, y, 1e-5, p, c))


LAYER_NORM = TunableOp("layer_norm", kernel=layer_norm_kernel, fields=FIELDS, space=SPACE,
                       default=default_config, buckets={"M": pow2_bucket}, bench=_bench,
                       signature=_signature)


def layer_norm(x, weight, bias, eps: float = 1e-5, *, out=None):
    """LayerNorm of x over its last dimension with affine weight and bias (fp32 statistics)."""
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
    if out is None:
        out = arrays.empty(xi.kind, xi.device, xi.shape, xi.dtype)
    else:
        out = arrays.check_out(out, "out", xi.kind, xi.device, xi.shape, xi.dtype)
    M = math.prod(xi.shape[:-1])
    if M == 0:
        return out
    p = (xi.dtype, M, N)
    plan = LAYER_NORM.plan((xi.device,) + p)
    problem = dict(zip(FIELDS, p))
    ct.launch(arrays.stream_for(xi.kind, xi.device), _grid(problem, plan.config), plan.kernel,
              _kernel_args(x.reshape(M, N), weight, bias, out.reshape(M, N), eps, problem, plan.config))
    return out


def layer_norm_reference(x, weight, bias, eps: float = 1e-5) -> np.ndarray:
    """float64 NumPy LayerNorm over the last axis."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(weight, np.float64) + np.asarray(bias, np.float64)
