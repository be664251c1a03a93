"""A whole GPT-2 block of a decode step in one persistent launch (the "megakernel" experiment of #12).

A decode step of few rows is bound by latency, not bytes: seven kernels per block, each paying its
own ramp-up (the first weight tiles' DRAM latency, programs starting and draining). Here one grid of
one program per SM runs the block's seven stages in turn:

    LayerNorm 1 -> QKV projection -> attention (+ KV-cache write) -> output projection (+= residual)
    -> LayerNorm 2 -> fc (+ GELU) -> MLP projection (+= residual)

with a kernel-wide barrier between stages: an arrival counter in global memory that every program
increments (release) and then reads until all programs have arrived (acquire). What one stage
writes and a later one reads moves by plain (non-TMA) loads and stores, which those atomics order. cuTile has no grid
barrier or cooperative launch, so the grid is `occupancy` programs per SM, all resident at once, and
a wait gives up after SPIN_LIMIT reads rather than hang. With PREFETCH a program that has finished a
stage loads the first weight tile of its next one before it waits, so the wait overlaps a DRAM trip.

The QKV and fc projections split K over SPLIT_QKV / SPLIT_FC programs per column tile, each storing
an fp32 partial product; the next stage adds the partials and the bias as it reads them (and GELU
for fc). The output projections add into the fixed-point residual with integer atomics
(fixed_point.py), split over K as residual_linear is. Rows: up to 16 (one tile), one new token each.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.device import sm_count
from tilekit.kernels.attention import LOG2E, online_softmax_step
from tilekit.kernels.decode_attention import decode_attention_reference
from tilekit.kernels.dependent_launch import sync_with_previous_kernel
from tilekit.kernels.fixed_point import FIXED_DTYPE, add_fixed, from_fixed
from tilekit.kernels.gelu import gelu_reference, gelu_tanh
from tilekit.kernels.layernorm import layer_norm_reference

ZERO = ct.PaddingMode.ZERO
MAX_ROWS = 16
SPIN_LIMIT = 1 << 14       # barrier reads (~10 ms) before a program stops waiting: a bug shows as wrong output
BARRIERS = 6               # between the seven stages; the exit counts as a seventh arrival
STAGE_NAMES = ("ln_1", "qkv", "attention", "proj", "ln_2", "fc", "mlp_proj")
ALL_STAGES = (1 << len(STAGE_NAMES)) - 1


@ct.function
def grid_barrier(Sync, target):
    """Arrive, then wait until `target` arrivals are counted (this barrier's and every earlier one's)."""
    seen = ct.atomic_add(Sync, 0, 1) + 1
    spins = 0
    while seen < target and spins < SPIN_LIMIT:
        seen = ct.atomic_add(Sync, 0, 0)       # an acquire read (acquire loads here never saw the count move)
        spins += 1


@ct.function
def leave(Sync, total):
    """The last program out sets the counter back to zero for the next launch (every program has
    passed the last barrier by then)."""
    if ct.atomic_add(Sync, 0, 1) == total - 1:
        ct.atomic_xchg(Sync, 0, 0)


@ct.function
def layer_norm_rows(X, W, B, Out, eps, CP):
    """Out[r] = LayerNorm(X[r]) for the rows of this program (X fixed point, one (1, CP) tile a row)."""
    C = X.shape[1]
    cols = ct.arange(CP, dtype=ct.int32).reshape((1, CP))
    for r in range(ct.bid(0), X.shape[0], ct.num_blocks(0)):
        x = from_fixed(ct.load(X, (r, 0), (1, CP), padding_mode=ZERO, allow_tma=False))
        mean = ct.sum(x, axis=1, keepdims=True) / C
        centered = ct.where(cols < C, x - mean, 0.0)
        var = ct.sum(centered * centered, axis=1, keepdims=True) / C
        w = ct.load(W, (0,), (CP,), padding_mode=ZERO).astype(ct.float32).reshape((1, CP))
        b = ct.load(B, (0,), (CP,), padding_mode=ZERO).astype(ct.float32).reshape((1, CP))
        ct.store(Out, (r, 0), (centered * ct.rsqrt(var + eps) * w + b).astype(Out.dtype), allow_tma=False)


@ct.function
def split_slice(item, SPLIT, k_tiles):
    """(column tile, first K tile, end K tile) of work item `item` = column tile * SPLIT + split."""
    per_split = ct.cdiv(k_tiles, SPLIT)
    lo = (item % SPLIT) * per_split
    return item // SPLIT, lo, ct.minimum(k_tiles, lo + per_split)


@ct.function
def weight_tile(W, k, n, TK, TN, LATENCY):
    """W's (TK, TN) tile (k, n), with a DRAM prefetch-depth hint when LATENCY > 0."""
    if LATENCY > 0:
        return ct.load(W, (k, n), (TK, TN), padding_mode=ZERO, latency=LATENCY)
    return ct.load(W, (k, n), (TK, TN), padding_mode=ZERO)


