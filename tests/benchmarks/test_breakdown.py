"""The breakdown's bookkeeping on CPU: calls expand to launches, bytes, FLOPs and shares add up."""

import pytest

from benchmarks.studies.breakdown import (format_prefill_table, format_table, kernel_rows, min_bytes, min_flops, short_key,
                                  summarize)
from tilekit.kernels.attention import ATTENTION
from tilekit.kernels.decode_attention import DECODE_ATTENTION
from tilekit.kernels.linear import LINEAR
from tilekit.kernels.next_token import NEXT_TOKEN

LIN = dict(dtype="bfloat16", M=1, N=4800, K=1600, wt="kn", bias=1, act="none", res=0, tf32=0)
ATT = dict(dtype="bfloat16", B=1, H=25, Hkv=25, nq=1, capacity=256, D=64, new_kv=1, fp8=0)
PICK = dict(dtype="bfloat16", B=1, V=50257, pen=0, KS=0, check=0, E=1, L=256)


def test_linear_bytes_are_weights_plus_activations():
    assert min_bytes("linear", LIN, 0) == 2 * (1600 + 1600 * 4800 + 4800 + 4800)
    assert min_bytes("decode_attention", ATT, 200) == 2 * 2 * 25 * (200 + 1) * 64
    assert min_bytes("decode_attention", dict(ATT, new_kv=0), 200) == 2 * 2 * 25 * 200 * 64
    assert min_bytes("decode_attention", dict(ATT, fp8=1), 200) == 2 * 25 * (200 + 1) * 64   # a byte a code


def test_calls_expand_to_their_launches_in_order():
    calls = [(LINEAR, LIN), (DECODE_ATTENTION, ATT), (NEXT_TOKEN, PICK)]
    kernels = [("linear_kernel_x", 5.0, 105.0), ("decode_attention_kernel_y", 4.0, 108.0),
               ("next_token_scan_kernel_z", 2.0, 111.0), ("next_token_finish_kernel_w", 1.0, 112.0)]
    rows = kernel_rows(calls, kernels, 200, 4000.0)    # (name, us, end us): attention overlaps the linear
    assert [r["kernel"] for r in rows] == ["linear_kernel", "decode_attention_kernel", "next_token_scan_kernel",
                                           "next_token_finish_kernel"]     # no check pass without top-p rows
    assert rows[3]["bytes"] == 0 and rows[2]["bytes"] == min_bytes("next_token", PICK, 200)
    assert rows[1]["bytes"] == min_bytes("decode_attention", ATT, 200)
    assert rows[0]["pct_bandwidth"] == pytest.approx(100 * rows[0]["bytes"] / 5e-6 / 4e12)
    assert [r["path_us"] for r in rows] == [5.0, 3.0, 3.0, 1.0]
    summary = summarize(rows)
    assert [s["op"] for s in summary] == ["linear", "decode_attention", "next_token"]
    assert [s["path_us"] for s in summary] == [5.0, 3.0, 4.0]
    assert sum(s["share"] for s in summary) == pytest.approx(1.0)
    assert "decode_attention" in format_table(summary, 4000.0, 0.02, 0.03)
    by_key = summarize(rows, by="key")           # one row per problem, named by its short key
    table = format_table(by_key, 4000.0, 0.02, 0.03, by="key").splitlines()
    assert table[0].startswith("problem") and len(table) == 2 + len(by_key) == 5
    assert table[1].startswith(short_key(rows[0]["key"])) and "linear" in table[1]
    with pytest.raises(RuntimeError, match="profiled"):
        kernel_rows(calls, kernels[:3], 200, 4000.0)
    with pytest.raises(RuntimeError, match="was launched"):
        kernel_rows(calls, [kernels[1], kernels[0], kernels[2], kernels[3]], 200, 4000.0)


def test_a_merge_runs_only_with_several_splits():
    one, several = dict(ATT, capacity=256), dict(ATT, capacity=4096)      # default configs: 1 and 16 splits
    split = [("decode_attention_kernel_a", 4.0, 104.0)]
    assert len(kernel_rows([(DECODE_ATTENTION, one)], split, 200, 4000.0)) == 1
    rows = kernel_rows([(DECODE_ATTENTION, several)], split + [("decode_merge_kernel_b", 1.0, 105.0)], 200, 4000.0)
    assert [r["kernel"] for r in rows] == ["decode_attention_kernel", "decode_merge_kernel"]
    with pytest.raises(RuntimeError, match="profiled"):
        kernel_rows([(DECODE_ATTENTION, several)], split, 200, 4000.0)


PREFILL_ATT = dict(dtype="bfloat16", B=8, H=25, Hkv=25, Tq=1024, Tk=1024, D=64, causal=1)


