"""Multi-head latent attention in the absorbed form over a paged latent cache: a few new queries per sequence
against latent entries kept in blocks of a shared pool, found through each sequence's block table.

mla_decode_attention's flash-decoding, its very body (mla_decode_attention.mla_split: head groups whose every latent
tile is the keys and the values of all of them, splits of the context merged by its merge kernel, the new tokens'
entries written into the cache and folded in from registers): only where a latent tile lives differs. Sequence b's
position p is slot p % BLOCK of block table[b, p // BLOCK] of the pools (blocks, BLOCK, R) of latents and (blocks,
BLOCK, P) of rotary keys (tilekit.engine.paged), and a tile of BN positions (BN dividing BLOCK) is one load from one
block. The grid depends on the table's width and the batch, not on the lengths, which live on the device: a CUDA
graph replays the step as the sequences grow and as their blocks change.

A query row need not be a sequence's newest token: continuous batching runs a prompt chunk's tokens as rows of their
own (each row its sequence's table row and its own position as its length), after the chunk's entries are written.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.attention import LOG2E, check_heads_out, heads_out
from tilekit.kernels.mla_decode_attention import SPACE as MLA_SPACE, _constants, _fits as mla_fits
from tilekit.kernels.mla_decode_attention import check_latent_queries, check_new_entries
from tilekit.kernels.mla_decode_attention import _grid, _groups, _merge_constants, _merge_grid, _scratch, mla_merge_kernel
from tilekit.kernels.mla_decode_attention import default_config as mla_default, mla_decode_attention_reference
from tilekit.kernels.mla_decode_attention import mla_split
from tilekit.kernels.paged_decode_attention import _table_values
from tilekit.kernels.tiles import sync_with_previous_kernel


@ct.kernel
def paged_mla_decode_kernel(Q, Qpe, Cnew, Pnew, C, Kpe, Table, Lengths, O, Opart, Mpart, Lpart, qk_scale: float,
                            length_offset: int, HT: ct.Constant[int], NQ: ct.Constant[int], BN: ct.Constant[int],
                            R: ct.Constant[int], P: ct.Constant[int], GROUPS: ct.Constant[int],
                            CHUNK: ct.Constant[int], SPLITS: ct.Constant[int], NEW_KV: ct.Constant[bool]):
    """Attention of split ct.bid(1) of (batch, head group) ct.bid(0), as mla_decode_kernel's, over the pools C
    (blocks, BLOCK, R) and Kpe (blocks, BLOCK, P) through Table (B, blocks per sequence)."""
    sync_with_previous_kernel()
    mla_split(Q, Qpe, Cnew, Pnew, C, Kpe, Table, Lengths, O, Opart, Mpart, Lpart, qk_scale, length_offset, HT, NQ, BN,
              R, P, GROUPS, CHUNK, SPLITS, NEW_KV, True)


def _fits(c: dict, p: dict) -> bool:
    """mla_decode_attention's space, with latent tiles that divide a block (one load each)."""
    return c["BN"] <= p["block"] and p["block"] % c["BN"] == 0 and mla_fits(c, p)


# mla_decode_attention's space, with splits as long as a whole context: a prompt chunk's rows are programs enough
SPACE = SearchSpace(_fits, **dict(MLA_SPACE.params, CHUNK=MLA_SPACE.params["CHUNK"] + tuple(4096 << i for i in range(7))))
WHOLE_CONTEXT_PROGRAMS = 264        # from this many (row, head group) programs, one split each (two per SM of 132)


def default_config(p: dict) -> dict:
    """mla_decode_attention's default, its latent tile shrunk to the block where the block is smaller, and one
    split per row where the rows alone give WHOLE_CONTEXT_PROGRAMS programs (no partial states, no merge)."""
    c = mla_default(p)
    c = dict(c, BN=min(c["BN"], p["block"]))
    if p["B"] * _groups(p, c) >= WHOLE_CONTEXT_PROGRAMS:
        c["CHUNK"] = max(c["CHUNK"], pow2_ceil(p["capacity"]))
    return c


