"""Quantized linear layer: act(x @ dequant(W)^T + b) + residual, W 8-bit [out, in] with fp32 scales.

Weights are INT8 or FP8 e4m3 (stored as uint8 bits, as checkpoints hold them) in nn.Linear's [out, in]
layout, with a scale per output channel (`scale="channel"`, Ws [N]) or per 128x128 block
(`scale="block"`, Ws [ceil(N/128), ceil(K/128)], DeepSeek-V3's weight_scale_inv). Two modes:

* weight-only (`x_scale=None`): x is bf16/fp16/fp32; each weight tile is widened to x's dtype in
  registers (exact for int8 and e4m3) and multiplied with an fp32 accumulator. With few rows (decoding)
  the kernel is a GEMV bound by how fast W streams in, at half the bytes of bf16, and SPLIT_K programs
  share an output tile as in `linear`;
* W8A8 (`x_scale` given): x is FP8 bits from `quantize_fp8` with a scale per row (Xs [M, 1]) or per row
  and 128-column group (Xs [M, ceil(K/128)], with block weights), multiplied in FP8 with fast
  accumulation, promoted into the fp32 accumulator every PROMOTE K tiles (at most 512 products), or with
  channel scales and PROMOTE 0 accumulated whole in the fast accumulator, as cuBLAS's and vLLM's fast-accumulation
  FP8 GEMMs do (no partial sum beside it, so twice the tile).

The config's MODE picks the product: MMA, x @ W^T on tensor cores, W's tile loaded transposed (the original
kernel; its transposed weight tiles are read from shared memory 2 bytes at a time); SWAP, W @ x^T, W's tile
in its own [N, K] layout as the register operand of the mma and x^T the other (few rows: the narrow side,
16 padded rows), transposed once at the end; FMA, for up to 4 rows, elementwise products on the FMA units
summed over K after the loop (int8 widened by an fp32 magic-number add instead of quarter-rate I2F).

Per-channel scales multiply the sum once, in the epilogue; block scales multiply each K tile's product
(K tiles never straddle a 128 block). `activation="swiglu"`: W holds [gate; up] (2N rows, each half with
its own scales) and the output is silu(x Wg^T) * (x Wu^T), Llama's MLP in one kernel.
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
from tilekit.kernels.swiglu_linear import swiglu_reference
from tilekit.kernels.tiles import grouped_tile, lends_split_k, sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
QBLOCK = 128              # the side of a block scale's square of weights (and of an activation group)
WEIGHT_DTYPES = {"int8": "int8", "fp8": "uint8"}       # weight kind -> the array dtype holding it


INT8_MAGIC_BITS, INT8_MAGIC = 0x4B400000, 12582912.0   # the fp32 1.5 * 2^23 and its bits
MMA, SWAP, FMA = 0, 1, 2   # MODE: how a K tile's product is formed (see quant_linear_kernel)


@ct.function
def x_tile(X, k, pid_m, TM, TK, MODE, XQ):
    """X's tile (pid_m, k) as the product takes it: (TK, TM) for SWAP, (TM, TK) otherwise; FP8 bits as e4m3 with
    XQ, fp32 for FMA."""
    if MODE == SWAP:
        a = ct.load(X, (k, pid_m), (TK, TM), order=(1, 0), padding_mode=ZERO)
    else:
        a = ct.load(X, (pid_m, k), (TM, TK), padding_mode=ZERO)
    if XQ:
        a = ct.bitcast(a, ct.float8_e4m3fn)
    if MODE == FMA:
        a = a.astype(ct.float32)
    return a


@ct.function
def weight_tile(W, g, k, pid_n, TN, TK, MODE, FP8, XQ, dtype):
    """Half g's weight tile (pid_n, k) widened for the product: as (TK, TN) through a transposed load for MMA, in
    W's own [N, K] layout as (TN, TK) otherwise; e4m3 as loaded with XQ (tensor cores take it), fp32 for FMA."""
    if MODE == MMA:
        w = ct.load(W, (g, k, pid_n), (1, TK, TN), order=(0, 2, 1), padding_mode=ZERO).reshape((TK, TN))
    else:
        w = ct.load(W, (g, pid_n, k), (1, TN, TK), padding_mode=ZERO).reshape((TN, TK))
    if FP8:
        w = ct.bitcast(w, ct.float8_e4m3fn)
    if MODE == FMA and not FP8:     # 1.5 * 2^23 + w exactly, then w: integer adds, not quarter-rate I2F
        w = ct.bitcast(w.astype(ct.int32) + INT8_MAGIC_BITS, ct.float32) - INT8_MAGIC
    elif MODE == FMA:
        w = w.astype(ct.float32)
    elif not XQ:
        w = w.astype(dtype)
    return w


