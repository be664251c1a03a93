"""quant_linear's and quantize_fp8's argument checks and problems on MetaArrays (no GPU), and their spaces: every
problem of the key's choices has candidates and a default inside them."""

import itertools

import pytest

from tilekit.autotune.arrays import MetaArray
from tilekit.autotune.op import recording
from tilekit.kernels import quant_linear, quantize_fp8
from tilekit.kernels.quant_linear import QUANT_LINEAR
from tilekit.kernels.quantize_fp8 import QUANTIZE_FP8


def a(shape, dtype="bfloat16"):
    return MetaArray(shape, dtype)


def test_calls_make_the_expected_problems():
    with recording() as calls:
        y = quant_linear(a((2, 3, 4096)), a((2 * 14336, 4096), "uint8"), a((224, 32), "float32"), weight_dtype="fp8",
                         activation="swiglu")
        q, s = quantize_fp8(a((8192, 4096)), a((8192, 4096), "uint8"), a((8192, 1), "float32"))
        quant_linear(q, a((4096, 4096), "uint8"),
                     a((4096,), "float32"), weight_dtype="fp8", x_scale=s, residual=a((8192, 4096)),
                     out=a((8192, 4096)))
    assert y.shape == (2, 3, 14336) and y.dtype == "bfloat16"
    assert [(op.name, p) for op, p in calls] == [
        ("quant_linear", dict(dtype="bfloat16", M=6, N=14336, K=4096, wq="fp8", scale="block", xq="none",
                              act="swiglu", bias=0, res=0)),
        ("quantize_fp8", dict(dtype="bfloat16", M=8192, K=4096, group=0)),
        ("quant_linear", dict(dtype="bfloat16", M=8192, N=4096, K=4096, wq="fp8", scale="channel", xq="fp8",
                              act="none", bias=0, res=1))]


def test_out_may_be_a_column_slice():
    """Rows of out may be strided (DeepSeek-V2 writes its queries after the rotary key in one buffer)."""
    wide = a((2, 100))
    with recording() as calls:
        y = quant_linear(a((2, 64)), a((32, 64), "int8"), a((32,), "float32"), weight_dtype="int8", out=wide[:, 10:42])
    assert y.shape == (2, 32) and calls[0][1]["N"] == 32


