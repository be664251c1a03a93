"""Decode attention over a paged KV cache: a few new query tokens per sequence against keys and values kept in
blocks of a shared pool, found through each sequence's block table.

decode_attention's flash-decoding, its very body (decode_attention.decode_split: its splits of the context, partial
softmax states and merge kernel, grouped-query programs that read each key and value tile once per group, the new
tokens' keys and values written into the cache and folded in from registers, FP8 codes with per-head scales): only
where a key tile lives differs. Sequence b's position p is slot p % BLOCK of block table[b, p // BLOCK] of the pool
(blocks, Hkv, BLOCK, D) (tilekit.engine.paged), and a key tile of BN positions (BN dividing BLOCK) is one load from
one block. The grid depends on the table's width (its capacity, BLOCK x blocks per sequence) and the batch, not on
the lengths, which live on the device: a CUDA graph replays the step as the sequences grow and as their blocks
change.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace
from tilekit.kernels.attention import LOG2E, attention_reference, check_heads_out, check_kv_scales, heads_out, qkv_views
from tilekit.kernels.decode_attention import MAX_QUERIES, MAX_ROWS, PROGRAMS, decode_merge_kernel, decode_split, split_chunk
from tilekit.kernels.decode_attention import _constants as decode_constants, _fits as decode_fits, _grid as decode_grid
from tilekit.kernels.decode_attention import _merge_constants, _merge_grid, _scratch as decode_scratch
from tilekit.kernels.decode_attention import default_config as decode_default
from tilekit.kernels.paged_write_kv import check_pool
from tilekit.kernels.quantize_fp8 import fp8_codes, fp8_values
from tilekit.kernels.tiles import sync_with_previous_kernel


@ct.kernel
def paged_decode_attention_kernel(Q, Knew, Vnew, K, V, KScale, VScale, Table, Lengths, O, Opart, Mpart, Lpart,
                                  qk_scale: float, length_offset: int, QP: ct.Constant[int], BN: ct.Constant[int],
                                  D: ct.Constant[int], CHUNK: ct.Constant[int], MERGE: ct.Constant[bool],
                                  NEW_KV: ct.Constant[bool], FP8: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """Attention of split ct.bid(1) of (batch, key/value head) ct.bid(0), as decode_attention_kernel's, over the
    pools K, V (blocks, Hkv, BLOCK, D) through Table (B, blocks per sequence)."""
    sync_with_previous_kernel()
    decode_split(Q, Knew, Vnew, K, V, KScale, VScale, Table, Lengths, O, Opart, Mpart, Lpart, qk_scale, length_offset,
                 QP, BN, D, CHUNK, MERGE, NEW_KV, FP8, LATENCY, True)


def _fits(c: dict, p: dict) -> bool:
    """decode_attention's space, with key tiles that divide a block (one load each; 16-key ones for blocks of 16)."""
    return (c["BN"] <= p["block"] and p["block"] % c["BN"] == 0 and (c["BN"] > 16 or p["block"] == 16)
            and decode_fits(c, p))


