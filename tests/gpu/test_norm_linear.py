"""norm_linear (LayerNorm folded into a linear's prologue) against its float64 reference on the GPU: float and
fixed-point x, decode-sized and odd shapes, every sampled config of its space, and validation that names the
argument before anything launches."""

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from tests.gpu.conftest import TOL, assert_close, host, poisoned, rand

cupy = pytest.importorskip("cupy")

from tilekit.autotune.arrays import MetaArray  # noqa: E402
from tilekit.autotune.compile import precompile  # noqa: E402
from tilekit.device import device_info  # noqa: E402
from tilekit.kernels import norm_linear  # noqa: E402
from tilekit.kernels.fixed_point import fixed_to_float, float_to_fixed  # noqa: E402
from tilekit.kernels.norm_linear import NORM_LINEAR, norm_linear_reference  # noqa: E402

GPU = settings(max_examples=10, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_norm_linear(shape, N, dtype, act=None, bias=True, fixed=False, eps=1e-5):
    """x of `shape` (rows with a nonzero mean), [K, N] weights; x in fixed point when `fixed`."""
    K = shape[-1]
    x = rand(shape, "float32" if fixed else dtype, 2.0, 0.3)
    if fixed:
        x = cupy.asarray(float_to_fixed(host(x)))
    values = fixed_to_float(cupy.asnumpy(x)) if fixed else host(x)
    g, beta = rand((K,), dtype, 0.2, 1.0), rand((K,), dtype, 0.5)
    w = rand((K, N), dtype, 1 / math.sqrt(K))
    b = rand((N,), dtype) if bias else None
    out = poisoned(shape[:-1] + (N,), dtype)
    y = norm_linear(x, g, beta, w, b, eps, activation=act, out=out)
    assert y is out
    ref = norm_linear_reference(values, host(g), host(beta), host(w), None if b is None else host(b), eps, act)
    assert_close(host(y), ref, TOL[dtype], f"norm_linear {(shape, N, dtype, act, bias, fixed, eps)}")


@GPU
@given(M=st.sampled_from([1, 3, 8, 16, 37]), KN=st.sampled_from([(768, 2304), (72, 1031), (136, 200)]),
       dtype=DTYPES, act=st.sampled_from([None, "gelu"]), bias=st.booleans())
def test_norm_linear_matches_reference(M, KN, dtype, act, bias):
    check_norm_linear((M, KN[0]), KN[1], dtype, act, bias)


@GPU
@given(M=st.sampled_from([1, 3, 8, 16, 37]), KN=st.sampled_from([(768, 2304), (72, 1031), (1600, 4800)]),
       dtype=DTYPES, act=st.sampled_from([None, "gelu"]))
def test_norm_linear_of_a_fixed_point_residual(M, KN, dtype, act):
    check_norm_linear((M, KN[0]), KN[1], dtype, act, fixed=True)


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("M", [1, 8])
def test_gpt2_decode_shapes(M, fixed):
    """gpt2's LN -> QKV and gpt2-xl's LN -> MLP fc (GELU) in bfloat16, as a decode step calls them."""
    check_norm_linear((M, 768), 2304, "bfloat16", fixed=fixed)
    check_norm_linear((M, 1600), 6400, "bfloat16", "gelu", fixed=fixed)


def test_norm_linear_many_rows_and_leading_dimensions():
    """More rows than one tile holds (each row tile takes its own statistics), and a (B, T, K) x."""
    check_norm_linear((300, 72), 1031, "float32")
    check_norm_linear((3, 7, 768), 200, "bfloat16", "gelu", fixed=True)


def test_norm_linear_eps():
    """eps is a runtime scalar: a large one changes the result, one kernel serves both."""
    check_norm_linear((5, 768), 256, "float32", eps=0.5)
    check_norm_linear((5, 768), 256, "float32", eps=1e-6)


def test_norm_linear_of_no_rows():
    out = norm_linear(rand((0, 64), "bfloat16"), rand((64,), "bfloat16"), rand((64,), "bfloat16"),
                      rand((64, 32), "bfloat16"))
    assert out.shape == (0, 32)


# -- every sampled config of the space is correct ---------------------------------------------

SPACE_CASES = [dict(dtype="bfloat16", M=3, N=1000, K=1600, bias=1, act="gelu", fixed=1),
               dict(dtype="float32", M=37, N=200, K=136, bias=1, act="none", fixed=0)]


def sampled_configs(p, k=5):
    candidates = NORM_LINEAR.space.candidates(NORM_LINEAR.tuning_problem(p))
    picks = random.Random(0).sample(candidates, min(k, len(candidates)))
    default = NORM_LINEAR.default(NORM_LINEAR.tuning_problem(p))
    return [default] + [c for c in picks if c != default]


@pytest.fixture(scope="module")
def precompiled_space_samples():
    """Fill cuTile's disk cache for the sampled configs in parallel before running them."""
    tasks = [(NORM_LINEAR, NORM_LINEAR.tuning_problem(p), c) for p in SPACE_CASES for c in sampled_configs(p)]
    precompile(tasks, device_info().arch)


@pytest.mark.parametrize("case", range(len(SPACE_CASES)))
def test_sampled_configs_are_correct(case, precompiled_space_samples):
    p = SPACE_CASES[case]
    for config in sampled_configs(p):
        with NORM_LINEAR.pinned(config):
            check_norm_linear((p["M"], p["K"]), p["N"], p["dtype"], p["act"], bool(p["bias"]), bool(p["fixed"]))


# -- validation ---------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    """Each error names its argument, raised while validating (MetaArrays: nothing could launch)."""
    def meta(shape, dtype="bfloat16"):
        return MetaArray(shape, dtype)

    x, g, beta, w, b = meta((2, 64)), meta((64,)), meta((64,)), meta((64, 32)), meta((32,))
    fixed = meta((2, 64), "int64")
    y = norm_linear(fixed, g, beta, w, b, activation="gelu")
    assert (y.shape, y.dtype) == ((2, 32), "bfloat16")                    # the weights' dtype
    cases = [
        (TypeError, "x has dtype int32", lambda: norm_linear(meta((2, 64), "int32"), g, beta, w)),
        (TypeError, "weight has dtype float16 but x", lambda: norm_linear(x, g, beta, meta((64, 32), "float16"))),
        (TypeError, "weight has dtype int64", lambda: norm_linear(fixed, g, beta, meta((64, 32), "int64"))),
        (ValueError, "weight must be", lambda: norm_linear(x, g, beta, meta((63, 32)))),
        (ValueError, "weight must be", lambda: norm_linear(x, g, beta, meta((64,)))),
        (ValueError, "ln_weight must have shape", lambda: norm_linear(x, meta((63,)), beta, w)),
        (TypeError, "ln_bias has dtype float32", lambda: norm_linear(fixed, g, meta((64,), "float32"), w)),
        (TypeError, "ln_weight must be a CUDA device array", lambda: norm_linear(x, None, beta, w)),
        (ValueError, "bias must have shape", lambda: norm_linear(x, g, beta, w, meta((31,)))),
        (TypeError, "bias has dtype float32 but weight",
         lambda: norm_linear(fixed, g, beta, w, meta((32,), "float32"))),
        (ValueError, "out has shape", lambda: norm_linear(x, g, beta, w, out=meta((2, 31)))),
        (TypeError, "out has dtype int64, expected bfloat16",
         lambda: norm_linear(fixed, g, beta, w, out=meta((2, 32), "int64"))),
        (ValueError, "activation must be", lambda: norm_linear(x, g, beta, w, activation="relu")),
        (ValueError, "eps must be a positive", lambda: norm_linear(x, g, beta, w, eps=0.0)),
        (ValueError, "eps must be a positive", lambda: norm_linear(x, g, beta, w, eps=float("nan"))),
        (ValueError, "x must be C-contiguous", lambda: norm_linear(meta((64, 4)).transpose(), g, beta, w)),
        (ValueError, "weight must be C-contiguous", lambda: norm_linear(x, g, beta, meta((32, 64)).transpose())),
        (ValueError, "x must have a non-empty last dimension", lambda: norm_linear(meta((2, 0)), g, beta, w)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
