"""GPT-2's MLP in one kernel for few rows: residual += gelu(h @ W_fc + b_fc) @ W_proj + b_proj.

Program j computes TF hidden columns of its rows (the fc slice, GELU applied and rounded to the
model's dtype as the two-kernel path stores it), then multiplies them by the matching TF rows of
W_proj and adds that share of the projection to every output column of the fixed-point residual
with integer atomics (fixed_point.py). The hidden activations never leave the program, and both
weight matrices stream through all programs at once: for gpt2-xl 100 programs each read 205 KB of
W_fc and 205 KB of W_proj. The atomics grow with the rows, so this pays for a single row (a
batch-1 decode step) and loses to the two-kernel path by eight rows
(docs/results/fused-decode-h100.txt).
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
from tilekit.kernels.dependent_launch import sync_with_previous_kernel
from tilekit.kernels.fixed_point import FIXED_DTYPE, add_fixed
from tilekit.kernels.gelu import gelu_reference, gelu_tanh

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def residual_mlp_kernel(H, Wfc, Bfc, Wproj, Bproj, Acc, TM: ct.Constant[int], TF: ct.Constant[int],
                        TK: ct.Constant[int], TN: ct.Constant[int]):
    """Acc[M, C] += gelu(H[M, C] @ Wfc[C, F] + Bfc) @ Wproj[F, C] + Bproj, Acc in fixed point; program
    bid(0) = row tile * (F / TF) + j owns hidden columns j*TF.. (program j = 0 adds Bproj)."""
    sync_with_previous_kernel()
    tiles_f = ct.cdiv(Wfc.shape[1], TF)
    pid_m = ct.bid(0) // tiles_f
    j = ct.bid(0) % tiles_f
    hidden = ct.zeros((TM, TF), dtype=ct.float32)
    for k in range(ct.cdiv(H.shape[1], TK)):
        a = ct.load(H, (pid_m, k), (TM, TK), padding_mode=ZERO)
        b = ct.load(Wfc, (k, j), (TK, TF), padding_mode=ZERO)
        hidden = ct.mma(a, b, hidden)
    hidden = hidden + ct.load(Bfc, (j,), (TF,), padding_mode=ZERO).astype(ct.float32).reshape((1, TF))
    f = gelu_tanh(hidden).astype(H.dtype)          # zero in padded hidden columns: gelu(0 + 0)
    rows = (ct.arange(TM, dtype=ct.int32) + pid_m * TM).reshape((TM, 1))
    first = ct.where(j == 0, 1.0, 0.0)
    for n in range(ct.cdiv(Acc.shape[1], TN)):
        w = ct.load(Wproj, (j, n), (TF, TN), padding_mode=ZERO)
        out = ct.mma(f, w, ct.zeros((TM, TN), dtype=ct.float32))
        out = out + first * ct.load(Bproj, (n,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
        cols = (ct.arange(TN, dtype=ct.int32) + n * TN).reshape((1, TN))
        add_fixed(Acc, rows, cols, out)


# -- search space and heuristic default ---------------------------------------------------------

def _row_tile(p: dict) -> int:
    return min(64, max(16, pow2_ceil(p["M"])))


def _fits(c: dict, p: dict) -> bool:
    item = 4 if p["dtype"] == "float32" else 2
    width = pow2_ceil(p["C"])
    return (c["TM"] == _row_tile(p) and c["TF"] <= max(32, pow2_ceil(p["F"]))
            and c["TK"] <= max(64, width) and c["TN"] <= max(64, width)
            and (c["TM"] + c["TF"]) * c["TK"] * item <= 48 * 1024 and c["TF"] * c["TN"] * item <= 64 * 1024)


SPACE = SearchSpace(_fits, TM=(16, 32, 64), TF=(32, 64, 128), TK=(64, 128, 256), TN=(64, 128, 256),
                    occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """The H100 prototype's winner for gpt2-xl at one row (docs/results/fused-decode-h100.txt)."""
    width = max(64, pow2_ceil(p["C"]))
    return dict(TM=_row_tile(p), TF=min(64, max(32, pow2_ceil(p["F"]))), TK=min(64, width), TN=min(256, width),
                occupancy=1)


