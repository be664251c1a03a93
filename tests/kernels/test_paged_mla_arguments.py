"""paged_mla_decode_attention without a GPU: its argument checks on MetaArrays (every bad argument named before
anything launches; a good call makes the problem its tuning key expects) and its float64 reference against
mla_decode_attention's over the same entries laid out contiguously."""

import numpy as np
import pytest

from tilekit.autotune.arrays import MetaArray
from tilekit.autotune.op import recording
from tilekit.kernels import paged_mla_decode_attention
from tilekit.kernels.mla_decode_attention import mla_decode_attention_reference
from tilekit.kernels.paged_mla_decode_attention import PAGED_MLA_DECODE_ATTENTION, paged_mla_decode_attention_reference


def a(shape, dtype="bfloat16"):
    return MetaArray(shape, dtype)


def call(q=(8, 16, 1, 512), q_pe=(8, 16, 1, 64), c=(300, 64, 512), pe=(300, 64, 64), table=(8, 64), lengths=(8,),
         **kw):
    queries = a((q[0], q[2], q[1], 576)).transpose(0, 2, 1, 3)
    qv = queries[:, :, :, :512] if q == (8, 16, 1, 512) else a(q)
    qpe = queries[:, :, :, 512:] if q_pe == (8, 16, 1, 64) else a(q_pe)
    return paged_mla_decode_attention(qv, qpe, a(c), a(pe), a(table, "int32"), a(lengths, "int32"),
                                      scale=kw.pop("scale", 0.1), **kw)


def test_a_decode_step_of_v2_lite_makes_the_expected_problem():
    with recording() as calls:
        out = call(new_c=a((8, 1, 512)), new_pe=a((8, 1, 64)), length_offset=1)
    assert out.shape == (8, 16, 1, 512)
    assert [(op.name, problem) for op, problem in calls] == [
        ("paged_mla_decode_attention", dict(dtype="bfloat16", B=8, H=16, nq=1, capacity=4096, R=512, P=64,
                                            new_kv=1, block=64))]


@pytest.mark.parametrize("kw, error, match", [
    (dict(pe=(300, 64, 32)), ValueError, "pe_pool must be a"),
    (dict(pe=(299, 64, 64)), ValueError, r"pe_pool must be a \(300, 64, 64\) pool"),
    (dict(c=(300, 64)), ValueError, "c_pool must be a"),
    (dict(table=(7, 64)), ValueError, "table must be an int32 .B=8"),
    (dict(lengths=(9,)), ValueError, "lengths must be an int32 array of shape"),
    (dict(q=(8, 16, 17, 512), q_pe=(8, 16, 17, 64)), ValueError, "paged_mla_decode_attention takes 1..16"),
    (dict(q_pe=(8, 16, 1, 2048)), ValueError, "rotary width"),
    (dict(new_c=a((8, 1, 512))), ValueError, "pass both new_c and new_pe"),
    (dict(new_c=a((8, 2, 512)), new_pe=a((8, 2, 64))), ValueError, "new_c must have shape"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(length_offset=1.0), TypeError, "length_offset must be an int"),
])
def test_bad_arguments_are_named(kw, error, match):
    with pytest.raises(error, match=match):
        call(**kw)


def test_the_dtype_of_a_pool_must_match_the_queries():
    queries = a((2, 1, 16, 576)).transpose(0, 2, 1, 3)
    with pytest.raises(TypeError, match="c_pool has dtype float32"):
        paged_mla_decode_attention(queries[:, :, :, :512], queries[:, :, :, 512:], a((9, 16, 512), "float32"),
                                   a((9, 16, 64)),
                                   a((2, 4), "int32"), a((2,), "int32"), scale=0.1)


def test_every_config_of_a_long_context_divides_the_block():
    problem = PAGED_MLA_DECODE_ATTENTION.tuning_problem(dict(dtype="bfloat16", B=1, H=16, nq=1, capacity=8192, R=512,
                                                             P=64, new_kv=1, block=32))
    candidates = PAGED_MLA_DECODE_ATTENTION.space.candidates(problem)
    assert candidates and all(32 % c["BN"] == 0 for c in candidates)
    assert PAGED_MLA_DECODE_ATTENTION.space.contains(PAGED_MLA_DECODE_ATTENTION.default(problem))
    rows = dict(problem, B=2048, new_kv=0)            # a prompt chunk's rows: one split each, no merge
    assert PAGED_MLA_DECODE_ATTENTION.default(rows)["CHUNK"] >= 8192


@pytest.mark.parametrize("nq,new", [(1, True), (3, True), (2, False)])
def test_the_reference_is_the_contiguous_one_over_gathered_blocks(nq, new):
    rng = np.random.default_rng()
    B, H, R, P, block, width = 3, 4, 32, 16, 8, 5
    blocks = B * width + 1
    table = (rng.permutation(blocks - 1) + 1)[:B * width].reshape(B, width).astype(np.int32)
    c_pool, pe_pool = rng.standard_normal((blocks, block, R)), rng.standard_normal((blocks, block, P))
    q, q_pe = rng.standard_normal((B, H, nq, R)), rng.standard_normal((B, H, nq, P))
    new_c, new_pe = rng.standard_normal((B, nq, R)), rng.standard_normal((B, nq, P))
    lengths = rng.integers(nq, width * block + 1, B).astype(np.int32)
    kw = dict(new_c=new_c, new_pe=new_pe) if new else {}
    out, cp, pp = paged_mla_decode_attention_reference(q, q_pe, c_pool, pe_pool, table, lengths, scale=0.3, **kw)
    dense_c = c_pool[table].reshape(B, width * block, R)     # sequence b's positions in order
    dense_pe = pe_pool[table].reshape(B, width * block, P)
    want = mla_decode_attention_reference(q, q_pe, dense_c, dense_pe, lengths, scale=0.3, **kw)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    if new:
        for b, n in enumerate(lengths):
            for t in range(nq):
                p = n - nq + t
                assert np.array_equal(cp[table[b, p // block], p % block], new_c[b, t])
                assert np.array_equal(pp[table[b, p // block], p % block], new_pe[b, t])
    untouched = np.ones(blocks, bool)
    untouched[table.reshape(-1)] = False
    assert np.array_equal(cp[untouched], c_pool[untouched]) and np.array_equal(pp[untouched], pe_pool[untouched])
