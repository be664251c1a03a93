"""Prefill attention over a paged KV cache for a flattened batch of requests: the new tokens of several requests,
one after another in one (T, H, D) array (a prompt, or a chunk of one whose earlier positions are cached), each
attending causally over its own sequence's keys and values in the pool, earlier chunks and cached prefixes
included (their keys and values written into the pool first: paged_write_kv).

The caller cuts each request's rows into tiles of at most TILE_ROWS rows and lists them: tiles[i] = (request,
first row in q, rows, position of that first row in its sequence); unused entries have 0 rows and do nothing, so
the list can have a fixed length whatever the requests. A program takes BM rows of one tile (a tile is TILE_ROWS /
BM programs) and one query head, and walks the sequence's key tiles of BN positions (BN dividing the block, each
one load from one block through the request's table row) up to its last query's position: the tiles every one of
its queries sees without a mask, then the rest masked. Online softmax as in kernels.attention; an FP8 pool holds
e4m3 codes with per-head scales, widened as they load.
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
from tilekit.kernels.attention import LOG2E, attention_reference, check_kv_scales, prefill_softmax_step
from tilekit.kernels.paged_decode_attention import gather_pool
from tilekit.kernels.paged_write_kv import check_pool, token_rows
from tilekit.kernels.quantize_fp8 import fp8_values
from tilekit.kernels.tiles import sync_with_previous_kernel, tensor_mma

ZERO = ct.PaddingMode.ZERO
TILE_ROWS = 128          # rows of a listed tile: the largest BM
TILE_FIELDS = 4          # request, first row, rows, first position


@ct.function
def pool_tiles(K, V, Table, request, hk, j, BN, D, FP8, dtype):
    """Key tile j of a request's sequence as (D, BN) and its value tile (BN, D): one load each from its block
    (FP8 codes widened to `dtype`)."""
    per_block = K.shape[2] // BN
    block = ct.load(Table, (request, j // per_block), shape=())
    k = ct.load(K, (block, hk, 0, j % per_block), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO)
    v = ct.load(V, (block, hk, j % per_block, 0), (1, 1, BN, D), padding_mode=ZERO)
    k = k.reshape((D, BN))
    v = v.reshape((BN, D))
    if FP8:
        k = ct.bitcast(k, ct.float8_e4m3fn).astype(dtype)
        v = ct.bitcast(v, ct.float8_e4m3fn).astype(dtype)
    return k, v


@ct.kernel
def paged_prefill_attention_kernel(Q, K, V, KScale, VScale, Table, Tiles, O, qk_scale: float,
                                   BM: ct.Constant[int], BN: ct.Constant[int], D: ct.Constant[int],
                                   FP8: ct.Constant[bool]):
    """Rows (ct.bid(0) % parts) x BM.. of listed tile ct.bid(0) // parts, query head ct.bid(1): Q, O (T, H, D)
    rows; K, V (blocks, Hkv, BLOCK, D) pools; Table (requests, blocks per sequence); Tiles (tiles, 4)."""
    sync_with_previous_kernel()
    parts = TILE_ROWS // BM
    tile = ct.bid(0) // parts
    h = ct.bid(1)
    hk = h // (Q.shape[1] // K.shape[1])
    request = ct.load(Tiles, (tile, 0), shape=())
    sub = (ct.bid(0) % parts) * BM
    row0 = ct.load(Tiles, (tile, 1), shape=()) + sub
    rows = ct.load(Tiles, (tile, 2), shape=()) - sub
    pos0 = ct.load(Tiles, (tile, 3), shape=()) + sub
    if rows > 0:
        i = ct.arange(BM, dtype=ct.int32).reshape((BM, 1))
        valid = i < rows
        dims = ct.arange(D, dtype=ct.int32).reshape((1, D))
        q = ct.gather(Q, (row0 + i, h, dims), mask=valid)                            # (BM, D)
        q_pos = pos0 + i
        score_scale = qk_scale
        if FP8:
            score_scale = qk_scale * ct.load(KScale, (hk,), shape=())
        m_i = ct.full((BM, 1), -math.inf, dtype=ct.float32)
        l_i = ct.zeros((BM, 1), dtype=ct.float32)
        acc = ct.zeros((BM, D), dtype=ct.float32)
        last = pos0 + ct.minimum(rows, BM)           # keys the last valid query sees
        n_full = (pos0 + 1) // BN                    # key tiles every query sees whole: no mask
        for j in range(n_full):
            k, v = pool_tiles(K, V, Table, request, hk, j, BN, D, FP8, Q.dtype)
            s = tensor_mma(q, k, ct.zeros((BM, BN), dtype=ct.float32))
            m_i, l_i, acc = prefill_softmax_step(s, m_i, l_i, acc, v, score_scale)
        for j in range(n_full, ct.cdiv(last, BN)):
            k, v = pool_tiles(K, V, Table, request, hk, j, BN, D, FP8, Q.dtype)
            s = tensor_mma(q, k, ct.zeros((BM, BN), dtype=ct.float32))
            k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((1, BN))
            s = ct.where(k_pos <= q_pos, s, -math.inf)
            m_i, l_i, acc = prefill_softmax_step(s, m_i, l_i, acc, v, score_scale)
        out = ct.truediv(acc, l_i, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)
        if FP8:
            out = out * ct.load(VScale, (hk,), shape=())
        ct.scatter(O, (row0 + i, h, dims), out.astype(O.dtype), mask=valid)


def _fits(c: dict, p: dict) -> bool:
    """Key tiles that divide a block (16-key ones for blocks of 16 only); tiles of at most 128 x 128; 4 programs an SM
    only with small query tiles. Left out: fp32 with 16- or 32-key tiles beside 32- or 128-row query tiles, which
    tileiras 13.4 does not compile for sm_90 ("Invalid use-def chain in LoopSchedule")."""
    d = pow2_ceil(p["D"])
    return (c["BN"] <= p["block"] and p["block"] % c["BN"] == 0 and (c["BN"] > 16 or p["block"] == 16)
            and c["BM"] * d <= 128 * 128 and c["BN"] * d <= 128 * 128 and (c["occupancy"] <= 2 or c["BM"] <= 64)
            and not (p["dtype"] == "float32" and c["BN"] <= 32 and c["BM"] != 64))


SPACE = SearchSpace(_fits, BM=(32, 64, 128), BN=(16, 32, 64, 128), occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    """kernels.attention's: 64-row query tiles, two programs an SM, the largest key tile a block holds up to 128
    (64 in fp32, whose products run as three tf32 ones with their operands split in registers)."""
    bn = min(p["block"], 64 if p["dtype"] == "float32" else 128)
    return dict(BM=64, BN=bn, occupancy=2)


def tile_list(lengths, starts, rows_before=None, capacity: int | None = None) -> np.ndarray:
    """tiles (capacity or as many as needed, TILE_FIELDS) int32 for requests of `lengths` new tokens each, stacked
    in that order from row 0, whose first new token sits at position starts[r] of request r's sequence."""
    tiles, row = [], 0
    for r, (n, start) in enumerate(zip(lengths, starts)):
        for first in range(0, n, TILE_ROWS):
            tiles.append((r, row + first, min(TILE_ROWS, n - first), start + first))
        row += n
    if capacity is not None:
        if len(tiles) > capacity:
            raise ValueError(f"{len(tiles)} query tiles exceed the list's {capacity}")
        tiles += [(0, 0, 0, 0)] * (capacity - len(tiles))
    return np.array(tiles, np.int32).reshape(-1, TILE_FIELDS)


