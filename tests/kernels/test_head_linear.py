"""head_linear against its float64 reference on the GPU: both weight layouts, strided views of a kv_b_proj-like
weight and of query buffers (as DeepSeek-V2's absorbed decode reads them), poisoned outputs, every tile config
of a decode shape."""

import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand  # noqa: E402
from tilekit.kernels.head_linear import HEAD_LINEAR, head_linear, head_linear_reference  # noqa: E402


def check(M, H, dn, dv, R, dtype):
    """W_UK (kn) then W_UV (nk), both views of one (H, dn + dv, R) weight; queries inside wider rows."""
    w = rand((H, dn + dv, R), dtype, R ** -0.5)
    q = rand((M, H + 1, dn + 64), dtype)[:, 1:, :dn]
    q_c = poisoned((M, H, R), dtype)
    head_linear(q, w[:, :dn], out=q_c, weight_layout="kn")
    assert_close(host(q_c), head_linear_reference(host(q), host(w[:, :dn]), "kn"), TOL[dtype], f"kn {M, H, R}")
    y = poisoned((H, M, dv), dtype).transpose(1, 0, 2)
    head_linear(q_c, w[:, dn:], out=y, weight_layout="nk")
    assert_close(host(y), head_linear_reference(host(q_c), host(w[:, dn:]), "nk"), TOL[dtype], f"nk {M, H, R}")


@pytest.mark.parametrize("M, H, dn, dv, R, dtype", [(1, 16, 128, 128, 512, "bfloat16"), (32, 16, 128, 128, 512,
                                                    "bfloat16"), (3, 4, 16, 16, 32, "float32"),
                                                   (5, 2, 24, 8, 40, "float16")])
def test_head_linear_matches_reference(M, H, dn, dv, R, dtype):
    check(M, H, dn, dv, R, dtype)


def test_every_config_of_a_decode_shape():
    problem = HEAD_LINEAR.tuning_problem(dict(dtype="bfloat16", M=1, H=16, N=512, K=128, wt="kn"))
    for config in HEAD_LINEAR.space.candidates(problem):
        with HEAD_LINEAR.pinned(config):
            check(1, 16, 128, 128, 512, "bfloat16")
