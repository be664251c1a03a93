"""Llama's ops against their float64 references on the GPU: RMSNorm (fused residual add, selected rows), rotary
embeddings in place on fused QKV views, the SwiGLU projection, and the token embedding without positions."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.gpu.conftest import TOL, assert_close, host, poisoned, rand, rounded

cupy = pytest.importorskip("cupy")

from tilekit.kernels import apply_rope, embedding, rms_norm, swiglu_linear  # noqa: E402
from tilekit.kernels.embedding import embedding_reference  # noqa: E402
from tilekit.kernels.rms_norm import rms_norm_reference  # noqa: E402
from tilekit.kernels.apply_rope import rope_reference, rope_tables  # noqa: E402
from tilekit.kernels.swiglu_linear import swiglu_linear_reference  # noqa: E402
from tilekit.models.llama.config import RopeScaling  # noqa: E402
from tilekit.models.llama.reference import rope_inv_freq  # noqa: E402

GPU = settings(max_examples=10, deadline=None, derandomize=True)
DTYPES = st.sampled_from(["bfloat16", "float16", "float32"])


def check_rms_norm(shape, dtype, residual=False, eps=1e-5):
    x, w = rand(shape, dtype, 2.0, mean=0.5), rand(shape[-1:], dtype, 0.1, mean=1.0)
    r = rand(shape, dtype) if residual else None
    expected_sum = rounded(host(x) + host(r), dtype) if residual else host(x)
    out = poisoned(shape, dtype)
    assert rms_norm(x, w, eps, residual=r, out=out) is out
    if residual:
        np.testing.assert_array_equal(host(r), expected_sum, f"rms_norm {shape} {dtype}: residual sum")
    assert_close(host(out), rms_norm_reference(expected_sum, host(w), eps), TOL[dtype], f"rms_norm {shape} {dtype}")


@GPU
@given(shape=st.sampled_from([(1, 2048), (3, 7, 4096), (8191, 2048), (5, 20000), (2, 1)]), dtype=DTYPES,
       residual=st.booleans())
def test_rms_norm_matches_reference(shape, dtype, residual):
    check_rms_norm(shape, dtype, residual)


def test_rms_norm_selected_rows():
    x, w = rand((6, 2048), "bfloat16"), rand((2048,), "bfloat16")
    rows = np.array([5, 0, 3], np.int32)
    out = rms_norm(x, w, 1e-6, rows=cupy.asarray(rows), out=poisoned((3, 2048), "bfloat16"))
    assert_close(host(out), rms_norm_reference(host(x)[rows], host(w), 1e-6), TOL["bfloat16"], "rms_norm rows")


def test_rms_norm_refuses_rows_with_a_residual():
    x = rand((4, 64), "bfloat16")
    with pytest.raises(ValueError, match="residual and rows"):
        rms_norm(x, rand((64,), "bfloat16"), residual=rand((4, 64), "bfloat16"), rows=cupy.zeros(2, cupy.int32))


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


def check_swiglu_linear(M, N, K, dtype):
    x = rand((M, K), dtype)
    wg, wu = rand((N, K), dtype, 1 / math.sqrt(K)), rand((N, K), dtype, 1 / math.sqrt(K))
    out = poisoned((M, N), dtype)
    assert swiglu_linear(x, wg, wu, out=out) is out
    assert_close(host(out), swiglu_linear_reference(host(x), host(wg), host(wu)), TOL[dtype],
                 f"swiglu_linear {(M, N, K, dtype)}")


@GPU
@given(M=st.sampled_from([1, 3, 8, 127, 1000]), N=st.sampled_from([64, 200, 1031]), K=st.sampled_from([64, 72, 512]),
       dtype=DTYPES)
def test_swiglu_linear_matches_reference(M, N, K, dtype):
    check_swiglu_linear(M, N, K, dtype)


def test_swiglu_linear_llama_shapes():
    check_swiglu_linear(1, 8192, 2048, "bfloat16")
    check_swiglu_linear(600, 2816, 1024, "bfloat16")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_embedding_without_positions(dtype):
    wte = rand((1031, 2048), dtype)
    ids = cupy.random.randint(0, 1031, (3, 17)).astype(cupy.int32)
    out = embedding(ids, wte, out=poisoned((3, 17, 2048), dtype))
    np.testing.assert_array_equal(host(out), embedding_reference(host(ids), host(wte)))
