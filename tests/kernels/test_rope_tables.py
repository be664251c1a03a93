"""rope_tables on the CPU: the angle-addition tables against cos and sin of every angle, evaluated directly in float64."""

import numpy as np
import pytest

from tilekit.kernels.apply_rope import rope_tables
from tilekit.models import LLAMA_PRESETS
from tilekit.models.llama.config import rope_inv_freq


@pytest.mark.parametrize("positions", [1, 511, 512, 4097, 1 << 17])
@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.2-1b"])
def test_tables_are_the_direct_evaluation_within_a_rounding_tie(positions, preset):
    c = LLAMA_PRESETS[preset]
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    cos, sin = rope_tables(positions, inv_freq)
    angles = np.arange(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)
    for got, want in ((cos, np.cos(angles)), (sin, np.sin(angles))):
        assert got.shape == (positions, c.head_dim // 2) and got.dtype == np.float32 and got.flags.c_contiguous
        direct = want.astype(np.float32)
        # one float32 ulp of the direct value, or 1e-9 near a zero (both carry the float64 angle's own rounding,
        # 1.5e-11 rad at 128K positions, many ulps of a value that small)
        assert (np.abs(got - direct) <= np.maximum(np.spacing(np.abs(direct)), 1e-9)).all()
        assert (got != direct).mean() < 1e-4                         # and different only at rounding ties
        assert np.abs(got - want).max() < 6e-8                      # within float32's resolution of the truth
