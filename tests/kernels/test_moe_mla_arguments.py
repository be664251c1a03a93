"""The argument checks of the MoE and MLA ops and of the DeepSeek-V2 model's other new ops (fixed_cast, head_linear,
mla_kv), on MetaArrays (no GPU): every bad argument is named before anything launches, and good calls make the
problems the tuning keys expect."""

import pytest

from tilekit.autotune.arrays import MetaArray
from tilekit.autotune.op import recording
from tilekit.kernels import (fixed_cast, head_linear, mla_decode_attention, mla_kv, moe_down_combine, moe_gate_up,
                             moe_permute, moe_router)


def a(shape, dtype="bfloat16"):
    return MetaArray(shape, dtype)


def test_a_decode_step_of_v2_lite_makes_the_expected_problems():
    with recording() as calls:
        ids, weights = moe_router(a((1, 2048)), a((64, 2048)), 6, shared=2)
        offsets, order = moe_permute(ids, 66)
        act = moe_gate_up(a((1, 2048)), a((66, 2816, 2048)), offsets, order)
        moe_down_combine(act, a((66, 2048, 1408)), weights, offsets, order, a((1, 2048), "int64"))
        latents, queries = a((1, 4096, 576)), a((1, 1, 16, 576)).transpose(0, 2, 1, 3)
        out = mla_decode_attention(queries[:, :, :, :512], queries[:, :, :, 512:], latents[:, :, :512],
                                   latents[:, :, 512:], a((1,), "int32"), scale=0.1147, new_c=a((1, 1, 512)),
                                   new_pe=a((1, 1, 64)), length_offset=1)
    assert (ids.shape, ids.dtype, weights.dtype, offsets.shape, order.shape, act.shape, out.shape) == (
        (1, 8), "int32", "float32", (67,), (8,), (8, 1408), (1, 16, 1, 512))
    assert [(op.name, problem) for op, problem in calls] == [
        ("moe_router", dict(dtype="bfloat16", M=1, E=64, C=2048, K=6, shared=2, renorm=0)),
        ("moe_permute", dict(P=8, E=66)),
        ("moe_gate_up", dict(dtype="bfloat16", M=1, slots=8, E=66, I=1408, C=2048)),
        ("moe_down_combine", dict(dtype="bfloat16", M=1, slots=8, E=66, I=1408, C=2048)),
        ("mla_decode_attention", dict(dtype="bfloat16", B=1, H=16, nq=1, capacity=4096, R=512, P=64, new_kv=1))]


