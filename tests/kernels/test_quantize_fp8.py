"""quantize_fp8 on the GPU against its fp32 NumPy reference: scales bit for bit, codes exactly but for rare
ties, and every dequantized value within half an e4m3 step of x."""

import numpy as np
import pytest

from tilekit.kernels import quantize_fp8
from tilekit.autotune.arrays import numpy_dtype
from tilekit.kernels.checks import host
from tilekit.kernels.quantize_fp8 import GROUP, QUANTIZE_FP8, quantize_fp8_reference

pytestmark = pytest.mark.gpu


def check_quantize(shape, dtype, group):
    import cupy
    import ml_dtypes
    values = 3 * np.random.default_rng().standard_normal(shape)
    values[..., :1] = 0                                     # a zero column and a zero row
    values.reshape(-1, shape[-1])[0] = 0
    x = cupy.asarray(values.astype(numpy_dtype(dtype)))
    groups = -(-shape[-1] // GROUP) if group else 1
    q = cupy.full(shape, 0x7F, cupy.uint8)                  # NaN codes: poisoned
    s = cupy.full(shape[:-1] + (groups,), np.nan, cupy.float32)
    quantize_fp8(x, q, s, group=group)
    ref_q, ref_s = quantize_fp8_reference(host(x), group)
    np.testing.assert_array_equal(host(s), ref_s.astype(np.float64))
    codes = host(q)
    assert np.mean(codes != ref_q) < 1e-3, "more than rare rounding ties differ"
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = np.repeat(host(s), group or shape[-1], -1)[..., :shape[-1]]
    step = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(values), 2.0 ** -6))) - 3), 2.0 ** -9)
    assert np.all(np.abs(values * scales - host(x)) <= (0.5 * step + 1e-30) * scales * (1 + 1e-6))


@pytest.mark.parametrize("group", [None, GROUP])
@pytest.mark.parametrize("shape, dtype", [((1, 4096), "bfloat16"), ((5, 200), "float16"), ((2, 3, 1100), "float32"),
                                          ((300, 136), "bfloat16")])
def test_quantize_matches_reference(shape, dtype, group):
    check_quantize(shape, dtype, group)


def test_every_row_tile():
    for config in QUANTIZE_FP8.space.candidates(QUANTIZE_FP8.tuning_problem(dict(dtype="bfloat16", M=40, K=1000,
                                                                                     group=0))):
        with QUANTIZE_FP8.pinned(config):
            check_quantize((40, 1000), "bfloat16", None)


@pytest.mark.parametrize("config", [dict(TM=4, TK=4096, occupancy=1), dict(TM=1, TK=4096, occupancy=2),
                                    dict(TM=16, TK=1024, occupancy=1)])
def test_one_pass_and_two_pass_rows(config):
    """A whole row in one tile (loaded once) and K steps over it (loaded twice) give the reference's bits; K not a
    multiple of the tile, rows not of TM."""
    with QUANTIZE_FP8.pinned(config):
        check_quantize((37, 3000), "bfloat16", None)
        check_quantize((5, 4096), "float32", None)
