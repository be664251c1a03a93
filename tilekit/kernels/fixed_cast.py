"""A fixed-point residual stream (int64, tiles.py) as floats of the model's dtype.

DeepSeek-V2 keeps its residual stream in fixed point (the MoE down projection adds into it); its norms read the
stream as it lies (rms_norm and layer_norm take fixed point), and this op hands the last layer's stream on as
floats (the model's hidden states).
"""

from __future__ import annotations

import cuda.tile as ct

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import FIXED_DTYPE, from_fixed, sync_with_previous_kernel


@ct.kernel
def fixed_cast_kernel(X, Y, TM: ct.Constant[int], TN: ct.Constant[int]):
    """Y[M, N] = X[M, N] / 2**32 in Y's dtype, tile (bid(0), bid(1))."""
    sync_with_previous_kernel()
    tile = ct.load(X, (ct.bid(0), ct.bid(1)), (TM, TN), padding_mode=ct.PaddingMode.ZERO)
    ct.store(Y, (ct.bid(0), ct.bid(1)), from_fixed(tile).astype(Y.dtype))


def _fits(c: dict, p: dict) -> bool:
    return c["TM"] <= max(1, pow2_ceil(p["M"])) and c["TN"] <= max(256, pow2_ceil(p["N"])) \
        and c["TM"] * c["TN"] <= 8192


SPACE = SearchSpace(_fits, TM=(1, 2, 4, 8, 16), TN=(256, 512, 1024, 2048), occupancy=(2, 4))


def default_config(p: dict) -> dict:
    return dict(TM=min(4, pow2_ceil(p["M"])), TN=min(1024, max(256, pow2_ceil(p["N"]))), occupancy=4)


def _arrays(p: dict) -> dict:
    M, N = p["M"], p["N"]
    return {"x": ArraySpec(FIXED_DTYPE, (M, N), high=1 << 33), "y": ArraySpec(p["dtype"], (M, N), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), ct.cdiv(p["N"], c["TN"]), 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"])


def _bind(a: list, flags: tuple) -> Binding:
    x, out = a
    arrays.check_dtype(x, "x", (FIXED_DTYPE,))
    arrays.check_dtype(out, "out", arrays.FLOAT_DTYPES)
    if len(x.shape) != 2:
        raise ValueError(f"x must be a 2-D (rows, width) fixed-point array, got shape {x.shape}")
    arrays.check_contiguous(x, "x")
    arrays.check_out(out, "out", x, x.shape, out.dtype)
    return Binding(problem=dict(dtype=out.dtype, M=x.shape[0], N=x.shape[1]), arrays={"x": (0, None), "y": (1, None)},
                   returns=1)


FIXED_CAST = Op(
    "fixed_cast", args=("x", "out"), key=dict(dtype=None, M=pow2_bucket, N=None), space=SPACE,
    default=default_config, arrays=_arrays, launches=(Launch(fixed_cast_kernel, _grid, ("x", "y"), _constants),),
    bind=_bind)


def fixed_cast(x, out):
    """out = x, a fixed-point (int64, 2**32 = 1.0) (M, N) array, as floats of out's dtype; returns out."""
    return FIXED_CAST((x, out))


if __name__ == "__main__":
    from tilekit.kernels.fixed_cast import fixed_cast  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned
    from tilekit.kernels.tiles import fixed_to_float
    for M, N, dtype in [(1, 2048, "bfloat16"), (300, 77, "float32")]:
        x = cupy.random.default_rng().integers(-1 << 34, 1 << 34, (M, N), dtype=cupy.int64)
        y = fixed_cast(x, poisoned((M, N), dtype))
        assert_close(host(y), fixed_to_float(host(x)), TOL[dtype], f"fixed_cast {(M, N, dtype)}")
    print("fixed_cast: ok")
