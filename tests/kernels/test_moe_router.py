"""moe_router against its float64 reference on the GPU: fresh random inputs, poisoned outputs, every config's
split-K path; expert choices compared where the reference's k-th and (k+1)-th probabilities are apart."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import host, rand  # noqa: E402
from tilekit.kernels.moe_router import MOE_ROUTER, moe_router, moe_router_reference  # noqa: E402

MARGIN = 1e-5       # probability gaps fp32 accumulation cannot cross (the products of bf16/fp16 inputs are exact)


def clear_rows(x, w, k) -> np.ndarray:
    """Rows whose k-th and (k+1)-th expert probabilities (float64, of the inputs as stored) are MARGIN apart."""
    logits = host(x) @ host(w).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = -np.sort(-p / p.sum(-1, keepdims=True), -1)
    return p[:, k - 1] - (p[:, k] if k < w.shape[0] else 0) > MARGIN


def check_router(M, E, C, k, shared, dtype, renormalize=False, scale=1.0):
    for _ in range(5):              # fresh inputs until most rows have a clear choice (nearly always the first)
        x, w = rand((M, C), dtype), rand((E, C), dtype, 1 / math.sqrt(C))
        clear = clear_rows(x, w, k)
        if clear.mean() > 0.5:
            break
    assert clear.mean() > 0.5, "too few rows with a clear choice to test"
    ids, weights = cupy.full((M, k + shared), -7, cupy.int32), cupy.full((M, k + shared), cupy.nan, cupy.float32)
    got = moe_router(x, w, k, renormalize=renormalize, scale=scale, shared=shared, topk_ids=ids, topk_weights=weights)
    assert got[0] is ids and got[1] is weights
    ref_ids, ref_w = moe_router_reference(host(x), host(w), k, renormalize=renormalize, scale=scale, shared=shared)
    got_ids, got_w = host(ids), host(weights)
    assert np.all(got_ids[:, k:] == E + np.arange(shared)) and np.all(got_w[:, k:] == 1), "shared experts"
    for row in np.flatnonzero(clear):                 # the same experts; each with its weight, in descending order
        order = np.argsort(got_ids[row, :k])
        ref_order = np.argsort(ref_ids[row, :k])
        assert np.array_equal(got_ids[row, :k][order], ref_ids[row, :k][ref_order]), f"row {row}: other experts"
        np.testing.assert_allclose(got_w[row, :k][order], ref_w[row, :k][ref_order], rtol=1e-4, atol=1e-7,
                                   err_msg=f"row {row}")
        assert np.all(np.diff(got_w[row, :k]) <= 1e-6), f"row {row}: not in descending order"
    assert np.all(np.isfinite(got_w)) and np.all((got_ids >= 0) & (got_ids < E + shared)), "unwritten outputs"


@pytest.mark.parametrize("M, E, C, k, shared, dtype", [
    (1, 64, 2048, 6, 2, "bfloat16"), (8, 64, 2048, 6, 2, "bfloat16"), (1000, 64, 2048, 6, 2, "bfloat16"),
    (37, 160, 5120, 6, 0, "bfloat16"), (5, 8, 72, 3, 1, "float32"), (300, 8, 64, 8, 0, "float16")])
def test_router_matches_reference(M, E, C, k, shared, dtype):
    check_router(M, E, C, k, shared, dtype, scale=1.5)


def test_renormalised_weights_sum_to_the_scale():
    check_router(33, 64, 512, 6, 2, "float32", renormalize=True, scale=2.5)


@pytest.mark.parametrize("split", [1, 2, 8, 16])
def test_every_split_k_gives_the_same_routing(split):
    p = MOE_ROUTER.tuning_problem(dict(dtype="bfloat16", M=3, E=64, C=2048, K=6, shared=2, renorm=0))
    config = next(c for c in MOE_ROUTER.space.candidates(p) if c["SPLIT_K"] == split)
    with MOE_ROUTER.pinned(config):
        check_router(3, 64, 2048, 6, 2, "bfloat16")
        check_router(3, 64, 2048, 6, 2, "bfloat16")      # the arrival counters were left at zero