@ct.function
def first_weight_tile(W, SPLIT, TN, TK, PREFETCH, LATENCY):
    """W's first tile of this program's first work item in a stage over W (zeros without PREFETCH;
    a valid tile, unused, for a program with no work there)."""
    if PREFETCH:
        k_tiles = ct.cdiv(W.shape[0], TK)
        item = ct.minimum(ct.bid(0), ct.cdiv(W.shape[1], TN) * SPLIT - 1)
        n, lo, hi = split_slice(item, SPLIT, k_tiles)
        return weight_tile(W, ct.minimum(lo, k_tiles - 1), n, TK, TN, LATENCY)
    return ct.zeros((TK, TN), dtype=W.dtype)


@ct.function
def plain_chunk(A, k, TM, TK):
    """Rows 0..TM of K chunk k of a stage input written by an earlier stage of this launch."""
    return ct.load(A, (0, k), (TM, TK), padding_mode=ZERO, allow_tma=False)


@ct.function
def summed_chunk(Part, Bias, k, like, TM, TK, SPLIT, GELU):
    """The same from SPLIT fp32 partial products Part[s] plus Bias (through GELU), as like's dtype."""
    a = ct.load(Bias, (k,), (TK,), padding_mode=ZERO).astype(ct.float32).reshape((1, TK)) \
        + ct.zeros((TM, TK), dtype=ct.float32)
    for s in range(SPLIT):
        a = a + ct.load(Part, (s, 0, k), (1, TM, TK), padding_mode=ZERO, allow_tma=False).reshape((TM, TK))
    if GELU:
        a = gelu_tanh(a)
    return a.astype(like.dtype)


@ct.function
def slice_product(A, ABias, W, n, lo, hi, w_first, first, TM, TN, TK, SPLIT_A, GELU_A, LATENCY):
    """A[:, K tiles lo..hi] @ W[same, column tile n] in fp32; A is plain (SPLIT_A == 0) or SPLIT_A
    partials plus ABias. `first`: w_first already holds W's tile (lo, n)."""
    acc = ct.zeros((TM, TN), dtype=ct.float32)
    start = lo
    if first:
        if SPLIT_A == 0:
            a = plain_chunk(A, lo, TM, TK)
        else:
            a = summed_chunk(A, ABias, lo, W, TM, TK, SPLIT_A, GELU_A)
        acc = ct.mma(a, w_first, acc)
        start = lo + 1
    for k in range(start, hi):
        if SPLIT_A == 0:
            a = plain_chunk(A, k, TM, TK)
        else:
            a = summed_chunk(A, ABias, k, W, TM, TK, SPLIT_A, GELU_A)
        acc = ct.mma(a, weight_tile(W, k, n, TK, TN, LATENCY), acc)
    return acc


@ct.function
def project_to_partials(A, W, Part, w_first, TM, TN, TK, SPLIT, PREFETCH, LATENCY):
    """Part[split] = A @ W over the split's slice of K, for this program's (column tile, split) items."""
    k_tiles = ct.cdiv(W.shape[0], TK)
    for item in range(ct.bid(0), ct.cdiv(W.shape[1], TN) * SPLIT, ct.num_blocks(0)):
        n, lo, hi = split_slice(item, SPLIT, k_tiles)
        first = PREFETCH and item == ct.bid(0) and lo < hi
        acc = slice_product(A, A, W, n, lo, hi, w_first, first, TM, TN, TK, 0, False, LATENCY)
        ct.store(Part, (item % SPLIT, 0, n), acc.reshape((1, TM, TN)), allow_tma=False)


