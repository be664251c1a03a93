"""decode_attention on the GPU against its float64 reference: splits and their merge, new keys written,
grouped-query, length offsets."""

import cupy
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tilekit.kernels import decode_attention
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.decode_attention import PROGRAMS, DECODE_ATTENTION, decode_attention_reference, split_chunk

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=12, deadline=None, derandomize=True)


def with_chunk(problem: dict, chunk: int, **config) -> dict:
    """config with the fewest programs whose splits are `chunk` positions long at this problem."""
    for programs in PROGRAMS:
        if split_chunk(problem, dict(config, PROGRAMS=programs)) == chunk:
            return dict(config, PROGRAMS=programs)
    raise AssertionError(f"no program count makes {chunk}-position splits at {problem}")


def check_decode(B, H, nq, capacity, D, dtype, Hkv=None, new_kv=False, lengths_h=None, rng=np.random.default_rng(0)):
    """With new_kv, the new tokens' keys and values come as views of a fused QKV buffer (as the models
    pass them) and must land in the caches, every other cache position untouched."""
    Hkv = H if Hkv is None else Hkv
    kc = rand((B, Hkv, capacity, D), dtype)
    vc = rand((B, Hkv, capacity, D), dtype)
    if new_kv:
        heads = rand((B, nq, H + 2 * Hkv, D), dtype).transpose(0, 2, 1, 3)
        q, k_new, v_new = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    else:
        q, k_new, v_new = rand((B, H, nq, D), dtype), None, None
    if lengths_h is None:
        lengths_h = rng.integers(nq, capacity + 1, B).astype(np.int32)
        lengths_h[0] = capacity
    new = {} if k_new is None else dict(new_k=host(k_new), new_v=host(v_new))
    ref = decode_attention_reference(host(q), host(kc), host(vc), lengths_h, **new)
    expected_k, expected_v = host(kc), host(vc)
    for b, n in enumerate(lengths_h if new_kv else ()):
        expected_k[b, :, n - nq:n], expected_v[b, :, n - nq:n] = new["new_k"][b], new["new_v"][b]
    out = poisoned((B, H, nq, D), dtype)
    decode_attention(q, kc, vc, cupy.asarray(lengths_h), new_k=k_new, new_v=v_new, out=out)
    assert_close(host(out), ref, TOL[dtype], f"decode_attention {(B, H, Hkv, nq, capacity, D, dtype, new_kv)}")
    assert np.array_equal(host(kc), expected_k) and np.array_equal(host(vc), expected_v), "KV cache contents"
    return q, kc, vc, lengths_h, out


@pytest.mark.parametrize("B,H,Hkv,nq,capacity,D,dtype", [(1, 32, 8, 1, 1024, 64, "bfloat16"),
                                                          (3, 32, 8, 2, 300, 128, "bfloat16"),
                                                          (2, 14, 2, 3, 100, 64, "float32"),
                                                          (1, 8, 1, 1, 4100, 128, "float16")])
def test_grouped_query_decode_attention(B, H, Hkv, nq, capacity, D, dtype):
    check_decode(B, H, nq, capacity, D, dtype, Hkv)
    check_decode(B, H, nq, capacity, D, dtype, Hkv, new_kv=True)


@pytest.mark.parametrize("chunk,BN", [(128, 64), (128, 128), (256, 64), (256, 128), (256, 256)])
def test_decode_splits_merge_and_write_new_keys_at_every_boundary(chunk, BN):
    """Pinned to several splits: the new tokens end on, start on and straddle split boundaries, and
    the merge kernel combines them (repeated calls on fresh data, and a float32 check: the merge read other
    splits' states wrongly at times when the last split to arrive did it, fp32 tiles on an H200)."""
    for nq in (1, 3):
        lengths = np.array([chunk, chunk + 1, chunk + nq, 2 * chunk + nq - 2, 600, nq], np.int32)
        bf16 = dict(B=6, Hkv=2, capacity=600)
        fp32 = dict(B=6, Hkv=4, capacity=600)
        for _ in range(2):
            with DECODE_ATTENTION.pinned(with_chunk(bf16, chunk, BN=BN, occupancy=2)):
                check_decode(6, 8, nq, 600, 64, "bfloat16", 2, new_kv=True, lengths_h=lengths)
            if BN <= 128:       # the space keeps fp32 to 128-key tiles, and off occupancy 2 (wrong-configs.txt)
                with DECODE_ATTENTION.pinned(with_chunk(fp32, chunk, BN=BN, occupancy=4)):
                    check_decode(6, 4, nq, 600, 64, "float32", new_kv=False, lengths_h=lengths)


@pytest.mark.parametrize("capacity,programs,occupancy", [(16384, 1024, 1), (40000, 64, 4)])
def test_long_contexts_many_and_few_splits(capacity, programs, occupancy):
    """128 splits of one sequence (the most there are: many partial states to merge) and a few long ones (10 of 4096
    positions), GQA group 4 and 8, three calls each."""
    with DECODE_ATTENTION.pinned(dict(BN=128, PROGRAMS=programs, occupancy=occupancy)):
        for H, Hkv in ((32, 8), (32, 4)):
            for _ in range(3):
                check_decode(1, H, 1, capacity, 128, "bfloat16", Hkv, new_kv=True)
        check_decode(2, 8, 1, capacity, 64, "bfloat16", 8, lengths_h=np.array([capacity, 3], np.int32))


@GPU
@given(B=st.sampled_from([1, 3, 32]), nq=st.sampled_from([1, 3]), capacity=st.sampled_from([100, 1024, 4100]),
       dtype=st.sampled_from(["bfloat16", "float32"]))
def test_decode_attention_matches_reference(B, nq, capacity, dtype):
    check_decode(B, 4, nq, capacity, 64, dtype)
    check_decode(B, 4, nq, capacity, 64, dtype, new_kv=True)


def test_decode_attention_length_offset():
    q = rand((2, 2, 1, 64), "bfloat16")
    kc, vc = rand((2, 2, 50, 64), "bfloat16"), rand((2, 2, 50, 64), "bfloat16")
    cached = np.array([9, 30], np.int32)
    out = decode_attention(q, kc, vc, cupy.asarray(cached), length_offset=1)
    ref = decode_attention_reference(host(q), host(kc), host(vc), cached + 1)
    assert_close(host(out), ref, TOL["bfloat16"], "decode_attention length_offset")
    k_new, v_new = rand((2, 2, 1, 64), "bfloat16"), rand((2, 2, 1, 64), "bfloat16")
    ref = decode_attention_reference(host(q), host(kc), host(vc), cached + 1, new_k=host(k_new), new_v=host(v_new))
    out = decode_attention(q, kc, vc, cupy.asarray(cached), new_k=k_new, new_v=v_new, length_offset=1)
    assert_close(host(out), ref, TOL["bfloat16"], "decode_attention length_offset new_kv")
    for b, n in enumerate(cached):            # written at the newest position, lengths + offset - 1
        assert np.array_equal(host(kc)[b, :, n], host(k_new)[b, :, 0])
