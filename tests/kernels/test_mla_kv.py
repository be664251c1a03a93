"""mla_kv on the GPU: keys and zero-padded values of MLA prompts exactly as its reference, from strided rotary keys
(as the model keeps them inside its query rows), the values' padding left alone."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import host, poisoned, rand  # noqa: E402
from tilekit.kernels.mla_kv import MLA_KV, mla_kv, mla_kv_reference  # noqa: E402


def check(M, H, dn, dv, P, dtype):
    kv, rows = rand((M, H, dn + dv), dtype), rand((M, (H + 1) * (dn + P)), dtype)
    k_pe = rows[:, dn:dn + P]
    k, v = poisoned((M, H, dn + P), dtype), cupy.zeros((M, H, dn + P), kv.dtype)
    mla_kv(kv, k_pe, k, v, dn=dn)
    ref_k, ref_v = mla_kv_reference(host(kv), host(k_pe), dn)
    np.testing.assert_array_equal(host(k), ref_k)
    np.testing.assert_array_equal(host(v)[..., :dv], ref_v)
    assert not host(v)[..., dv:].any(), "the values' padding was written"


@pytest.mark.parametrize("M, H, dn, dv, P, dtype", [(1, 16, 128, 128, 64, "bfloat16"), (8192, 16, 128, 128, 64,
                                                    "bfloat16"), (37, 4, 16, 16, 16, "float32"),
                                                   (5, 3, 16, 8, 16, "float16")])
def test_mla_kv_matches_reference(M, H, dn, dv, P, dtype):
    check(M, H, dn, dv, P, dtype)


@pytest.mark.parametrize("tm", [1, 8, 32])
def test_every_row_tile(tm):
    with MLA_KV.pinned(dict(TM=tm, occupancy=4)):
        check(77, 16, 128, 128, 64, "bfloat16")