@ct.function
def project_into_residual(A, ABias, W, Bias, X, w_first, TM, TN, TK, SPLIT, SPLIT_A, GELU_A, PREFETCH,
                          LATENCY):
    """X += A @ W + Bias (fixed point, atomically), A plain or partials; split 0 adds the bias."""
    k_tiles = ct.cdiv(W.shape[0], TK)
    cols0 = ct.arange(TN, dtype=ct.int32).reshape((1, TN))
    rows = ct.arange(TM, dtype=ct.int32).reshape((TM, 1))
    for item in range(ct.bid(0), ct.cdiv(W.shape[1], TN) * SPLIT, ct.num_blocks(0)):
        n, lo, hi = split_slice(item, SPLIT, k_tiles)
        first = PREFETCH and item == ct.bid(0) and lo < hi
        acc = slice_product(A, ABias, W, n, lo, hi, w_first, first, TM, TN, TK, SPLIT_A, GELU_A, LATENCY)
        bias = ct.load(Bias, (n,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
        acc = acc + ct.where(item % SPLIT == 0, 1.0, 0.0) * bias
        add_fixed(X, rows, cols0 + n * TN, acc)


@ct.function
def head_vector(Part, Bias, b, col_tile, SPLIT, D):
    """Columns col_tile*D.. of row b of the QKV projection: its SPLIT partials plus the bias, (1, D) fp32."""
    v = ct.load(Bias, (col_tile,), (D,)).astype(ct.float32).reshape((1, D))
    for s in range(SPLIT):
        v = v + ct.load(Part, (s, b, col_tile), (1, 1, D), allow_tma=False).reshape((1, D))
    return v


@ct.function
def attend_heads(QKVpart, Bqkv, Kc, Vc, Lengths, Y, qk_scale, length_offset, TM, D, BN, SPLIT):
    """Attention of each (sequence, head) of this program over the cached positions and its new key
    and value, which it then writes into the cache; Y[b, head h's columns] = the output. The query
    tile repeats the one query in all TM rows (the matrix units' minimum); row 0 is kept."""
    H = Kc.shape[1]
    rows = ct.arange(TM, dtype=ct.int32).reshape((TM, 1))
    for item in range(ct.bid(0), Kc.shape[0] * H, ct.num_blocks(0)):
        b = item // H
        h = item % H
        q = head_vector(QKVpart, Bqkv, b, h, SPLIT, D)
        k_new = head_vector(QKVpart, Bqkv, b, H + h, SPLIT, D).astype(Kc.dtype)
        v_new = head_vector(QKVpart, Bqkv, b, 2 * H + h, SPLIT, D).astype(Vc.dtype)
        q_rows = (ct.zeros((TM, D), dtype=ct.float32) + q).astype(Kc.dtype)
        position = ct.load(Lengths, (b,), shape=()) + length_offset - 1      # the new token's
        m_i = ct.full((TM, 1), -math.inf, dtype=ct.float32)
        l_i = ct.zeros((TM, 1), dtype=ct.float32)
        acc = ct.zeros((TM, D), dtype=ct.float32)
        for j in range(ct.cdiv(ct.minimum(position, Kc.shape[2]), BN)):
            k = ct.load(Kc, (b, h, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
            v = ct.load(Vc, (b, h, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
            s = ct.mma(q_rows, k, ct.zeros((TM, BN), dtype=ct.float32)) * qk_scale
            k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((1, BN))
            m_i, l_i, acc = online_softmax_step(ct.where(k_pos < position, s, -math.inf), m_i, l_i, acc, v)
        k_rows = ct.zeros((TM, D), dtype=Kc.dtype) + k_new
        s = ct.mma(q_rows, ct.transpose(k_rows), ct.zeros((TM, TM), dtype=ct.float32)) * qk_scale
        only_new = ct.arange(TM, dtype=ct.int32).reshape((1, TM)) == 0
        m_i, l_i, acc = online_softmax_step(ct.where(only_new, s, -math.inf), m_i, l_i, acc,
                                            ct.zeros((TM, D), dtype=Vc.dtype) + v_new)
        out = ct.sum(ct.where(rows == 0, acc / l_i, 0.0), axis=0, keepdims=True)
        ct.store(Y, (b, h), out.astype(Y.dtype), allow_tma=False)
        ct.store(Kc, (b, h, position, 0), k_new.reshape((1, 1, 1, D)))
        ct.store(Vc, (b, h, position, 0), v_new.reshape((1, 1, 1, D)))


@ct.kernel
def decode_block_kernel(X, Ln1W, Ln1B, Wqkv, Bqkv, Wproj, Bproj, Ln2W, Ln2B, Wfc, Bfc, Wmp, Bmp, Kc, Vc, Lengths,
                        H1, QKVpart, Y, H2, Fpart, Sync, eps: float, qk_scale: float, length_offset: int,
                        TM: ct.Constant[int], CP: ct.Constant[int], D: ct.Constant[int], TN: ct.Constant[int],
                        TK: ct.Constant[int], BN: ct.Constant[int], SPLIT_QKV: ct.Constant[int],
                        SPLIT_PROJ: ct.Constant[int], SPLIT_FC: ct.Constant[int], SPLIT_MP: ct.Constant[int],
                        PREFETCH: ct.Constant[bool], LATENCY: ct.Constant[int], STAGES: ct.Constant[int]):
    """X (M, C) fixed point += the block's attention and MLP branches for M sequences of one new
    token; Kc, Vc (M, H, capacity, D) gain position Lengths[b] + length_offset - 1. H1, QKVpart, Y,
    H2, Fpart are the stages' outputs; Sync (1,) int32 is zero before and after the launch. STAGES:
    which stages run (bit i: stage i; ALL_STAGES in use, fewer to time the rest, the barriers always)."""
    sync_with_previous_kernel()
    P = ct.num_blocks(0)
    if STAGES & 1:
        layer_norm_rows(X, Ln1W, Ln1B, H1, eps, CP)
    w = first_weight_tile(Wqkv, SPLIT_QKV, TN, TK, PREFETCH, LATENCY)
    grid_barrier(Sync, P)
    if STAGES & 2:
        project_to_partials(H1, Wqkv, QKVpart, w, TM, TN, TK, SPLIT_QKV, PREFETCH, LATENCY)
    grid_barrier(Sync, 2 * P)
    if STAGES & 4:
        attend_heads(QKVpart, Bqkv, Kc, Vc, Lengths, Y, qk_scale, length_offset, TM, D, BN, SPLIT_QKV)
    w = first_weight_tile(Wproj, SPLIT_PROJ, TN, TK, PREFETCH, LATENCY)
    grid_barrier(Sync, 3 * P)
    if STAGES & 8:
        project_into_residual(Y, Bproj, Wproj, Bproj, X, w, TM, TN, TK, SPLIT_PROJ, 0, False, PREFETCH, LATENCY)
    grid_barrier(Sync, 4 * P)
    if STAGES & 16:
        layer_norm_rows(X, Ln2W, Ln2B, H2, eps, CP)
    w = first_weight_tile(Wfc, SPLIT_FC, TN, TK, PREFETCH, LATENCY)
    grid_barrier(Sync, 5 * P)
    if STAGES & 32:
        project_to_partials(H2, Wfc, Fpart, w, TM, TN, TK, SPLIT_FC, PREFETCH, LATENCY)
    w = first_weight_tile(Wmp, SPLIT_MP, TN, TK, PREFETCH, LATENCY)
    grid_barrier(Sync, BARRIERS * P)
    if STAGES & 64:
        project_into_residual(Fpart, Bfc, Wmp, Bmp, X, w, TM, TN, TK, SPLIT_MP, SPLIT_FC, True, PREFETCH, LATENCY)
    leave(Sync, (BARRIERS + 1) * P)


# -- search space and heuristic default ---------------------------------------------------------

def _even_splits(split: int, k: int, tk: int) -> bool:
    """Every one of `split` slices of K's tiles is non-empty."""
    k_tiles = ct.cdiv(k, tk)
    return split <= k_tiles and (split - 1) * ct.cdiv(k_tiles, split) < k_tiles


def _fits(c: dict, p: dict) -> bool:
    C = p["C"]
    return (c["BN"] <= max(64, pow2_ceil(p["capacity"]))
            and all(_even_splits(c[s], k, c["TK"]) for s, k in
                    (("SPLIT_QKV", C), ("SPLIT_PROJ", C), ("SPLIT_FC", C), ("SPLIT_MP", 4 * C))))


SPACE = SearchSpace(_fits, TN=(32, 64), TK=(128, 256, 512), BN=(64, 128), SPLIT_QKV=(1, 2), SPLIT_PROJ=(2, 4, 8),
                    SPLIT_FC=(1, 2), SPLIT_MP=(4, 8, 16), PREFETCH=(0, 1), LATENCY=(0, 4, 8), occupancy=(1, 2))


def default_config(p: dict) -> dict:
    return dict(TN=64, TK=128, BN=128, SPLIT_QKV=2, SPLIT_PROJ=4, SPLIT_FC=1, SPLIT_MP=8, PREFETCH=1, LATENCY=0,
                occupancy=1)


def _dims(p: dict) -> tuple[int, int, int]:
    return p["B"], p["C"], p["C"] // p["H"]


def _arrays(p: dict) -> dict:
    B, C, D = _dims(p)
    dt, cap, H = p["dtype"], p["capacity"], p["H"]
    vector = {n: ArraySpec(dt, (k,)) for n, k in (("ln1_w", C), ("ln1_b", C), ("qkv_b", 3 * C), ("proj_b", C),
                                                  ("ln2_w", C), ("ln2_b", C), ("fc_b", 4 * C), ("mp_b", C))}
    return {"x": ArraySpec(FIXED_DTYPE, (B, C), role="out", high=1 << 33), **vector,
            "qkv_w": ArraySpec(dt, (C, 3 * C)), "proj_w": ArraySpec(dt, (C, C)), "fc_w": ArraySpec(dt, (C, 4 * C)),
            "mp_w": ArraySpec(dt, (4 * C, C)), "k": ArraySpec(dt, (B, H, cap, D), role="out"),
            "v": ArraySpec(dt, (B, H, cap, D), role="out"), "lengths": ArraySpec("int32", (B,), fill=cap - 1)}


def _scratch(p: dict, c: dict) -> dict:
    """Each stage's output, and the barrier's arrival counter (zero between launches)."""
    B, C, _ = _dims(p)
    dt = p["dtype"]
    return {"h1": ArraySpec(dt, (B, C), role="scratch"), "y": ArraySpec(dt, (B, C), role="scratch"),
            "h2": ArraySpec(dt, (B, C), role="scratch"),
            "qkv_part": ArraySpec("float32", (c["SPLIT_QKV"], B, 3 * C), role="scratch"),
            "f_part": ArraySpec("float32", (c["SPLIT_FC"], B, 4 * C), role="scratch"),
            "sync": ArraySpec("int32", (1,), role="zeros")}


def _grid(p: dict, c: dict) -> tuple:
    """`occupancy` programs per SM: every program must be resident at once for the barriers."""
    return (sm_count() * c["occupancy"], 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (MAX_ROWS, pow2_ceil(p["C"]), pow2_ceil(p["C"] // p["H"]), c["TN"], c["TK"], c["BN"], c["SPLIT_QKV"],
            c["SPLIT_PROJ"], c["SPLIT_FC"], c["SPLIT_MP"], bool(c["PREFETCH"]), c["LATENCY"], ALL_STAGES)


ARGS = ("residual", "ln_1_weight", "ln_1_bias", "attn_weight", "attn_bias", "proj_weight", "proj_bias",
        "ln_2_weight", "ln_2_bias", "fc_weight", "fc_bias", "mlp_proj_weight", "mlp_proj_bias", "k_cache",
        "v_cache", "positions")
KERNEL_ARRAYS = ("x", "ln1_w", "ln1_b", "qkv_w", "qkv_b", "proj_w", "proj_b", "ln2_w", "ln2_b", "fc_w", "fc_b",
                 "mp_w", "mp_b", "k", "v", "lengths")


def _bind(a: list, flags: tuple) -> Binding:
    x, k_cache = a[0], a[13]
    arrays.check_dtype(x, "residual", (FIXED_DTYPE,))
    if len(x.shape) != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] == 0:
        raise ValueError(f"residual must be (rows, width) with 1..{MAX_ROWS} rows, got shape {x.shape}")
    B, C = x.shape
    arrays.check_dtype(a[1], "ln_1_weight", arrays.FLOAT_DTYPES)
    if len(k_cache.shape) != 4 or k_cache.shape[0] != B or k_cache.shape[1] < 1 or k_cache.shape[2] < 1:
        raise ValueError(f"k_cache must be ({B}, heads, capacity, head_dim), got shape {k_cache.shape}")
    H, cap, D = k_cache.shape[1:]
    if H * D != C or D != pow2_ceil(D):
        raise ValueError(f"k_cache must have heads x head_dim = {C} with a power-of-two head_dim, got {k_cache.shape}")
    shapes = {"ln_1_weight": (C,), "ln_1_bias": (C,), "attn_weight": (C, 3 * C), "attn_bias": (3 * C,),
              "proj_weight": (C, C), "proj_bias": (C,), "ln_2_weight": (C,), "ln_2_bias": (C,),
              "fc_weight": (C, 4 * C), "fc_bias": (4 * C,), "mlp_proj_weight": (4 * C, C), "mlp_proj_bias": (C,),
              "k_cache": k_cache.shape, "v_cache": k_cache.shape}
    for i, name in enumerate(ARGS[1:15], start=1):
        arrays.check_same("ln_1_weight", a[1], name, a[i])
        if a[i].shape != shapes[name]:
            raise ValueError(f"{name} must have shape {shapes[name]}, got {a[i].shape}")
        arrays.check_contiguous(a[i], name)
    arrays.check_contiguous(x, "residual")
    positions = a[15]
    arrays.check_dtype(positions, "positions", ("int32",))
    if positions.shape != (B,) or positions.device != x.device:
        raise ValueError(f"positions must be an int32 array of shape ({B},) on GPU {x.device}, "
                         f"got shape {positions.shape} on GPU {positions.device}")
    return Binding(problem=dict(dtype=a[1].dtype, B=B, C=C, H=H, capacity=cap),
                   arrays={n: (i, None) for i, n in enumerate(KERNEL_ARRAYS)}, returns=0,
                   scalars={"eps": (0, None), "qk_scale": (1, LOG2E / math.sqrt(D)), "length_offset": (2, 1)})


DECODE_BLOCK = Op(
    "decode_block", args=ARGS, key=dict(dtype=None, B=pow2_bucket, C=None, H=None, capacity=pow2_bucket),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    scalars=lambda p: {"eps": 1e-5, "qk_scale": LOG2E / math.sqrt(p["C"] // p["H"]), "length_offset": 1},
    launches=(Launch(decode_block_kernel, _grid,
                     (*KERNEL_ARRAYS, "h1", "qkv_part", "y", "h2", "f_part", "sync", "eps", "qk_scale",
                      "length_offset"), _constants),),
    bind=_bind, cli_defaults=dict(B=1))


def decode_block(residual, ln_1_weight, ln_1_bias, attn_weight, attn_bias, proj_weight, proj_bias, ln_2_weight,
                 ln_2_bias, fc_weight, fc_bias, mlp_proj_weight, mlp_proj_bias, k_cache, v_cache, positions,
                 eps: float = 1e-5):
    """One GPT-2 block for B sequences of one new token each, in one launch; returns residual.

    residual: the fixed-point (int64) residual stream (B, C), updated in place; weights [in, out] as
    GPT-2 stores them; k_cache, v_cache: (B, H, capacity, D) of this layer; positions: int32 (B,) on
    the device, each sequence's new token's position: its key and value are written there and it
    attends to positions 0..positions[b].
    """
    return DECODE_BLOCK((residual, ln_1_weight, ln_1_bias, attn_weight, attn_bias, proj_weight, proj_bias,
                         ln_2_weight, ln_2_bias, fc_weight, fc_bias, mlp_proj_weight, mlp_proj_bias, k_cache,
                         v_cache, positions), (), (arrays.checked_positive(eps, "eps"), None, None))


def decode_block_reference(x, ln_1_weight, ln_1_bias, attn_weight, attn_bias, proj_weight, proj_bias, ln_2_weight,
                           ln_2_bias, fc_weight, fc_bias, mlp_proj_weight, mlp_proj_bias, k_cache, v_cache, positions,
                           eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 NumPy block of a decode step: (new residual, new key, new value) for residual x (B, C)
    given as float values; the keys and values are those written at `positions`."""
    f64 = [np.asarray(t, np.float64) for t in (x, ln_1_weight, ln_1_bias, attn_weight, attn_bias, proj_weight,
                                               proj_bias, ln_2_weight, ln_2_bias, fc_weight, fc_bias,
                                               mlp_proj_weight, mlp_proj_bias)]
    x, ln1w, ln1b, wqkv, bqkv, wproj, bproj, ln2w, ln2b, wfc, bfc, wmp, bmp = f64
    B, C = x.shape
    H, D = k_cache.shape[1], k_cache.shape[3]
    qkv = layer_norm_reference(x, ln1w, ln1b, eps) @ wqkv + bqkv
    q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(B, H, 1, D) for j in range(3))
    heads = decode_attention_reference(q, k_cache, v_cache, np.asarray(positions), new_k=k, new_v=v, length_offset=1)
    x = x + heads.reshape(B, C) @ wproj + bproj
    x = x + gelu_reference(layer_norm_reference(x, ln2w, ln2b, eps) @ wfc + bfc) @ wmp + bmp
    return x, k[:, :, 0], v[:, :, 0]
