"""benchmarks.studies.long_context on the CPU: its refusals before any GPU work, and the summary table it prints
last."""

import math

import pytest

from benchmarks.studies import long_context


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--layers", "33"], ["--parts", "decode,training"]])
def test_bad_arguments_are_refused_before_any_gpu_work(argv, capsys):
    with pytest.raises(SystemExit) as e:
        long_context.main(argv)
    assert e.value.code == 2
    assert "--layers must lie in 1..32 and --parts name decode, prefill or model" in capsys.readouterr().err


def test_summary_table_takes_geomeans_and_the_worst_row():
    decode = [dict(cache="bf16", B=1, D=64, Hkv=8, context=4096, vs_sdpa=0.5, pct_copy=40.0, vs_sdpa_graph=0.8,
                   pct_copy_graph=60.0),
              dict(cache="bf16", B=1, D=128, Hkv=32, context=32768, vs_sdpa=2.0, pct_copy=85.0, vs_sdpa_graph=1.25,
                   pct_copy_graph=math.nan),
              dict(cache="fp8", B=1, D=64, Hkv=8, context=4096, vs_sdpa=math.nan, pct_copy=30.0)]
    prefill = [dict(B=4, H=16, T=2048, D=128, vs_sdpa=1.1, tflops=512.0)]
    model = [dict(model="llama-3.1-8b shape, 4 of 32 layers", context=8192, vs_compiled=1.25, bf16_ms=1.0,
                  fp8_ms=0.8)]
    table = long_context.summary_table(dict(decode=decode, prefill=prefill, model=model)).splitlines()
    assert table[2] == "| decode bf16 B1 | 2 | 1.00x | 0.50x (D64 G4 ctx 4096) | 40% | 1.00x | 60% |"
    assert table[3] == "| decode fp8 B1 | 1 | nanx | nanx (D64 G4 ctx 4096) | 30% | nanx | nan% |"
    assert table[4] == "| prefill B4 H16 T2048 D128 | 1 | 1.10x | 512 TFLOP/s | - | - | - |"
    assert table[5].startswith("| llama-3.1-8b shape, 4 of 32 layers ctx 8192 | 1 | 1.25x (1.000 ms/token")


def test_kernel_calls_are_the_rows_problems_with_every_key_field():
    """What the study compiles up front: each decode shape with both caches, each prefill shape; every problem
    holds the fields its op's key reads, and the shapes whose bf16 cache exceeds the cap are left out."""
    calls = long_context.kernel_calls(["decode", "prefill"])
    shapes = list(long_context.decode_shapes())
    assert len(calls) == 2 * len(shapes) + len(long_context.PREFILL)
    assert all(2 * B * Hkv * ctx * D * 2 <= long_context.MAX_CACHE_BYTES for B, Hkv, D, ctx in shapes)
    assert (32, 32, 128, 131072) not in shapes and (1, 32, 64, 131072) in shapes
    for op, problem in calls:
        assert op.space.candidates(op.tuning_problem(problem)), (op.name, problem)
        assert set(op.fields) == set(problem), (op.name, sorted(set(op.fields) ^ set(problem)))
    assert long_context.kernel_calls(["model"]) == []
