"""decode_attention's search space on the CPU: the configs tileiras 13.4 builds wrong on sm_90
(docs/results/wrong-configs.txt) are not candidates at any shape, so no tuned or borrowed entry holds one; the
defaults stay candidates."""

import pytest

from tilekit.kernels.decode_attention import DECODE_ATTENTION


def _problem(dtype, D, B=1, capacity=2048, fp8=0):
    return DECODE_ATTENTION.tuning_problem(dict(dtype=dtype, B=B, H=32, Hkv=8, nq=1, capacity=capacity, D=D,
                                                new_kv=1, fp8=fp8))


def _wrong(c, dtype, D):
    """The measured classes: occupancy 2 with rows of 256+ bytes; 64-key tiles at occupancy 4, 16-bit D128."""
    row_bytes = D * (4 if dtype == "float32" else 2)
    return ((c["occupancy"] == 2 and row_bytes >= 256)
            or (dtype != "float32" and D == 128 and c["BN"] == 64 and c["occupancy"] == 4))


@pytest.mark.parametrize("dtype,D", [("bfloat16", 128), ("float16", 128), ("float32", 64), ("float32", 128),
                                     ("bfloat16", 64)])
@pytest.mark.parametrize("B,capacity,fp8", [(1, 2048, 0), (4, 2048, 0), (8, 131072, 0), (1, 4096, 1)])
def test_no_candidate_is_a_measured_miscompile_and_the_default_stays(dtype, D, B, capacity, fp8):
    p = _problem(dtype, D, B, capacity, fp8)
    candidates = DECODE_ATTENTION.space.candidates(p)
    assert candidates and not [c for c in candidates if _wrong(c, dtype, D)]
    assert DECODE_ATTENTION.space.admits(DECODE_ATTENTION.default(p), p)


def test_64_wide_16_bit_heads_keep_occupancy_2():
    """The exclusion is no wider than measured: bf16 D64 agreed at every config."""
    assert any(c["occupancy"] == 2 for c in DECODE_ATTENTION.space.candidates(_problem("bfloat16", 64)))


def test_a_borrowed_miscompile_is_not_admitted():
    """The entry lookup admits a borrowed config only if the space does at the borrowing shape."""
    p = _problem("bfloat16", 128, B=2)
    assert not DECODE_ATTENTION.space.admits(dict(BN=128, PROGRAMS=64, occupancy=2), p)
    assert DECODE_ATTENTION.space.admits(dict(BN=128, PROGRAMS=64, occupancy=4), p)


@pytest.mark.parametrize("B,Hkv,capacity,splits", [(1, 32, 131072, 8), (1, 8, 131072, 32), (8, 8, 131072, 4),
                                                   (1, 8, 16384, 16), (32, 8, 131072, 1), (1, 32, 4096, 4),
                                                   (1, 12, 2048, 2), (1, 12, 1024, 1)])
def test_a_long_context_fills_the_gpu_whatever_program_count_the_entry_holds(B, Hkv, capacity, splits):
    """An entry tuned at a short context holds few programs (one split per head); at a context long enough for
    1024-position splits the grid still gets 264 programs (or as many as such splits make)."""
    from tilekit.kernels.decode_attention import _splits
    p = _problem("bfloat16", 64, B, capacity)
    p["Hkv"] = Hkv
    assert _splits(p, dict(BN=128, PROGRAMS=1, occupancy=1)) == splits
    assert _splits(p, dict(BN=128, PROGRAMS=4096, occupancy=1)) >= splits
