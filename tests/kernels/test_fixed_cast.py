"""fixed_cast on the GPU: a fixed-point stream as floats, against the host's conversion, poisoned outputs."""

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import TOL, assert_close, host, poisoned  # noqa: E402
from tilekit.kernels.fixed_cast import fixed_cast  # noqa: E402
from tilekit.kernels.tiles import fixed_to_float  # noqa: E402


@pytest.mark.parametrize("M, N, dtype", [(1, 2048, "bfloat16"), (8, 2048, "float16"), (8192, 2048, "bfloat16"),
                                         (3, 77, "float32")])
def test_fixed_cast_matches_the_host(M, N, dtype):
    x = cupy.random.default_rng().integers(-(1 << 36), 1 << 36, (M, N), dtype=cupy.int64)
    out = poisoned((M, N), dtype)
    assert fixed_cast(x, out) is out
    assert_close(host(out), fixed_to_float(host(x)), TOL[dtype], f"fixed_cast {(M, N, dtype)}")
