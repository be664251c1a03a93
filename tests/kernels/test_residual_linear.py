"""residual_linear into the fixed-point residual stream of decode steps on the GPU: against its float64 reference,
every split summed, bit-for-bit repeatable, bad inputs named."""

import math

import cupy
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tilekit.kernels import layer_norm, residual_linear
from tilekit.kernels.checks import TOL, assert_close, host, rand
from tilekit.kernels.residual_linear import RESIDUAL_LINEAR, residual_linear_reference
from tilekit.kernels.tiles import fixed_to_float, float_to_fixed

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=10, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def fixed_residual(shape, scale=1.0):
    """(device fixed-point array, its float64 values) of fresh random values."""
    start = float_to_fixed(host(rand(shape, "float32", scale)))
    return cupy.asarray(start), fixed_to_float(start)


def added(residual, start) -> np.ndarray:
    """What a kernel added to a fixed-point residual, in float64 (the difference is exact)."""
    return fixed_to_float(cupy.asnumpy(residual)) - start


def check_residual_linear(M, N, K, dtype, bias=True):
    residual, start = fixed_residual((M, N))
    x, w = rand((M, K), dtype), rand((K, N), dtype, 1 / math.sqrt(K))
    b = rand((N,), dtype) if bias else None
    assert residual_linear(residual, x, w, b) is residual
    ref = residual_linear_reference(0.0, host(x), host(w), None if b is None else host(b))
    assert_close(added(residual, start), ref, TOL[dtype], f"residual_linear {(M, N, K, dtype, bias)}")


@GPU
@given(M=st.sampled_from([1, 3, 8, 17, 130]), N=st.sampled_from([64, 200, 768, 1031]),
       K=st.sampled_from([64, 72, 768, 3072]), dtype=DTYPES, bias=st.booleans())
def test_residual_linear_matches_reference(M, N, K, dtype, bias):
    check_residual_linear(M, N, K, dtype, bias)


@pytest.mark.parametrize("split_k", [1, 4, 16])
def test_residual_linear_splits_sum_every_slice(split_k):
    """Every split of K adds its slice once (the bias once too), with K not a multiple of the splits."""
    config = dict(TM=16, TN=64, TK=64, SPLIT_K=split_k, occupancy=1)
    with RESIDUAL_LINEAR.pinned(config):
        for M, N, K in [(1, 1600, 6400), (8, 777, 1600), (3, 1031, 1088)]:
            check_residual_linear(M, N, K, "bfloat16")
            check_residual_linear(M, N, K, "float32")


def test_fixed_point_sums_repeat_bit_for_bit():
    """Many programs add into one residual in whatever order they finish: integer sums do not care."""
    x, w, b = rand((3, 6400), "bfloat16"), rand((6400, 1600), "bfloat16", 0.0125), rand((1600,), "bfloat16")
    start = float_to_fixed(np.random.default_rng(3).standard_normal((3, 1600)))
    results = []
    for _ in range(4):
        residual = cupy.asarray(start)
        with RESIDUAL_LINEAR.pinned(dict(TM=16, TN=64, TK=64, SPLIT_K=16, occupancy=2)):
            residual_linear(residual, x, w, b)
            residual_linear(residual, x, w, b)
        results.append(cupy.asnumpy(residual))
    assert all(np.array_equal(r, results[0]) for r in results[1:])


def test_bad_inputs_name_the_argument():
    x, w = rand((2, 64), "bfloat16"), rand((64, 32), "bfloat16")
    residual = cupy.zeros((2, 32), cupy.int64)
    with pytest.raises(TypeError, match="residual has dtype bfloat16"):
        residual_linear(rand((2, 32), "bfloat16"), x, w)
    with pytest.raises(ValueError, match="residual must have shape"):
        residual_linear(cupy.zeros((3, 32), cupy.int64), x, w)
    with pytest.raises(ValueError, match="weight must be"):
        residual_linear(residual, x, rand((63, 32), "bfloat16"))
    with pytest.raises(TypeError, match="weight has dtype float32"):
        residual_linear(residual, x, rand((64, 32), "float32"))
    with pytest.raises(TypeError, match="x has dtype int32"):
        layer_norm(cupy.zeros((2, 64), cupy.int32), rand((64,), "bfloat16"), rand((64,), "bfloat16"))
    with pytest.raises(TypeError, match="out has dtype bfloat16, expected float32"):
        layer_norm(cupy.zeros((2, 64), cupy.int64), rand((64,), "float32"), rand((64,), "float32"),
                   out=rand((2, 64), "bfloat16"))
