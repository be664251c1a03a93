"""decode_block (a whole GPT-2 block of a decode step in one persistent launch) against its float64
reference: the residual it adds, the key and value it writes into the cache, and nothing else of the
cache touched; configs pinned across the split, tile and prefetch axes; the model's decode path."""

import math

import numpy as np
import pytest

from tests.gpu.conftest import TOL, assert_close, host, rand

cupy = pytest.importorskip("cupy")

from tilekit.kernels import decode_block  # noqa: E402
from tilekit.kernels.decode_block import DECODE_BLOCK, decode_block_reference  # noqa: E402
from tilekit.kernels.fixed_point import fixed_to_float, float_to_fixed  # noqa: E402

CONFIGS = [None,        # whatever the op resolves (the default here: the tests' tuning cache is empty)
           dict(TN=32, TK=256, BN=64, SPLIT_QKV=1, SPLIT_PROJ=2, SPLIT_FC=2, SPLIT_MP=16, PREFETCH=0, LATENCY=4,
                occupancy=1)]


def block_inputs(B, C, H, capacity, dtype, seed):
    """Fresh random weights (scaled as a trained block's), a fixed-point residual, random caches and
    positions; returns (device arrays in decode_block's order, the residual's float64 values)."""
    def vec(n, scale=0.5, mean=0.0):
        return rand((n,), dtype, scale, mean)
    start = float_to_fixed(np.random.default_rng(seed).standard_normal((B, C)) * 2.0)
    D = C // H
    args = [cupy.asarray(start), vec(C, 0.2, 1.0), vec(C), rand((C, 3 * C), dtype, 1 / math.sqrt(C)), vec(3 * C),
            rand((C, C), dtype, 1 / math.sqrt(C)), vec(C), vec(C, 0.2, 1.0), vec(C),
            rand((C, 4 * C), dtype, 1 / math.sqrt(C)), vec(4 * C), rand((4 * C, C), dtype, 0.5 / math.sqrt(C)), vec(C),
            rand((B, H, capacity, D), dtype), rand((B, H, capacity, D), dtype),
            cupy.asarray(np.random.default_rng(seed + 1).integers(0, capacity, B).astype(np.int32))]
    return args, fixed_to_float(start)


def check_block(B, C, H, capacity, dtype, config, seed=0):
    args, start = block_inputs(B, C, H, capacity, dtype, seed)
    cache_before = [host(args[13]), host(args[14])]
    positions = host(args[15])
    ref_x, ref_k, ref_v = decode_block_reference(start, *map(host, args[1:13]), *cache_before, positions)
    if config is None:
        assert decode_block(*args) is args[0]
    else:
        with DECODE_BLOCK.pinned(config):
            decode_block(*args)
    what = f"decode_block B{B} C{C} H{H} capacity {capacity} {dtype} {config}"
    assert_close(fixed_to_float(cupy.asnumpy(args[0])) - start, ref_x - start, 2 * TOL[dtype], what + " residual")
    for cache, before, ref, name in ((args[13], cache_before[0], ref_k, "key"), (args[14], cache_before[1], ref_v, "value")):
        after = host(cache)
        rows = (np.arange(B), slice(None), positions)
        assert_close(after[rows], ref, TOL[dtype], f"{what} new {name}")
        after[rows] = before[rows]
        assert np.array_equal(after, before), f"{what}: cache {name}s written outside the new positions"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("B,C,H,capacity,dtype", [(1, 1600, 25, 256, "bfloat16"), (3, 768, 12, 200, "float32"),
                                                  (8, 1024, 16, 1024, "bfloat16")])
def test_decode_block_matches_reference(B, C, H, capacity, dtype, config):
    check_block(B, C, H, capacity, dtype, config)


def test_decode_block_repeats_launch_after_launch():
    """The barrier counter is left at zero: the same block twice in a row, on fresh inputs each time."""
    for seed in range(3):
        check_block(2, 768, 12, 128, "bfloat16", None, seed)


def test_generate_with_block_launches_equals_recomputation():
    """Greedy fp32 decoding with every block of a decode step in one launch (graph and eager) gives the
    tokens that recomputing the whole sequence with forward() gives."""
    from tests.gpu.test_model import greedy_by_recomputation
    from tilekit.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2").replace(n_layer=2, block_size=256), dtype="float32", seed=3)
    model.decode_block_launches = True
    prompts = [[5, 17, 900, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42]]
    for use_graph in (True, False):
        out = model.generate(prompts, 12, temperature=0, use_graph=use_graph)
        for prompt, seq in zip(prompts, out):
            assert seq.tolist() == greedy_by_recomputation(model, prompt, 12), use_graph


def test_bad_inputs_name_the_argument():
    args, _ = block_inputs(1, 256, 4, 64, "bfloat16", 0)
    with pytest.raises(TypeError, match="residual has dtype"):
        decode_block(rand((1, 256), "bfloat16"), *args[1:])
    bad = list(args)
    bad[5] = rand((256, 255), "bfloat16")
    with pytest.raises(ValueError, match="proj_weight must have shape"):
        decode_block(*bad)
    bad = list(args)
    bad[15] = cupy.zeros((2,), cupy.int32)
    with pytest.raises(ValueError, match="positions must be"):
        decode_block(*bad)
