"""rms_norm on the GPU against its float64 reference: fused residual add, selected rows, a fixed-point residual
stream as input."""

import cupy
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.kernels.test_residual_linear import fixed_residual
from tilekit.kernels import rms_norm
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand, rounded
from tilekit.kernels.rms_norm import rms_norm_reference

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=10, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_rms_norm(shape, dtype, residual=False, eps=1e-5):
    x, w = rand(shape, dtype, 2.0, mean=0.5), rand(shape[-1:], dtype, 0.1, mean=1.0)
    r = rand(shape, dtype) if residual else None
    expected_sum = rounded(host(x) + host(r), dtype) if residual else host(x)
    out = poisoned(shape, dtype)
    assert rms_norm(x, w, eps, residual=r, out=out) is out
    if residual:
        np.testing.assert_array_equal(host(r), expected_sum, f"rms_norm {shape} {dtype}: residual sum")
    assert_close(host(out), rms_norm_reference(expected_sum, host(w), eps), TOL[dtype], f"rms_norm {shape} {dtype}")


@GPU
@given(shape=st.sampled_from([(1, 2048), (3, 7, 4096), (8191, 2048), (5, 20000), (2, 1)]), dtype=DTYPES,
       residual=st.booleans())
def test_rms_norm_matches_reference(shape, dtype, residual):
    check_rms_norm(shape, dtype, residual)


def test_rms_norm_selected_rows():
    x, w = rand((6, 2048), "bfloat16"), rand((2048,), "bfloat16")
    rows = np.array([5, 0, 3], np.int32)
    out = rms_norm(x, w, 1e-6, rows=cupy.asarray(rows), out=poisoned((3, 2048), "bfloat16"))
    assert_close(host(out), rms_norm_reference(host(x)[rows], host(w), 1e-6), TOL["bfloat16"], "rms_norm rows")


def test_rms_norm_refuses_rows_with_a_residual():
    x = rand((4, 64), "bfloat16")
    with pytest.raises(ValueError, match="residual and rows"):
        rms_norm(x, rand((64,), "bfloat16"), residual=rand((4, 64), "bfloat16"), rows=cupy.zeros(2, cupy.int32))


@pytest.mark.parametrize("rows, width, start, n, dtype", [
    (1, 3648, 0, 512, "bfloat16"), (37, 3648, 64, 512, "bfloat16"), (5, 300, 7, 96, "float32")])
def test_rms_norm_of_rows_of_a_wider_array(rows, width, start, n, dtype):
    """x a column slice of a wider buffer (DeepSeek-V2's latent in its fused projection's output): any row stride."""
    buf, w = rand((rows, width), dtype, 2.0, mean=0.5), rand((n,), dtype, 0.1, mean=1.0)
    x = buf[:, start:start + n]
    out = rms_norm(x, w, 1e-6, out=poisoned((rows, n), dtype))
    assert_close(host(out), rms_norm_reference(host(x), host(w), 1e-6), TOL[dtype], f"rms_norm of rows {rows}x{n}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("M, N, gather", [(1, 2048, False), (9, 2048, False), (9, 2048, True), (2, 20000, False)])
def test_rms_norm_of_a_fixed_point_residual(M, N, gather, dtype):
    """DeepSeek-V2's residual stream (int64 fixed point) read as it lies; rows longer than a tile read twice."""
    x, values = fixed_residual((M, N), 3.0)
    w = rand((N,), dtype, 0.1, mean=1.0)
    rows = np.arange(M, dtype=np.int32)[::-2] if gather else np.arange(M, dtype=np.int32)
    out = poisoned((len(rows), N), dtype)
    assert rms_norm(x, w, 1e-6, rows=cupy.asarray(rows) if gather else None, out=out) is out
    assert_close(host(out), rms_norm_reference(values[rows], host(w), 1e-6), TOL[dtype],
                 f"rms_norm of fixed point {(M, N, dtype, gather)}")


def test_rms_norm_refuses_a_residual_with_a_fixed_point_x():
    x, _ = fixed_residual((4, 64))
    with pytest.raises(ValueError, match="residual needs a float x"):
        rms_norm(x, rand((64,), "bfloat16"), residual=rand((4, 64), "bfloat16"))
