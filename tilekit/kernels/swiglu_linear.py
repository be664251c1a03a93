"""SwiGLU projection: silu(x @ Wg^T) * (x @ Wu^T) in one kernel (Llama's MLP before its down projection).

Each program computes the same output tile of the gate and the up projection with two fp32
accumulators over one shared stream of x tiles, and writes only their SwiGLU product: the
[M, 2I] intermediate of an unfused gate_up projection never reaches memory. Weights are
nn.Linear's [out, in], read in place through transposed tile loads.
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
from tilekit.kernels.tiles import grouped_tile, sync_with_previous_kernel, tensor_mma

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def swiglu_linear_kernel(X, Wg, Wu, Y, TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                         GROUP_M: ct.Constant[int]):
    """Y[M, I] = silu(X[M, K] @ Wg^T) * (X @ Wu^T), with Wg and Wu [I, K]."""
    M = X.shape[0]
    K = X.shape[1]
    N = Y.shape[1]
    pid_m, pid_n = grouped_tile(ct.bid(0), ct.cdiv(M, TM), ct.cdiv(N, TN), GROUP_M)
    sync_with_previous_kernel()
    gate = ct.zeros((TM, TN), dtype=ct.float32)
    up = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(ct.cdiv(K, TK)):
        a = ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO)
        gate = tensor_mma(a, ct.load(Wg, (k, pid_n), (TK, TN), order=(1, 0), padding_mode=ZERO), gate)
        up = tensor_mma(a, ct.load(Wu, (k, pid_n), (TK, TN), order=(1, 0), padding_mode=ZERO), up)
    ct.store(Y, (pid_m, pid_n), (gate / (1.0 + ct.exp(-gate)) * up).astype(Y.dtype))


def _fits(c: dict, p: dict) -> bool:
    """Two accumulators: half the tile area of linear's; thin tiles only for few rows."""
    m = pow2_ceil(p["M"])
    few_rows = m <= 64
    item = 4 if p["dtype"] == "float32" else 2
    return (max(16, m // 4) <= c["TM"] <= max(16, m) if few_rows else c["TM"] >= 64) and (
        c["TN"] <= max(32, pow2_ceil(p["N"])) and c["TK"] <= max(32, pow2_ceil(p["K"]))
        and (few_rows or (c["TN"] >= 64 and c["TK"] <= 128))
        and c["TM"] * c["TN"] <= 128 * 128
        and (c["TM"] + 2 * c["TN"]) * c["TK"] * item <= 48 * 1024
        and (c["occupancy"] == 1 or c["TM"] * c["TN"] <= 64 * 128)
        # two warpgroups of workers for the larger many-row tiles (as linear's 128x256)
        and (c["num_worker_warps"] == 0 or (not few_rows and c["TM"] * c["TN"] >= 64 * 128)))


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TN=(32, 64, 128), TK=(32, 64, 128, 256), GROUP_M=(8,),
                    occupancy=(1, 2), num_worker_warps=(0, 8))


def default_config(p: dict) -> dict:
    """fp32 products run on FMA units with the tiles in registers (see linear's fp32 default): K steps of 32,
    64 x 32 tiles for many rows (0.2 KB of spills a thread against 7.7 KB at 128x64x64), 16 x 32 for few (none,
    against 1 KB at 16x32x128; sm_90, docs/results/fp32-tiles-sm90.txt)."""
    if p["dtype"] == "float32":
        return dict(TM=64 if pow2_ceil(p["M"]) >= 128 else max(16, pow2_ceil(p["M"])), TN=32, TK=32, GROUP_M=8,
                    occupancy=1, num_worker_warps=0)
    if pow2_ceil(p["M"]) >= 128:
        return dict(TM=128, TN=64, TK=64, GROUP_M=8, occupancy=1, num_worker_warps=0)
    return dict(TM=max(16, pow2_ceil(p["M"])), TN=32, TK=128, GROUP_M=8, occupancy=1, num_worker_warps=0)


