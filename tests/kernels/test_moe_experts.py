"""moe_gate_up and moe_down_combine against their float64 references on the GPU: fresh random inputs and routings
(decode: one token; prefill: many, some experts crowded, some unused), moe_permute's order, poisoned outputs,
row by row; the fixed-point combine bit-exact across runs and splits."""

import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand  # noqa: E402
from tilekit.kernels.tiles import fixed_to_float, float_to_fixed  # noqa: E402
from tilekit.kernels.moe_down_combine import MOE_DOWN_COMBINE, moe_down_combine, moe_down_combine_reference  # noqa
from tilekit.kernels.moe_gate_up import MOE_GATE_UP, moe_gate_up, moe_gate_up_reference  # noqa: E402
from tilekit.kernels.moe_permute import moe_permute_reference  # noqa: E402

CASES = [(1, 8, 66, 1408, 2048, "bfloat16"), (8, 8, 66, 1408, 2048, "bfloat16"), (300, 8, 66, 1408, 2048, "bfloat16"),
         (2000, 8, 66, 96, 256, "bfloat16"), (5, 3, 8, 40, 72, "float32"), (33, 2, 4, 200, 136, "float16")]


def routed(M, slots, E, rng):
    """Distinct experts per token, crowded towards the low ids (some never hit); (ids, offsets, sorted pairs)."""
    p = np.linspace(1, 0.05, E) ** 3
    ids = np.stack([rng.choice(E, slots, replace=False, p=p / p.sum()) for _ in range(M)]).astype(np.int32)
    return (ids, *moe_permute_reference(ids, E))


def down_reference(act, down, ids, order, weights) -> np.ndarray:
    """moe_down_combine_reference of sorted-order rows act (row r is pair order[r])."""
    M, slots = ids.shape
    pair_act = np.empty((M * slots, act.shape[1]))
    pair_act[order] = host(act)
    return moe_down_combine_reference(pair_act.reshape(M, slots, -1), host(down), ids, host(weights))


def check_gate_up(M, slots, E, I, C, dtype, rng=np.random.default_rng(0)):
    ids, offsets, order = routed(M, slots, E, rng)
    x, gate_up = rand((M, C), dtype), rand((E, 2 * I, C), dtype, 1 / math.sqrt(C))
    out = poisoned((M * slots, I), dtype)
    assert moe_gate_up(x, gate_up, cupy.asarray(offsets), cupy.asarray(order), out=out) is out
    ref = moe_gate_up_reference(host(x), host(gate_up), ids).reshape(M * slots, I)[order]
    assert_close(host(out), ref, TOL[dtype], f"moe_gate_up {(M, slots, E, I, C, dtype)}")


def check_down_combine(M, slots, E, I, C, dtype, rng=np.random.default_rng(1)):
    ids, offsets, order = routed(M, slots, E, rng)
    act, down = rand((M * slots, I), dtype), rand((E, C, I), dtype, 1 / math.sqrt(I))
    weights = cupy.asarray(rng.random((M, slots)), cupy.float32)
    start = rng.standard_normal((M, C)) * 3
    args = (act, down, weights, cupy.asarray(offsets), cupy.asarray(order))
    acc = cupy.asarray(float_to_fixed(start))
    moe_down_combine(*args, acc)
    ref = down_reference(act, down, ids, order, weights)
    assert_close(fixed_to_float(host(acc)) - start, ref, 1e-4, f"moe_down_combine {(M, slots, E, I, C, dtype)}")
    again = cupy.asarray(float_to_fixed(start))
    moe_down_combine(*args, again)
    assert cupy.array_equal(again, acc), "the fixed-point combine must give the same bits every run"


@pytest.mark.parametrize("M, slots, E, I, C, dtype", CASES)
def test_gate_up_matches_reference(M, slots, E, I, C, dtype):
    check_gate_up(M, slots, E, I, C, dtype)


@pytest.mark.parametrize("M, slots, E, I, C, dtype", CASES)
def test_down_combine_matches_reference(M, slots, E, I, C, dtype):
    check_down_combine(M, slots, E, I, C, dtype)


def test_every_gate_up_tile_shape_for_decode():
    p = MOE_GATE_UP.tuning_problem(dict(dtype="bfloat16", M=1, slots=8, E=66, I=1408, C=2048))
    for config in MOE_GATE_UP.space.candidates(p):
        with MOE_GATE_UP.pinned(config):
            check_gate_up(1, 8, 66, 1408, 2048, "bfloat16")


def test_every_split_agrees():
    """Every config matches the reference, and the configs agree with each other to fp32 rounding: each sums its
    own split of the inner dimension in fp32 before the exact fixed-point combine, so the bits may differ by a few
    units in the last place of an fp32 output."""
    M, slots, E, I, C = 2, 8, 66, 1408, 2048
    rng = np.random.default_rng(5)
    ids, offsets, order = routed(M, slots, E, rng)
    act, down = rand((M * slots, I), "bfloat16"), rand((E, C, I), "bfloat16", 1 / math.sqrt(I))
    weights, start = cupy.asarray(rng.random((M, slots)), cupy.float32), rng.standard_normal((M, C))
    ref = down_reference(act, down, ids, order, weights)
    p = MOE_DOWN_COMBINE.tuning_problem(dict(dtype="bfloat16", M=M, slots=slots, E=E, I=I, C=C))
    results = []
    for config in [c for c in MOE_DOWN_COMBINE.space.candidates(p) if c["TN"] == 64 and c["occupancy"] == 1]:
        acc = cupy.asarray(float_to_fixed(start))
        with MOE_DOWN_COMBINE.pinned(config):
            moe_down_combine(act, down, weights, cupy.asarray(offsets), cupy.asarray(order), acc)
        results.append(fixed_to_float(host(acc)) - start)
        assert_close(results[-1], ref, 1e-4, f"moe_down_combine {config}")
    assert len(results) > 1
    ulp = np.finfo(np.float32).eps * np.abs(ref).max()
    assert all(np.abs(r - results[0]).max() <= 16 * ulp for r in results)
