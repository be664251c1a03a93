"""An FP8 (e4m3) KV cache on the GPU: decode_attention against its float64 reference over the dequantized cache
(new keys and values quantized as stored, saturation included), the codes it and write_kv store bit for bit
against NumPy's fp32 quantization, one split and many."""

import cupy
import numpy as np
import pytest

from tilekit.kernels import decode_attention, write_kv
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.decode_attention import DECODE_ATTENTION, decode_attention_reference
from tilekit.kernels.quantize_fp8 import fp8_codes
from tilekit.kernels.write_kv import write_kv_reference
from tests.kernels.test_decode_attention import with_chunk

pytestmark = pytest.mark.gpu


def codes_and_scales(shape, rng):
    """Random e4m3 codes (normal values over scales 0.002-0.05: the largest codes saturate) and per-head scales."""
    scales = rng.uniform(0.002, 0.05, shape[1]).astype(np.float32)
    return fp8_codes(rng.standard_normal(shape).astype(np.float32), scales), scales


@pytest.mark.parametrize("B,H,Hkv,nq,capacity,D,dtype,chunk", [(1, 32, 8, 1, 4100, 128, "bfloat16", None),
                                                                (3, 32, 8, 2, 700, 64, "bfloat16", 128),
                                                                (2, 8, 8, 1, 300, 128, "float16", 512),
                                                                (2, 4, 2, 3, 200, 64, "float32", 128)])
@pytest.mark.parametrize("new_kv", [False, True])
def test_fp8_decode_attention_matches_the_dequantized_reference(B, H, Hkv, nq, capacity, D, dtype, chunk, new_kv):
    rng = np.random.default_rng(B * capacity + nq)
    (kc_h, ks), (vc_h, vs) = codes_and_scales((B, Hkv, capacity, D), rng), codes_and_scales((B, Hkv, capacity, D), rng)
    kc, vc, k_scale, v_scale = map(cupy.asarray, (kc_h, vc_h, ks, vs))
    if new_kv:     # views of a fused buffer, as the models pass them; scaled so that some new values saturate
        heads = rand((B, nq, H + 2 * Hkv, D), dtype, scale=4.0).transpose(0, 2, 1, 3)
        q, k_new, v_new = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
        new = dict(new_k=host(k_new), new_v=host(v_new))
    else:
        q, k_new, v_new, new = rand((B, H, nq, D), dtype), None, None, {}
    lengths = rng.integers(nq, capacity + 1, B).astype(np.int32)
    lengths[0] = capacity
    ref = decode_attention_reference(host(q), kc_h, vc_h, lengths, k_scale=ks, v_scale=vs, **new)
    expected_k, expected_v = kc_h.copy(), vc_h.copy()
    for b, n in enumerate(lengths if new_kv else ()):
        expected_k[b, :, n - nq:n] = fp8_codes(new["new_k"], ks)[b]
        expected_v[b, :, n - nq:n] = fp8_codes(new["new_v"], vs)[b]
    out = poisoned((B, H, nq, D), dtype)
    # pinned splits; occupancy 2 only with 64-wide 16-bit heads, as in the space (docs/results/wrong-configs.txt)
    problem = dict(dtype=dtype, B=B, H=H, Hkv=Hkv, nq=nq, capacity=capacity, D=D, new_kv=int(new_kv), fp8=1)
    config = with_chunk(problem, chunk, BN=64, occupancy=2 if D == 64 and dtype != "float32" else 1) if chunk else \
        DECODE_ATTENTION.default(DECODE_ATTENTION.tuning_problem(problem))
    with DECODE_ATTENTION.pinned(config):
        for _ in range(2):             # a second call on the same caches: the same result
            decode_attention(q, kc, vc, cupy.asarray(lengths), new_k=k_new, new_v=v_new, k_scale=k_scale,
                             v_scale=v_scale, out=out)
    assert_close(host(out), ref, TOL[dtype], f"fp8 decode_attention {(B, H, Hkv, nq, capacity, D, dtype, chunk)}")
    np.testing.assert_array_equal(host(kc), expected_k)
    np.testing.assert_array_equal(host(vc), expected_v)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_write_kv_stores_numpys_codes(dtype):
    B, H, T, capacity, D = 3, 4, 70, 160, 128
    rng = np.random.default_rng(1)
    qkv = rand((B, T, 3, H, D), dtype, scale=3.0)
    k, v = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
    (kc_h, ks), (vc_h, vs) = codes_and_scales((B, H, capacity, D), rng), codes_and_scales((B, H, capacity, D), rng)
    kc, vc = cupy.asarray(kc_h), cupy.asarray(vc_h)
    start = np.array([0, 17, 120], np.int32)          # the last runs past the capacity: clipped
    ref_k, ref_v = write_kv_reference(host(k), host(v), kc_h, vc_h, start, k_scale=ks, v_scale=vs)
    write_kv(k, v, kc, vc, cupy.asarray(start), k_scale=cupy.asarray(ks), v_scale=cupy.asarray(vs))
    np.testing.assert_array_equal(host(kc), ref_k)
    np.testing.assert_array_equal(host(vc), ref_v)


def test_fp8_arguments_are_checked_before_launch():
    q, kc = rand((1, 4, 1, 64), "bfloat16"), cupy.zeros((1, 2, 64, 64), cupy.uint8)
    scale, lengths = cupy.ones((2,), cupy.float32), cupy.full((1,), 64, cupy.int32)
    with pytest.raises(TypeError, match="an FP8 \\(uint8\\) cache needs k_scale"):
        decode_attention(q, kc, kc, lengths)
    with pytest.raises(ValueError, match="v_scale must be a contiguous float32 array of shape \\(2,\\)"):
        decode_attention(q, kc, kc, lengths, k_scale=scale, v_scale=cupy.ones((4,), cupy.float32))
    with pytest.raises(TypeError, match="k_scale has dtype float16"):
        decode_attention(q, kc, kc, lengths, k_scale=scale.astype(cupy.float16), v_scale=scale)
    with pytest.raises(ValueError, match="k_scale and v_scale go with an FP8"):
        decode_attention(q, rand((1, 2, 64, 64), "bfloat16"), rand((1, 2, 64, 64), "bfloat16"), lengths,
                         k_scale=scale, v_scale=scale)
    with pytest.raises(TypeError, match="k_cache has dtype int8"):
        decode_attention(q, kc.view(cupy.int8), kc, lengths, k_scale=scale, v_scale=scale)