@ct.function
def k_product(a, w, acc, TM, TN, TK, MODE, FAST):
    """acc + one K tile's product in MODE's accumulator shape: MMA x @ W^T (TM, TN) on tensor cores, SWAP
    W @ x^T (TN, TM) (the weight tile is the register operand, few rows the narrow side), FMA the elementwise
    x * W (TM, TN, TK), summed over K once after the loop. FAST: FP8 fast accumulation."""
    if MODE == MMA:
        acc = ct.mma(a, w, acc, use_fast_acc=FAST)
    elif MODE == SWAP:
        acc = ct.mma(w, a, acc, use_fast_acc=FAST)
    else:
        acc = acc + fma_product(a, w, TM, TN, TK)
    return acc


@ct.function
def fma_product(a, w, TM, TN, TK):
    """x (TM, TK) times W (TN, TK) elementwise, (TM, TN, TK), on the FMA units."""
    return a.reshape((TM, 1, TK)) * w.reshape((1, TN, TK))


@ct.function
def block_scaled(part, Xs, Ws, g, kb, rows, cols, BLOCK, XQ):
    """A K tile's product times the scales of its 128-column block kb (rows, cols shaped like part's axes)."""
    if BLOCK:
        part = part * ct.gather(Ws, (g, cols // QBLOCK, kb))
        if XQ:
            part = part * ct.gather(Xs, (rows, kb))
    return part


@ct.function
def finished(acc, MODE):
    """The (TM, TN) sum of a MODE accumulator."""
    if MODE == SWAP:
        acc = ct.transpose(acc)
    elif MODE == FMA:
        acc = ct.sum(acc, axis=2)
    return acc


@ct.function
def channel_scaled(acc, Xs, Ws, g, rows, cols, BLOCK, XQ):
    """A finished sum of half g times its per-channel (and per-row) scales."""
    if not BLOCK:
        acc = acc * ct.gather(Ws, (g, cols))
        if XQ:
            acc = acc * ct.gather(Xs, (rows, 0))
    return acc


@ct.kernel
def quant_linear_kernel(X, Xs, W, Ws, Bias, Res, Y, Partial, Counter,
                        TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                        GROUP_M: ct.Constant[int], SPLIT_K: ct.Constant[int], MODE: ct.Constant[int],
                        PROMOTE: ct.Constant[int], FP8: ct.Constant[bool], BLOCK: ct.Constant[bool],
                        XQ: ct.Constant[bool], SWIGLU: ct.Constant[bool], HAS_BIAS: ct.Constant[bool],
                        HAS_RES: ct.Constant[bool]):
    """Y[M, N] = act(X[M, K] @ dequant(W[g, N, K])^T + Bias) + Res, g = 0 (and 1, the up half, for SWIGLU).

    MODE picks the product (k_product). On tensor cores, block scales and FP8 activations sum PROMOTE K tiles (one
    with block scales; FP8 x FP8 with fast accumulation) into a partial that is scaled and added to the fp32
    accumulator; FP8 activations with PROMOTE 0 go straight into it, fast. (cuTile's exact FP8 accumulation,
    use_fast_acc=False, does the same per instruction: the 128x128 tile then spilled: 275 local stores, sm_90
    cubin.) Program bid(0) = tile * SPLIT_K + split sums its slice of K into Partial[split] (fp32); the last of a
    tile's programs to arrive, counted in Counter[tile] (left at zero), adds the slices and runs the epilogue, as
    in linear."""
    sync_with_previous_kernel()
    M = X.shape[0]
    K = X.shape[1]
    N = Y.shape[1]
    tiles_m = ct.cdiv(M, TM)
    tiles_n = ct.cdiv(N, TN)
    tile = ct.bid(0) // SPLIT_K
    split = ct.bid(0) % SPLIT_K
    pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
    rows = (ct.arange(TM, dtype=ct.int32) + pid_m * TM).reshape((TM, 1))
    cols = (ct.arange(TN, dtype=ct.int32) + pid_n * TN).reshape((1, TN))
    if MODE == SWAP:
        shape = (TN, TM)
        rows_k = rows.reshape((1, TM))
        cols_k = cols.reshape((TN, 1))
    elif MODE == FMA:
        shape = (TM, TN, TK)
        rows_k = rows.reshape((TM, 1, 1))
        cols_k = cols.reshape((1, TN, 1))
    else:
        shape = (TM, TN)
        rows_k = rows
        cols_k = cols
    k_tiles = ct.cdiv(K, TK)
    per_split = ct.cdiv(k_tiles, SPLIT_K)
    first = split * per_split
    last = ct.minimum(k_tiles, first + per_split)
    gate = ct.zeros(shape, dtype=ct.float32)
    up = ct.zeros(shape, dtype=ct.float32)
    if MODE != FMA and (BLOCK or (XQ and PROMOTE > 0)):
        for k0 in range(first, last, PROMOTE):
            part_gate = ct.zeros(shape, dtype=ct.float32)
            part_up = ct.zeros(shape, dtype=ct.float32)
            for k in range(k0, ct.minimum(last, k0 + PROMOTE)):
                a = x_tile(X, k, pid_m, TM, TK, MODE, XQ)
                part_gate = k_product(a, weight_tile(W, 0, k, pid_n, TN, TK, MODE, FP8, XQ, Y.dtype), part_gate,
                                      TM, TN, TK, MODE, XQ)
                if SWIGLU:
                    part_up = k_product(a, weight_tile(W, 1, k, pid_n, TN, TK, MODE, FP8, XQ, Y.dtype), part_up,
                                        TM, TN, TK, MODE, XQ)
            kb = (k0 * TK) // QBLOCK
            gate = gate + block_scaled(part_gate, Xs, Ws, 0, kb, rows_k, cols_k, BLOCK, XQ)
            if SWIGLU:
                up = up + block_scaled(part_up, Xs, Ws, 1, kb, rows_k, cols_k, BLOCK, XQ)
    else:
        for k in range(first, last):
            a = x_tile(X, k, pid_m, TM, TK, MODE, XQ)
            kb = (k * TK) // QBLOCK
            w = weight_tile(W, 0, k, pid_n, TN, TK, MODE, FP8, XQ, Y.dtype)
            if MODE == FMA and BLOCK:       # elementwise: the block scales multiply the tile's products directly
                gate = gate + block_scaled(fma_product(a, w, TM, TN, TK), Xs, Ws, 0, kb, rows_k, cols_k, BLOCK, XQ)
            else:
                gate = k_product(a, w, gate, TM, TN, TK, MODE, XQ)
            if SWIGLU:
                w = weight_tile(W, 1, k, pid_n, TN, TK, MODE, FP8, XQ, Y.dtype)
                if MODE == FMA and BLOCK:
                    up = up + block_scaled(fma_product(a, w, TM, TN, TK), Xs, Ws, 1, kb, rows_k, cols_k, BLOCK, XQ)
                else:
                    up = k_product(a, w, up, TM, TN, TK, MODE, XQ)
    gate = finished(gate, MODE)
    up = finished(up, MODE)

    if SPLIT_K > 1:
        ct.scatter(Partial, (split, 0, rows, cols), gate)      # plain stores, which the release below orders
        if SWIGLU:
            ct.scatter(Partial, (split, 1, rows, cols), up)
        arrived = ct.atomic_add(Counter, tile, 1)       # acq_rel: our partial before it, theirs after
        is_last = arrived == SPLIT_K - 1
        rows = ct.where(is_last, rows, M)                # other programs address no row at all
        gate = ct.zeros((TM, TN), dtype=ct.float32)
        up = ct.zeros((TM, TN), dtype=ct.float32)
        for s in range(SPLIT_K):
            gate = gate + ct.gather(Partial, (s, 0, rows, cols))
            if SWIGLU:
                up = up + ct.gather(Partial, (s, 1, rows, cols))
        ct.atomic_xchg(Counter, ct.where(is_last, tile, tiles_m * tiles_n), 0, memory_order=ct.MemoryOrder.RELAXED)

    acc = channel_scaled(gate, Xs, Ws, 0, rows, cols, BLOCK, XQ)
    if SWIGLU:
        acc = acc / (1.0 + ct.exp(-acc)) * channel_scaled(up, Xs, Ws, 1, rows, cols, BLOCK, XQ)
    if HAS_BIAS:
        acc = acc + ct.load(Bias, (pid_n,), (TN,), padding_mode=ZERO).astype(ct.float32).reshape((1, TN))
    if HAS_RES:
        acc = acc + ct.load(Res, (pid_m, pid_n), (TM, TN), padding_mode=ZERO).astype(ct.float32)
    if SPLIT_K > 1 or MODE != MMA:     # SWAP's tile stored whole wrote past a strided out's columns (H200)
        ct.scatter(Y, (rows, cols), acc.astype(Y.dtype))
    else:
        ct.store(Y, (pid_m, pid_n), acc.astype(Y.dtype))


# -- search space and heuristic default ---------------------------------------------------------

def _halves(p: dict) -> int:
    return 2 if p["act"] == "swiglu" else 1


def _partial(c: dict, p: dict) -> bool:
    """Whether the main loop keeps a partial sum beside the accumulator (block scales, promoted fast FP8
    accumulation), doubling the accumulator's registers."""
    return c["MODE"] != FMA and (p["scale"] == "block" or (p["xq"] == "fp8" and c["PROMOTE"] > 0))


def _may_split_k(mode: int, p: dict) -> bool:
    """Whether product `mode` may split K for problem p. SWAP and FMA only over W rows 16 bytes apart (K a multiple
    of 16 one-byte weights): they summed wrongly where they were not (K = 1544 on an H200; 1536 and 2112 were right,
    MMA was right at 1544). SWAP not with block scales: now and then such a launch never finished, on the H100 and
    the H200 (16 x 128 x 128 split 2 the 7th time in a row, fp8 block SwiGLU, M 1, N 300, K 528; 32 x 32 x 128 split 2
    with FP8 activations, M 1 and 20); the kernel has no wait loop of its own, so probably in tileiras's producer /
    consumer barriers. MMA split 2 and SWAP split 1 and 4 of the same problem finished 8 of 8 times. The kernel is
    left as it is: no shipped entry has block scales."""
    return mode == MMA or (p["K"] % 16 == 0 and (mode != SWAP or p["scale"] != "block"))


def _fits(c: dict, p: dict) -> bool:
    """Few rows (<= 64): the three products (MMA with M padded to TM >= 16; SWAP with TM >= 16 as the narrow mma
    side, 8 fell back to FMA code with spills, as fp32 does; FMA for up to 4 rows, its TM x TN x TK accumulator in
    registers), narrow tiles, long K steps, split-K. Many rows: MMA or SWAP tiles from 64 columns, K steps up to 128
    (SWAP keeps the converted weights in registers where MMA stores them back to shared memory for the mma). PROMOTE
    is 1 except with FP8 activations and channel scales: fast accumulation promoted every PROMOTE K tiles (at most
    512 products), or never (0). Accumulator and partial at most 128 fp32 registers a thread (the 128x128 W8A8
    tile with its partial spilled with one warpgroup, 546 local stores in its sm_90 cubin; some longer promotions
    spill anyway, which the tuner sees). K tiles inside a scale block. SWAP and FMA split K only where
    _may_split_k says. Split-K tiles at least 32 columns wide: 16-wide ones with occupancy 2 summed wrongly on an
    H200 (SwiGLU, block scales; cause not found)."""
    m = pow2_ceil(p["M"])
    few_rows = m <= 64
    halves = _halves(p)
    tile = c["TM"] * c["TN"] * halves
    item = 1 if p["xq"] == "fp8" else 4 if p["dtype"] == "float32" else 2
    warpgroups = 2 if c["num_worker_warps"] == 8 else 1
    if c["MODE"] == MMA or (c["MODE"] == SWAP and not few_rows):
        rows_ok = (max(16, m // 4) if m < 256 else 64) <= c["TM"] <= max(16, m)
    elif c["MODE"] == SWAP:
        rows_ok = c["TM"] == max(16, m)
    else:
        rows_ok = m <= 4 and c["TM"] == m and tile * c["TK"] <= 128 * 128
    promoted = p["xq"] == "fp8" and p["scale"] == "channel" and not few_rows
    promote_ok = c["PROMOTE"] * c["TK"] <= 512 if promoted else c["PROMOTE"] == 1     # 0 with promoted: never
    return (rows_ok and promote_ok and (c["MODE"] != SWAP or p["dtype"] != "float32")
            and c["TN"] <= max(32 if few_rows else 64, pow2_ceil(p["N"])) and c["TK"] <= max(128, pow2_ceil(p["K"]))
            and (c["TK"] <= QBLOCK or (p["scale"] == "channel" and p["xq"] == "none"))
            and (c["TN"] <= (64 if c["MODE"] == MMA else 128) and c["TK"] >= 128 and c["num_worker_warps"] == 0
                 and (c["MODE"] != SWAP or c["TN"] >= 32) if few_rows
                 else c["MODE"] != FMA and c["TN"] >= 64 and c["TK"] <= 128 and c["SPLIT_K"] == 1)
            and c["SPLIT_K"] <= ct.cdiv(p["K"], c["TK"])
            and (c["SPLIT_K"] == 1 or c["TN"] >= 32)
            and (c["SPLIT_K"] == 1 or _may_split_k(c["MODE"], p))
            and tile <= 128 * 256
            and tile * (2 if _partial(c, p) else 1) <= 128 * 128 * warpgroups
            and (c["TM"] * item + c["TN"] * halves) * c["TK"] <= 64 * 1024       # x and weight tiles, bytes
            and (c["occupancy"] == 1 or tile <= 128 * 128)
            and (c["num_worker_warps"] == 0 or tile >= 128 * 128))


SPACE = SearchSpace(_fits, TM=(1, 2, 4, 8, 16, 32, 64, 128), TN=(16, 32, 64, 128, 256), TK=(32, 64, 128, 256, 512),
                    GROUP_M=(8,), SPLIT_K=(1, 2, 4, 8, 16), MODE=(MMA, SWAP, FMA), PROMOTE=(0, 1, 2, 4),
                    occupancy=(1, 2), num_worker_warps=(0, 8))

MIN_PROGRAMS = 128    # an untuned decode GEMV splits K only below about one program per SM of an H100 or H200
MIN_SPLIT_TILES = 8   # ... and keeps at least this many K tiles a split (a split's stores and arrival are a tail)


def default_config(p: dict) -> dict:
    """What the H100 tuning of the first kernel chose (13 int8 Llama-3.1-8B shapes; splitting K to about two
    programs per SM, the first default, was 1.3-3x slower than no split). Few rows: SWAP (weights in their own
    layout as the register operand) 32 columns by 256 of K (128 in scale blocks and with FP8 x), occupancy 2, split
    over K only below MIN_PROGRAMS programs and where _may_split_k allows (fp32: MMA, no tensor cores for
    SWAP). From 1024 rows 128 x 256 tiles (128 x 128 for SwiGLU's two accumulators) with two warpgroups, halved
    where a partial sum doubles the accumulator (block scales, FP8 activations promoted every K tile of 128, as
    DeepSeek-V3); 128-1023 rows 64 x 64 x 128; fp32 64 x 64 x 32. A split-K default runs one program a SM: split-K
    configs with two summed wrongly now and then (the tuner rejects 4-11 per few-row shape against this default; a
    TP=2 rank's FP8 forward with the split default of its 3072-row qkv slice differed between two runs of the same
    inputs, H100; cause not found). W8A8 with channel scales above 64 rows (fp16 / bf16 out): fast accumulation
    unpromoted, as every H100 pick of Llama-3.1-8B's 12 such shapes (M 128 / 1024 / 8192), and their tiles: SwiGLU
    SWAP 128 x 64 at occupancy 2 (all three M), else MMA 128 x 256 from 1024 rows and SWAP 64 x 64 at occupancy 2
    below (the promoted default ran them 1.05-1.6x slower)."""
    m = pow2_ceil(p["M"])
    plain = dict(GROUP_M=8, SPLIT_K=1, PROMOTE=1, occupancy=1, num_worker_warps=0)
    if m > 64 and p["xq"] == "fp8" and p["scale"] == "channel" and p["dtype"] != "float32":   # W8A8, unpromoted
        unpromoted = dict(plain, PROMOTE=0, TK=128)
        if p["act"] == "swiglu":
            return dict(unpromoted, MODE=SWAP, TM=128, TN=64, occupancy=2, num_worker_warps=8)
        if m >= 1024:
            tn = min(256, max(64, pow2_ceil(p["N"])))
            return dict(unpromoted, MODE=MMA, TM=128, TN=tn, num_worker_warps=8 if tn >= 128 else 0)
        return dict(unpromoted, MODE=SWAP, TM=64, TN=64, occupancy=2)
    if m > 64:
        if p["dtype"] == "float32":
            c = dict(plain, MODE=MMA, TM=64, TN=64, TK=32)
        elif m >= 1024:
            c = dict(plain, MODE=MMA, TM=128, TN=256 // _halves(p), TK=128 if p["xq"] == "fp8" else 64,
                     num_worker_warps=8)
            if _partial(c, p):
                c["TN"] //= 2
        else:
            c = dict(plain, MODE=MMA, TM=64, TN=64, TK=128)
        c["TN"] = min(c["TN"], max(64, pow2_ceil(p["N"])))      # no wider than the problem
        wide = c["TM"] * c["TN"] * _halves(p) >= 128 * 128      # two warpgroups only for 128x128 and up
        return dict(c, num_worker_warps=c["num_worker_warps"] if wide else 0)
    c = dict(plain, MODE=SWAP, TM=max(16, m), TN=32, occupancy=2,
             TK=min(256 if p["scale"] == "channel" and p["xq"] == "none" else QBLOCK, max(128, pow2_ceil(p["K"]))))
    if p["dtype"] == "float32":
        c.update(MODE=MMA, TK=128)
    k_tiles, tiles = ct.cdiv(p["K"], c["TK"]), ct.cdiv(p["N"], c["TN"])
    split = 1
    while (split < 16 and 2 * split * MIN_SPLIT_TILES <= k_tiles and tiles * split < MIN_PROGRAMS
           and _may_split_k(c["MODE"], p)):
        split *= 2
    return dict(c, SPLIT_K=split, occupancy=1 if split > 1 else c["occupancy"])


def _scale_shape(p: dict) -> tuple:
    """Ws's kernel view: (halves, N) per channel, (halves, N blocks, K blocks) per block."""
    g = _halves(p)
    if p["scale"] == "channel":
        return (g, p["N"])
    return (g, ct.cdiv(p["N"], QBLOCK), ct.cdiv(p["K"], QBLOCK))


def _arrays(p: dict) -> dict:
    M, N, K, dt = p["M"], p["N"], p["K"], p["dtype"]
    xq = p["xq"] == "fp8"
    # Codes of either sign below the NaN codes (0x7F, 0xFF), zero-mean as layers' weights and activations are:
    # sums of one sign would lose 4-6% to FP8 fast accumulation without promotion (K = 4096-14336, H100).
    return {"x": ArraySpec("uint8" if xq else dt, (M, K), high=0x7F if xq else None, signed=xq),
            "x_scale": ArraySpec("float32", (M, 1 if p["scale"] == "channel" else ct.cdiv(K, QBLOCK)))
            if xq else absent("float32", 2),
            "w": ArraySpec(WEIGHT_DTYPES[p["wq"]], (_halves(p), N, K), high=0x7F, signed=True),
            "w_scale": ArraySpec("float32", _scale_shape(p)),
            "bias": ArraySpec(dt, (N,)) if p["bias"] else absent(dt, 1),
            "res": ArraySpec(dt, (M, N)) if p["res"] else absent(dt, 2),
            "y": ArraySpec(dt, (M, N), role="out")}


def _tiles(p: dict, c: dict) -> int:
    return ct.cdiv(p["M"], c["TM"]) * ct.cdiv(p["N"], c["TN"])


def _scratch(p: dict, c: dict) -> dict:
    if c["SPLIT_K"] == 1:
        return {"partial": absent("float32", 4), "counter": absent("int32", 1)}
    return {"partial": ArraySpec("float32", (c["SPLIT_K"], _halves(p), p["M"], p["N"]), role="scratch"),
            "counter": ArraySpec("int32", (_tiles(p, c),), role="zeros")}


def _grid(p: dict, c: dict) -> tuple:
    return (_tiles(p, c) * c["SPLIT_K"], 1, 1)


def _dependent(p: dict, c: dict) -> bool:
    """Programmatic dependent launch for one row only. Replayed decode steps of the Llama-3.1-8B shape with fp8
    weights, this kernel launched ordinarily against dependently, the rest as usual: B8 (M 8) 4.281 against 4.771 ms
    on an H100, 3.950 against 4.333 on an H200; B1 3.814 against 3.656 on an H100
    (docs/results/dependent-launch-quant-h100-h200.txt)."""
    return p["M"] == 1


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], c["GROUP_M"], c["SPLIT_K"], c["MODE"], c["PROMOTE"], p["wq"] == "fp8",
            p["scale"] == "block",
            p["xq"] == "fp8", p["act"] == "swiglu", bool(p["bias"]), bool(p["res"]))


def _bind(a: list, flags: tuple) -> Binding:
    x, x_scale, w, w_scale, bias, res, out = a
    weight, activation = flags
    if weight not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be 'int8' or 'fp8', got {weight!r}")
    if activation not in (None, "swiglu"):
        raise ValueError(f"activation must be None or 'swiglu', got {activation!r}")
    arrays.check_dtype(w, "weight", (WEIGHT_DTYPES[weight],))
    arrays.check_dtype(w_scale, "weight_scale", ("float32",))
    arrays.check_same("weight", w, "x", x, dtype=False)
    arrays.check_same("weight", w, "weight_scale", w_scale, dtype=False)
    halves = 2 if activation == "swiglu" else 1
    if len(w.shape) != 2 or w.shape[0] % halves or 0 in w.shape:
        raise ValueError(f"weight must be a non-empty 2-D [out, in] array{' of 2N rows' if halves == 2 else ''}, "
                         f"got shape {w.shape}")
    N, K = w.shape[0] // halves, w.shape[1]
    if len(x.shape) < 1 or x.shape[-1] != K:
        raise ValueError(f"x must have last dimension {K} (weight shape {w.shape}), got shape {x.shape}")
    M = math.prod(x.shape[:-1])
    blocks = (halves * ct.cdiv(N, QBLOCK), ct.cdiv(K, QBLOCK))
    if w_scale.shape == (halves * N,):
        scale_kind = "channel"
    elif w_scale.shape == blocks:
        scale_kind = "block"
    else:
        raise ValueError(f"weight_scale must have shape ({halves * N},) (per channel) or {blocks} (per "
                         f"{QBLOCK}x{QBLOCK} block{', per half' if halves == 2 else ''}), got {w_scale.shape}")
    views = {"w": (2, (halves, N, K)), "w_scale": (3, (halves, *((N,) if scale_kind == "channel" else
                                                                 (blocks[0] // halves, blocks[1]))))}
    if x_scale is None:
        arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
        dtype = x.dtype
    else:
        if weight != "fp8":
            raise ValueError("x_scale (FP8 activations) needs FP8 weights")
        arrays.check_dtype(x, "x", ("uint8",))
        arrays.check_dtype(x_scale, "x_scale", ("float32",))
        arrays.check_same("x", x, "x_scale", x_scale, dtype=False)
        groups = 1 if scale_kind == "channel" else blocks[1]
        if x_scale.shape != x.shape[:-1] + (groups,):
            raise ValueError(f"x_scale must have shape {x.shape[:-1] + (groups,)} (one scale per row"
                             f"{'' if groups == 1 else f' and {QBLOCK} columns'}), got {x_scale.shape}")
        arrays.check_contiguous(x_scale, "x_scale")
        views["x_scale"] = (1, (M, groups))
        if out is None:
            raise ValueError("out must be given with FP8 activations (its dtype is the output's)")
        arrays.check_dtype(out, "out", arrays.FLOAT_DTYPES)
        dtype = out.dtype
    for name, v in (("x", x), ("weight", w), ("weight_scale", w_scale)):
        arrays.check_contiguous(v, name)
    out_shape = x.shape[:-1] + (N,)
    views["x"] = (0, None if len(x.shape) == 2 else (M, K))
    views["y"] = (6, None if len(out_shape) == 2 else (M, N))
    like = arrays.Info(x.kind, dtype, x.shape, x.strides, x.device)
    if bias is not None:
        if halves == 2:
            raise ValueError("bias is not supported with activation='swiglu'")
        arrays.check_bias(bias, like, N)
        views["bias"] = (4, None)
    if res is not None:
        arrays.check_same("x", like, "residual", res)
        if res.shape != out_shape:
            raise ValueError(f"residual must have shape {out_shape}, got {res.shape}")
        arrays.check_contiguous(res, "residual")
        views["res"] = (5, None if len(out_shape) == 2 else (M, N))
    if out is not None:                  # rows may be strided (a model's column slice of a wider buffer)
        arrays.check_out(out, "out", like, out_shape, contiguous=False)
        arrays.check_rows(out, "out")
    problem = dict(dtype=dtype, M=M, N=N, K=K, wq=weight, scale=scale_kind, xq="none" if x_scale is None else "fp8",
                   act=activation or "none", bias=int(bias is not None), res=int(res is not None))
    return Binding(problem=problem, arrays=views, returns=6, output=(6, arrays.allocator(x.kind, x.device, out_shape,
                                                                                          dtype)))


QUANT_LINEAR = Op(
    "quant_linear", args=("x", "x_scale", "weight", "weight_scale", "bias", "residual", "out"),
    optional=("x_scale", "bias", "residual", "out"),
    key=dict(dtype=None, M=pow2_bucket, N=None, K=None, wq=None, scale=None, xq=None, act=None, bias=None, res=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    launches=(Launch(quant_linear_kernel, _grid, ("x", "x_scale", "w", "w_scale", "bias", "res", "y", "partial",
                                                  "counter"), _constants, dependent=_dependent),),
    bind=_bind, choices=dict(wq=("int8", "fp8"), scale=("channel", "block"), xq=("none", "fp8"),
                             act=("none", "swiglu"), bias=(0, 1), res=(0, 1)),
    cli_defaults=dict(wq="fp8", scale="channel", xq="none", act="none", bias=0, res=0), borrowable=lends_split_k)


# -- public function ---------------------------------------------------------------------------

def quant_linear(x, weight, weight_scale, bias=None, *, weight_dtype: str, x_scale=None, activation=None,
                 residual=None, out=None):
    """act(x @ dequant(weight)^T + bias) + residual over the last dimension of x.

    weight: [out, in] int8 (weight_dtype='int8') or FP8 e4m3 bits as uint8 ('fp8'); weight_scale: fp32, [out]
    per channel or [ceil(out/128), ceil(in/128)] per block (dequant(W) = W * scale). x: bf16/fp16/fp32, or FP8
    bits with x_scale ([..., 1] per row, [..., ceil(in/128)] per group with block weights; quantize_fp8 makes
    both), then `out` gives the output dtype. activation='swiglu': weight is [gate; up] ([2I, in], scales of
    both stacked the same way), the output silu(gate) * up of width I. Returns an array of x's kind, or `out`.
    """
    return QUANT_LINEAR((x, x_scale, weight, weight_scale, bias, residual, out), (weight_dtype, activation))


def dequantize_reference(weight, weight_scale, weight_dtype: str) -> np.ndarray:
    """float64 W * scale of an [out, in] int8 or FP8-bits weight with per-channel or 128x128 block scales."""
    w = np.asarray(weight)
    values = w.view(_float8()).astype(np.float64) if weight_dtype == "fp8" else w.astype(np.float64)
    s = np.asarray(weight_scale, np.float64)
    if s.ndim == 1:
        return values * s[:, None]
    return values * np.repeat(np.repeat(s, QBLOCK, 0), QBLOCK, 1)[:w.shape[0], :w.shape[1]]


def _float8():
    import ml_dtypes
    return ml_dtypes.float8_e4m3fn


def quant_linear_reference(x, weight, weight_scale, bias=None, *, weight_dtype: str, x_scale=None,
                           activation=None, residual=None) -> np.ndarray:
    """float64 NumPy quant_linear (x as values, or FP8 bits with x_scale)."""
    if x_scale is None:
        x = np.asarray(x, np.float64)
    else:
        x = np.asarray(x).view(_float8()).astype(np.float64)
        s = np.asarray(x_scale, np.float64)
        x = x * np.repeat(s, QBLOCK, -1)[..., :x.shape[-1]] if s.shape[-1] > 1 else x * s
    if activation == "swiglu":         # each half with its own scales
        halves = zip(np.split(np.asarray(weight), 2), np.split(np.asarray(weight_scale), 2))
        gate, up = (x @ dequantize_reference(w, s, weight_dtype).T for w, s in halves)
        y = swiglu_reference(gate, up)
    else:
        y = x @ dequantize_reference(weight, weight_scale, weight_dtype).T
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    return y


if __name__ == "__main__":
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    from tilekit.kernels.quant_linear import quant_linear, quant_linear_reference  # the package's op
    rng = np.random.default_rng()
    for M, N, K, kind, block in [(1, 4096, 4096, "int8", False), (8, 1031, 200, "fp8", True), (300, 512, 136, "fp8",
                                                                                                False)]:
        w = rng.integers(-127, 128, (N, K)).astype(np.int8)
        if kind == "fp8":
            w = w.view(np.uint8) & 0x7E                     # positive e4m3 codes, no NaN
        s = rng.uniform(0.5, 1.5, (-(-N // QBLOCK), -(-K // QBLOCK)) if block else (N,)).astype(np.float32) / K
        x, r = rand((M, K), "bfloat16"), rand((M, N), "bfloat16")
        y = quant_linear(x, cupy.asarray(w), cupy.asarray(s), weight_dtype=kind, residual=r,
                         out=poisoned((M, N), "bfloat16"))
        ref = quant_linear_reference(host(x), w, s, weight_dtype=kind, residual=host(r))
        err = assert_close(host(y), ref, TOL["bfloat16"], f"quant_linear {M}x{N}x{K} {kind}")
        print(f"quant_linear M{M} N{N} K{K} {kind} {'block' if block else 'channel'}: ok, relative error {err:.2e}")
