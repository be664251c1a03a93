"""quantize_fp8's search space on the CPU: the 1 x 128 tiles that never finished on an H100 with occupancy 2 or 4
are not candidates at any shape (so the tuner cannot hang on one), and the defaults stay candidates."""

import pytest

from tilekit.kernels.quantize_fp8 import QUANTIZE_FP8


@pytest.mark.parametrize("M,K,group", [(1, 4096, 1), (1, 4096, 0), (8192, 4096, 0), (8192, 14336, 0), (40, 1000, 0),
                                       (300, 136, 1), (3, 40000, 0), (5, 72, 0)])
def test_no_small_tile_runs_several_a_sm_and_the_default_stays(M, K, group):
    p = QUANTIZE_FP8.tuning_problem(dict(dtype="bfloat16", M=M, K=K, group=group))
    candidates = QUANTIZE_FP8.space.candidates(p)
    assert candidates and not [c for c in candidates if c["TM"] * c["TK"] < 256 and c["occupancy"] > 1]
    default = QUANTIZE_FP8.default(p)
    assert QUANTIZE_FP8.space.admits(default, p)


def test_one_pass_rows_up_to_16k_by_default():
    """Rows up to 16384 columns are loaded once (the fastest of every tile on an H100 at K 4096 and 14336)."""
    for K, tk, tm in ((4096, 4096, 4), (14336, 16384, 1), (20000, 1024, 16)):
        c = QUANTIZE_FP8.default(QUANTIZE_FP8.tuning_problem(dict(dtype="bfloat16", M=8192, K=K, group=0)))
        assert (c["TK"], c["TM"]) == (tk, tm)
