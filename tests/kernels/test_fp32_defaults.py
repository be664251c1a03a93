"""Untuned fp32 configs on the CPU: linear's fp32 products run on tensor cores as three tf32 products, its many-row
defaults the largest of a few measured tiles that still makes enough output tiles; the few-row ones keep K steps of
32 and small tiles, as do attention's and SwiGLU's; the bf16 and fp16 defaults are not touched."""

import pytest

from tilekit.kernels.attention import ATTENTION
from tilekit.kernels.decode_attention import DECODE_ATTENTION
from tilekit.kernels.linear import LINEAR, MIN_TILES
from tilekit.kernels.residual_linear import RESIDUAL_LINEAR
from tilekit.kernels.swiglu_linear import SWIGLU_LINEAR


def _linear(dtype, M, N, K, wt="kn"):
    return LINEAR.default(LINEAR.tuning_problem(dict(dtype=dtype, M=M, N=N, K=K, wt=wt, bias=1, act="none", res=0,
                                                     tf32=0)))


@pytest.mark.parametrize("M, N, K, wt, tile", [
    (4096, 2304, 768, "kn", (128, 128, 32, 8)), (8192, 768, 3072, "kn", (128, 128, 32, 8)),
    (128, 50257, 768, "nk", (128, 128, 32, 8)), (128, 2304, 768, "kn", (64, 64, 64, 0)),
    (256, 768, 768, "kn", (64, 64, 32, 0)), (128, 768, 768, "kn", (32, 32, 32, 0)),
    (300, 20, 20, "kn", (64, 64, 32, 0))])
def test_fp32_many_rows_take_the_largest_tile_that_makes_enough_output_tiles(M, N, K, wt, tile):
    c = _linear("float32", M, N, K, wt)
    assert (c["TM"], c["TN"], c["TK"], c["num_worker_warps"], c["SPLIT_K"]) == (*tile, 1)
    assert LINEAR.space.contains(c)
    problem = LINEAR.tuning_problem(dict(dtype="float32", M=M, N=N, K=K, wt=wt, bias=1, act="none", res=0, tf32=0))
    assert LINEAR.space.admits(c, problem) or not LINEAR.space.candidates(problem)    # (300 x 20: no candidate)


def test_fp32_k_steps_of_32_are_candidates_where_bf16_needs_64():
    """The rule is 128 bytes per K step: fp32 at 32, bf16 at 64 (bf16's candidates did not change)."""
    fp32, bf16 = (LINEAR.tuning_problem(dict(dtype=dt, M=4096, N=2304, K=768, wt="kn", bias=1, act="none", res=0,
                                             tf32=0)) for dt in ("float32", "bfloat16"))
    tile = dict(TM=128, TN=128, TK=32, GROUP_M=8, SPLIT_K=1, PERSISTENT=0, occupancy=1, num_ctas=1, num_worker_warps=8)
    assert LINEAR.space.admits(tile, fp32) and not LINEAR.space.admits(tile, bf16)
    assert LINEAR.space.admits(dict(tile, TK=64), bf16)


@pytest.mark.parametrize("M, N, K, wt", [(1, 2304, 768, "kn"), (1, 768, 768, "kn"), (8, 3072, 768, "kn"),
                                         (1, 50257, 768, "nk"), (1, 2048, 2048, "kn"), (3, 40, 32, "kn")])
def test_fp32_few_rows_take_16x32x32_tiles_split_over_k_until_two_programs_per_sm(M, N, K, wt):
    c = _linear("float32", M, N, K, wt)
    assert (c["TM"], c["TN"], c["TK"]) == (16, 32, 32) and LINEAR.space.contains(c)
    tiles, k_tiles = -(-N // 32), -(-K // 32)
    assert c["SPLIT_K"] <= max(1, k_tiles // 2) + (k_tiles == 1)
    assert c["SPLIT_K"] == 8 or tiles * c["SPLIT_K"] >= 2 * MIN_TILES or 2 * c["SPLIT_K"] > k_tiles
    assert c["SPLIT_K"] == 1 or tiles * c["SPLIT_K"] // 2 < 2 * MIN_TILES


def test_bf16_and_fp16_defaults_are_unchanged():
    for dtype in ("bfloat16", "float16"):
        assert {k: _linear(dtype, 1, 2304, 768)[k] for k in ("TM", "TN", "TK", "SPLIT_K")} == \
            dict(TM=16, TN=32, TK=128, SPLIT_K=1)
        wide = _linear(dtype, 1024, 2304, 768)
        assert (wide["TM"], wide["TN"], wide["PERSISTENT"], wide["num_worker_warps"]) == (128, 256, 1, 8)
    attention = dict(B=1, H=12, Hkv=12, Tq=128, Tk=128, D=64, causal=1)
    assert ATTENTION.default(ATTENTION.tuning_problem(dict(attention, dtype="bfloat16")))["BN"] == 128
    assert ATTENTION.default(ATTENTION.tuning_problem(dict(attention, dtype="float32")))["BN"] == 64
    decode = dict(B=1, H=12, Hkv=12, nq=1, capacity=256, D=64, new_kv=1, fp8=0)
    assert DECODE_ATTENTION.default(DECODE_ATTENTION.tuning_problem(dict(decode, dtype="bfloat16")))["BN"] == 128
    assert DECODE_ATTENTION.default(DECODE_ATTENTION.tuning_problem(dict(decode, dtype="float32")))["BN"] == 64
    residual = dict(M=1, N=768, K=768, bias=1)
    assert RESIDUAL_LINEAR.default(RESIDUAL_LINEAR.tuning_problem(dict(residual, dtype="bfloat16")))["TN"] == 64
    assert RESIDUAL_LINEAR.default(RESIDUAL_LINEAR.tuning_problem(dict(residual, dtype="float32")))["TN"] == 32
    for M, tm in ((1, 16), (8192, 64)):
        c = SWIGLU_LINEAR.default(SWIGLU_LINEAR.tuning_problem(dict(dtype="float32", M=M, N=8192, K=2048)))
        assert (c["TM"], c["TN"], c["TK"]) == (tm, 32, 32) and SWIGLU_LINEAR.space.contains(c)
        bf16 = SWIGLU_LINEAR.default(SWIGLU_LINEAR.tuning_problem(dict(dtype="bfloat16", M=M, N=8192, K=2048)))
        assert (bf16["TN"], bf16["TK"]) == ((32, 128) if M == 1 else (64, 64))


def test_the_fp32_study_refuses_bad_sizes_before_touching_a_gpu():
    from benchmarks.studies import fp32_prefill
    with pytest.raises(SystemExit):
        fp32_prefill.main(["--batch", "0"])


def test_the_fp32_many_row_defaults_barely_spill(tmp_path, monkeypatch):
    """Read from sm_90 cubins compiled here: local-memory bytes per thread of the fp32 many-row defaults, whose
    operands are split for three tf32 products in registers (under FMA products the old 128x128x64 tile spilled
    6.7 KB, docs/results/fp32-tiles-sm90.txt)."""
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cutile"))
    from benchmarks.studies.local_memory import usage
    for M, N in ((4096, 2304), (128, 2304), (128, 768)):
        p = LINEAR.tuning_problem(dict(dtype="float32", M=M, N=N, K=768, wt="kn", bias=1, act="none", res=0, tf32=0))
        (_, frame, _), = usage(LINEAR, p, LINEAR.default(p), "sm_90")
        assert frame <= 256, (M, N, LINEAR.default(p), frame)