@pytest.mark.parametrize("call, error, match", [
    (lambda: moe_router(a((4, 64)), a((8, 64)), 9), ValueError, "top_k must be an int in"),
    (lambda: moe_router(a((4, 64)), a((8, 64)), 2, shared=-1), ValueError, "shared must be an int in"),
    (lambda: moe_router(a((4, 64)), a((8, 64)), 2.0), TypeError, "top_k must be an int"),
    (lambda: moe_router(a((4, 64)), a((8, 32)), 2), ValueError, "gate_weight must be"),
    (lambda: moe_router(a((4, 64)), a((300, 64)), 2), ValueError, "gate_weight must be"),
    (lambda: moe_router(a((4, 64)), a((8, 64), "float32"), 2), TypeError, "gate_weight has dtype float32"),
    (lambda: moe_router(a((4, 64)), a((8, 64)), 2, scale=0.0), ValueError, "scale"),
    (lambda: moe_router(a((4, 64)), a((8, 64)), 2, renormalize=1), ValueError, "renormalize"),
    (lambda: moe_router(a((4, 64)), a((8, 64)), 2, topk_ids=a((4, 3), "int32")), ValueError, "topk_ids has shape"),
    (lambda: moe_router(a((4, 64)), a((8, 64)), 2, topk_weights=a((4, 2))), TypeError, "topk_weights has dtype"),
    (lambda: moe_permute(a((4, 2), "int64"), 4), TypeError, "topk_ids has dtype int64"),
    (lambda: moe_permute(a((4, 2), "int32"), 0), ValueError, "n_experts"),
    (lambda: moe_permute(a((4, 2), "int32"), 4, sorted_pairs=a((7,), "int32")), ValueError, "sorted_pairs has shape"),
    (lambda: moe_gate_up(a((4, 64)), a((8, 32, 48)), a((9,), "int32"), a((8,), "int32")), ValueError,
     "gate_up_proj must be"),
    (lambda: moe_gate_up(a((4, 64)), a((8, 31, 64)), a((9,), "int32"), a((8,), "int32")), ValueError,
     "gate_up_proj must be"),
    (lambda: moe_gate_up(a((4, 64)), a((8, 32, 64)), a((8,), "int32"), a((8,), "int32")), ValueError,
     "offsets must have shape"),
    (lambda: moe_gate_up(a((4, 64)), a((8, 32, 64)), a((9,), "int32"), a((7,), "int32")), ValueError,
     "sorted_pairs must hold"),
    (lambda: moe_gate_up(a((4, 64)), a((8, 32, 64)), a((9,), "int32"), a((8,), "int32"), out=a((8, 15))),
     ValueError, "out has shape"),
    (lambda: moe_down_combine(a((8, 16)), a((8, 64, 16)), a((4, 2), "float32"), a((9,), "int32"), a((8,), "int32"),
                              a((4, 64), "float32")), TypeError, "acc has dtype float32"),
    (lambda: moe_down_combine(a((8, 16)), a((8, 64, 16)), a((3, 2), "float32"), a((9,), "int32"), a((8,), "int32"),
                              a((4, 64), "int64")), ValueError, "topk_weights must be"),
    (lambda: moe_down_combine(a((8, 16)), a((8, 64, 15)), a((4, 2), "float32"), a((9,), "int32"), a((8,), "int32"),
                              a((4, 64), "int64")), ValueError, "down_proj must be"),
    (lambda: moe_down_combine(a((8, 16)), a((8, 64, 16)), a((4, 2), "float32"), a((9,), "int32"), a((8,), "int32"),
                              a((4, 32), "int64")), ValueError, "acc must be the"),
    (lambda: mla_decode_attention(a((1, 16, 1, 512)), a((1, 16, 1, 64)), a((1, 64, 512)), a((1, 64, 32)),
                                  a((1,), "int32"), scale=0.1), ValueError, "pe_cache must have shape"),
    (lambda: mla_decode_attention(a((1, 16, 1, 512)), a((1, 16, 1, 64)), a((1, 64, 512)), a((1, 64, 64)),
                                  a((1,), "int32"), scale=0.1, new_c=a((1, 1, 512))), ValueError, "both new_c and"),
    (lambda: mla_decode_attention(a((1, 16, 1, 512)), a((1, 16, 1, 64)), a((1, 64, 512)), a((1, 64, 64)),
                                  a((1,), "int32"), scale=-1.0), ValueError, "scale"),
    (lambda: mla_decode_attention(a((1, 16, 1, 512)), a((1, 16, 1, 64)), a((1, 64, 512), "float32"),
                                  a((1, 64, 64)), a((1,), "int32"), scale=0.1), TypeError, "c_cache has dtype float32"),
    (lambda: mla_decode_attention(a((1, 16, 17, 512)), a((1, 16, 17, 64)), a((1, 64, 512)), a((1, 64, 64)),
                                  a((1,), "int32"), scale=0.1), ValueError, "query tokens"),
    (lambda: mla_decode_attention(a((1, 16, 1, 512)), a((1, 16, 1, 64)), a((1, 64, 512)), a((1, 64, 64)),
                                  a((2,), "int32"), scale=0.1), ValueError, "lengths must be"),
    (lambda: mla_decode_attention(a((1, 16, 1, 512)), a((1, 16, 1, 64)), a((1, 64, 512)), a((1, 64, 64)),
                                  a((1,), "int32"), scale=0.1, length_offset=1.0), TypeError, "length_offset"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("call, error, match", [
    (lambda: fixed_cast(a((4, 64)), a((4, 64))), TypeError, "x has dtype bfloat16"),
    (lambda: fixed_cast(a((4, 64), "int64"), a((4, 32))), ValueError, "out has shape"),
    (lambda: head_linear(a((2, 4, 16)), a((4, 16, 32)), out=a((2, 4, 32)), weight_layout="in_out"), ValueError,
     "weight_layout must be one of"),
    (lambda: head_linear(a((2, 4, 16)), a((4, 32, 16)), out=a((2, 4, 32))), ValueError, r"weight must be \[4, 16, out\]"),
    (lambda: head_linear(a((2, 4, 16)), a((3, 32, 16)), out=a((2, 4, 32)), weight_layout="nk"), ValueError,
     r"weight must be \[4, out, 16\]"),
    (lambda: mla_kv(a((8, 4, 32)), a((8, 16)), a((8, 4, 32)), a((8, 4, 32)), dn=32), ValueError, "dn must be"),
    (lambda: mla_kv(a((8, 4, 32)), a((7, 16)), a((8, 4, 32)), a((8, 4, 32)), dn=16), ValueError, "k_pe must be"),
    (lambda: mla_kv(a((8, 4, 32)), a((8, 16)), a((8, 4, 32)), a((8, 4, 8)), dn=16), ValueError, "v must be"),
])
def test_the_model_ops_name_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_model_ops_make_the_expected_problems():
    with recording() as calls:
        fixed_cast(a((1, 2048), "int64"), a((1, 2048)))
        head_linear(a((1, 17, 192))[:, 1:, :128], a((16, 256, 512))[:, :128], out=a((1, 16, 512)))
        head_linear(a((1, 16, 512)), a((16, 256, 512))[:, 128:], out=a((16, 1, 128)).transpose(1, 0, 2),
                    weight_layout="nk")
        mla_kv(a((64, 16, 256)), a((64, 3264))[:, 128:192], a((64, 16, 192)), a((64, 16, 192)), dn=128)
    assert [(op.name, problem) for op, problem in calls] == [
        ("fixed_cast", dict(dtype="bfloat16", M=1, N=2048)),
        ("head_linear", dict(dtype="bfloat16", M=1, H=16, N=512, K=128, wt="kn")),
        ("head_linear", dict(dtype="bfloat16", M=1, H=16, N=128, K=512, wt="nk")),
        ("mla_kv", dict(dtype="bfloat16", M=64, H=16, DN=128, DV=128, P=64))]
