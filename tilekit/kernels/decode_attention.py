"""Decode attention: a few new query tokens per sequence against a KV cache, split over the context.

Flash-decoding: the context of each (sequence, head) is cut into CHUNK-long splits handled by
separate programs, so even batch 1 can fill the GPU (the tuner picks a program count, split_chunk the
length); each split stores a partial softmax state (max, sum, unnormalised output) and a second,
small kernel merges them (no merge with one split); the tuner times both launches. (A merge by the
last split to arrive, counted on an atomic, was one launch but read other splits' states wrongly at
times on an H200: fp32 tiles, and MLA's 32 splits of a 4K context.) Given the new tokens' keys and
values, the kernel also writes them into the
cache (no separate KV write) and attends to them from registers. Lengths live on the device, so a
CUDA graph can replay a decode step as the cache grows; the grid depends only on the cache
capacity, and splits past a sequence's length store an empty state at once. With grouped-query
attention (Hkv < H key/value heads) a program serves one key/value head and every query head of its
group, a column each of one query tile, so each key and value tile is read once per group.

An FP8 cache (fp8) holds e4m3 codes as uint8 with one fp32 scale per key/value head for keys and one
for values (value = code x scale): tiles are widened to the query's dtype as they are loaded, the key
scale folds into the score scale and the value scale into the output, and new keys and values are
divided by their scale, saturated to +-448 and rounded to e4m3 before they are written and attended to.
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
from tilekit.kernels.attention import (LOG2E, attention_reference, check_heads_out, check_kv_scales, check_qkv,
                                      heads_out, qkv_views)
from tilekit.kernels.quantize_fp8 import fp8_bits, fp8_codes, fp8_values
from tilekit.kernels.tiles import (batch_head, online_softmax_fold_key, online_softmax_step_by_column,
                                  sync_with_previous_kernel)

ZERO = ct.PaddingMode.ZERO
MAX_QUERIES = 16
MAX_ROWS = 64          # query heads per key/value head x query tokens, stacked in one tile


@ct.function
def query_rows(QP, nq, hk, group, H):
    """(query head, token) of each row of a (QP, 1) query tile of key/value head hk; rows past the
    group's G x nq address head H, which does not exist (gathers read zeros, scatters drop them)."""
    r = ct.arange(QP, dtype=ct.int32).reshape((QP, 1))
    return ct.where(r < group * nq, hk * group + r // nq, H), r % nq


@ct.function
def cache_tile(C, Table, b, hk, j, BN, D, LATENCY, PAGED):
    """Tile j (BN, D) of head (b, hk) of cache C, loaded with latency hint LATENCY (0: none): C (B, Hkv, capacity,
    D), or with PAGED a pool (blocks, Hkv, BLOCK, D) whose block Table[b, p // BLOCK] holds position p (BN divides
    BLOCK: one load from one block)."""
    if PAGED:
        per_block = C.shape[2] // BN
        block = ct.load(Table, (b, j // per_block), shape=())
        if LATENCY:
            tile = ct.load(C, (block, hk, j % per_block, 0), (1, 1, BN, D), padding_mode=ZERO, latency=LATENCY)
        else:
            tile = ct.load(C, (block, hk, j % per_block, 0), (1, 1, BN, D), padding_mode=ZERO)
    else:
        if LATENCY:
            tile = ct.load(C, (b, hk, j, 0), (1, 1, BN, D), padding_mode=ZERO, latency=LATENCY)
        else:
            tile = ct.load(C, (b, hk, j, 0), (1, 1, BN, D), padding_mode=ZERO)
    return tile.reshape((BN, D))


@ct.kernel
def decode_attention_kernel(Q, Knew, Vnew, K, V, KScale, VScale, Lengths, O, Opart, Mpart, Lpart,
                            qk_scale: float, length_offset: int, QP: ct.Constant[int], BN: ct.Constant[int],
                            D: ct.Constant[int], CHUNK: ct.Constant[int], MERGE: ct.Constant[bool],
                            NEW_KV: ct.Constant[bool], FP8: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """Attention of split ct.bid(1) of (batch, key/value head) ct.bid(0).

    Q: (B, H, nq, D); K, V: (B, Hkv, capacity, D) caches; Lengths[b] + length_offset = valid keys,
    the last nq of which are the queries' own positions (causal among them). With NEW_KV those nq
    keys and values come from Knew, Vnew (B, Hkv, nq, D): the split holding the last position folds them
    in first, one rank-1 update each, and writes them into K, V; the splits read only the older positions
    from the cache. Query r of the tile is query head hk * G + r // nq, token r % nq (G = H / Hkv), a
    column each: the scores are (keys, queries) and the output (D, queries), so that the products' M axis
    is the keys and the head dimension (Hopper's asynchronous MMA, operands in shared memory); with the
    queries as rows (M = 16, operands in registers) a 128-wide bf16 head spilled registers
    (docs/results/decode-attention-cubins-sm90.txt), as MLA's kernel did. Without MERGE (one split) the
    program writes O; otherwise its partial state goes to Opart (B, Hkv, S, QP, D), Mpart, Lpart
    (B, Hkv, S, QP), fp32, for decode_merge_kernel. With FP8, K and V hold e4m3 codes (uint8) and KScale,
    VScale (Hkv,) fp32 their per-head scales (the value scale multiplies the output, or the partial output,
    which the merge's weighted sum carries through). LATENCY: the cache tiles' load latency hint (load_latency).
    """
    sync_with_previous_kernel()
    decode_split(Q, Knew, Vnew, K, V, KScale, VScale, Lengths, Lengths, O, Opart, Mpart, Lpart, qk_scale,
                 length_offset, QP, BN, D, CHUNK, MERGE, NEW_KV, FP8, LATENCY, False)


@ct.function
def decode_split(Q, Knew, Vnew, K, V, KScale, VScale, Table, Lengths, O, Opart, Mpart, Lpart, qk_scale, length_offset,
                 QP, BN, D, CHUNK, MERGE, NEW_KV, FP8, LATENCY, PAGED):
    """The body of decode_attention_kernel and paged_decode_attention_kernel (PAGED: K and V are pools read through
    Table; the dense kernel passes Lengths in its place, never read). Its kernel has waited for the one before."""
    bh = ct.bid(0)
    b, hk = batch_head(bh, K.shape[1])
    split = ct.bid(1)
    H = Q.shape[1]
    nq = Q.shape[2]
    length = ct.load(Lengths, (b,), shape=()) + length_offset
    first_new = length - nq
    start = split * CHUNK
    cached = length
    if NEW_KV:
        cached = first_new
    end = ct.minimum(cached, start + CHUNK)
    head, token = query_rows(QP, nq, hk, H // K.shape[1], H)
    dims = ct.arange(D, dtype=ct.int32).reshape((1, D))
    q_t = ct.transpose(ct.gather(Q, (b, head, token, dims)))                         # (D, QP)
    q_token = ct.transpose(token)                                                    # (1, QP)
    q_pos = q_token + first_new
    score_scale = qk_scale
    if FP8:
        k_scale = ct.load(KScale, (hk,), shape=())
        v_scale = ct.load(VScale, (hk,), shape=())
        score_scale = qk_scale * k_scale
    m_i = ct.full((1, QP), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((1, QP), dtype=ct.float32)
    acc = ct.zeros((D, QP), dtype=ct.float32)
    if NEW_KV:
        if split == (length - 1) // CHUNK:
            for t in range(nq):          # each new token a rank-1 update
                k_new = ct.load(Knew, (b, hk, t, 0), (1, 1, 1, D), padding_mode=ZERO).reshape((1, D))
                v_new = ct.load(Vnew, (b, hk, t, 0), (1, 1, 1, D), padding_mode=ZERO).reshape((1, D))
                k_write = k_new
                v_write = v_new
                if FP8:                                  # attend to what the cache will hold
                    k_write = fp8_bits(k_new.astype(ct.float32), k_scale)
                    v_write = fp8_bits(v_new.astype(ct.float32), v_scale)
                    k_new = ct.bitcast(k_write, ct.float8_e4m3fn).astype(Q.dtype)
                    v_new = ct.bitcast(v_write, ct.float8_e4m3fn).astype(Q.dtype)
                k_col = ct.transpose(k_new).astype(ct.float32)                       # (D, 1)
                s_t = ct.sum(q_t.astype(ct.float32) * k_col, axis=0, keepdims=True) * score_scale
                s_t = ct.where(t <= q_token, s_t, -math.inf)                         # causal among the new
                m_i, l_i, acc = online_softmax_fold_key(s_t, m_i, l_i, acc, ct.transpose(v_new).astype(ct.float32))
                if PAGED:                                # its block of the pool, its slot there
                    pos = first_new + t
                    block = ct.load(Table, (b, pos // K.shape[2]), shape=())
                    ct.scatter(K, (block, hk, pos % K.shape[2], dims), k_write)
                    ct.scatter(V, (block, hk, pos % K.shape[2], dims), v_write)
                else:
                    ct.scatter(K, (b, hk, first_new + t, dims), k_write)
                    ct.scatter(V, (b, hk, first_new + t, dims), v_write)
    for j in range(start // BN, ct.cdiv(end, BN)):
        k = cache_tile(K, Table, b, hk, j, BN, D, LATENCY, PAGED)
        if FP8:
            k = ct.bitcast(k, ct.float8_e4m3fn).astype(Q.dtype)
        s = ct.mma(k, q_t, ct.zeros((BN, QP), dtype=ct.float32)) * score_scale
        k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((BN, 1))
        s = ct.where((k_pos < end) & (k_pos <= q_pos), s, -math.inf)
        # V's tile loaded after the scores: loaded beside K's, a 128-wide bf16 head took 225 KB of shared memory
        # (one program an SM) whatever the occupancy (docs/results/decode-attention-cubins-sm90.txt)
        v = cache_tile(V, Table, b, hk, j, BN, D, LATENCY, PAGED)
        if FP8:
            v = ct.bitcast(v, ct.float8_e4m3fn).astype(Q.dtype)
        m_i, l_i, acc = online_softmax_step_by_column(s, m_i, l_i, acc, ct.transpose(v))
    if not MERGE:
        out = acc / l_i
        if FP8:
            out = out * v_scale
        ct.scatter(O, (b, head, token, dims), ct.transpose(out).astype(O.dtype))
    else:
        if FP8:
            acc = acc * v_scale
        ct.store(Opart, (b, hk, split, 0, 0), ct.transpose(acc).reshape((1, 1, 1, QP, D)))
        ct.store(Mpart, (b, hk, split, 0), m_i.reshape((1, 1, 1, QP)))
        ct.store(Lpart, (b, hk, split, 0), l_i.reshape((1, 1, 1, QP)))


def merge_splits(Opart, Mpart, Lpart, b, g, QP, D):
    """The (QP, D) fp32 merge of the partial softmax states of every split of (batch b, group g): each split's
    output weighted by its exp2(max - the overall max), over the splits' weighted sums."""
    S = Mpart.shape[2]
    m_max = ct.full((QP, 1), -math.inf, dtype=ct.float32)
    for s in range(S):
        m_max = ct.maximum(m_max, ct.load(Mpart, (b, g, s, 0), (1, 1, 1, QP)).reshape((QP, 1)))
    m_max = ct.where(m_max == -math.inf, 0.0, m_max)
    total = ct.zeros((QP, 1), dtype=ct.float32)
    out = ct.zeros((QP, D), dtype=ct.float32)
    for s in range(S):
        w = ct.exp2(ct.load(Mpart, (b, g, s, 0), (1, 1, 1, QP)).reshape((QP, 1)) - m_max)
        total = total + ct.load(Lpart, (b, g, s, 0), (1, 1, 1, QP)).reshape((QP, 1)) * w
        out = out + ct.load(Opart, (b, g, s, 0, 0), (1, 1, 1, QP, D)).reshape((QP, D)) * w
    return out / total


@ct.kernel
def decode_merge_kernel(Opart, Mpart, Lpart, O, QP: ct.Constant[int], D: ct.Constant[int]):
    """O[b, heads of kv head hk] = the merge of the partial softmax states of all splits of (batch,
    key/value head) ct.bid(0)."""
    sync_with_previous_kernel()
    b, hk = batch_head(ct.bid(0), Mpart.shape[1])
    out = merge_splits(Opart, Mpart, Lpart, b, hk, QP, D)
    H = O.shape[1]
    head, token = query_rows(QP, O.shape[2], hk, H // Mpart.shape[1], H)
    ct.scatter(O, (b, head, token, ct.arange(D, dtype=ct.int32).reshape((1, D))), out.astype(O.dtype))


MIN_CHUNK = 128       # positions of the shortest split
MAX_SPLITS = 128      # partial states the merge reads back per (sequence, key/value head)
FILL_PROGRAMS, LONG_SPLIT = 264, 1024


def split_chunk(p: dict, c: dict) -> int:
    """Positions per split: the capacity cut so that the grid holds at most PROGRAMS programs (B x Hkv x splits),
    the split a power of two from MIN_CHUNK (and the key tile) up to the whole capacity, at most MAX_SPLITS splits.
    B and the capacity count as their buckets, so every problem of a tuned entry's bucket runs its kernel. Tuning a
    program count rather than a split length lets a shape that borrows another's entry (another batch, GQA group)
    keep a grid that fills the GPU; and since short contexts tune to few programs, a context long enough for splits
    of LONG_SPLIT positions gets at least FILL_PROGRAMS programs (two per SM of a 132-SM GPU) whatever the entry
    (borrowed from a 1K context, one split per head ran batch 1 with 32 heads at 128K at 23% of the copy bandwidth;
    with LONG_SPLIT 4096, at 4K at 33% against 51% with 8 splits)."""
    capacity = pow2_ceil(p["capacity"])
    pairs = pow2_ceil(p["B"]) * p["Hkv"]
    splits = max(1, c["PROGRAMS"] // pairs, min(FILL_PROGRAMS // pairs, capacity // LONG_SPLIT))
    chunk = max(MIN_CHUNK, c["BN"], pow2_ceil(ct.cdiv(capacity, splits)), capacity // MAX_SPLITS)
    return min(chunk, max(capacity, MIN_CHUNK, c["BN"]))


def _fits(c: dict, p: dict) -> bool:
    """A program count only where it makes a split length of its own (the smallest one that does). 256-key tiles
    only where K and V tiles stay 32 KB and the fp32 score tile does not spill. Left out, as tileiras 13.4 builds
    them wrong on sm_90 at some shapes (docs/results/wrong-configs.txt): occupancy 2 with query rows of 256 bytes
    or more (bf16 D128, fp32), and 64-key tiles at occupancy 4 with 16-bit D128 rows. The tuner's check catches
    such a config at the shape it tunes; this keeps a shape that borrows another shape's entry from inheriting one."""
    row_bytes = pow2_ceil(p["D"]) * (4 if p["dtype"] == "float32" else 2)
    index = PROGRAMS.index(c["PROGRAMS"])
    return ((index == 0 or split_chunk(p, dict(c, PROGRAMS=PROGRAMS[index - 1])) != split_chunk(p, c))
            and (c["BN"] <= 128 or (p["D"] <= 64 and p["dtype"] != "float32"))
            and (c["occupancy"] != 2 or row_bytes < 256)
            and not (c["BN"] == 64 and c["occupancy"] == 4 and p["dtype"] != "float32" and p["D"] > 64))


# The tuner times the merge launch with the splits, so it weighs more programs against more states to merge.
# PROGRAMS 1: one split per (sequence, key/value head), no merge.
PROGRAMS = (1, 64, 128, 256, 512, 1024, 2048, 4096)
SPACE = SearchSpace(_fits, BN=(64, 128, 256), PROGRAMS=PROGRAMS, occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    """About two programs per SM of a 132-SM GPU, in splits of at least two 128-key tiles (a short context in one
    split: no merge launch). fp32 products run on FMA units with the tiles in registers: 64-key tiles spill less
    (sm_90 D64: 1.9 KB a thread against 2.5 KB at 128; docs/results/fp32-tiles-sm90.txt)."""
    c = dict(BN=64 if p["dtype"] == "float32" else 128, occupancy=4)
    chunk = {n: split_chunk(p, dict(c, PROGRAMS=n)) for n in PROGRAMS}
    target = min((chunk[n] for n in PROGRAMS if n <= 256 and chunk[n] >= 256), default=chunk[1])
    return dict(c, PROGRAMS=min(n for n in PROGRAMS if chunk[n] == target))     # the space's one for that length


def load_latency(c: dict) -> int:
    """The K and V tiles' latency hint: 4 at occupancy 1, where a program has an SM's shared memory to prefetch
    into, 0 (no hint) otherwise. Batch 1 of 16 query heads over 4 key/value heads, 256 keys of 128 dims, one
    program per head: 7.6 us a launch with it against 10.3 without (H100, replayed;
    docs/results/decode-attention-short-h100.txt); at occupancy 4 the hint changed nothing."""
    return 4 if c["occupancy"] == 1 else 0


def _splits(p: dict, c: dict) -> int:
    return ct.cdiv(p["capacity"], split_chunk(p, c))


def _qp(p: dict) -> int:
    """Rows of the query tile: the group's query heads x the new tokens."""
    return max(16, pow2_ceil(p["H"] // p["Hkv"] * p["nq"]))


def _arrays(p: dict) -> dict:
    B, H, Hkv, nq, cap, D, dt = p["B"], p["H"], p["Hkv"], p["nq"], p["capacity"], p["D"], p["dtype"]
    fused = H + 2 * Hkv
    new_kv = {"k_new": qkv_views(dt, B, Hkv, nq, D, 0, fused), "v_new": qkv_views(dt, B, Hkv, nq, D, 0, fused)} \
        if p["new_kv"] else {"k_new": absent(dt, 4), "v_new": absent(dt, 4)}
    if p["fp8"]:       # positive e4m3 codes below 0x7F (NaN)
        cache = {n: ArraySpec("uint8", (B, Hkv, cap, D), high=0x7F) for n in ("k", "v")}
        scales = {n: ArraySpec("float32", (Hkv,), fill=1) for n in ("k_scale", "v_scale")}
    else:
        cache = {n: ArraySpec(dt, (B, Hkv, cap, D)) for n in ("k", "v")}
        scales = {n: absent("float32", 1) for n in ("k_scale", "v_scale")}
    return {"q": qkv_views(dt, B, H, nq, D, 0, fused), **new_kv, **cache, **scales,
            "lengths": ArraySpec("int32", (B,), fill=cap), "o": heads_out(dt, B, H, nq, D)}


def _scratch(p: dict, c: dict) -> dict:
    """Partial softmax states of the splits (none with one split)."""
    B, H, S, QP = p["B"], p["Hkv"], _splits(p, c), _qp(p)
    if S == 1:
        return {"opart": absent("float32", 5), "mpart": absent("float32", 4), "lpart": absent("float32", 4)}
    return {"opart": ArraySpec("float32", (B, H, S, QP, pow2_ceil(p["D"])), role="scratch"),
            "mpart": ArraySpec("float32", (B, H, S, QP), role="scratch"),
            "lpart": ArraySpec("float32", (B, H, S, QP), role="scratch")}


def _grid(p: dict, c: dict) -> tuple:
    return (p["B"] * p["Hkv"], _splits(p, c), 1)


def _merge_grid(p: dict, c: dict) -> tuple:
    """No merge launch with one split."""
    return (p["B"] * p["Hkv"] if _splits(p, c) > 1 else 0, 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (_qp(p), c["BN"], pow2_ceil(p["D"]), split_chunk(p, c), _splits(p, c) > 1, bool(p["new_kv"]),
            bool(p["fp8"]), load_latency(c))


def _merge_constants(p: dict, c: dict) -> tuple:
    return (_qp(p), pow2_ceil(p["D"]))


def _bind(a: list, flags: tuple) -> Binding:
    q, k_cache, v_cache, lengths, k_new, v_new, k_scale, v_scale, out = a
    fp8 = k_cache.dtype == "uint8"
    check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"), codes=fp8)
    B, H, nq, D = q.shape
    arrays.check_dtype(lengths, "lengths", ("int32",))
    if lengths.shape != (B,) or lengths.device != q.device:
        raise ValueError(f"lengths must be an int32 array of shape ({B},) on GPU {q.device}, "
                         f"got shape {lengths.shape} on GPU {lengths.device}")
    if k_cache.shape[2] < 1:
        raise ValueError(f"k_cache has no positions to attend to (shape {k_cache.shape})")
    if not 1 <= nq <= MAX_QUERIES:
        raise ValueError(f"q holds {nq} query tokens per sequence; decode_attention takes 1..{MAX_QUERIES} "
                         f"(use attention() for prefill)")
    Hkv = k_cache.shape[1]
    if H // Hkv * nq > MAX_ROWS:
        raise ValueError(f"{H // Hkv} query heads per key/value head x {nq} tokens exceed {MAX_ROWS} rows; "
                         f"pass fewer tokens per call")
    views = {"q": (0, None), "k": (1, None), "v": (2, None), "lengths": (3, None), "o": (8, None)}
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both new_k and new_v, or neither")
    if k_new is not None:
        check_qkv(q, k_new, v_new, ("q", "new_k", "new_v"))
        if k_new.shape != (B, Hkv, nq, D):
            raise ValueError(f"new_k must have shape {(B, Hkv, nq, D)} (one key per new token), got {k_new.shape}")
        views.update(k_new=(4, None), v_new=(5, None))
    if fp8:
        check_kv_scales(q, k_scale, v_scale, Hkv)
        views.update(k_scale=(6, None), v_scale=(7, None))
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with an FP8 (uint8) cache; k_cache has dtype {k_cache.dtype}")
    if out is not None:
        check_heads_out(out, q)
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, Hkv=Hkv, nq=nq, capacity=k_cache.shape[2], D=D,
                                new_kv=int(k_new is not None), fp8=int(fp8)),
                   arrays=views, output=(8, arrays.allocator(q.kind, q.device, q.shape, q.dtype)), returns=8,
                   scalars={"qk_scale": (0, LOG2E / math.sqrt(D)), "length_offset": (1, 0)})


DECODE_ATTENTION = Op(
    "decode_attention", args=("q", "k_cache", "v_cache", "lengths", "new_k", "new_v", "k_scale", "v_scale", "out"),
    optional=("new_k", "new_v", "k_scale", "v_scale", "out"),
    key=dict(dtype=None, B=pow2_bucket, H=None, Hkv=None, nq=None, capacity=pow2_bucket, D=None, new_kv=None,
             fp8=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(p["D"]), "length_offset": 0},
    launches=(Launch(decode_attention_kernel, _grid,
                     ("q", "k_new", "v_new", "k", "v", "k_scale", "v_scale", "lengths", "o", "opart", "mpart",
                      "lpart", "qk_scale", "length_offset"), _constants,
                     # An ordinary launch, once per layer: with every kernel of a decode step launched early,
                     # kernels queue up several deep and steps run slower (H100: gpt2-xl 2.56 ms against 2.06,
                     # gpt2 0.355 against 0.321; docs/results/decode-one-launch-h100.txt).
                     dependent=False),
              Launch(decode_merge_kernel, _merge_grid, ("opart", "mpart", "lpart", "o"), _merge_constants,
                     hinted=False)),
    bind=_bind, choices=dict(new_kv=(0, 1), fp8=(0, 1)), cli_defaults=dict(nq=1, new_kv=1, fp8=0),
    tune_whole=True)


def decode_attention(q, k_cache, v_cache, lengths, *, new_k=None, new_v=None, k_scale=None, v_scale=None,
                     scale: float | None = None, length_offset: int = 0, out=None):
    """Attention of nq new queries per sequence against a KV cache (flash-decoding).

    q: (B, H, nq, D); k_cache, v_cache: (B, Hkv, capacity, D) (Hkv dividing H: grouped-query
    attention) of q's dtype, or an FP8 cache: e4m3 codes as uint8 with k_scale, v_scale float32 (Hkv,)
    (key = code x k_scale[head]); lengths: int32 (B,) on the device.
    Sequence b attends to its first n = lengths[b] + length_offset cached positions, the last nq of
    which are the queries' own (causal among them); n must lie in nq .. capacity. new_k, new_v
    (B, Hkv, nq, D), when given, are those nq positions' keys and values: they are written into the
    caches at n - nq .. n - 1 in the same launch (an FP8 cache: divided by the scale, saturated to
    +-448, rounded to e4m3). Returns (B, H, nq, D) of q's kind.
    """
    if not isinstance(length_offset, (int, np.integer)) or isinstance(length_offset, bool):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    return DECODE_ATTENTION((q, k_cache, v_cache, lengths, new_k, new_v, k_scale, v_scale, out), (),
                            (None if scale is None else arrays.checked_positive(scale, "scale") * LOG2E,
                             int(length_offset)))


def decode_attention_reference(q, k_cache, v_cache, lengths, *, new_k=None, new_v=None, k_scale=None, v_scale=None,
                               scale: float | None = None, length_offset: int = 0) -> np.ndarray:
    """float64 NumPy decode attention: per sequence, attention over its first lengths[b] + offset keys,
    the last nq of them replaced by new_k, new_v when given. With k_scale, v_scale the caches are FP8
    codes: attention runs over their values, the new keys and values quantized as the kernel stores them."""
    q = np.asarray(q, np.float64)
    fp8 = k_scale is not None
    if fp8:
        k_cache, v_cache = fp8_values(k_cache, k_scale), fp8_values(v_cache, v_scale)
        if new_k is not None:
            new_k, new_v = fp8_values(fp8_codes(new_k, k_scale), k_scale), fp8_values(fp8_codes(new_v, v_scale), v_scale)
    k_cache, v_cache = np.array(k_cache, np.float64), np.array(v_cache, np.float64)
    out = np.empty(q.shape)
    nq = q.shape[2]
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        if new_k is not None:
            k_cache[b, :, n - nq:n] = np.asarray(new_k, np.float64)[b]
            v_cache[b, :, n - nq:n] = np.asarray(new_v, np.float64)[b]
        out[b] = attention_reference(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                                     causal=True, scale=scale)[0]
    return out


if __name__ == "__main__":
    from tilekit.kernels.decode_attention import decode_attention, decode_attention_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    cases = [(1, 25, 25, 1, 1024, "bfloat16", True), (2, 32, 8, 1, 300, "bfloat16", False),
             (3, 4, 4, 3, 700, "float32", False), (2, 8, 2, 3, 100, "float16", True)]
    for B, H, Hkv, nq, cap, dtype, new in cases:
        q, kc, vc = rand((B, H, nq, 64), dtype), rand((B, Hkv, cap, 64), dtype), rand((B, Hkv, cap, 64), dtype)
        kn, vn = (rand((B, Hkv, nq, 64), dtype), rand((B, Hkv, nq, 64), dtype)) if new else (None, None)
        lengths = np.random.default_rng(0).integers(nq, cap + 1, B).astype(np.int32)
        ref = decode_attention_reference(host(q), host(kc), host(vc), lengths,
                                         **(dict(new_k=host(kn), new_v=host(vn)) if new else {}))
        out = decode_attention(q, kc, vc, cupy.asarray(lengths), new_k=kn, new_v=vn,
                               out=poisoned((B, H, nq, 64), dtype))
        err = assert_close(host(out), ref, TOL[dtype], f"decode_attention B{B} cap{cap} {dtype}")
        if new:
            for b, n in enumerate(lengths):
                assert np.array_equal(host(kc)[b, :, n - nq:n], host(kn)[b]), "new keys not in the cache"
                assert np.array_equal(host(vc)[b, :, n - nq:n], host(vn)[b]), "new values not in the cache"
        print(f"decode_attention B{B} H{H} Hkv{Hkv} nq{nq} capacity {cap} {dtype} new_kv={new}: ok, "
              f"relative error {err:.2e}")