def _arrays(p: dict) -> dict:
    B, H, nq, cap, R, P, dt, block = p["B"], p["H"], p["nq"], p["capacity"], p["R"], p["P"], p["dtype"], p["block"]
    per_seq = ct.cdiv(cap, block)
    blocks = B * per_seq + 1
    row = R + P            # queries: views of one (B, nq, H, R + P) buffer, as the model's
    queries = (nq * H * row, row, H * row, 1)
    new = {"c_new": ArraySpec(dt, (B, nq, R), (nq * row, row, 1)), "pe_new": ArraySpec(dt, (B, nq, P), (nq * row, row, 1))} \
        if p["new_kv"] else {"c_new": absent(dt, 3), "pe_new": absent(dt, 3)}
    return {"q": ArraySpec(dt, (B, H, nq, R), queries), "q_pe": ArraySpec(dt, (B, H, nq, P), queries), **new,
            "c": ArraySpec(dt, (blocks, block, R)), "k_pe": ArraySpec(dt, (blocks, block, P)),
            "table": ArraySpec("int32", (B, per_seq), values=_table_values(B, per_seq, blocks)),
            "lengths": ArraySpec("int32", (B,), fill=cap), "o": heads_out(dt, B, H, nq, R)}


def _check_pool(pool, name: str, like, width: int, blocks: int | None = None, block: int | None = None) -> None:
    arrays.check_same("q", like, name, pool)
    if len(pool.shape) != 3 or pool.shape[2] != width or pool.shape[1] < 1 or pool.shape[0] < 1 \
            or (blocks is not None and pool.shape[:2] != (blocks, block)):
        want = f"({blocks}, {block}, {width})" if blocks is not None else f"(blocks, block, {width})"
        raise ValueError(f"{name} must be a {want} pool, got shape {pool.shape}")
    arrays.check_last_contiguous(pool, name)


def _bind(a: list, flags: tuple) -> Binding:
    q, q_pe, c_pool, pe_pool, table, lengths, c_new, pe_new, out = a
    B, H, nq, R, P = check_latent_queries(q, q_pe, "paged_mla_decode_attention")
    _check_pool(c_pool, "c_pool", q, R)
    _check_pool(pe_pool, "pe_pool", q, P, *c_pool.shape[:2])
    arrays.check_dtype(table, "table", ("int32",))
    if len(table.shape) != 2 or table.shape[0] != B or table.shape[1] < 1 or table.device != q.device:
        raise ValueError(f"table must be an int32 (B={B}, blocks per sequence) array on GPU {q.device}, got shape "
                         f"{table.shape}")
    arrays.check_contiguous(table, "table")
    arrays.check_dtype(lengths, "lengths", ("int32",))
    if lengths.shape != (B,) or lengths.device != q.device:
        raise ValueError(f"lengths must be an int32 array of shape ({B},) on GPU {q.device}, got shape "
                         f"{lengths.shape}")
    views = {"q": (0, None), "q_pe": (1, None), "c": (2, None), "k_pe": (3, None), "table": (4, None),
             "lengths": (5, None), "o": (8, None)}
    check_new_entries(c_new, pe_new, q, views, 6)
    if out is not None:
        check_heads_out(out, q)
    block = c_pool.shape[1]
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, nq=nq, capacity=table.shape[1] * block, R=R, P=P,
                                new_kv=int(c_new is not None), block=block),
                   arrays=views, output=(8, arrays.allocator(q.kind, q.device, (B, nq, H, R), q.dtype, (0, 2, 1, 3))),
                   returns=8, scalars={"qk_scale": (0, None), "length_offset": (1, 0)})


PAGED_MLA_DECODE_ATTENTION = Op(
    "paged_mla_decode_attention",
    args=("q", "q_pe", "c_pool", "pe_pool", "table", "lengths", "new_c", "new_pe", "out"),
    optional=("new_c", "new_pe", "out"),
    key=dict(dtype=None, B=pow2_bucket, H=None, nq=None, capacity=pow2_bucket, R=None, P=None, new_kv=None,
             block=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(192), "length_offset": 0},
    launches=(Launch(paged_mla_decode_kernel, _grid,
                     ("q", "q_pe", "c_new", "pe_new", "c", "k_pe", "table", "lengths", "o", "opart", "mpart", "lpart",
                      "qk_scale", "length_offset"), _constants,
                     dependent=False),       # one ordinary launch per layer, as mla_decode_attention
              Launch(mla_merge_kernel, _merge_grid, ("opart", "mpart", "lpart", "o"), _merge_constants,
                     hinted=False)),
    bind=_bind, choices=dict(new_kv=(0, 1), block=(16, 32, 64, 128, 256)),
    cli_defaults=dict(nq=1, new_kv=1, block=64))


