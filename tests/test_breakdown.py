"""The decode breakdown's bookkeeping on CPU: calls expand to launches, bytes and shares add up."""

import pytest

from benchmarks.breakdown import format_table, kernel_rows, min_bytes, summarize
from tilekit.kernels.decode_attention import DECODE_ATTENTION
from tilekit.kernels.linear import LINEAR

LIN = dict(dtype="bfloat16", M=1, N=4800, K=1600, wt="kn", bias=1, act="none", res=0, tf32=0)
ATT = dict(dtype="bfloat16", B=1, H=25, Hkv=25, nq=1, capacity=256, D=64)


def test_linear_bytes_are_weights_plus_activations():
    assert min_bytes("linear", LIN, 0) == 2 * (1600 + 1600 * 4800 + 4800 + 4800)
    assert min_bytes("decode_attention", ATT, 200) == 2 * 2 * 25 * 200 * 64


def test_calls_expand_to_their_launches_in_order():
    calls = [(LINEAR, LIN), (DECODE_ATTENTION, ATT)]
    kernels = [("linear_kernel_x", 5.0, 105.0), ("decode_split_kernel_y", 4.0, 108.0),
               ("decode_merge_kernel_z", 2.0, 111.0)]          # (name, us, end us): the split overlaps the linear
    rows = kernel_rows(calls, kernels, 200, 4000.0)
    assert [r["kernel"] for r in rows] == ["linear_kernel", "decode_split_kernel", "decode_merge_kernel"]
    assert rows[2]["bytes"] == 0 and rows[1]["bytes"] == min_bytes("decode_attention", ATT, 200)
    assert rows[0]["pct_bandwidth"] == pytest.approx(100 * rows[0]["bytes"] / 5e-6 / 4e12)
    assert [r["path_us"] for r in rows] == [5.0, 3.0, 3.0]
    summary = summarize(rows)
    assert [s["op"] for s in summary] == ["decode_attention", "linear"]
    assert [s["path_us"] for s in summary] == [6.0, 5.0]
    assert sum(s["share"] for s in summary) == pytest.approx(1.0)
    assert "decode_attention" in format_table(summary, 4000.0, 0.02, 0.03)
    with pytest.raises(RuntimeError, match="profiled"):
        kernel_rows(calls, kernels[:2], 200, 4000.0)
    with pytest.raises(RuntimeError, match="was launched"):
        kernel_rows(calls, [kernels[1], kernels[0], kernels[2]], 200, 4000.0)
