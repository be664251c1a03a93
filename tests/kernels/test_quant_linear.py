"""quant_linear on the GPU against the float64 reference of its dequantized weights: INT8 and FP8 weights, per
channel and 128x128 block scales, weight-only and W8A8 (FP8 activations from quantize_fp8), the SwiGLU, bias and
residual epilogues, split-K for few rows."""

import math

import numpy as np
import pytest

from tilekit.kernels import quant_linear, quantize_fp8
from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.quant_linear import FMA, MMA, QBLOCK, QUANT_LINEAR, SWAP, quant_linear_reference

pytestmark = pytest.mark.gpu


def random_weight(rows: int, K: int, kind: str, scale: str, rng):
    """(host weight, host fp32 scales) with fresh random codes: int8 in [-127, 127], FP8 e4m3 of N(0, 1) values
    (NaN codes never drawn); scales around 1/sqrt(K) per channel or per 128x128 block of `rows` rows."""
    import ml_dtypes
    if kind == "int8":
        w = rng.integers(-127, 128, (rows, K)).astype(np.int8)
    else:
        w = rng.standard_normal((rows, K)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    shape = (rows,) if scale == "channel" else (-(-rows // QBLOCK), -(-K // QBLOCK))
    s = (rng.uniform(0.5, 1.5, shape) / math.sqrt(K) / (64 if kind == "int8" else 1)).astype(np.float32)
    return w, s


def check_quant_linear(M, N, K, dtype, kind="fp8", scale="channel", fp8_x=False, swiglu=False, bias=False,
                       res=False):
    import cupy
    rng = np.random.default_rng()
    halves = [random_weight(N, K, kind, scale, rng) for _ in range(2 if swiglu else 1)]
    w, s = (np.concatenate(parts) for parts in zip(*halves))
    b = rand((N,), dtype) if bias else None
    r = rand((M, N), dtype) if res else None
    x = rand((M, K), dtype)
    x_bits = x_scale = None
    if fp8_x:
        x_bits, x_scale = cupy.empty((M, K), cupy.uint8), cupy.empty((M, 1 if scale == "channel" else
                                                                       -(-K // QBLOCK)), cupy.float32)
        quantize_fp8(x, x_bits, x_scale, group=None if scale == "channel" else QBLOCK)
    out = poisoned((M, N), dtype)
    y = quant_linear(x_bits if fp8_x else x, cupy.asarray(w), cupy.asarray(s), b, weight_dtype=kind,
                     x_scale=x_scale, activation="swiglu" if swiglu else None, residual=r, out=out)
    assert y is out
    ref = quant_linear_reference(host(x_bits) if fp8_x else host(x), w, s, None if b is None else host(b),
                                 weight_dtype=kind, x_scale=None if x_scale is None else host(x_scale),
                                 activation="swiglu" if swiglu else None, residual=None if r is None else host(r))
    assert_close(host(y), ref, TOL[dtype], f"quant_linear {(M, N, K, dtype, kind, scale, fp8_x, swiglu, bias, res)}")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("scale", ["channel", "block"])
@pytest.mark.parametrize("M, N, K", [(1, 1000, 1536), (3, 200, 136), (8, 4096, 512), (300, 1031, 200)])
def test_weight_only_matches_reference(kind, scale, M, N, K):
    check_quant_linear(M, N, K, "bfloat16", kind, scale, res=True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_activation_dtypes(dtype):
    check_quant_linear(5, 300, 264, dtype, "int8", bias=True)
    check_quant_linear(130, 300, 264, dtype, "fp8", "block", bias=True, res=True)


@pytest.mark.parametrize("scale", ["channel", "block"])
@pytest.mark.parametrize("M", [1, 4, 200])
def test_swiglu(scale, M):
    """[gate; up] halves with their own scales; N not a multiple of 128 puts a partial block at each half's end."""
    check_quant_linear(M, 300, 520, "bfloat16", "fp8", scale, swiglu=True)
    check_quant_linear(M, 256, 384, "bfloat16", "int8", scale, swiglu=True)


@pytest.mark.parametrize("scale", ["channel", "block"])
@pytest.mark.parametrize("M, N, K", [(1, 512, 1024), (64, 384, 640), (1000, 1031, 1536)])
def test_fp8_activations(scale, M, N, K):
    check_quant_linear(M, N, K, "bfloat16", "fp8", scale, fp8_x=True, res=True)
    check_quant_linear(M, N, K, "bfloat16", "fp8", scale, fp8_x=True, swiglu=True)


@pytest.mark.parametrize("mode", [MMA, SWAP, FMA])
def test_every_split_k_of_a_decode_shape(mode):
    """Each few-row product with each split: 17 K tiles (uneven splits, the last ones empty); block scales with
    the splits the space holds (none for SWAP)."""
    for split in (1, 2, 4, 8, 16):
        config = dict(TM=2 if mode == FMA else 16, TN=32, TK=128, GROUP_M=8, SPLIT_K=split, MODE=mode, PROMOTE=1,
                      occupancy=1, num_worker_warps=0)
        with QUANT_LINEAR.pinned(config):
            check_quant_linear(2, 320, 2112, "bfloat16", "int8", res=True)
            if mode != SWAP or split == 1:
                check_quant_linear(2, 320, 2112, "bfloat16", "fp8", "block", swiglu=True)


@pytest.mark.parametrize("mode, TM, TN, TK", [(SWAP, 16, 64, 128), (SWAP, 16, 128, 256), (SWAP, 32, 32, 512),
                                              (FMA, 1, 16, 512), (FMA, 1, 64, 128), (FMA, 4, 32, 128)])
@pytest.mark.parametrize("kind, scale, fp8_x", [("int8", "channel", False), ("fp8", "channel", False),
                                                ("fp8", "block", False), ("fp8", "block", True)])
def test_decode_products(mode, TM, TN, TK, kind, scale, fp8_x):
    """SWAP (W @ x^T, weights as the register operand) and FMA (elementwise products summed over K) at their
    decode tiles, every weight kind, against the float64 reference; rows 1 and TM (FMA: all its rows), N and K
    not multiples of the tile (K a multiple of 16, as the space keeps split-K SWAP and FMA), K tiles of 128 with
    block scales; K split in two, except SWAP's with block scales (not in the space)."""
    TK = min(TK, QBLOCK) if scale == "block" else TK
    split = 1 if mode == SWAP and scale == "block" else 2
    config = dict(TM=TM, TN=TN, TK=TK, GROUP_M=8, SPLIT_K=split, MODE=mode, PROMOTE=1, occupancy=1,
                  num_worker_warps=0)
    with QUANT_LINEAR.pinned(config):
        for M in sorted({1, TM if mode == FMA else 3}):
            check_quant_linear(M, 1000, 1552, "bfloat16", kind, scale, fp8_x=fp8_x, res=True)
            check_quant_linear(M, 300, 528, "float16", kind, scale, fp8_x=fp8_x, swiglu=True)


@pytest.mark.parametrize("mode, promote, TK, warps", [(MMA, 1, 128, 8), (MMA, 2, 64, 8), (MMA, 4, 128, 0),
                                                      (MMA, 2, 128, 8), (SWAP, 1, 128, 8), (SWAP, 2, 64, 8),
                                                      (MMA, 0, 128, 8), (SWAP, 0, 128, 0)])
def test_w8a8_promotion(mode, promote, TK, warps):
    """FP8 x FP8 with fast accumulation promoted into fp32 every `promote` K tiles (up to 512 products), or never
    (0): within the bf16 tolerance of the float64 reference of the same FP8 bits at K = 4096 (32 promotions of 128,
    8 of 512), and K not a multiple of the promotion interval; MMA and SWAP tiles."""
    TM, TN = (128, 128) if warps else (64, 64)
    config = dict(TM=TM, TN=TN, TK=TK, GROUP_M=8, SPLIT_K=1, MODE=mode, PROMOTE=promote, occupancy=1,
                  num_worker_warps=warps)
    with QUANT_LINEAR.pinned(config):
        check_quant_linear(300, 520, 4096, "bfloat16", "fp8", "channel", fp8_x=True, res=True)
        check_quant_linear(200, 264, 1000, "bfloat16", "fp8", "channel", fp8_x=True, swiglu=True)


@pytest.mark.parametrize("mode", [MMA, SWAP])
def test_w8a8_unpromoted_wide_tile(mode):
    """The prefill tile that fast accumulation without promotion allows (128 x 256, two warpgroups, no partial
    sum): within the bf16 tolerance of the float64 reference at Llama-3.1-8B's longest K (14336) too."""
    config = dict(TM=128, TN=256, TK=128, GROUP_M=8, SPLIT_K=1, MODE=mode, PROMOTE=0, occupancy=1,
                  num_worker_warps=8)
    with QUANT_LINEAR.pinned(config):
        check_quant_linear(384, 520, 14336, "bfloat16", "fp8", "channel", fp8_x=True, res=True)
        check_quant_linear(200, 264, 4096, "bfloat16", "fp8", "channel", fp8_x=True)


@pytest.mark.parametrize("kind, scale", [("int8", "channel"), ("fp8", "block")])
def test_many_rows_swap(kind, scale):
    """Weight-only many-row tiles of the SWAP product (W @ x^T, the converted weights the register operand)."""
    config = dict(TM=128, TN=64, TK=64, GROUP_M=8, SPLIT_K=1, MODE=SWAP, PROMOTE=1, occupancy=1,
                  num_worker_warps=8 if scale == "block" else 0)
    with QUANT_LINEAR.pinned(config):
        check_quant_linear(300, 1031, 520, "bfloat16", kind, scale, bias=True, res=True)
        check_quant_linear(130, 300, 264, "float16", kind, scale, swiglu=True)


@pytest.mark.parametrize("M", [1, 200])
def test_row_strided_out(M):
    """out a column slice of a wider buffer (DeepSeek-V2 writes the queries after its rotary key so): the columns
    around it stay as they were, split-K (few rows) and whole tiles alike."""
    import cupy
    rng = np.random.default_rng()
    w, s = random_weight(300, 256, "fp8", "block", rng)
    x, wide = rand((M, 256), "bfloat16"), poisoned((M, 64 + 300 + 40), "bfloat16")
    before = cupy.asnumpy(wide.view(cupy.uint16))
    y = quant_linear(x, cupy.asarray(w), cupy.asarray(s), weight_dtype="fp8", out=wide[:, 64:364])
    ref = quant_linear_reference(host(x), w, s, weight_dtype="fp8")
    assert_close(host(y), ref, TOL["bfloat16"], f"quant_linear strided out M{M}")
    after = cupy.asnumpy(wide.view(cupy.uint16))
    np.testing.assert_array_equal(after[:, :64], before[:, :64])
    np.testing.assert_array_equal(after[:, 364:], before[:, 364:])


def test_bad_arguments_name_themselves():
    import cupy
    x = rand((2, 64), "bfloat16")
    w, s = cupy.zeros((32, 64), cupy.int8), cupy.ones((32,), cupy.float32)
    with pytest.raises(TypeError, match="weight has dtype int8"):
        quant_linear(x, w, s, weight_dtype="fp8")
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        quant_linear(x, w, cupy.ones((31,), cupy.float32), weight_dtype="int8")
    with pytest.raises(ValueError, match="x_scale .* needs FP8 weights"):
        quant_linear(cupy.zeros((2, 64), cupy.uint8), w, s, weight_dtype="int8", x_scale=cupy.ones((2, 1), cupy.float32))