SPACE = SearchSpace(_fits, BN=(16, 32, 64, 128, 256), PROGRAMS=PROGRAMS, occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    """decode_attention's default, its key tile shrunk to the block where the block is smaller."""
    c = decode_default(p)
    if c["BN"] > p["block"]:
        c = dict(c, BN=p["block"])
        chunk = {n: split_chunk(p, dict(c, PROGRAMS=n)) for n in PROGRAMS}
        c["PROGRAMS"] = min(n for n in PROGRAMS if chunk[n] == chunk[c["PROGRAMS"]])
    return c


def _table_values(B: int, per_seq: int, blocks: int) -> tuple:
    """A benchmark's block tables: sequence b's blocks spread over the pool (every other block first), distinct."""
    order = list(range(0, blocks, 2)) + list(range(1, blocks, 2))
    return tuple(order[(b * per_seq + j) % blocks] for b in range(B) for j in range(per_seq))


def _arrays(p: dict) -> dict:
    B, H, Hkv, nq, cap, D, dt, block = p["B"], p["H"], p["Hkv"], p["nq"], p["capacity"], p["D"], p["dtype"], p["block"]
    per_seq = ct.cdiv(cap, block)
    blocks = B * per_seq + 1
    fused = H + 2 * Hkv
    new_kv = {"k_new": qkv_views(dt, B, Hkv, nq, D, 0, fused), "v_new": qkv_views(dt, B, Hkv, nq, D, 0, fused)} \
        if p["new_kv"] else {"k_new": absent(dt, 4), "v_new": absent(dt, 4)}
    if p["fp8"]:       # positive e4m3 codes below 0x7F (NaN)
        pools = {n: ArraySpec("uint8", (blocks, Hkv, block, D), high=0x7F) for n in ("k", "v")}
        scales = {n: ArraySpec("float32", (Hkv,), fill=1) for n in ("k_scale", "v_scale")}
    else:
        pools = {n: ArraySpec(dt, (blocks, Hkv, block, D)) for n in ("k", "v")}
        scales = {n: absent("float32", 1) for n in ("k_scale", "v_scale")}
    return {"q": qkv_views(dt, B, H, nq, D, 0, fused), **new_kv, **pools, **scales,
            "table": ArraySpec("int32", (B, per_seq), values=_table_values(B, per_seq, blocks)),
            "lengths": ArraySpec("int32", (B,), fill=cap), "o": heads_out(dt, B, H, nq, D)}


def _bind(a: list, flags: tuple) -> Binding:
    q, k_pool, v_pool, table, lengths, k_new, v_new, k_scale, v_scale, out = a
    fp8 = k_pool.dtype == "uint8"
    if len(q.shape) != 4:
        raise ValueError(f"q must be 4-D (batch, heads, tokens, head_dim), got shape {q.shape}")
    arrays.check_dtype(q, "q", arrays.FLOAT_DTYPES)
    arrays.check_last_contiguous(q, "q")
    B, H, nq, D = q.shape
    Hkv = k_pool.shape[1] if len(k_pool.shape) == 4 else 0
    if not Hkv or H % Hkv:
        raise ValueError(f"k_pool must be (blocks, Hkv, block, {D}) with Hkv dividing q's {H} heads, got shape "
                         f"{k_pool.shape}")
    check_pool(k_pool, "k_pool", q, Hkv, D, fp8)
    check_pool(v_pool, "v_pool", q, Hkv, D, fp8)
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool must have k_pool's shape {k_pool.shape}, got {v_pool.shape}")
    arrays.check_dtype(table, "table", ("int32",))
    if len(table.shape) != 2 or table.shape[0] != B or table.shape[1] < 1 or table.device != q.device:
        raise ValueError(f"table must be an int32 (B={B}, blocks per sequence) array on GPU {q.device}, got shape "
                         f"{table.shape}")
    arrays.check_contiguous(table, "table")
    arrays.check_dtype(lengths, "lengths", ("int32",))
    if lengths.shape != (B,) or lengths.device != q.device:
        raise ValueError(f"lengths must be an int32 array of shape ({B},) on GPU {q.device}, got shape "
                         f"{lengths.shape}")
    if not 1 <= nq <= MAX_QUERIES:
        raise ValueError(f"q holds {nq} query tokens per sequence; paged_decode_attention takes 1..{MAX_QUERIES}")
    if H // Hkv * nq > MAX_ROWS:
        raise ValueError(f"{H // Hkv} query heads per key/value head x {nq} tokens exceed {MAX_ROWS} rows")
    views = {"q": (0, None), "k": (1, None), "v": (2, None), "table": (3, None), "lengths": (4, None), "o": (9, None)}
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both new_k and new_v, or neither")
    if k_new is not None:
        for x, name in ((k_new, "new_k"), (v_new, "new_v")):
            arrays.check_dtype(x, name, (q.dtype,))
            if x.shape != (B, Hkv, nq, D) or x.device != q.device:
                raise ValueError(f"{name} must have shape {(B, Hkv, nq, D)} on GPU {q.device}, got {x.shape}")
            arrays.check_last_contiguous(x, name)
        views.update(k_new=(5, None), v_new=(6, None))
    if fp8:
        check_kv_scales(q, k_scale, v_scale, Hkv)
        views.update(k_scale=(7, None), v_scale=(8, None))
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with an FP8 (uint8) pool; k_pool has dtype {k_pool.dtype}")
    if out is not None:
        check_heads_out(out, q)
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, Hkv=Hkv, nq=nq, capacity=table.shape[1] * k_pool.shape[2],
                                D=D, new_kv=int(k_new is not None), fp8=int(fp8), block=k_pool.shape[2]),
                   arrays=views, output=(9, arrays.allocator(q.kind, q.device, q.shape, q.dtype)), returns=9,
                   scalars={"qk_scale": (0, LOG2E / math.sqrt(D)), "length_offset": (1, 0)})


