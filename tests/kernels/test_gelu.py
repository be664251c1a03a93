"""gelu (tanh and exact) on the GPU against its float64 reference."""

from hypothesis import given, settings, strategies as st
import pytest

from tilekit.kernels import gelu
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand, rounded
from tilekit.kernels.gelu import gelu_reference

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=12, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_gelu(shape, dtype, approximate):
    x = rand(shape, dtype, 3.0)
    out = poisoned(shape, dtype)
    gelu(x, approximate=approximate, out=out)
    ref = rounded(gelu_reference(host(x), approximate), dtype)   # GELU's tail underflows fp16 (gelu(-6.45) ~ 1e-12)
    assert_close(host(out), ref, TOL[dtype], f"gelu {shape} {dtype} {approximate}")


@GPU
@given(shape=st.sampled_from([(1,), (1000,), (3, 333), ((1 << 20) + 3,)]), dtype=DTYPES,
       approximate=st.sampled_from(["tanh", "none"]))
def test_gelu_matches_reference(shape, dtype, approximate):
    check_gelu(shape, dtype, approximate)
