"""Linear layers over a few rows (decoding): act(norm(x) @ W + b) + residual for at most 16 rows.

With a handful of rows a linear layer is a matrix-vector product bound by how fast W streams in,
so the grid runs over N (and, split-K, over K) only: every program streams one TN-wide panel of W
through a 16-row tensor-core tile, with a prefetch-depth hint (`latency`) on the weight loads the
tuner chooses. Optionally the LayerNorm or RMSNorm before the layer runs in its prologue: each
program takes the statistics of the rows (they are a few kilobytes, read from L2) and normalises
each x tile as it loads it, so the normalised rows never make a trip to memory and a decode step
launches one kernel where it launched two. `linear()` sends calls with at most ROWS rows here.
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
from tilekit.kernels.gelu import gelu_reference, gelu_tanh

ZERO = ct.PaddingMode.ZERO
ROWS = 16                      # rows of the x tile: the most rows this op takes
NORMS = {None: 0, "layer_norm": 1, "rms_norm": 2}


@ct.function
def row_statistics(X, TK, NORM, eps):
    """(mean, 1 / std) of each of the ROWS rows of X[M, K] in fp32, over K in TK-wide tiles: the
    mean first, then the squares around it (LayerNorm), or the mean square about zero (RMSNorm)."""
    K = X.shape[1]
    cols = ct.arange(TK, dtype=ct.int32).reshape((1, TK))
    mean = ct.zeros((ROWS, 1), dtype=ct.float32)
    if NORM == 1:
        for k in range(ct.cdiv(K, TK)):
            x = ct.load(X, (0, k), (ROWS, TK), padding_mode=ZERO).astype(ct.float32)
            mean = mean + ct.sum(x, axis=1, keepdims=True)
        mean = mean / K
    squares = ct.zeros((ROWS, 1), dtype=ct.float32)
    for k in range(ct.cdiv(K, TK)):
        x = ct.load(X, (0, k), (ROWS, TK), padding_mode=ZERO).astype(ct.float32)
        centered = ct.where(cols + k * TK < K, x - mean, 0.0)
        squares = squares + ct.sum(centered * centered, axis=1, keepdims=True)
    return mean, ct.rsqrt(squares / K + eps)


@ct.function
def weight_tile(W, k, n, TK, TN, W_NK, LATENCY):
    """Tile (k, n) of W as (TK, TN), read from [N, K] storage when W_NK; LATENCY 0 leaves the
    prefetch depth to the compiler."""
    if W_NK:
        if LATENCY > 0:
            w = ct.load(W, (k, n), (TK, TN), order=(1, 0), padding_mode=ZERO, latency=LATENCY)
        else:
            w = ct.load(W, (k, n), (TK, TN), order=(1, 0), padding_mode=ZERO)
    else:
        if LATENCY > 0:
            w = ct.load(W, (k, n), (TK, TN), padding_mode=ZERO, latency=LATENCY)
        else:
            w = ct.load(W, (k, n), (TK, TN), padding_mode=ZERO)
    return w


@ct.kernel
def gemv_kernel(X, W, Bias, Res, NormW, NormB, Y, Partial, Counter, eps: float,
                TN: ct.Constant[int], TK: ct.Constant[int], SPLIT_K: ct.Constant[int], LATENCY: ct.Constant[int],
                W_NK: ct.Constant[bool], HAS_BIAS: ct.Constant[bool], GELU: ct.Constant[bool],
                HAS_RES: ct.Constant[bool], NORM: ct.Constant[int], TF32: ct.Constant[bool]):
    """Y[M, N] = act(norm(X)[M, K] @ W + Bias) + Res for M <= ROWS; W is [K, N], or [N, K] when W_NK.
    NORM: 0 none, 1 LayerNorm (NormW, NormB), 2 RMSNorm (NormW).

    With SPLIT_K > 1, SPLIT_K programs share each TN-wide panel, each summing a slice of K into its
    own fp32 Partial[split]; the last to arrive, counted in Counter[panel] (left at zero for the
    next call), adds the partial sums and runs the epilogue.
    """
    M = X.shape[0]
    K = X.shape[1]
    panel = ct.bid(0) // SPLIT_K
    split = ct.bid(0) % SPLIT_K
    sync_with_previous_kernel()
    if NORM != 0:
        mean, rstd = row_statistics(X, TK, NORM, eps)
    k_tiles = ct.cdiv(K, TK)
    per_split = ct.cdiv(k_tiles, SPLIT_K)
    acc = ct.zeros((ROWS, TN), dtype=ct.float32)
    for k in range(split * per_split, ct.minimum(k_tiles, (split + 1) * per_split)):
        a = ct.load(X, (0, k), (ROWS, TK), padding_mode=ZERO)
        if NORM != 0:
            scaled = (a.astype(ct.float32) - mean) * rstd
            scaled = scaled * ct.load(NormW, (k,), (TK,), padding_mode=ZERO).astype(ct.float32).reshape((1, TK))
            if NORM == 1:
                scaled = scaled + ct.load(NormB, (k,), (TK,), padding_mode=ZERO).astype(ct.float32).reshape((1, TK))
            a = scaled.astype(X.dtype)        # rounded as the separate norm kernel stores it
        b = weight_tile(W, k, panel, TK, TN, W_NK, LATENCY)
        if TF32:
            a = a.astype(ct.tfloat32)
            b = b.astype(ct.tfloat32)
        acc = ct.mma(a, b, acc)

    rows = ct.arange(ROWS, dtype=ct.int32).reshape((ROWS, 1))
    cols = (ct.arange(TN, dtype=ct.int32) + panel * TN).reshape((1, TN))
    if SPLIT_K > 1:
        ct.store(Partial, (split, 0, panel), acc.reshape((1, ROWS, TN)))
        arrived = ct.atomic_add(Counter, panel, 1)      # acq_rel: our partial before it, theirs after
        last = arrived == SPLIT_K - 1
        rows = ct.where(last, rows, M)                   # other programs address no row at all
        acc = ct.zeros((ROWS, TN), dtype=ct.float32)
        for s in range(SPLIT_K):
            acc = acc + ct.gather(Partial, (s, rows, cols))
        ct.atomic_xchg(Counter, ct.where(last, panel, Counter.shape[0]), 0, memory_order=ct.MemoryOrder.RELAXED)
    if HAS_BIAS:
        acc = acc + ct.load(Bias, (panel,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
    if GELU:
        acc = gelu_tanh(acc)
    if HAS_RES:
        acc = acc + ct.gather(Res, (rows, cols)).astype(ct.float32)
    ct.scatter(Y, (rows, cols), acc.astype(Y.dtype))


# -- search space and heuristic default ---------------------------------------------------------

def _fits(c: dict, p: dict) -> bool:
    """Prune tiles wider than the problem, weight tiles over 64 KB, and K splits that leave a split no
    tile or that the panels alone already outnumber the SMs for."""
    item = 4 if p["dtype"] == "float32" else 2
    panels = ct.cdiv(p["N"], c["TN"])
    return (c["TN"] <= max(32, pow2_ceil(p["N"])) and c["TK"] <= max(128, pow2_ceil(p["K"]))
            and c["TN"] * c["TK"] * item <= 64 * 1024
            and (c["SPLIT_K"] == 1 or (c["SPLIT_K"] <= ct.cdiv(p["K"], c["TK"]) and panels < 264)))


SPACE = SearchSpace(_fits, TN=(32, 64, 128), TK=(128, 256, 512), SPLIT_K=(1, 2, 4), LATENCY=(0, 8), occupancy=(1, 2))


def default_config(p: dict) -> dict:
    return dict(TN=32, TK=128 if p["dtype"] == "float32" else 256, SPLIT_K=1, LATENCY=0, occupancy=2)


def _arrays(p: dict) -> dict:
    M, N, K, dt = p["M"], p["N"], p["K"], p["dtype"]
    return {"x": ArraySpec(dt, (M, K)), "w": ArraySpec(dt, (N, K) if p["wt"] == "nk" else (K, N)),
            "bias": ArraySpec(dt, (N,)) if p["bias"] else absent(dt, 1),
            "res": ArraySpec(dt, (M, N)) if p["res"] else absent(dt, 2),
            "norm_w": ArraySpec(dt, (K,)) if p["norm"] else absent(dt, 1),
            "norm_b": ArraySpec(dt, (K,)) if p["norm"] == 1 else absent(dt, 1),
            "y": ArraySpec(dt, (M, N), role="out")}


def _scratch(p: dict, c: dict) -> dict:
    """Split-K partial sums, and arrival counters zeroed once and left zeroed by every launch."""
    if c["SPLIT_K"] == 1:
        return {"partial": absent("float32", 3), "counter": absent("int32", 1)}
    return {"partial": ArraySpec("float32", (c["SPLIT_K"], p["M"], p["N"]), role="scratch"),
            "counter": ArraySpec("int32", (ct.cdiv(p["N"], c["TN"]),), role="zeros")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["N"], c["TN"]) * c["SPLIT_K"], 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TN"], c["TK"], c["SPLIT_K"], c["LATENCY"], p["wt"] == "nk", bool(p["bias"]), p["act"] == "gelu",
            bool(p["res"]), p["norm"], bool(p["tf32"]))


def check_linear_args(x, w, bias, res, out, activation, weight_layout, allow_tf32) -> tuple[dict, dict]:
    """Validate a linear layer's arguments (shared with the tiled GEMM): (problem fields, kernel array
    name -> (index among x, w, bias, res, out; view shape or None))."""
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "weight", w)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    if len(w.shape) != 2:
        raise ValueError(f"weight must be 2-D, got shape {w.shape}")
    if weight_layout not in ("in_out", "out_in"):
        raise ValueError(f"weight_layout must be 'in_out' or 'out_in', got {weight_layout!r}")
    K = x.shape[-1]
    N = w.shape[1] if weight_layout == "in_out" else w.shape[0]
    if (w.shape[0] if weight_layout == "in_out" else w.shape[1]) != K:
        raise ValueError(f"weight shape {w.shape} ({weight_layout}) does not match x's last dimension {K}")
    if activation not in (None, "gelu"):
        raise ValueError(f"activation must be None or 'gelu', got {activation!r}")
    if allow_tf32 not in (False, True):
        raise ValueError(f"allow_tf32 must be a bool, got {allow_tf32!r}")
    if allow_tf32 and x.dtype != "float32":
        raise ValueError("allow_tf32 applies to float32 inputs only")
    arrays.check_last_contiguous(x, "x")
    arrays.check_last_contiguous(w, "weight")
    M = math.prod(x.shape[:-1])
    out_shape = x.shape[:-1] + (N,)
    views = {"x": (0, None if len(x.shape) == 2 else (M, K)), "w": (1, None),
             "y": (4, None if len(out_shape) == 2 else (M, N))}
    if bias is not None:
        arrays.check_same("x", x, "bias", bias)
        if bias.shape != (N,):
            raise ValueError(f"bias must have shape ({N},), got {bias.shape}")
        arrays.check_contiguous(bias, "bias")
        views["bias"] = (2, None)
    if res is not None:
        arrays.check_same("x", x, "residual", res)
        if res.shape != out_shape:
            raise ValueError(f"residual must have shape {out_shape}, got {res.shape}")
        arrays.check_contiguous(res, "residual")
        views["res"] = (3, None if len(out_shape) == 2 else (M, N))
    if out is not None:
        arrays.check_out(out, "out", x, out_shape)
    problem = dict(dtype=x.dtype, M=M, N=N, K=K, wt="kn" if weight_layout == "in_out" else "nk",
                   bias=int(bias is not None), act=activation or "none", res=int(res is not None),
                   tf32=int(bool(allow_tf32)))
    return problem, views


def _bind(a: list, flags: tuple) -> Binding:
    x, w, bias, res, norm_w, norm_b, out = a
    activation, weight_layout, allow_tf32, norm = flags
    problem, views = check_linear_args(x, w, bias, res, out, activation, weight_layout, allow_tf32)
    if problem["M"] > ROWS:
        raise ValueError(f"x has {problem['M']} rows; gemv takes at most {ROWS} (use linear)")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {tuple(NORMS)}, got {norm!r}")
    K = problem["K"]
    for name, v, wanted in (("norm_weight", norm_w, norm is not None), ("norm_bias", norm_b, norm == "layer_norm")):
        if (v is not None) != wanted:
            raise ValueError(f"{name} {'is needed' if wanted else 'is not taken'} with norm={norm!r}")
        if v is not None:
            arrays.check_same("x", x, name, v)
            if v.shape != (K,):
                raise ValueError(f"{name} must have shape ({K},), got {v.shape}")
            arrays.check_contiguous(v, name)
    views = {name: (i + (i >= 4) * 2, view) for name, (i, view) in views.items()}     # out is argument 6 here
    if norm_w is not None:
        views["norm_w"] = (4, None)
    if norm_b is not None:
        views["norm_b"] = (5, None)
    out_shape = x.shape[:-1] + (problem["N"],)
    return Binding(problem={**problem, "norm": NORMS[norm]}, arrays=views, returns=6,
                   output=(6, arrays.allocator(x.kind, x.device, out_shape, x.dtype)), scalars={"eps": (0, 1e-5)})


GEMV = Op(
    "gemv", args=("x", "weight", "bias", "residual", "norm_weight", "norm_bias", "out"),
    optional=("bias", "residual", "norm_weight", "norm_bias", "out"),
    key=dict(dtype=None, M=pow2_bucket, N=None, K=None, wt=None, bias=None, act=None, res=None, tf32=None,
             norm=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch, scalars=lambda p: {"eps": 1e-5},
    launches=(Launch(gemv_kernel, _grid, ("x", "w", "bias", "res", "norm_w", "norm_b", "y", "partial", "counter",
                                          "eps"), _constants),),
    bind=_bind, cli_defaults=dict(wt="kn", bias=1, act="none", res=0, tf32=0, norm=0))


# -- public function ---------------------------------------------------------------------------

def gemv(x, weight, bias=None, *, activation: str | None = None, residual=None, norm: str | None = None,
         norm_weight=None, norm_bias=None, eps: float = 1e-5, out=None, weight_layout: str = "in_out",
         allow_tf32: bool = False):
    """act(norm(x) @ W + bias) + residual over the last dimension of x, for at most 16 rows.

    norm: None, 'layer_norm' (norm_weight and norm_bias) or 'rms_norm' (norm_weight), applied to x
    with eps inside the kernel. The rest is linear()'s: weight is [in, out] ('in_out') or [out, in]
    ('out_in'); activation None or 'gelu'; fp32 inputs use exact fp32 products unless allow_tf32.
    """
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)) \
            or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    return GEMV((x, weight, bias, residual, norm_weight, norm_bias, out),
                (activation, weight_layout, allow_tf32, norm), (float(eps),))


def gemv_reference(x, weight, bias=None, *, activation=None, residual=None, norm=None, norm_weight=None,
                   norm_bias=None, eps: float = 1e-5, weight_layout: str = "in_out", dtype=None) -> np.ndarray:
    """float64 NumPy gemv. With a norm and `dtype` (a NumPy dtype), the normalised rows are rounded to
    it first, as the kernel feeds them to the tensor cores."""
    x = np.asarray(x, np.float64)
    if norm is not None:
        mean = x.mean(-1, keepdims=True) if norm == "layer_norm" else 0.0
        x = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * np.asarray(norm_weight, np.float64)
        if norm == "layer_norm":
            x = x + np.asarray(norm_bias, np.float64)
        if dtype is not None:
            x = x.astype(dtype).astype(np.float64)
    w = np.asarray(weight, np.float64)
    y = x @ (w if weight_layout == "in_out" else w.T)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if activation == "gelu":
        y = gelu_reference(y)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y


if __name__ == "__main__":
    from tilekit.kernels.gemv import gemv, gemv_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for M, N, K, dtype, layout, act, norm in [(1, 1600, 6400, "bfloat16", "in_out", None, None),
                                              (8, 4800, 1600, "bfloat16", "in_out", "gelu", "layer_norm"),
                                              (3, 1031, 72, "float32", "out_in", None, "rms_norm")]:
        x, b, r = rand((M, K), dtype, 2.0), rand((N,), dtype), rand((M, N), dtype)
        g, beta = (rand((K,), dtype) if norm else None), (rand((K,), dtype) if norm == "layer_norm" else None)
        w = rand((K, N) if layout == "in_out" else (N, K), dtype, 1 / math.sqrt(K))
        y = gemv(x, w, b, activation=act, residual=r, norm=norm, norm_weight=g, norm_bias=beta, weight_layout=layout,
                 out=poisoned((M, N), dtype))
        ref = gemv_reference(host(x), host(w), host(b), activation=act, residual=host(r), norm=norm,
                             norm_weight=None if g is None else host(g), norm_bias=None if beta is None else host(beta),
                             weight_layout=layout)
        err = assert_close(host(y), ref, TOL[dtype], f"gemv {M}x{N}x{K} {dtype} {norm}")
        print(f"gemv M{M} N{N} K{K} {dtype} {layout} {act} {norm}: ok, relative error {err:.2e}")