def test_prefill_rows_group_by_problem_with_their_flops():
    big = dict(LIN, M=8192)
    calls = [(LINEAR, big), (ATTENTION, PREFILL_ATT), (LINEAR, big)]
    kernels = [("linear_kernel_a", 200.0, 200.0), ("attention_kernel_b", 100.0, 300.0),
               ("linear_kernel_c", 220.0, 520.0)]
    rows = kernel_rows(calls, kernels, 1024, 4000.0, lambda op, p: dict(op.default(p), PERSISTENT=0))  # no GPU to size
    assert rows[0]["flops"] == min_flops("linear", big) == 2.0 * 8192 * 4800 * 1600
    assert rows[1]["flops"] == 2.0 * 8 * 25 * 1024 * 1024 * 64          # the causal half of 4 B H T^2 D
    assert min_flops("attention", dict(PREFILL_ATT, causal=0)) == 2 * rows[1]["flops"]
    summary = summarize(rows, by="key")
    assert [s["kernels"] for s in summary] == [2, 1]
    assert summary[0]["us"] == 420.0 and summary[0]["flops"] == 2 * rows[0]["flops"]
    assert short_key(summary[0]["op"]) == "linear K=1600,M=8192,N=4800,bias=1,wt=kn"
    table = format_prefill_table(summary, 800.0, 4000.0, {"ordinary launch": 0.6})
    tflops = 2 * rows[0]["flops"] / 420e-6 / 1e12
    assert f"{tflops:.0f}" in table.splitlines()[1] and f"{100 * tflops / 800:.0f}%" in table.splitlines()[1]
    assert "ordinary launch 0.600 ms" in table.splitlines()[-1]


def test_quantized_ops_bytes_and_flops():
    """quant_linear moves its 8-bit weights once (both halves for SwiGLU) with their fp32 scales; FP8 activations
    are a byte each; quantize_fp8 reads x and writes its bits and scales."""
    p = dict(dtype="bfloat16", M=1, N=4096, K=4096, wq="int8", scale="channel", xq="none", act="none", bias=0, res=1)
    assert min_bytes("quant_linear", p, 0) == 2 * 4096 + 4096 * 4096 + 4 * 4096 + 2 * 2 * 4096
    swiglu = dict(p, M=8192, N=14336, scale="block", xq="fp8", act="swiglu", res=0)
    assert min_bytes("quant_linear", swiglu, 0) == (8192 * 4096 + 2 * (14336 * 4096 + 4 * 112 * 32)
                                                    + 2 * 8192 * 14336)
    assert min_flops("quant_linear", swiglu) == 4.0 * 8192 * 14336 * 4096
    assert min_bytes("quantize_fp8", dict(dtype="bfloat16", M=8, K=4096, group=1), 0) == 3 * 8 * 4096 + 4 * 8 * 32


def test_moe_and_mla_bytes_at_v2_lite_batch_1():
    """One token reads exactly its 6 routed + 2 shared experts' weights (92.3 MB up, 46.1 MB down for V2-Lite); the
    one-expert combine (o_proj) its one matrix and the int64 residual twice; MLA decode the latent cache once."""
    moe = dict(dtype="bfloat16", M=1, slots=8, E=66, I=1408, C=2048)
    assert min_bytes("moe_gate_up", moe, 0) == 2 * (8 * 2 * 1408 * 2048 + 2048 + 8 * 1408)
    assert min_bytes("moe_down_combine", moe, 0) == 2 * (8 * 2048 * 1408 + 8 * 1408) + 4 * 8 + 16 * 2048
    assert min_bytes("moe_down_combine", dict(moe, E=1, slots=1, I=2048), 0) == \
        2 * (2048 * 2048 + 2048) + 4 + 16 * 2048
    assert min_bytes("moe_gate_up", dict(moe, M=8), 0) == 2 * (8 * 2 * 1408 * 2048 + 8 * 2048 + 64 * 1408)
    mla = dict(dtype="bfloat16", B=1, H=16, nq=1, capacity=256, R=512, P=64, new_kv=1)
    assert min_bytes("mla_decode_attention", mla, 200) == 2 * ((200 + 1) * 576 + 16 * (1024 + 64))
    assert min_bytes("moe_router", dict(dtype="bfloat16", M=1, E=64, C=2048, K=6, shared=2, renorm=0), 0) == \
        2 * 65 * 2048 + 8 * 8
    assert min_bytes("head_linear", dict(dtype="bfloat16", M=1, H=16, N=512, K=128, wt="kn"), 0) == \
        2 * 16 * (128 * 512 + 640)
    assert min_bytes("fixed_cast", dict(dtype="bfloat16", M=1, N=2048), 0) == 10 * 2048