def _arrays(p: dict) -> dict:
    M, N, K, dt = p["M"], p["N"], p["K"], p["dtype"]
    return {"x": ArraySpec(dt, (M, K)), "wg": ArraySpec(dt, (N, K)), "wu": ArraySpec(dt, (N, K)),
            "y": ArraySpec(dt, (M, N), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]) * ct.cdiv(p["N"], c["TN"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], c["GROUP_M"])


def _bind(a: list, flags: tuple) -> Binding:
    x, wg, wu, out = a
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "gate_weight", wg)
    arrays.check_same("x", x, "up_weight", wu)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    K = x.shape[-1]
    if len(wg.shape) != 2 or wg.shape[1] != K:
        raise ValueError(f"gate_weight must be [out, in] = [I, {K}], got shape {wg.shape}")
    if wu.shape != wg.shape:
        raise ValueError(f"up_weight shape {wu.shape} must equal gate_weight shape {wg.shape}")
    for name, v in (("x", x), ("gate_weight", wg), ("up_weight", wu)):
        arrays.check_last_contiguous(v, name)
    M, N = math.prod(x.shape[:-1]), wg.shape[0]
    out_shape = x.shape[:-1] + (N,)
    if out is not None:
        arrays.check_out(out, "out", x, out_shape)
    return Binding(problem=dict(dtype=x.dtype, M=M, N=N, K=K),
                   arrays={"x": (0, None if len(x.shape) == 2 else (M, K)), "wg": (1, None), "wu": (2, None),
                           "y": (3, None if len(out_shape) == 2 else (M, N))},
                   output=(3, arrays.allocator(x.kind, x.device, out_shape, x.dtype)), returns=3)


SWIGLU_LINEAR = Op(
    "swiglu_linear", args=("x", "gate_weight", "up_weight", "out"), optional=("out",),
    key=dict(dtype=None, M=pow2_bucket, N=None, K=None), space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(swiglu_linear_kernel, _grid, ("x", "wg", "wu", "y"), _constants),), bind=_bind)


def swiglu_linear(x, gate_weight, up_weight, *, out=None):
    """silu(x @ gate_weight^T) * (x @ up_weight^T) over the last dimension of x.

    gate_weight and up_weight are nn.Linear weights [I, in] (e.g. Llama's mlp.gate_proj and
    mlp.up_proj). Returns (..., I) of x's kind, or writes into `out`.
    """
    return SWIGLU_LINEAR((x, gate_weight, up_weight, out))


def swiglu_reference(gate, up) -> np.ndarray:
    """float64 silu(gate) * up."""
    gate = np.asarray(gate, np.float64)
    return gate * 0.5 * (1 + np.tanh(gate / 2)) * np.asarray(up, np.float64)  # sigmoid via tanh: no overflow


def swiglu_linear_reference(x, gate_weight, up_weight) -> np.ndarray:
    """float64 silu(x @ Wg^T) * (x @ Wu^T)."""
    x = np.asarray(x, np.float64)
    return swiglu_reference(x @ np.asarray(gate_weight, np.float64).T, x @ np.asarray(up_weight, np.float64).T)


if __name__ == "__main__":
    from tilekit.kernels.swiglu_linear import swiglu_linear, swiglu_linear_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for M, N, K, dtype in [(300, 200, 136, "bfloat16"), (1, 2816, 1024, "bfloat16"), (5, 77, 72, "float32")]:
        x = rand((M, K), dtype)
        wg, wu = rand((N, K), dtype, 1 / math.sqrt(K)), rand((N, K), dtype, 1 / math.sqrt(K))
        y = swiglu_linear(x, wg, wu, out=poisoned((M, N), dtype))
        err = assert_close(host(y), swiglu_linear_reference(host(x), host(wg), host(wu)), TOL[dtype],
                           f"swiglu_linear {M}x{N}x{K} {dtype}")
        print(f"swiglu_linear M{M} N{N} K{K} {dtype}: ok, relative error {err:.2e}")
