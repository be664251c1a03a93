"""Fused linear layer: act(x @ W + b) + residual, with W stored [in, out] (GPT-2 Conv1D) or [out, in].

One kernel does the matrix product on tensor cores with an fp32 accumulator and applies bias,
GELU and the residual add in its epilogue, so the output makes one trip to memory. The tied LM
head (x @ wte^T) reads wte as it is stored, through a transposed tile load.
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
from tilekit.device import sm_count
from tilekit.kernels.gelu import gelu_reference
from tilekit.kernels.tiles import gelu_tanh, grouped_tile, lends_split_k, sync_with_previous_kernel, tensor_mma

ZERO = ct.PaddingMode.ZERO


@ct.function
def output_tile(X, W, Bias, Res, Y, Partial, Counter, tile, split, TM, TN, TK, GROUP_M, SPLIT_K, W_NK,
                HAS_BIAS, GELU, HAS_RES, TF32):
    """Output tile `tile` (split `split` of its K range when SPLIT_K > 1): the main loop and the epilogue."""
    M = X.shape[0]
    K = X.shape[1]
    N = Y.shape[1]
    tiles_m = ct.cdiv(M, TM)
    tiles_n = ct.cdiv(N, TN)
    pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
    k_tiles = ct.cdiv(K, TK)
    per_split = ct.cdiv(k_tiles, SPLIT_K)
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(split * per_split, ct.minimum(k_tiles, (split + 1) * per_split)):
        a = ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO)
        if W_NK:
            b = ct.load(W, (k, pid_n), (TK, TN), order=(1, 0), padding_mode=ZERO)
        else:
            b = ct.load(W, (k, pid_n), (TK, TN), padding_mode=ZERO)
        if TF32:
            acc = ct.mma(a.astype(ct.tfloat32), b.astype(ct.tfloat32), acc)
        else:
            acc = tensor_mma(a, b, acc)

    rows = (ct.arange(TM, dtype=ct.int32) + pid_m * TM).reshape((TM, 1))
    cols = (ct.arange(TN, dtype=ct.int32) + pid_n * TN).reshape((1, TN))
    if SPLIT_K > 1:
        ct.store(Partial, (split, pid_m, pid_n), acc.reshape((1, TM, TN)))
        arrived = ct.atomic_add(Counter, tile, 1)       # acq_rel: our partial before it, theirs after
        last = arrived == SPLIT_K - 1
        rows = ct.where(last, rows, M)                   # other programs address no row at all
        acc = ct.zeros((TM, TN), dtype=ct.float32)
        for s in range(SPLIT_K):
            acc = acc + ct.gather(Partial, (s, rows, cols))
        ct.atomic_xchg(Counter, ct.where(last, tile, tiles_m * tiles_n), 0, memory_order=ct.MemoryOrder.RELAXED)

    if HAS_BIAS:
        acc = acc + ct.load(Bias, (pid_n,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
    if GELU:
        acc = gelu_tanh(acc)
    if HAS_RES:
        acc = acc + ct.load(Res, (pid_m, pid_n), (TM, TN), padding_mode=ZERO).astype(ct.float32)
    if SPLIT_K > 1:
        ct.scatter(Y, (rows, cols), acc.astype(Y.dtype))
    else:
        ct.store(Y, (pid_m, pid_n), acc.astype(Y.dtype))


@ct.kernel
def linear_kernel(X, W, Bias, Res, Y, Partial, Counter,
                  TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                  GROUP_M: ct.Constant[int], SPLIT_K: ct.Constant[int], PERSISTENT: ct.Constant[bool],
                  W_NK: ct.Constant[bool], HAS_BIAS: ct.Constant[bool], GELU: ct.Constant[bool],
                  HAS_RES: ct.Constant[bool], TF32: ct.Constant[bool]):
    """Y[M, N] = act(X[M, K] @ W + Bias) + Res; W is [K, N], or [N, K] when W_NK.

    PERSISTENT: a grid of about one program per resident slot walks the output tiles in strides of
    the grid, so one tile's epilogue overlaps the next one's loads. With SPLIT_K > 1 (few rows, as
    in decoding) SPLIT_K programs share each output tile, each summing a slice of K into its own
    fp32 Partial[split]; the last to arrive, counted in Counter[tile] (left at zero for the next
    call), adds the partial sums and runs the epilogue.
    """
    sync_with_previous_kernel()
    if PERSISTENT:
        tiles = ct.cdiv(X.shape[0], TM) * ct.cdiv(Y.shape[1], TN)
        for tile in range(ct.bid(0), tiles, ct.num_blocks(0)):
            output_tile(X, W, Bias, Res, Y, Partial, Counter, tile, 0, TM, TN, TK, GROUP_M, 1, W_NK,
                        HAS_BIAS, GELU, HAS_RES, TF32)
    else:
        output_tile(X, W, Bias, Res, Y, Partial, Counter, ct.bid(0) // SPLIT_K, ct.bid(0) % SPLIT_K, TM, TN, TK,
                    GROUP_M, SPLIT_K, W_NK, HAS_BIAS, GELU, HAS_RES, TF32)


# -- search space and heuristic default ---------------------------------------------------------

def _fits(c: dict, p: dict) -> bool:
    """Prune tiles larger than the problem, register/shared-memory hogs and pointless hints."""
    item = 4 if p["dtype"] == "float32" else 2
    m = pow2_ceil(p["M"])
    few_rows = m <= 64
    tm_min = 64 if m >= 256 else max(16, m // 4)
    tile = c["TM"] * c["TN"]
    eight_warps = c["num_worker_warps"] == 8
    return (tm_min <= c["TM"] <= max(16, m)
            and c["TN"] <= max(32, pow2_ceil(p["N"])) and c["TK"] <= max(32, pow2_ceil(p["K"]))
            and (few_rows or c["TN"] >= 32)
            # thin tiles only pay off for few rows; K steps under 128 bytes only for the two-warpgroup 128x256 tiles
            and (m < 256 or (c["TN"] >= 64 and (c["TK"] * item >= 128 or (tile == 128 * 256 and eight_warps))))
            and (c["TK"] <= 128 or few_rows)      # long K steps cut the serial loop when rows are few
            and (not few_rows or (c["TN"] <= 64 and c["TK"] >= 128 and c["num_ctas"] == 1 and not eight_warps))
            and (c["SPLIT_K"] == 1 or (few_rows and c["SPLIT_K"] <= ct.cdiv(p["K"], c["TK"])))
            and tile <= 128 * 256
            and (c["TM"] + c["TN"]) * c["TK"] * item <= 48 * 1024
            and (c["occupancy"] == 1 or tile <= 128 * 128)
            and (c["num_ctas"] == 1 or (m >= 1024 and c["TM"] >= 128 and not eight_warps))
            # two warpgroups of workers for tiles from 128x128; a one-CTA 128x256 tile spills without them
            and (not eight_warps or tile >= 128 * 128)
            and (tile < 128 * 256 or eight_warps or c["num_ctas"] == 2)
            # persistent grids measured well only with two warpgroups and one program per SM
            and (not c["PERSISTENT"] or (eight_warps and c["occupancy"] == 1 and c["num_ctas"] == 1)))


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128, 256), TN=(16, 32, 64, 128, 256), TK=(32, 64, 128, 256, 512),
                    GROUP_M=(8,), SPLIT_K=(1, 2, 4, 8), PERSISTENT=(0, 1), occupancy=(1, 2), num_ctas=(1, 2),
                    num_worker_warps=(0, 8))


MIN_TILES = 72        # an untuned grid should keep more than half of an H100's or H200's 132 SMs busy
WAVE_TILES = ((128, 128, 64), (128, 64, 64), (64, 64, 64), (64, 32, 128))   # (TM, TN, TK), largest first


def default_config(p: dict) -> dict:
    """The untuned config. From 128 rows: the largest tile that makes at least MIN_TILES output tiles,
    first the two-warpgroup persistent 128x256 grid (from 1024 rows), then WAVE_TILES: the choices the
    tuner made for the shapes where it beat one fixed tile by 1.4-2.4x (shipped databases). Few rows:
    narrow tiles with long K steps. (Untuned GPT-2 shapes at 128 and 1024 rows on an H100: geometric mean
    0.95x of cuBLAS, against 0.70x for the 128x256 grid or one 128x128 tile alone;
    docs/results/linear-default-h100.txt.)"""
    m = pow2_ceil(p["M"])
    plain = dict(GROUP_M=8, SPLIT_K=1, PERSISTENT=0, occupancy=1, num_ctas=1, num_worker_warps=0)
    if p["dtype"] == "float32":
        return _fp32_default(p, m, plain)
    if m >= 128:
        wide = [dict(plain, TM=128, TN=256, TK=32, PERSISTENT=1, num_worker_warps=8)] if m >= 1024 else []
        fitting = wide + [c for tm, tn, tk in WAVE_TILES if _fits(c := dict(plain, TM=tm, TN=tn, TK=tk), p)]
        return next((c for c in fitting if _tiles(p, c) >= MIN_TILES),
                    fitting[-1] if fitting else dict(plain, TM=128, TN=128, TK=64))
    # Few rows: a GEMV in disguise, bound by how fast W streams in; narrow tiles give more programs.
    return dict(TM=max(16, m), TN=32, TK=128, GROUP_M=8, SPLIT_K=1, PERSISTENT=0, occupancy=1, num_ctas=1,
                num_worker_warps=0)


# (TM, TN, TK, worker warps) of the fp32 many-row default, largest first
FP32_TILES = ((128, 128, 32, 8), (64, 64, 64, 0), (64, 64, 32, 0), (32, 32, 32, 0))


def _fp32_default(p: dict, m: int, plain: dict) -> dict:
    """fp32 products run on tensor cores as three tf32 products (tiles.tensor_mma), the operands split in registers
    on the way. From 128 rows: the largest of FP32_TILES the space admits that makes at least MIN_TILES output tiles
    (GPT-2 fp32 prefill on an H100, every linear on one tile: B8 x T512 20.7 ms at 128x128x32 with two warpgroups,
    24.6 at 64x64x64, 46.8 at 32x32x32, against 28.9 eager; B1 x T128 2.3 ms at 64x64x64, 2.0 at 32x32x32, against
    4.4; docs/results/fp32-h100.txt). Few rows: 16 x 32 tiles with K steps of 32, split over K until about two
    programs per SM."""
    if m >= 128:
        admitted = [c for tm, tn, tk, warps in FP32_TILES
                    if _fits(c := dict(plain, TM=tm, TN=tn, TK=tk, num_worker_warps=warps), p)]
        return next((c for c in admitted if _tiles(p, c) >= MIN_TILES),
                    admitted[-1] if admitted else dict(plain, TM=64, TN=64, TK=32))
    tiles, k_tiles = ct.cdiv(p["N"], 32), ct.cdiv(p["K"], 32)
    split = 1
    while split < 8 and 2 * split <= k_tiles and tiles * split < 2 * MIN_TILES:
        split *= 2
    return dict(plain, TM=max(16, m), TN=32, TK=32, SPLIT_K=split)


def _arrays(p: dict) -> dict:
    M, N, K, dt = p["M"], p["N"], p["K"], p["dtype"]
    return {"x": ArraySpec(dt, (M, K)), "w": ArraySpec(dt, (N, K) if p["wt"] == "nk" else (K, N)),
            "bias": ArraySpec(dt, (N,)) if p["bias"] else absent(dt, 1),
            "res": ArraySpec(dt, (M, N)) if p["res"] else absent(dt, 2),
            "y": ArraySpec(dt, (M, N), role="out")}


def _tiles(p: dict, c: dict) -> int:
    return ct.cdiv(p["M"], c["TM"]) * ct.cdiv(p["N"], c["TN"])


def _scratch(p: dict, c: dict) -> dict:
    """Split-K partial sums, and arrival counters zeroed once and left zeroed by every launch."""
    if c["SPLIT_K"] == 1:
        return {"partial": absent("float32", 3), "counter": absent("int32", 1)}
    return {"partial": ArraySpec("float32", (c["SPLIT_K"], p["M"], p["N"]), role="scratch"),
            "counter": ArraySpec("int32", (_tiles(p, c),), role="zeros")}


def _grid(p: dict, c: dict) -> tuple:
    if c["PERSISTENT"]:
        return (min(_tiles(p, c), sm_count() * c["occupancy"]), 1, 1)
    return (_tiles(p, c) * c["SPLIT_K"], 1, 1)


def _dependent(p: dict, c: dict) -> bool:
    """Programmatic dependent launch except for a persistent grid, which gains nothing from starting
    early and, scheduled while the kernel before it drains, may place its programs unevenly for the
    whole kernel (gpt2-xl's B8 x T1024 prefill: 1% faster so, H200, docs/results/prefill-lm-pdl-h200.txt)."""
    return not c["PERSISTENT"]


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], c["GROUP_M"], c["SPLIT_K"], bool(c["PERSISTENT"]), p["wt"] == "nk",
            bool(p["bias"]), p["act"] == "gelu", bool(p["res"]), bool(p["tf32"]))


