"""swiglu_linear (gate and up projections in one kernel) on the GPU against its float64 reference."""

import math

from hypothesis import given, settings, strategies as st
import pytest

from tilekit.kernels import swiglu_linear
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.swiglu_linear import swiglu_linear_reference

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=10, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_swiglu_linear(M, N, K, dtype):
    x = rand((M, K), dtype)
    wg, wu = rand((N, K), dtype, 1 / math.sqrt(K)), rand((N, K), dtype, 1 / math.sqrt(K))
    out = poisoned((M, N), dtype)
    assert swiglu_linear(x, wg, wu, out=out) is out
    assert_close(host(out), swiglu_linear_reference(host(x), host(wg), host(wu)), TOL[dtype],
                 f"swiglu_linear {(M, N, K, dtype)}")


@GPU
@given(M=st.sampled_from([1, 3, 8, 127, 1000]), N=st.sampled_from([64, 200, 1031]), K=st.sampled_from([64, 72, 512]),
       dtype=DTYPES)
def test_swiglu_linear_matches_reference(M, N, K, dtype):
    check_swiglu_linear(M, N, K, dtype)


def test_swiglu_linear_llama_shapes():
    check_swiglu_linear(1, 8192, 2048, "bfloat16")
    check_swiglu_linear(600, 2816, 1024, "bfloat16")
