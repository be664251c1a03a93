"""mla_decode_attention's search space and compiled kernel on the CPU: head groups are tiles of the heads axis
(exactly HP heads, at least 16 query rows) or one group of every head, and the kernel keeps its tiles out of local
memory at V2-Lite's decode shapes (it spilled 4.9 KB a thread with the queries as rows)."""

import pytest

from tilekit.kernels.mla_decode_attention import MLA_DECODE_ATTENTION


def problem(H, nq, R=512, capacity=256, B=1):
    return MLA_DECODE_ATTENTION.tuning_problem(dict(dtype="bfloat16", B=B, H=H, nq=nq, capacity=capacity, R=R, P=64,
                                                    new_kv=1))


@pytest.mark.parametrize("H, nq, groups", [(16, 1, {16}), (128, 1, {16, 32}), (16, 4, {4, 8}), (16, 3, {4, 8}),
                                           (4, 1, {4}), (12, 2, {16})])
def test_head_groups_tile_the_heads_axis(H, nq, groups):
    """The HP values of the space at (H, nq): HP dividing H with HP x pow2(nq) >= 16 rows, or one group (HP >= H,
    the tile padded past H), at most 32 rows of 512 latents."""
    p = problem(H, nq)
    assert {c["HP"] for c in MLA_DECODE_ATTENTION.space.candidates(p)} == groups
    assert MLA_DECODE_ATTENTION.default(p)["HP"] == max(groups)


@pytest.mark.parametrize("B, capacity", [(1, 256), (8, 2048)])
def test_the_v2_lite_decode_kernel_spills_nothing(tmp_path, monkeypatch, B, capacity):
    """Per-thread local memory of the sm_90 cubins of the default config, compiled here."""
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cutile"))
    from benchmarks.studies.local_memory import usage
    p = problem(16, 1, capacity=capacity, B=B)
    for kernel, frame, _ in usage(MLA_DECODE_ATTENTION, p, MLA_DECODE_ATTENTION.default(p), "sm_90"):
        assert frame == 0, (kernel, frame)
