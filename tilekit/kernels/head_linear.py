"""Per-head projection: y[m, h] = x[m, h] @ W[h] for H heads, each with its own weight (a head-batched GEMM).

DeepSeek-V2's absorbed decode (MLA) runs two: the query heads up-projected through W_UK into the latent space
(W[h] [K, N], "kn"), and the latent outputs through W_UV (W[h] [N, K], "nk", nn.Linear's layout). Both weights
are strided views of kv_b_proj, read in place. A program computes one (rows, columns) tile of one head.
"""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
LAYOUTS = ("kn", "nk")


@ct.kernel
def head_linear_kernel(X, W, Y, TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                       W_NK: ct.Constant[bool]):
    """Y[M, H, N] = X[M, H, K] @ W[h] per head h = bid(2); W [H, K, N], or [H, N, K] read transposed (W_NK)."""
    pid_m, pid_n, h = ct.bid(0), ct.bid(1), ct.bid(2)
    sync_with_previous_kernel()
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    for k in range(ct.cdiv(X.shape[2], TK)):
        a = ct.load(X, (pid_m, h, k), (TM, 1, TK), padding_mode=ZERO).reshape((TM, TK))
        if W_NK:
            w = ct.load(W, (h, k, pid_n), (1, TK, TN), order=(0, 2, 1), padding_mode=ZERO)
        else:
            w = ct.load(W, (h, k, pid_n), (1, TK, TN), padding_mode=ZERO)
        acc = ct.mma(a, w.reshape((TK, TN)), acc)
    ct.store(Y, (pid_m, h, pid_n), acc.reshape((TM, 1, TN)).astype(Y.dtype))


def _fits(c: dict, p: dict) -> bool:
    item = 4 if p["dtype"] == "float32" else 2
    return (c["TM"] <= max(16, pow2_ceil(p["M"])) and c["TN"] <= max(32, pow2_ceil(p["N"]))
            and c["TK"] <= max(32, pow2_ceil(p["K"])) and c["TM"] * c["TN"] <= 128 * 128
            and (c["TM"] + c["TN"]) * c["TK"] * item <= 64 * 1024)


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TN=(32, 64, 128, 256), TK=(32, 64, 128), occupancy=(1, 2))


def default_config(p: dict) -> dict:
    return dict(TM=min(64, max(16, pow2_ceil(p["M"]))), TN=min(128, max(32, pow2_ceil(p["N"]))),
                TK=min(64, max(32, pow2_ceil(p["K"]))), occupancy=2 if p["M"] <= 64 else 1)


def _arrays(p: dict) -> dict:
    M, H, N, K, dt = p["M"], p["H"], p["N"], p["K"], p["dtype"]
    return {"x": ArraySpec(dt, (M, H, K)), "w": ArraySpec(dt, (H, N, K) if p["wt"] == "nk" else (H, K, N)),
            "y": ArraySpec(dt, (M, H, N), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), ct.cdiv(p["N"], c["TN"]), p["H"])


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], p["wt"] == "nk")


def _bind(a: list, flags: tuple) -> Binding:
    x, w, out = a
    (layout,) = flags
    if layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {LAYOUTS}, got {layout!r}")
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "weight", w)
    if len(x.shape) != 3 or 0 in x.shape:
        raise ValueError(f"x must be a non-empty 3-D (rows, heads, in) array, got shape {x.shape}")
    M, H, K = x.shape
    if len(w.shape) != 3 or w.shape[0] != H or w.shape[2 if layout == "nk" else 1] != K:
        want = f"[{H}, out, {K}]" if layout == "nk" else f"[{H}, {K}, out]"
        raise ValueError(f"weight must be {want} (weight_layout {layout!r}), got shape {w.shape}")
    N = w.shape[1 if layout == "nk" else 2]
    for name, v in (("x", x), ("weight", w)):
        arrays.check_last_contiguous(v, name)
    arrays.check_out(out, "out", x, (M, H, N), contiguous=False)
    arrays.check_last_contiguous(out, "out")
    return Binding(problem=dict(dtype=x.dtype, M=M, H=H, N=N, K=K, wt=layout),
                   arrays={"x": (0, None), "w": (1, None), "y": (2, None)}, returns=2)


HEAD_LINEAR = Op(
    "head_linear", args=("x", "weight", "out"),
    key=dict(dtype=None, M=pow2_bucket, H=None, N=None, K=None, wt=None), space=SPACE, default=default_config,
    arrays=_arrays, launches=(Launch(head_linear_kernel, _grid, ("x", "w", "y"), _constants),), bind=_bind,
    choices=dict(wt=LAYOUTS))


def head_linear(x, weight, *, out, weight_layout: str = "kn"):
    """out[m, h] = x[m, h] @ weight[h] for x (M, H, K): weight [H, K, N] ("kn") or [H, N, K] ("nk", x @ W[h]^T).
    Any strides with a contiguous last dimension (views of larger buffers); writes and returns out (M, H, N)."""
    return HEAD_LINEAR((x, weight, out), (weight_layout,))


def head_linear_reference(x, weight, weight_layout: str = "kn") -> np.ndarray:
    """float64 per-head x[:, h] @ W[h] (or W[h]^T for "nk")."""
    w = np.asarray(weight, np.float64)
    return np.einsum("mhk,hkn->mhn", np.asarray(x, np.float64), w.transpose(0, 2, 1) if weight_layout == "nk" else w)


if __name__ == "__main__":
    from tilekit.kernels.head_linear import head_linear, head_linear_reference  # the package's op, not this copy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for M, H, N, K, layout, dtype in [(1, 16, 512, 128, "kn", "bfloat16"), (8, 16, 128, 512, "nk", "bfloat16"),
                                      (5, 3, 40, 24, "nk", "float32")]:
        x = rand((M, H, K), dtype)
        w = rand((H, N, K) if layout == "nk" else (H, K, N), dtype, K ** -0.5)
        y = head_linear(x, w, out=poisoned((M, H, N), dtype), weight_layout=layout)
        assert_close(host(y), head_linear_reference(host(x), host(w), layout), TOL[dtype], f"head_linear {layout}")
    print("head_linear: ok")