def _bind(a: list, flags: tuple) -> Binding:
    x, w, bias, res, out = a
    activation, weight_layout, allow_tf32 = flags
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
        arrays.check_bias(bias, x, N)
        views["bias"] = (2, None)
    if res is not None:
        arrays.check_same("x", x, "residual", res)
        if res.shape != out_shape:
            raise ValueError(f"residual must have shape {out_shape}, got {res.shape}")
        arrays.check_contiguous(res, "residual")
        views["res"] = (3, None if len(out_shape) == 2 else (M, N))
    if out is not None:                  # rows may be padded, the padding scratch (see linear())
        arrays.check_out(out, "out", x, out_shape, contiguous=False)
        arrays.check_rows(out, "out")
    problem = dict(dtype=x.dtype, M=M, N=N, K=K, wt="kn" if weight_layout == "in_out" else "nk",
                   bias=int(bias is not None), act=activation or "none", res=int(res is not None),
                   tf32=int(bool(allow_tf32)))
    return Binding(problem=problem, arrays=views, returns=4,
                   output=(4, arrays.allocator(x.kind, x.device, out_shape, x.dtype)))


LINEAR = Op(
    "linear", args=("x", "weight", "bias", "residual", "out"), optional=("bias", "residual", "out"),
    key=dict(dtype=None, M=pow2_bucket, N=None, K=None, wt=None, bias=None, act=None, res=None, tf32=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    launches=(Launch(linear_kernel, _grid, ("x", "w", "bias", "res", "y", "partial", "counter"), _constants,
                     dependent=_dependent),),
    bind=_bind, choices=dict(wt=("kn", "nk"), bias=(0, 1), act=("none", "gelu"), res=(0, 1), tf32=(0, 1)),
    cli_defaults=dict(wt="kn", bias=1, act="none", res=0, tf32=0), borrowable=lends_split_k)


# -- public function ---------------------------------------------------------------------------

def linear(x, weight, bias=None, *, activation: str | None = None, residual=None, out=None,
           weight_layout: str = "in_out", allow_tf32: bool = False):
    """act(x @ W + bias) + residual over the last dimension of x.

    weight is [in, out] (weight_layout='in_out', GPT-2's Conv1D) or [out, in] ('out_in', e.g. the
    tied LM head x @ wte^T). activation: None or 'gelu' (tanh form). fp32 inputs keep fp32 accuracy
    (three tf32 products each, tiles.tensor_mma) unless allow_tf32=True (one). Returns an array of x's
    kind, or writes into `out`, whose rows may be padded (a [..., :N] slice of a buffer of wider rows:
    an odd N's rows then start 16-byte aligned and store faster; configs are tuned on contiguous
    outputs). The padding is scratch: the vector store of a row's last elements may write zeros up to
    the row's next 16-byte boundary.
    """
    return LINEAR((x, weight, bias, residual, out), (activation, weight_layout, allow_tf32))


def linear_reference(x, weight, bias=None, *, activation=None, residual=None,
                     weight_layout: str = "in_out") -> np.ndarray:
    """float64 NumPy linear; weight is [in, out] ('in_out', GPT-2 Conv1D) or [out, in] ('out_in')."""
    x = np.asarray(x, np.float64)
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
    from tilekit.kernels.linear import linear, linear_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for M, N, K, dtype, layout, act in [(300, 200, 136, "bfloat16", "in_out", "gelu"), (1, 1600, 6400, "bfloat16",
                                        "in_out", None), (5, 1031, 72, "float32", "out_in", None)]:
        x, b, r = rand((M, K), dtype), rand((N,), dtype), rand((M, N), dtype)
        w = rand((K, N) if layout == "in_out" else (N, K), dtype, 1 / math.sqrt(K))
        y = linear(x, w, b, activation=act, residual=r, weight_layout=layout, out=poisoned((M, N), dtype))
        ref = linear_reference(host(x), host(w), host(b), activation=act, residual=host(r), weight_layout=layout)
        err = assert_close(host(y), ref, TOL[dtype], f"linear {M}x{N}x{K} {dtype}")
        print(f"linear M{M} N{N} K{K} {dtype} {layout} {act}: ok, relative error {err:.2e}")
