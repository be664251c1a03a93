"""moe_permute against its NumPy reference on the GPU: exact offsets and stable order, one chunk and several,
poisoned outputs, skewed and uniform routings."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import host  # noqa: E402
from tilekit.kernels.moe_permute import MOE_PERMUTE, moe_permute, moe_permute_reference  # noqa: E402


def routing(M, slots, E, rng, skew=False):
    """Distinct experts per token (as top-k gives), uniform or crowded onto the first few experts."""
    p = np.linspace(1, 0.01, E) ** 4 if skew else np.ones(E)
    return np.stack([rng.choice(E, slots, replace=False, p=p / p.sum()) for _ in range(M)]).astype(np.int32)


def check_permute(M, slots, E, skew=False, rng=np.random.default_rng(0)):
    ids = routing(M, slots, E, rng, skew)
    offsets, order = cupy.full(E + 1, -9, cupy.int32), cupy.full(M * slots, -9, cupy.int32)
    got = moe_permute(cupy.asarray(ids), E, offsets=offsets, sorted_pairs=order)
    assert got[0] is offsets and got[1] is order
    ref_offsets, ref_order = moe_permute_reference(ids, E)
    np.testing.assert_array_equal(host(offsets), ref_offsets, f"offsets M{M} slots {slots} E{E}")
    np.testing.assert_array_equal(host(order), ref_order, f"order M{M} slots {slots} E{E}")


@pytest.mark.parametrize("M, slots, E, skew", [(1, 8, 66, False), (8, 8, 66, False), (1000, 8, 66, True),
                                               (8192, 8, 66, False), (77, 3, 8, True), (5, 1, 1, False)])
def test_permute_matches_reference(M, slots, E, skew):
    check_permute(M, slots, E, skew)


@pytest.mark.parametrize("ch", [16, 64, 256])
def test_every_chunk_size_gives_the_same_order(ch):
    with MOE_PERMUTE.pinned(dict(CH=ch, occupancy=1)):
        check_permute(300, 6, 64, skew=True)

