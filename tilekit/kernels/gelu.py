"""GELU: GPT-2's tanh approximation ("gelu_new") and the exact erf form, elementwise on any shape."""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import gelu_tanh, sync_with_previous_kernel

@ct.function
def gelu_erf(x):
    """0.5 x (1 + erf(x / sqrt 2)) on an fp32 tile; erf from a Chebyshev-fitted erfc (|err| < 1.2e-7)."""
    z = ct.abs(x) * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    erfc = t * ct.exp(poly)   # erfc(|x| / sqrt 2); 1 + erf(x / sqrt 2) is 2 - erfc or erfc
    return 0.5 * x * ct.where(x >= 0.0, 2.0 - erfc, erfc)


@ct.kernel
def gelu_kernel(X, Y, BLOCK: ct.Constant[int], EXACT: ct.Constant[bool]):
    """Y = gelu(X) over flat arrays, one BLOCK-sized tile per program."""
    sync_with_previous_kernel()
    pid = ct.bid(0)
    x = ct.load(X, (pid,), (BLOCK,), padding_mode=ct.PaddingMode.ZERO).astype(ct.float32)
    if EXACT:
        y = gelu_erf(x)
    else:
        y = gelu_tanh(x)
    ct.store(Y, (pid,), y.astype(Y.dtype))


def _fits(c: dict, p: dict) -> bool:
    return c["BLOCK"] <= max(256, pow2_ceil(p["n"]))


SPACE = SearchSpace(_fits, BLOCK=(256, 512, 1024, 2048, 4096, 8192), occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    return dict(BLOCK=min(1024, max(256, pow2_ceil(p["n"]))), occupancy=2)


def _arrays(p: dict) -> dict:
    return {"x": ArraySpec(p["dtype"], (p["n"],)), "y": ArraySpec(p["dtype"], (p["n"],), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["n"], c["BLOCK"]), 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["BLOCK"], bool(p["exact"]))


def _bind(a: list, flags: tuple) -> Binding:
    x, out = a
    (approximate,) = flags
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    arrays.check_contiguous(x, "x")
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    if out is not None:
        arrays.check_out(out, "out", x, x.shape)
    n = math.prod(x.shape)
    flat = None if len(x.shape) == 1 else (n,)
    return Binding(problem=dict(dtype=x.dtype, n=n, exact=int(approximate == "none")),
                   arrays={"x": (0, flat), "y": (1, flat)},
                   output=(1, arrays.allocator(x.kind, x.device, x.shape, x.dtype)), returns=1)


GELU = Op("gelu", args=("x", "out"), optional=("out",), key=dict(dtype=None, n=pow2_bucket, exact=None),
          space=SPACE, default=default_config, arrays=_arrays,
          launches=(Launch(gelu_kernel, _grid, ("x", "y"), _constants),), bind=_bind,
          choices=dict(exact=(0, 1)), cli_defaults=dict(exact=0))


def gelu(x, *, approximate: str = "tanh", out=None):
    """Elementwise GELU of a contiguous array; approximate='tanh' (GPT-2) or 'none' (erf)."""
    return GELU((x, out), (approximate,))


def gelu_reference(x, approximate: str = "tanh") -> np.ndarray:
    """float64 NumPy GELU; approximate='tanh' is GPT-2's gelu_new, 'none' the erf form."""
    x = np.asarray(x, np.float64)
    if approximate == "tanh":   # 0.5 (1 + tanh u) == 1 / (1 + exp(-2u)), free of cancellation in the tails
        u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
        with np.errstate(over="ignore"):
            return x / (1.0 + np.exp(-2.0 * u))
    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    return 0.5 * x * erfc(-x / math.sqrt(2.0))


if __name__ == "__main__":
    from tilekit.kernels.gelu import gelu, gelu_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand, rounded
    for shape, dtype, approximate in [((1000, 333), "bfloat16", "tanh"), ((4096,), "float32", "none"),
                                      ((7, 3), "float16", "tanh")]:
        x = rand(shape, dtype, 3.0)
        y = gelu(x, approximate=approximate, out=poisoned(shape, dtype))
        ref = rounded(gelu_reference(host(x), approximate), dtype)
        err = assert_close(host(y), ref, TOL[dtype], f"{shape} {dtype} {approximate}")
        print(f"gelu {shape} {dtype} {approximate}: ok, relative error {err:.2e}")