PAGED_DECODE_ATTENTION = Op(
    "paged_decode_attention",
    args=("q", "k_pool", "v_pool", "table", "lengths", "new_k", "new_v", "k_scale", "v_scale", "out"),
    optional=("new_k", "new_v", "k_scale", "v_scale", "out"),
    key=dict(dtype=None, B=pow2_bucket, H=None, Hkv=None, nq=None, capacity=pow2_bucket, D=None, new_kv=None,
             fp8=None, block=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=decode_scratch,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(p["D"]), "length_offset": 0},
    launches=(Launch(paged_decode_attention_kernel, decode_grid,
                     ("q", "k_new", "v_new", "k", "v", "k_scale", "v_scale", "table", "lengths", "o", "opart",
                      "mpart", "lpart", "qk_scale", "length_offset"), decode_constants, dependent=False),
              Launch(decode_merge_kernel, _merge_grid, ("opart", "mpart", "lpart", "o"),
                     _merge_constants, hinted=False)),
    bind=_bind, choices=dict(new_kv=(0, 1), fp8=(0, 1), block=(16, 32, 64, 128, 256)),
    cli_defaults=dict(nq=1, new_kv=1, fp8=0, block=64), tune_whole=True)


def paged_decode_attention(q, k_pool, v_pool, table, lengths, *, new_k=None, new_v=None, k_scale=None,
                           v_scale=None, scale: float | None = None, length_offset: int = 0, out=None):
    """Attention of nq new queries per sequence against a paged KV cache (flash-decoding over block tables).

    q: (B, H, nq, D); k_pool, v_pool: (blocks, Hkv, BLOCK, D) of q's dtype, or FP8 e4m3 codes as uint8 with
    k_scale, v_scale float32 (Hkv,); table: int32 (B, blocks per sequence), sequence b's position p in block
    table[b, p // BLOCK] at slot p % BLOCK; lengths: int32 (B,). Sequence b attends to its first n = lengths[b] +
    length_offset positions, the last nq of them the queries' own (causal among them); new_k, new_v (B, Hkv, nq,
    D), when given, are written into those positions' slots in the same launch. Returns (B, H, nq, D).
    """
    if not isinstance(length_offset, (int, np.integer)) or isinstance(length_offset, bool):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    return PAGED_DECODE_ATTENTION((q, k_pool, v_pool, table, lengths, new_k, new_v, k_scale, v_scale, out), (),
                                  (None if scale is None else arrays.checked_positive(scale, "scale") * LOG2E,
                                   int(length_offset)))


def gather_pool(pool, table_row, n: int) -> np.ndarray:
    """A sequence's first n positions of a pool, (Hkv, n, D), through its table row."""
    block = pool.shape[2]
    rows = [np.asarray(pool)[table_row[p // block], :, p % block] for p in range(n)]
    return np.stack(rows, axis=1) if rows else np.zeros((pool.shape[1], 0, pool.shape[3]), pool.dtype)


def paged_decode_attention_reference(q, k_pool, v_pool, table, lengths, *, new_k=None, new_v=None, k_scale=None,
                                     v_scale=None, scale: float | None = None, length_offset: int = 0) -> tuple:
    """float64 NumPy paged decode attention and the pools after it: (out (B, H, nq, D), k_pool, v_pool), the new
    keys and values written as the kernel writes them (FP8: as codes)."""
    q = np.asarray(q, np.float64)
    fp8 = k_scale is not None
    kp, vp = np.array(k_pool), np.array(v_pool)
    block, nq = kp.shape[2], q.shape[2]
    out = np.empty(q.shape)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        if new_k is not None:
            nk, nv = np.asarray(new_k)[b], np.asarray(new_v)[b]
            if fp8:
                nk, nv = fp8_codes(nk[None], k_scale)[0], fp8_codes(nv[None], v_scale)[0]
            for t in range(nq):
                p = n - nq + t
                kp[table[b][p // block], :, p % block] = nk[:, t]
                vp[table[b][p // block], :, p % block] = nv[:, t]
        k, v = gather_pool(kp, table[b], n), gather_pool(vp, table[b], n)
        if fp8:
            k, v = fp8_values(k[None], k_scale)[0], fp8_values(v[None], v_scale)[0]
        out[b] = attention_reference(q[b:b + 1], np.asarray(k, np.float64)[None], np.asarray(v, np.float64)[None],
                                     causal=True, scale=scale)[0]
    return out, kp, vp