def _arrays(p: dict) -> dict:
    T, H, Hkv, D, dt, block, R = p["T"], p["H"], p["Hkv"], p["D"], p["dtype"], p["block"], p["R"]
    past = p["past"]
    per_seq = ct.cdiv(past + ct.cdiv(T, R), block)
    blocks = R * per_seq + 1
    lengths = [T // R + (r < T % R) for r in range(R)]
    fused = H + 2 * Hkv
    pool = "uint8" if p["fp8"] else dt
    scales = {n: ArraySpec("float32", (Hkv,), fill=1) if p["fp8"] else absent("float32", 1)
              for n in ("k_scale", "v_scale")}
    tiles = tile_list(lengths, [past] * R, capacity=ct.cdiv(T, TILE_ROWS) + R)
    return {"q": token_rows(dt, T, H, D, fused),
            "k": ArraySpec(pool, (blocks, Hkv, block, D), high=0x7F if p["fp8"] else None),
            "v": ArraySpec(pool, (blocks, Hkv, block, D), high=0x7F if p["fp8"] else None), **scales,
            "table": ArraySpec("int32", (R, per_seq), values=tuple(range(1, R * per_seq + 1))),
            "tiles": ArraySpec("int32", tiles.shape, values=tuple(int(v) for v in tiles.reshape(-1))),
            "o": ArraySpec(dt, (T, H, D), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (p["tiles"] * (TILE_ROWS // c["BM"]), p["H"], 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["BM"], c["BN"], pow2_ceil(p["D"]), bool(p["fp8"]))


def _bind(a: list, flags: tuple) -> Binding:
    q, k_pool, v_pool, table, tiles, k_scale, v_scale, out = a
    fp8 = k_pool.dtype == "uint8"
    arrays.check_dtype(q, "q", arrays.FLOAT_DTYPES)
    if len(q.shape) != 3:
        raise ValueError(f"q must be (tokens, heads, head_dim), got shape {q.shape}")
    arrays.check_last_contiguous(q, "q")
    T, H, D = q.shape
    Hkv = k_pool.shape[1] if len(k_pool.shape) == 4 else 0
    if not Hkv or H % Hkv:
        raise ValueError(f"k_pool must be (blocks, Hkv, block, {D}) with Hkv dividing q's {H} heads, got shape "
                         f"{k_pool.shape}")
    check_pool(k_pool, "k_pool", q, Hkv, D, fp8)
    check_pool(v_pool, "v_pool", q, Hkv, D, fp8)
    for x, name, width in ((table, "table", None), (tiles, "tiles", TILE_FIELDS)):
        arrays.check_dtype(x, name, ("int32",))
        if len(x.shape) != 2 or (width is not None and x.shape[1] != width) or x.device != q.device:
            raise ValueError(f"{name} must be a 2-D int32 array{f' of {width} columns' if width else ''} on GPU "
                             f"{q.device}, got shape {x.shape}")
        arrays.check_contiguous(x, name)
    views = {"q": (0, None), "k": (1, None), "v": (2, None), "table": (3, None), "tiles": (4, None), "o": (7, None)}
    if fp8:
        check_kv_scales(q, k_scale, v_scale, Hkv)
        views.update(k_scale=(5, None), v_scale=(6, None))
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with an FP8 (uint8) pool; k_pool has dtype {k_pool.dtype}")
    if out is not None:
        arrays.check_out(out, "out", q, q.shape, contiguous=False)
    return Binding(problem=dict(dtype=q.dtype, T=T, H=H, Hkv=Hkv, D=D, fp8=int(fp8), block=k_pool.shape[2],
                                tiles=tiles.shape[0], R=table.shape[0], past=0),
                   arrays=views, output=(7, arrays.allocator(q.kind, q.device, q.shape, q.dtype)), returns=7,
                   scalars={"qk_scale": (0, LOG2E / math.sqrt(D))})


PAGED_PREFILL_ATTENTION = Op(
    "paged_prefill_attention", args=("q", "k_pool", "v_pool", "table", "tiles", "k_scale", "v_scale", "out"),
    optional=("k_scale", "v_scale", "out"),
    key=dict(dtype=None, T=pow2_bucket, H=None, Hkv=None, D=None, fp8=None, block=None),
    extras=dict(tiles=lambda p: -(-p["T"] // TILE_ROWS) + 1, R=lambda p: 1, past=lambda p: 0),
    space=SPACE, default=default_config, arrays=_arrays,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(p["D"])},
    launches=(Launch(paged_prefill_attention_kernel, _grid,
                     ("q", "k", "v", "k_scale", "v_scale", "table", "tiles", "o", "qk_scale"), _constants),),
    bind=_bind, choices=dict(fp8=(0, 1), block=(16, 32, 64, 128, 256)), cli_defaults=dict(fp8=0, block=64))


def paged_prefill_attention(q, k_pool, v_pool, table, tiles, *, k_scale=None, v_scale=None,
                            scale: float | None = None, out=None):
    """Causal attention of a flattened batch of requests' new tokens over their sequences in a paged KV cache.

    q: (T, H, D) rows (views of a fused QKV buffer allowed); k_pool, v_pool: (blocks, Hkv, BLOCK, D), already
    holding every position up to each request's newest (paged_write_kv), of q's dtype or FP8 codes with k_scale,
    v_scale float32 (Hkv,); table: int32 (requests, blocks per sequence); tiles: int32 (n, 4) from tile_list.
    Returns (T, H, D) (rows no tile lists are left as they were).
    """
    return PAGED_PREFILL_ATTENTION((q, k_pool, v_pool, table, tiles, k_scale, v_scale, out), (),
                                   (None if scale is None else arrays.checked_positive(scale, "scale") * LOG2E,))


def paged_prefill_attention_reference(q, k_pool, v_pool, table, lengths, starts, *, k_scale=None, v_scale=None,
                                      scale: float | None = None) -> np.ndarray:
    """float64 NumPy: request r's lengths[r] rows (stacked in order) attend causally over its positions 0 ..
    starts[r] + lengths[r] - 1 in the pools (FP8 codes: their values)."""
    q = np.asarray(q, np.float64)
    out, row = np.empty(q.shape), 0
    for r, (n, start) in enumerate(zip(lengths, starts)):
        k, v = gather_pool(k_pool, table[r], start + n), gather_pool(v_pool, table[r], start + n)
        if k_scale is not None:
            k, v = fp8_values(k[None], k_scale)[0], fp8_values(v[None], v_scale)[0]
        heads = q[row:row + n].transpose(1, 0, 2)[None]                                  # (1, H, n, D)
        out[row:row + n] = attention_reference(heads, np.asarray(k, np.float64)[None],
                                               np.asarray(v, np.float64)[None], causal=True,
                                               scale=scale)[0].transpose(1, 0, 2)
        row += n
    return out
