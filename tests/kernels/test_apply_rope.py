"""apply_rope (rotary embeddings in place on fused QKV views) on the GPU against its float64 reference."""

import cupy
import numpy as np
from hypothesis import given, settings, strategies as st
import pytest

from tilekit.kernels import apply_rope
from tilekit.kernels.apply_rope import rope_reference, rope_tables
from tilekit.kernels.checks import TOL, assert_close, host, rand
from tilekit.models.llama.config import RopeScaling
from tilekit.models.llama.config import rope_inv_freq

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=10, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_rope(B, H, Hkv, T, D, dtype, table_dtype="float32", scaling=None, rng=np.random.default_rng(1)):
    """RoPE on the query and key heads of a fused [B, T, H + 2 Hkv, D] buffer, in place, values untouched."""
    inv_freq = rope_inv_freq(D, 500000.0, scaling)
    cos, sin = rope_tables(4096, inv_freq)
    cos, sin = (cupy.asarray(t.astype(np.float32 if table_dtype == "float32" else np.float16)) for t in (cos, sin))
    qkv = rand((B, T, H + 2 * Hkv, D), dtype)
    before = host(qkv)
    positions = rng.integers(0, 4096, (B, T)).astype(np.int32)
    apply_rope(qkv.transpose(0, 2, 1, 3)[:, :H + Hkv], cupy.asarray(positions), cos, sin)
    after = host(qkv)
    tables = host(cos), host(sin)
    angles_cos, angles_sin = tables[0][positions], tables[1][positions]     # (B, T, D/2) as the kernel reads them
    x1, x2 = np.split(before[:, :, :H + Hkv], 2, axis=-1)
    c, s = angles_cos[:, :, None], angles_sin[:, :, None]
    ref = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    assert_close(after[:, :, :H + Hkv], ref, TOL[dtype], f"rope {(B, H, Hkv, T, D, dtype)}")
    np.testing.assert_array_equal(after[:, :, H + Hkv:], before[:, :, H + Hkv:], "rope wrote into the value heads")
    if table_dtype == "float32":      # the float32 tables are the exact rotation, to float32 rounding
        exact = rope_reference(before[:, :, :H + Hkv].transpose(0, 2, 1, 3), positions[:, None, :], inv_freq)
        assert_close(after[:, :, :H + Hkv].transpose(0, 2, 1, 3), exact, TOL[dtype], "rope against float64")


@GPU
@given(shape=st.sampled_from([(1, 32, 8, 1, 64), (2, 8, 2, 77, 128), (3, 4, 4, 1000, 64), (1, 2, 1, 5, 80)]),
       dtype=DTYPES, llama3=st.booleans())
def test_rope_matches_reference(shape, dtype, llama3):
    check_rope(*shape, dtype, scaling=RopeScaling(32.0, 1.0, 4.0, 8192) if llama3 else None)


def test_rope_with_half_precision_tables_as_hugging_face_passes_them():
    check_rope(2, 4, 2, 33, 64, "float16", table_dtype="float16")
