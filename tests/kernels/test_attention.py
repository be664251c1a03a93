"""Prefill flash attention on the GPU against its float64 reference: causal and not, grid orders, grouped-query."""

import pytest
from hypothesis import given, settings, strategies as st

from tilekit.kernels import attention
from tilekit.kernels.attention import ATTENTION, attention_reference
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=12, deadline=None, derandomize=True)


def check_attention(B, H, Tq, Tk, D, dtype, causal, Hkv=None):
    """q, k, v as strided views of one fused QKV buffer, the way GPT-2 (Hkv = H) and Llama call it."""
    Hkv = H if Hkv is None else Hkv
    heads = rand((B, Tk, H + 2 * Hkv, D), dtype).transpose(0, 2, 1, 3)
    q, k, v = heads[:, :H, Tk - Tq:], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    out = poisoned((B, Tq, H, D), dtype).transpose(0, 2, 1, 3)
    attention(q, k, v, causal=causal, out=out)
    ref = attention_reference(host(q), host(k), host(v), causal=causal)
    assert_close(host(out), ref, TOL[dtype], f"attention {(B, H, Hkv, Tq, Tk, D, dtype, causal)}")


@GPU
@given(T=st.sampled_from([1, 7, 64, 1023, 1025]), D=st.sampled_from([64, 128, 80]),
       dtype=st.sampled_from(["bfloat16", "float16"]), causal=st.booleans())
def test_attention_matches_reference(T, D, dtype, causal):
    check_attention(2, 3, T, T, D, dtype, causal)


def test_attention_fp32_and_shorter_queries():
    check_attention(1, 2, 5, 77, 64, "float32", True)
    check_attention(2, 1, 33, 40, 64, "bfloat16", False)


@pytest.mark.parametrize("longest_first", [0, 1])
def test_attention_grid_orders(longest_first):
    """Both grid orders cover every (query tile, batch, head) once: several query tiles, grouped heads,
    fewer queries than keys, with and without the causal mask."""
    with ATTENTION.pinned(dict(BM=64, BN=64, LONGEST_FIRST=longest_first, occupancy=2)):
        check_attention(3, 4, 300, 300, 64, "bfloat16", True, Hkv=2)
        check_attention(2, 3, 130, 333, 64, "float16", True)
        check_attention(2, 3, 200, 200, 128, "bfloat16", False)


@pytest.mark.parametrize("H,Hkv,T,D,dtype", [(8, 2, 300, 64, "bfloat16"), (32, 8, 129, 128, "bfloat16"),
                                             (4, 1, 65, 64, "float32"), (6, 3, 1, 64, "float16")])
def test_grouped_query_attention(H, Hkv, T, D, dtype):
    check_attention(2, H, T, T, D, dtype, True, Hkv)
    check_attention(1, H, max(1, T // 3), T, D, dtype, True, Hkv)
