"""LayerNorm folded into a linear layer: y = act(LayerNorm(x) @ W + bias), for a decode step's few rows.

A decode step normalises a handful of rows and multiplies them straight into a projection (GPT-2's
LN -> QKV and LN -> MLP fc). Here the normalisation is the linear's prologue: every program first
takes its rows' statistics over the whole of K (two passes over x in K chunks, fp32: the mean, then
the centred sum of squares; the rows are tiny and sit in L2), then runs the usual main loop over K,
normalising each x tile on the fly before the matrix product. No normalised copy of x is written or
read back, and one kernel launch replaces two. x may be the fixed-point residual stream (int64,
fixed_point.py); the output takes the weights' dtype.
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
from tilekit.kernels.dependent_launch import sync_with_previous_kernel
from tilekit.kernels.fixed_point import FIXED_DTYPE
from tilekit.kernels.gelu import gelu_reference, gelu_tanh
from tilekit.kernels.layernorm import as_float, layer_norm_reference

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def norm_linear_kernel(X, G, Beta, W, Bias, Y, eps: float, TM: ct.Constant[int], TN: ct.Constant[int],
                       TK: ct.Constant[int], HAS_BIAS: ct.Constant[bool], GELU: ct.Constant[bool],
                       FIXED: ct.Constant[bool]):
    """Y[M, N] = act(((X - mean) / sqrt(var + eps) * G + Beta) @ W[K, N] + Bias), statistics over each
    row of X[M, K] (in fixed point when FIXED); program bid(0) = pid_m * tiles_n + pid_n owns one
    TM x TN output tile."""
    sync_with_previous_kernel()
    K = X.shape[1]
    tiles_n = ct.cdiv(Y.shape[1], TN)
    pid_m = ct.bid(0) // tiles_n
    pid_n = ct.bid(0) % tiles_n
    k_tiles = ct.cdiv(K, TK)
    cols = ct.arange(TK, dtype=ct.int32).reshape((1, TK))

    # Statistics of the TM rows over all of K: the mean, then the sum of squares around it.
    total = ct.zeros((TM, 1), dtype=ct.float32)
    for k in range(k_tiles):
        x = as_float(ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO), FIXED)
        total = total + ct.sum(x, axis=1, keepdims=True)
    mean = total / K
    m2 = ct.zeros((TM, 1), dtype=ct.float32)
    for k in range(k_tiles):
        x = as_float(ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO), FIXED)
        centered = ct.where((cols + k * TK) < K, x - mean, 0.0)
        m2 = m2 + ct.sum(centered * centered, axis=1, keepdims=True)
    rstd = ct.rsqrt(m2 / K + eps)

    # The main loop, normalising each x tile (columns past K: gamma = beta = 0 there, so a = 0).
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(k_tiles):
        x = as_float(ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO), FIXED)
        g = ct.load(G, (k,), (TK,), padding_mode=ZERO).astype(ct.float32).reshape((1, TK))
        beta = ct.load(Beta, (k,), (TK,), padding_mode=ZERO).astype(ct.float32).reshape((1, TK))
        a = ((x - mean) * rstd * g + beta).astype(W.dtype)
        w = ct.load(W, (k, pid_n), (TK, TN), padding_mode=ZERO)
        acc = ct.mma(a, w, acc)

    if HAS_BIAS:
        acc = acc + ct.load(Bias, (pid_n,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
    if GELU:
        acc = gelu_tanh(acc)
    ct.store(Y, (pid_m, pid_n), acc.astype(Y.dtype))


# -- search space and heuristic default ---------------------------------------------------------

def _row_tile(p: dict) -> int:
    """Rows per tile: every row in one tile up to 128 rows (16 at least, the matrix units' minimum)."""
    return min(128, max(16, pow2_ceil(p["M"])))


def _fits(c: dict, p: dict) -> bool:
    """TM fixed by the rows; no tiles larger than the problem, no shared-memory hogs (the normalised
    x tile the matrix units read has the weights' dtype, whatever x's)."""
    item = 4 if p["dtype"] == "float32" else 2
    return (c["TM"] == _row_tile(p)
            and c["TN"] <= max(32, pow2_ceil(p["N"])) and c["TK"] <= max(64, pow2_ceil(p["K"]))
            and (c["TM"] + c["TN"]) * c["TK"] * item <= 48 * 1024)


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TN=(32, 64, 128), TK=(64, 128, 256), occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """What the tuned plain linear picks for GPT-2's decode shapes (narrow column tiles, long K steps),
    K steps halved where the tile would not fit."""
    tn = min(32 if p["N"] <= 3072 else 64, max(32, pow2_ceil(p["N"])))
    tk = min(256 if p["K"] <= 1024 or p["N"] <= 2048 else 128, max(64, pow2_ceil(p["K"])))
    config = dict(TM=_row_tile(p), TN=tn, TK=tk, occupancy=2)
    while config["TK"] > 64 and not _fits(config, p):
        config["TK"] //= 2
    return config


def _arrays(p: dict) -> dict:
    M, N, K, dt = p["M"], p["N"], p["K"], p["dtype"]
    x = ArraySpec(FIXED_DTYPE, (M, K), high=1 << 33) if p["fixed"] else ArraySpec(dt, (M, K))
    return {"x": x, "ln_w": ArraySpec(dt, (K,)), "ln_b": ArraySpec(dt, (K,)), "w": ArraySpec(dt, (K, N)),
            "bias": ArraySpec(dt, (N,)) if p["bias"] else absent(dt, 1),
            "y": ArraySpec(dt, (M, N), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]) * ct.cdiv(p["N"], c["TN"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], bool(p["bias"]), p["act"] == "gelu", bool(p["fixed"]))


def _bind(a: list, flags: tuple) -> Binding:
    x, g, beta, w, bias, out = a
    (activation,) = flags
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES + (FIXED_DTYPE,))
    arrays.check_dtype(w, "weight", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "weight", w, dtype=x.dtype != FIXED_DTYPE)
    if not x.shape or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    if len(w.shape) != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [in, out] = ({x.shape[-1]}, N), got shape {w.shape}")
    K, N = w.shape
    for name, v in (("ln_weight", g), ("ln_bias", beta)):
        arrays.check_same("weight", w, name, v)
        if v.shape != (K,):
            raise ValueError(f"{name} must have shape ({K},), got {v.shape}")
        arrays.check_contiguous(v, name)
    if activation not in (None, "gelu"):
        raise ValueError(f"activation must be None or 'gelu', got {activation!r}")
    arrays.check_contiguous(x, "x")
    arrays.check_contiguous(w, "weight")
    M = math.prod(x.shape[:-1])
    out_shape = x.shape[:-1] + (N,)
    views = {"x": (0, None if len(x.shape) == 2 else (M, K)), "ln_w": (1, None), "ln_b": (2, None),
             "w": (3, None), "y": (5, None if len(out_shape) == 2 else (M, N))}
    if bias is not None:
        arrays.check_same("weight", w, "bias", bias)       # the weights' dtype, whatever x's
        arrays.check_bias(bias, w, N)
        views["bias"] = (4, None)
    if out is not None:
        arrays.check_out(out, "out", x, out_shape, w.dtype)
    problem = dict(dtype=w.dtype, M=M, N=N, K=K, bias=int(bias is not None), act=activation or "none",
                   fixed=int(x.dtype == FIXED_DTYPE))
    return Binding(problem=problem, arrays=views, returns=5,
                   output=(5, arrays.allocator(x.kind, x.device, out_shape, w.dtype)),
                   scalars={"eps": (0, None)})