@pytest.mark.parametrize("call, error, match", [
    (lambda: quant_linear(a((2, 64)), a((32, 64), "int8"), a((32,), "float32"), weight_dtype="int4"), ValueError,
     "weight_dtype must be"),
    (lambda: quant_linear(a((2, 64)), a((32, 64), "uint8"), a((32,), "float32"), weight_dtype="int8"), TypeError,
     "weight has dtype uint8"),
    (lambda: quant_linear(a((2, 64)), a((32, 64), "int8"), a((32,), "bfloat16"), weight_dtype="int8"), TypeError,
     "weight_scale has dtype"),
    (lambda: quant_linear(a((2, 64)), a((32, 64), "int8"), a((31,), "float32"), weight_dtype="int8"), ValueError,
     r"weight_scale must have shape \(32,\) \(per channel\) or \(1, 1\)"),
    (lambda: quant_linear(a((2, 63)), a((32, 64), "int8"), a((32,), "float32"), weight_dtype="int8"), ValueError,
     "x must have last dimension 64"),
    (lambda: quant_linear(a((2, 64)), a((33, 64), "int8"), a((33,), "float32"), weight_dtype="int8",
                          activation="swiglu"), ValueError, "of 2N rows"),
    (lambda: quant_linear(a((2, 64)), a((32, 64), "int8"), a((32,), "float32"), weight_dtype="int8",
                          activation="gelu"), ValueError, "activation must be"),
    (lambda: quant_linear(a((2, 64), "uint8"), a((32, 64), "int8"), a((32,), "float32"), weight_dtype="int8",
                          x_scale=a((2, 1), "float32")), ValueError, "needs FP8 weights"),
    (lambda: quant_linear(a((2, 64), "uint8"), a((32, 64), "uint8"), a((32,), "float32"), weight_dtype="fp8",
                          x_scale=a((2, 2), "float32"), out=a((2, 32))), ValueError, r"x_scale must have shape \(2, 1\)"),
    (lambda: quant_linear(a((2, 64), "uint8"), a((32, 64), "uint8"), a((32,), "float32"), weight_dtype="fp8",
                          x_scale=a((2, 1), "float32")), ValueError, "out must be given"),
    (lambda: quant_linear(a((2, 64)), a((64, 64), "int8"), a((64,), "float32"), a((32,)), weight_dtype="int8",
                          activation="swiglu"), ValueError, "bias is not supported"),
    (lambda: quant_linear(a((2, 64)), a((32, 64), "int8"), a((32,), "float32"), weight_dtype="int8",
                          residual=a((2, 31))), ValueError, "residual must have shape"),
    (lambda: quantize_fp8(a((2, 64)), a((2, 64), "uint8"), a((2, 1), "float32"), group=64), ValueError,
     "group must be None"),
    (lambda: quantize_fp8(a((2, 200)), a((2, 200), "uint8"), a((2, 1), "float32"), group=128), ValueError,
     r"scale has shape \(2, 1\), expected \(2, 2\)"),
    (lambda: quantize_fp8(a((2, 64)), a((2, 64), "int8"), a((2, 1), "float32")), TypeError, "out has dtype int8"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("dtype, M", list(itertools.product(["bfloat16", "float16", "float32"], [1, 5, 64, 200, 8192])))
def test_every_problem_has_a_space_and_a_default_in_it(dtype, M):
    for wq, scale, xq, act, res in itertools.product(["int8", "fp8"], ["channel", "block"], ["none", "fp8"],
                                                     ["none", "swiglu"], [0, 1]):
        if xq == "fp8" and wq == "int8":
            continue
        p = QUANT_LINEAR.tuning_problem(dict(dtype=dtype, M=M, N=1031, K=200, wq=wq, scale=scale, xq=xq, act=act,
                                             bias=0, res=res))
        assert QUANT_LINEAR.space.candidates(p) and QUANT_LINEAR.space.contains(QUANT_LINEAR.default(p)), p
    for group in (0, 1):
        p = QUANTIZE_FP8.tuning_problem(dict(dtype=dtype, M=M, K=14336, group=group))
        assert QUANTIZE_FP8.space.candidates(p) and QUANTIZE_FP8.space.contains(QUANTIZE_FP8.default(p)), p


def test_swap_and_fma_split_k_only_over_16_byte_weight_rows():
    """SWAP and FMA split over K summed wrongly where W's rows were not 16 bytes apart (K = 1544, an H200): the space
    and the default leave those splits out there, and keep them where K is a multiple of 16."""
    from tilekit.kernels.quant_linear import MMA
    for K in (14336, 14344, 1544, 1552):
        p = QUANT_LINEAR.tuning_problem(dict(dtype="bfloat16", M=1, N=1024, K=K, wq="int8", scale="channel",
                                             xq="none", act="none", bias=0, res=0))
        split = [c for c in QUANT_LINEAR.space.candidates(p) if c["SPLIT_K"] > 1 and c["MODE"] != MMA]
        assert bool(split) == (K % 16 == 0), K
        default = QUANT_LINEAR.default(p)
        assert default["MODE"] != MMA and (default["SPLIT_K"] > 1) == (K == 14336), (K, default)


@pytest.mark.parametrize("xq", ["none", "fp8"])
def test_no_split_k_swap_with_block_scales(xq):
    """Split-K SWAP launches with block scales now and then never finished (H100, H200): neither the space nor the
    default holds one, while MMA and FMA keep their splits and channel scales keep SWAP's."""
    from tilekit.kernels.quant_linear import FMA, MMA, SWAP
    for scale in ("block", "channel"):
        p = QUANT_LINEAR.tuning_problem(dict(dtype="bfloat16", M=1, N=1024, K=14336, wq="fp8", scale=scale, xq=xq,
                                             act="swiglu", bias=0, res=0))
        candidates = QUANT_LINEAR.space.candidates(p)
        split = {c["MODE"] for c in candidates if c["SPLIT_K"] > 1}
        assert split == ({MMA, FMA} if scale == "block" else {MMA, FMA, SWAP}), (scale, split)
        default = QUANT_LINEAR.default(p)
        assert default["MODE"] == SWAP and (default["SPLIT_K"] > 1) == (scale == "channel"), (scale, default)


def test_only_one_row_launches_dependently():
    (launch,) = QUANT_LINEAR.launches
    for M, dependent in ((1, True), (2, False), (8, False), (8192, False)):
        problem = dict(dtype="bfloat16", M=M, N=4096, K=4096, wq="fp8", scale="channel", xq="none", act="none",
                       bias=0, res=0)
        assert launch.dependent(problem, QUANT_LINEAR.default(problem)) is dependent
