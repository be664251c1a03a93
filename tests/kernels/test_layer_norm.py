"""layer_norm on the GPU against its float64 reference, selected rows, and a fixed-point residual stream as input."""

import cupy
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.kernels.test_residual_linear import fixed_residual
from tilekit.kernels import layer_norm
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.layer_norm import layer_norm_reference

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=12, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_layer_norm(shape, dtype, eps=1e-5):
    x = rand(shape, dtype, 2.0, mean=0.5)
    w = rand(shape[-1:], dtype)
    b = rand(shape[-1:], dtype)
    out = poisoned(shape, dtype)
    layer_norm(x, w, b, eps, out=out)
    assert_close(host(out), layer_norm_reference(host(x), host(w), host(b), eps), TOL[dtype], f"layer_norm {shape}")


@GPU
@given(shape=st.sampled_from([(1, 768), (3, 7, 1600), (8191, 768), (5, 20000), (2, 1)]), dtype=DTYPES)
def test_layer_norm_matches_reference(shape, dtype):
    check_layer_norm(shape, dtype)


def test_layer_norm_selected_rows():
    x = rand((5, 9, 768), "bfloat16", 2.0, mean=0.3)
    w, b = rand((768,), "bfloat16"), rand((768,), "bfloat16")
    rows = np.array([8, 17, 44, 0], np.int32)
    out = poisoned((4, 768), "bfloat16")
    layer_norm(x, w, b, rows=cupy.asarray(rows), out=out)
    ref = layer_norm_reference(host(x).reshape(45, 768)[rows], host(w), host(b))
    assert_close(host(out), ref, TOL["bfloat16"], "layer_norm rows")


def check_layer_norm_of_fixed_point(M, N, dtype, gather=False):
    x, values = fixed_residual((M, N), 3.0)
    w, b = rand((N,), dtype), rand((N,), dtype)
    rows = np.arange(M, dtype=np.int32)[::-2] if gather else np.arange(M, dtype=np.int32)
    out = poisoned((len(rows), N), dtype)
    layer_norm(x, w, b, rows=cupy.asarray(rows) if gather else None, out=out)
    ref = layer_norm_reference(values[rows], host(w), host(b))
    assert_close(host(out), ref, TOL[dtype], f"layer_norm of fixed point {(M, N, dtype, gather)}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("gather", [False, True])
def test_layer_norm_of_a_fixed_point_residual(dtype, gather):
    check_layer_norm_of_fixed_point(9, 1600, dtype, gather)
    check_layer_norm_of_fixed_point(2, 20000, dtype)          # rows longer than a tile