def _arrays(p: dict) -> dict:
    M, C, F, dt = p["M"], p["C"], p["F"], p["dtype"]
    return {"h": ArraySpec(dt, (M, C)), "w_fc": ArraySpec(dt, (C, F)), "b_fc": ArraySpec(dt, (F,)),
            "w_proj": ArraySpec(dt, (F, C)), "b_proj": ArraySpec(dt, (C,)),
            "residual": ArraySpec(FIXED_DTYPE, (M, C), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]) * ct.cdiv(p["F"], c["TF"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TF"], c["TK"], c["TN"])


def _bind(a: list, flags: tuple) -> Binding:
    residual, h, w_fc, b_fc, w_proj, b_proj = a
    arrays.check_dtype(residual, "residual", (FIXED_DTYPE,))
    arrays.check_dtype(h, "h", arrays.FLOAT_DTYPES)
    arrays.check_same("h", h, "residual", residual, dtype=False)
    for name, v in (("fc_weight", w_fc), ("fc_bias", b_fc), ("proj_weight", w_proj), ("proj_bias", b_proj)):
        arrays.check_same("h", h, name, v)
    if len(h.shape) < 1 or h.shape[-1] == 0:
        raise ValueError(f"h must have a non-empty last dimension, got shape {h.shape}")
    C = h.shape[-1]
    if len(w_fc.shape) != 2 or w_fc.shape[0] != C:
        raise ValueError(f"fc_weight must be [in, out] = ({C}, F), got shape {w_fc.shape}")
    F = w_fc.shape[1]
    expected = {"fc_bias": (F,), "proj_weight": (F, C), "proj_bias": (C,), "residual": h.shape}
    for name, v in (("fc_bias", b_fc), ("proj_weight", w_proj), ("proj_bias", b_proj), ("residual", residual)):
        if v.shape != expected[name]:
            raise ValueError(f"{name} must have shape {expected[name]}, got {v.shape}")
    for name, v in (("residual", residual), ("h", h), ("fc_weight", w_fc), ("fc_bias", b_fc),
                    ("proj_weight", w_proj), ("proj_bias", b_proj)):
        arrays.check_contiguous(v, name)
    M = math.prod(h.shape[:-1])
    flat = None if len(h.shape) == 2 else (M, C)
    views = {"residual": (0, flat), "h": (1, flat), "w_fc": (2, None), "b_fc": (3, None), "w_proj": (4, None),
             "b_proj": (5, None)}
    return Binding(problem=dict(dtype=h.dtype, M=M, C=C, F=F), arrays=views, returns=0)


RESIDUAL_MLP = Op(
    "residual_mlp", args=("residual", "h", "fc_weight", "fc_bias", "proj_weight", "proj_bias"),
    key=dict(dtype=None, M=pow2_bucket, C=None, F=None), space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(residual_mlp_kernel, _grid, ("h", "w_fc", "b_fc", "w_proj", "b_proj", "residual"),
                     _constants),),
    bind=_bind)


# -- public function ---------------------------------------------------------------------------

def residual_mlp(residual, h, fc_weight, fc_bias, proj_weight, proj_bias):
    """residual += gelu_tanh(h @ fc_weight + fc_bias) @ proj_weight + proj_bias in place; returns residual.

    residual is a fixed-point (int64) array of h's shape (fixed_point.py); weights are [in, out]
    (GPT-2's Conv1D layout); the hidden activations are rounded to h's dtype before the projection.
    """
    return RESIDUAL_MLP((residual, h, fc_weight, fc_bias, proj_weight, proj_bias))


def residual_mlp_reference(residual, h, fc_weight, fc_bias, proj_weight, proj_bias) -> np.ndarray:
    """float64 NumPy residual + gelu_tanh(h @ fc_weight + fc_bias) @ proj_weight + proj_bias."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    hidden = gelu_reference(f64(h) @ f64(fc_weight) + f64(fc_bias), "tanh")
    return f64(residual) + hidden @ f64(proj_weight) + f64(proj_bias)


if __name__ == "__main__":
    from tilekit.kernels.residual_mlp import residual_mlp, residual_mlp_reference  # the package's op
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, rand
    from tilekit.kernels.fixed_point import fixed_to_float, float_to_fixed
    for M, C, dtype in [(1, 1600, "bfloat16"), (3, 200, "float32"), (2, 768, "float16")]:
        start = float_to_fixed(host(rand((M, C), "float32")))
        residual = cupy.asarray(start)
        h, w_fc, b_fc = rand((M, C), dtype), rand((C, 4 * C), dtype, C ** -0.5), rand((4 * C,), dtype)
        w_proj, b_proj = rand((4 * C, C), dtype, (4 * C) ** -0.5), rand((C,), dtype)
        residual_mlp(residual, h, w_fc, b_fc, w_proj, b_proj)
        added = fixed_to_float(cupy.asnumpy(residual)) - fixed_to_float(start)     # exact in float64
        ref = residual_mlp_reference(0.0, host(h), host(w_fc), host(b_fc), host(w_proj), host(b_proj))
        err = assert_close(added, ref, TOL[dtype], f"residual_mlp {M}x{C} {dtype}")
        print(f"residual_mlp M{M} C{C} {dtype}: ok, relative error {err:.2e}")