NORM_LINEAR = Op(
    "norm_linear", args=("x", "ln_weight", "ln_bias", "weight", "bias", "out"), optional=("bias", "out"),
    key=dict(dtype=None, M=pow2_bucket, N=None, K=None, bias=None, act=None, fixed=None),
    space=SPACE, default=default_config, arrays=_arrays, scalars=lambda p: {"eps": 1e-5},
    launches=(Launch(norm_linear_kernel, _grid, ("x", "ln_w", "ln_b", "w", "bias", "y", "eps"), _constants),),
    bind=_bind, cli_defaults=dict(bias=1, act="none", fixed=0))


# -- public function ---------------------------------------------------------------------------

def norm_linear(x, ln_weight, ln_bias, weight, bias=None, eps: float = 1e-5, *, activation: str | None = None,
                out=None):
    """act(LayerNorm(x; ln_weight, ln_bias, eps) @ weight + bias) over the last dimension of x, in one kernel.

    x is a float array of the weights' dtype, or a fixed-point residual (int64, fixed_point.py);
    weight is [in, out] (GPT-2's Conv1D layout); ln_weight, ln_bias and bias have the weights' dtype,
    and so does the output. activation: None or 'gelu' (tanh form). Returns an array of x's kind, or
    writes into `out`.
    """
    return NORM_LINEAR((x, ln_weight, ln_bias, weight, bias, out), (activation,),
                       (arrays.checked_positive(eps, "eps"),))


def norm_linear_reference(x, ln_weight, ln_bias, weight, bias=None, eps: float = 1e-5,
                          activation=None) -> np.ndarray:
    """float64 NumPy act(LayerNorm(x) @ weight + bias), weight [in, out] (x given as float values)."""
    y = layer_norm_reference(x, ln_weight, ln_bias, eps) @ np.asarray(weight, np.float64)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    return gelu_reference(y) if activation == "gelu" else y


if __name__ == "__main__":
    from tilekit.kernels.norm_linear import norm_linear, norm_linear_reference  # the package's op
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    from tilekit.kernels.fixed_point import fixed_to_float, float_to_fixed
    for M, N, K, dtype, act, fixed in [(1, 2304, 768, "bfloat16", None, True),
                                       (8, 6400, 1600, "bfloat16", "gelu", True),
                                       (5, 1031, 72, "float32", None, False),
                                       (37, 200, 136, "float16", "gelu", False)]:
        x = rand((M, K), "float32" if fixed else dtype, 2.0, 0.3)
        if fixed:
            x = cupy.asarray(float_to_fixed(host(x)))
        g, beta = rand((K,), dtype, 0.2, 1.0), rand((K,), dtype, 0.2)
        w, b = rand((K, N), dtype, 1 / math.sqrt(K)), rand((N,), dtype)
        y = norm_linear(x, g, beta, w, b, activation=act, out=poisoned((M, N), dtype))
        values = fixed_to_float(cupy.asnumpy(x)) if fixed else host(x)
        ref = norm_linear_reference(values, host(g), host(beta), host(w), host(b), activation=act)
        err = assert_close(host(y), ref, TOL[dtype], f"norm_linear {M}x{N}x{K} {dtype} {act} fixed={fixed}")
        print(f"norm_linear M{M} N{N} K{K} {dtype} {act} fixed={int(fixed)}: ok, relative error {err:.2e}")