def paged_mla_decode_attention(q, q_pe, c_pool, pe_pool, table, lengths, *, scale: float, new_c=None, new_pe=None,
                               length_offset: int = 0, out=None):
    """Absorbed multi-head latent attention of nq new queries per sequence against a paged latent cache.

    q: (B, H, nq, R) queries absorbed into the latent space; q_pe: (B, H, nq, P) rotary queries; c_pool: (blocks,
    BLOCK, R) latents and pe_pool: (blocks, BLOCK, P) rotary keys; table: int32 (B, blocks per sequence), sequence b's
    position p in block table[b, p // BLOCK] at slot p % BLOCK; lengths: int32 (B,) on the device. Sequence b
    attends to its first n = lengths[b] + length_offset positions, the last nq of which are the queries' own (causal
    among them). scores = (q . c + q_pe . k_pe) * scale. new_c (B, nq, R), new_pe (B, nq, P), when given, are those
    nq positions' entries, written into their slots in the same launch. Returns the latent outputs, (B, H, nq, R).
    """
    if not isinstance(length_offset, (int, np.integer)) or isinstance(length_offset, bool):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    return PAGED_MLA_DECODE_ATTENTION((q, q_pe, c_pool, pe_pool, table, lengths, new_c, new_pe, out), (),
                                      (arrays.checked_positive(scale, "scale") * LOG2E, int(length_offset)))


def gather_latents(pool, table_row, n: int) -> np.ndarray:
    """A sequence's first n positions of a latent pool, (n, width), through its table row."""
    block = pool.shape[1]
    return np.stack([np.asarray(pool)[table_row[p // block], p % block] for p in range(n)]) if n else \
        np.zeros((0, pool.shape[2]), pool.dtype)


def paged_mla_decode_attention_reference(q, q_pe, c_pool, pe_pool, table, lengths, *, scale: float, new_c=None,
                                         new_pe=None, length_offset: int = 0) -> tuple:
    """float64 NumPy paged absorbed MLA and the pools after it: (out (B, H, nq, R), c_pool, pe_pool), the new entries
    written into their slots; each sequence's attention as mla_decode_attention_reference's over its gathered
    entries."""
    cp, pp = np.array(c_pool), np.array(pe_pool)
    table = np.asarray(table)
    block, nq = cp.shape[1], q.shape[2]
    out = np.empty(q.shape)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        if new_c is not None:
            for t in range(nq):
                p = n - nq + t
                cp[table[b][p // block], p % block] = np.asarray(new_c)[b, t]
                pp[table[b][p // block], p % block] = np.asarray(new_pe)[b, t]
        c, pe = gather_latents(cp, table[b], n), gather_latents(pp, table[b], n)
        out[b] = mla_decode_attention_reference(q[b:b + 1], q_pe[b:b + 1], c[None], pe[None], [n], scale=scale)[0]
    return out, cp, pp


if __name__ == "__main__":
    from tilekit.kernels.paged_mla_decode_attention import (paged_mla_decode_attention,  # the package's op
                                                            paged_mla_decode_attention_reference)
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    rng = np.random.default_rng(0)
    for B, H, nq, width, block, R, P, dtype, new in [(2, 16, 1, 64, 64, 512, 64, "bfloat16", True),
                                                     (3, 16, 1, 8, 16, 512, 64, "bfloat16", False),
                                                     (2, 4, 3, 5, 32, 32, 16, "float32", True)]:
        blocks = B * width + 1
        qq = rand((B, nq, H, R + P), dtype)
        q, q_pe = qq[..., :R].transpose(0, 2, 1, 3), qq[..., R:].transpose(0, 2, 1, 3)
        c_pool, pe_pool = rand((blocks, block, R), dtype), rand((blocks, block, P), dtype)
        table = (rng.permutation(blocks - 1)[:B * width] + 1).reshape(B, width).astype(np.int32)
        kv_new = rand((B, nq, R + P), dtype) if new else None
        kw = dict(new_c=kv_new[..., :R], new_pe=kv_new[..., R:]) if new else {}
        lengths = rng.integers(nq, width * block + 1, B).astype(np.int32)
        ref, ref_c, ref_pe = paged_mla_decode_attention_reference(
            host(q), host(q_pe), host(c_pool), host(pe_pool), table, lengths, scale=0.1,
            **{k: host(v) for k, v in kw.items()})
        out = paged_mla_decode_attention(q, q_pe, c_pool, pe_pool, cupy.asarray(table), cupy.asarray(lengths),
                                         scale=0.1, **kw, out=poisoned((B, nq, H, R), dtype).transpose(0, 2, 1, 3))
        err = assert_close(host(out), ref, TOL[dtype], f"paged_mla_decode_attention B{B} block{block} {dtype}")
        assert np.array_equal(host(c_pool), ref_c) and np.array_equal(host(pe_pool), ref_pe), "entries written wrong"
        print(f"paged_mla_decode_attention B{B} H{H} nq{nq} {width} blocks of {block} R{R} P{P} {dtype} new={new}: ok, "
              f"relative error {err:.2e}")
