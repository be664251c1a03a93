"""The paged KV cache's kernels on the GPU against their float64 references: paged_write_kv (exact), paged decode
attention over block tables (splits and their merge, grouped-query, the new token written into its block, FP8
pools) and paged prefill attention over a flattened batch of requests with cached pasts (chunked prefill and
prefix hits), on fresh random inputs, outputs poisoned first. Every other slot of the pools stays as it was."""

import cupy
import numpy as np
import pytest

from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
from tilekit.kernels.paged_decode_attention import (PAGED_DECODE_ATTENTION, paged_decode_attention,
                                                    paged_decode_attention_reference)
from tilekit.kernels.paged_prefill_attention import (paged_prefill_attention, paged_prefill_attention_reference,
                                                     tile_list)
from tilekit.kernels.paged_write_kv import paged_write_kv, paged_write_kv_reference
from tilekit.kernels.quantize_fp8 import fp8_codes

pytestmark = pytest.mark.gpu


def tables(rng, lengths, block: int, blocks: int, width: int) -> np.ndarray:
    """Each sequence's blocks drawn at random from the pool without repeats (block 0 left out), a row of `width`
    entries, -1 past its blocks."""
    free = list(rng.permutation(np.arange(1, blocks)))
    table = np.full((len(lengths), width), -1, np.int32)
    for b, n in enumerate(lengths):
        for j in range(-(-int(n) // block)):
            table[b, j] = free.pop()
    return table


def pools(blocks, heads, block, D, dtype, fp8, rng):
    if fp8:
        codes = lambda: cupy.asarray(rng.integers(0, 0x7F, (blocks, heads, block, D)).astype(np.uint8))  # noqa: E731
        scales = [cupy.asarray(rng.uniform(0.5, 2.0, heads).astype(np.float32)) for _ in range(2)]
        return codes(), codes(), scales
    return rand((blocks, heads, block, D), dtype), rand((blocks, heads, block, D), dtype), [None, None]


@pytest.mark.parametrize("T,H,D,block,dtype,fp8", [(37, 4, 64, 16, "bfloat16", False), (300, 8, 128, 64, "float16",
                                                                                          False),
                                                    (5, 2, 80, 32, "float32", False), (64, 8, 128, 64, "bfloat16",
                                                                                       True),
                                                    (40, 4, 16, 16, "float32", False)])       # tiny GPT-2's heads
def test_paged_write_kv_writes_each_token_into_its_slot(T, H, D, block, dtype, fp8):
    rng = np.random.default_rng()
    blocks = -(-T // block) + 3
    qkv = rand((T, 3, H, D), dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    kp, vp, (ks, vs) = pools(blocks, H, block, D, dtype, fp8, rng)
    slots = rng.permutation(blocks * block)[:T].astype(np.int32)
    slots[rng.integers(0, T)] = -1                                   # a padded row: no write
    scales = {} if not fp8 else dict(k_scale=host(ks), v_scale=host(vs))
    ref_k, ref_v = paged_write_kv_reference(host(k), host(v), host(kp), host(vp), slots, **scales)
    paged_write_kv(k, v, kp, vp, cupy.asarray(slots), k_scale=ks, v_scale=vs)
    assert np.array_equal(host(kp), ref_k.astype(host(kp).dtype)) and np.array_equal(
        host(vp), ref_v.astype(host(vp).dtype)), "pool contents"


@pytest.mark.parametrize("B,H,Hkv,D,block,width,dtype,fp8", [
    (1, 32, 8, 128, 64, 64, "bfloat16", False), (5, 12, 12, 64, 64, 20, "bfloat16", False),
    (3, 8, 2, 64, 32, 10, "float32", False), (4, 32, 8, 128, 64, 40, "bfloat16", True),
    (7, 16, 4, 128, 16, 300, "float16", False),
    (3, 4, 4, 16, 16, 4, "float32", False), (4, 4, 2, 16, 16, 8, "bfloat16", False)])   # the tiny GPT-2 and Llama
def test_paged_decode_attention_matches_the_reference(B, H, Hkv, D, block, width, dtype, fp8):
    """Lengths from 1 to the table's capacity; the new token's key and value (views of a fused QKV buffer) land in
    their blocks and nowhere else."""
    rng = np.random.default_rng()
    lengths = rng.integers(1, width * block + 1, B).astype(np.int32)
    lengths[0] = width * block
    blocks = int(sum(-(-n // block) for n in lengths)) + 2
    table = tables(rng, lengths, block, blocks, width)
    kp, vp, (ks, vs) = pools(blocks, Hkv, block, D, dtype, fp8, rng)
    heads = rand((B, 1, H + 2 * Hkv, D), dtype).transpose(0, 2, 1, 3)
    q, k_new, v_new = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:]
    scales = {} if not fp8 else dict(k_scale=host(ks), v_scale=host(vs))
    ref, ref_k, ref_v = paged_decode_attention_reference(host(q), host(kp), host(vp), table, lengths - 1,
                                                         new_k=host(k_new), new_v=host(v_new), length_offset=1,
                                                         **scales)
    out = poisoned((B, H, 1, D), dtype)
    paged_decode_attention(q, kp, vp, cupy.asarray(table), cupy.asarray(lengths - 1), new_k=k_new, new_v=v_new,
                           length_offset=1, out=out, k_scale=ks, v_scale=vs)
    assert_close(host(out), ref, TOL["bfloat16" if fp8 else dtype], f"paged decode {B, H, Hkv, D, block, dtype}")
    assert np.array_equal(host(kp), ref_k) and np.array_equal(host(vp), ref_v), "pool contents"


def test_paged_decode_attention_splits_a_long_context_over_programs():
    """The tuner's space end: the shortest splits (many programs, a merge) and one split per head (no merge)
    give the same output."""
    rng = np.random.default_rng()
    B, H, Hkv, D, block, width = 2, 32, 8, 128, 64, 128
    lengths = np.array([width * block, 3000], np.int32)
    table = tables(rng, lengths, block, 300, width)
    kp, vp, _ = pools(300, Hkv, block, D, "bfloat16", False, rng)
    q = rand((B, H, 1, D), "bfloat16")
    ref, _, _ = paged_decode_attention_reference(host(q), host(kp), host(vp), table, lengths)
    problem = dict(dtype="bfloat16", B=B, H=H, Hkv=Hkv, nq=1, capacity=width * block, D=D, new_kv=0, fp8=0,
                   block=block)
    candidates = [c for c in PAGED_DECODE_ATTENTION.space.candidates(PAGED_DECODE_ATTENTION.tuning_problem(problem))
                  if c["BN"] == 64 and c["occupancy"] == 1]
    shortest, whole = max(candidates, key=lambda c: c["PROGRAMS"]), min(candidates, key=lambda c: c["PROGRAMS"])
    assert whole["PROGRAMS"] == 1 and shortest["PROGRAMS"] >= 256
    for config in (shortest, whole):
        with PAGED_DECODE_ATTENTION.pinned(config):
            out = poisoned((B, H, 1, D), "bfloat16")
            paged_decode_attention(q, kp, vp, cupy.asarray(table), cupy.asarray(lengths), out=out)
        assert_close(host(out), ref, TOL["bfloat16"], f"paged decode {config}")


@pytest.mark.parametrize("H,Hkv,D,block,dtype,fp8", [(32, 8, 128, 64, "bfloat16", False),
                                                      (12, 12, 64, 64, "bfloat16", False),
                                                      (4, 2, 64, 32, "float32", False),
                                                      (16, 4, 128, 64, "bfloat16", True),
                                                      (4, 4, 16, 16, "float32", False)])   # the tiny GPT-2
def test_paged_prefill_attention_over_a_flattened_batch_with_cached_pasts(H, Hkv, D, block, dtype, fp8):
    """Requests of 1 to 300 new tokens, some with no past (a whole prompt), some continuing a cached past (a later
    chunk, a prefix hit) not ending on a block edge; their keys and values written by paged_write_kv, as the
    engine does, then attention; a request's rows attend to its own sequence only."""
    rng = np.random.default_rng()
    new = np.array([300, 1, 77, 130, 64], np.int32)
    past = np.array([0, 200, 0, 65, 1000], np.int32)
    total = past + new
    width = int(max(-(-total // block)))
    blocks = int(sum(-(-total // block))) + 2
    table = tables(rng, total, block, blocks, width)
    kp, vp, (ks, vs) = pools(blocks, Hkv, block, D, dtype, fp8, rng)
    T = int(new.sum())
    qkv = rand((T, H + 2 * Hkv, D), dtype)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
    slots = np.concatenate([table[r, p // block] * block + p % block
                            for r in range(len(new)) for p in [np.arange(past[r], total[r])]]).astype(np.int32)
    paged_write_kv(k, v, kp, vp, cupy.asarray(slots), k_scale=ks, v_scale=vs)
    scales = {} if not fp8 else dict(k_scale=host(ks), v_scale=host(vs))
    ref = paged_prefill_attention_reference(host(q), host(kp), host(vp), table, new, past, **scales)
    tiles = tile_list(new, past, capacity=16)
    out = poisoned((T, H, D), dtype)
    paged_prefill_attention(q, kp, vp, cupy.asarray(table), cupy.asarray(tiles), out=out, k_scale=ks, v_scale=vs)
    assert_close(host(out), ref, TOL["bfloat16" if fp8 else dtype], f"paged prefill {H, Hkv, D, block, dtype}")
    if fp8:      # what the pool holds is what the write made of the new keys: codes of k / scale
        row = int(new[0] - 1)
        expected = fp8_codes(host(k)[row][None, :, None], host(ks))[0, :, 0]
        assert np.array_equal(host(kp)[table[0, row // block], :, row % block], expected)


def latent_pools(blocks, block, R, P, dtype):
    return rand((blocks, block, R), dtype), rand((blocks, block, P), dtype)


@pytest.mark.parametrize("B,H,nq,R,P,block,width,dtype,new", [
    (1, 16, 1, 512, 64, 64, 64, "bfloat16", True), (6, 16, 1, 512, 64, 16, 20, "bfloat16", True),
    (40, 16, 1, 512, 64, 64, 4, "bfloat16", False),          # prefill rows: many rows, each its own length
    (3, 4, 2, 32, 16, 32, 6, "float32", True), (5, 4, 1, 32, 16, 16, 5, "float32", False)])   # the tiny DeepSeek-V2
def test_paged_mla_decode_attention_matches_the_reference(B, H, nq, R, P, block, width, dtype, new):
    """Lengths from nq to the table's capacity; the new tokens' entries (views of the model's query buffer) land in
    their blocks and nowhere else."""
    from tilekit.kernels.paged_mla_decode_attention import (paged_mla_decode_attention,
                                                            paged_mla_decode_attention_reference)
    rng = np.random.default_rng()
    lengths = rng.integers(nq, width * block + 1, B).astype(np.int32)
    lengths[0] = width * block
    blocks = int(sum(-(-n // block) for n in lengths)) + 2
    table = tables(rng, lengths, block, blocks, width)
    cp, pp = latent_pools(blocks, block, R, P, dtype)
    qq = rand((B, nq, H + 1, R + P), dtype)               # the queries' heads, then the new entries
    q, q_pe = qq[:, :, :H, :R].transpose(0, 2, 1, 3), qq[:, :, :H, R:].transpose(0, 2, 1, 3)
    kw = dict(new_c=qq[:, :, H, :R], new_pe=qq[:, :, H, R:]) if new else {}
    ref, ref_c, ref_pe = paged_mla_decode_attention_reference(host(q), host(q_pe), host(cp), host(pp), table,
                                                              lengths - nq, scale=0.07, length_offset=nq,
                                                              **{k: host(v) for k, v in kw.items()})
    out = poisoned((B, nq, H, R), dtype).transpose(0, 2, 1, 3)
    paged_mla_decode_attention(q, q_pe, cp, pp, cupy.asarray(table), cupy.asarray(lengths - nq), scale=0.07,
                               length_offset=nq, out=out, **kw)
    assert_close(host(out), ref, TOL[dtype], f"paged MLA decode {B, H, nq, R, P, block, dtype}")
    assert np.array_equal(host(cp), ref_c.astype(host(cp).dtype)) and np.array_equal(
        host(pp), ref_pe.astype(host(pp).dtype)), "pool contents"


def test_paged_mla_decode_attention_splits_a_long_context_over_programs():
    """The tuner's space ends for a V2-Lite-shape context: the shortest splits (a merge) and one split give the
    same output."""
    from tilekit.kernels.paged_mla_decode_attention import (PAGED_MLA_DECODE_ATTENTION, paged_mla_decode_attention,
                                                            paged_mla_decode_attention_reference)
    rng = np.random.default_rng()
    B, H, R, P, block, width = 2, 16, 512, 64, 64, 96
    lengths = np.array([width * block, 2500], np.int32)
    table = tables(rng, lengths, block, 200, width)
    cp, pp = latent_pools(200, block, R, P, "bfloat16")
    q, q_pe = rand((B, H, 1, R), "bfloat16"), rand((B, H, 1, P), "bfloat16")
    ref, _, _ = paged_mla_decode_attention_reference(host(q), host(q_pe), host(cp), host(pp), table, lengths,
                                                     scale=0.04)
    problem = dict(dtype="bfloat16", B=B, H=H, nq=1, capacity=width * block, R=R, P=P, new_kv=0, block=block)
    candidates = PAGED_MLA_DECODE_ATTENTION.space.candidates(PAGED_MLA_DECODE_ATTENTION.tuning_problem(problem))
    shortest, whole = min(candidates, key=lambda c: c["CHUNK"]), max(candidates, key=lambda c: c["CHUNK"])
    assert shortest["CHUNK"] <= 128 and whole["CHUNK"] >= width * block
    for config in (shortest, whole):
        with PAGED_MLA_DECODE_ATTENTION.pinned(config):
            out = poisoned((B, 1, H, R), "bfloat16").transpose(0, 2, 1, 3)
            paged_mla_decode_attention(q, q_pe, cp, pp, cupy.asarray(table), cupy.asarray(lengths), scale=0.04,
                                       out=out)
        assert_close(host(out), ref, TOL["bfloat16"], f"paged MLA decode {config}")
