"""Grouped expert down projection with the combine fused: acc[token] += weight * (act[row] @ Wd[e]^T) for every
sorted (token, slot) pair, added in place into a fixed-point residual stream.

The rows are moe_gate_up's output in moe_permute's expert order, found the same way (a program is one row tile
of one expert's run and one column tile; the grid is the worst case and spare programs exit at once). Each
program scales its fp32 tile by the pairs' router weights and adds it into its tokens' rows of `acc` with
integer atomic adds (kernels/fixed_point.py): the k contributions of a token are summed exactly, in any order,
so the result is the same bits every run, and with the residual stream as the accumulator the residual add
costs nothing. With few rows (a decode step) SPLIT_K programs share each tile, each adding the partial sum of
its slice of the intermediate dimension: more programs streaming the chosen experts' weights.
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
from tilekit.kernels.tiles import sync_with_previous_kernel
from tilekit.kernels.tiles import FIXED_DTYPE, add_fixed
from tilekit.kernels.moe_gate_up import (check_experts, check_routing, ep, expert_tile, max_tiles, routing_arrays,
                                         rows_per_expert, tile_rows)

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def moe_down_combine_kernel(Act, Wd, Offsets, Pairs, Weights, Acc, TM: ct.Constant[int], TN: ct.Constant[int],
                            TK: ct.Constant[int], EP: ct.Constant[int], SLOTS: ct.Constant[int],
                            SPLIT_K: ct.Constant[int]):
    """Acc[token, tile] += Weights[pair] * Act[row] @ Wd[e]^T over split bid(1) % SPLIT_K of the intermediate
    dimension, for the rows of row tile bid(0) and column tile bid(1) // SPLIT_K; Act[pairs, I], Wd[E, C, I],
    Weights[pairs] (the router's (M, slots) weights, flat), Acc[M, C] fixed point."""
    sync_with_previous_kernel()
    e, row0, row_end = expert_tile(Offsets, ct.bid(0), TM, EP)
    if e < Wd.shape[0]:
        n = ct.bid(1) // SPLIT_K
        split = ct.bid(1) % SPLIT_K
        rows, pairs, real = tile_rows(Pairs, row0, row_end, TM)
        rows = ct.where(real, rows, Act.shape[0]).reshape((TM, 1))               # padding rows read zeros
        k_tiles = ct.cdiv(Act.shape[1], TK)
        per_split = ct.cdiv(k_tiles, SPLIT_K)
        acc = ct.zeros((TM, TN), dtype=ct.float32)
        for k in range(split * per_split, ct.minimum(k_tiles, (split + 1) * per_split)):
            a = ct.gather(Act, (rows, (ct.arange(TK, dtype=ct.int32) + k * TK).reshape((1, TK))))
            w = ct.load(Wd, (e, k, n), (1, TK, TN), order=(0, 2, 1), padding_mode=ZERO).reshape((TK, TN))
            acc = ct.mma(a, w, acc)
        weight = ct.gather(Weights, pairs, mask=real).reshape((TM, 1))
        tokens = ct.where(real, pairs // SLOTS, Acc.shape[0]).reshape((TM, 1))   # padding rows add nowhere
        add_fixed(Acc, tokens, (ct.arange(TN, dtype=ct.int32) + n * TN).reshape((1, TN)), acc * weight)


def _fits(c: dict, p: dict) -> bool:
    """One accumulator (as linear's few-row tiles); split-K only while rows are few."""
    m = rows_per_expert(p)
    few_rows = m <= 64
    item = 4 if p["dtype"] == "float32" else 2
    return ((max(16, m // 4) <= c["TM"] <= max(16, m) if few_rows else c["TM"] >= 64)
            and c["TN"] <= max(32, pow2_ceil(p["C"])) and c["TK"] <= max(32, pow2_ceil(p["I"]))
            and (few_rows or (c["TN"] >= 64 and c["TK"] <= 128))
            and (c["SPLIT_K"] == 1 or (few_rows and c["SPLIT_K"] <= ct.cdiv(p["I"], c["TK"])))
            # with the int64 epilogue, sm_100 compiles 128x128 (two warpgroups) but not 64x128, 64x256 or 128x256
            and (c["TM"] * c["TN"] <= 64 * 64 or (c["TM"] == 128 and c["TN"] <= 128))
            and (c["TM"] + c["TN"]) * c["TK"] * item <= 48 * 1024
            and (c["occupancy"] == 1 or c["TM"] * c["TN"] <= 128 * 128))


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TN=(32, 64, 128, 256), TK=(32, 64, 128, 256), SPLIT_K=(1, 2, 4),
                    occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """linear's defaults on the rows an expert gets; with few, two splits of the intermediate dimension."""
    m = rows_per_expert(p)
    if m >= 128:
        return dict(TM=128, TN=128, TK=64, SPLIT_K=1, occupancy=1)
    tk = 128 if p["I"] >= 128 else 32
    return dict(TM=max(16, m), TN=64 if p["C"] >= 64 else 32, TK=tk,
                SPLIT_K=2 if m <= 64 and ct.cdiv(p["I"], tk) >= 2 else 1, occupancy=1)


def _arrays(p: dict) -> dict:
    dt, E, I, C, M, pairs = p["dtype"], p["E"], p["I"], p["C"], p["M"], p["M"] * p["slots"]
    return {"act": ArraySpec(dt, (pairs, I)), "wd": ArraySpec(dt, (E, C, I)), **routing_arrays(p),
            "weights": ArraySpec("float32", (pairs,)), "acc": ArraySpec(FIXED_DTYPE, (M, C), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (max_tiles(p, c), ct.cdiv(p["C"], c["TN"]) * c["SPLIT_K"], 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], ep(p), p["slots"], c["SPLIT_K"])


def _bind(a: list, flags: tuple) -> Binding:
    act, wd, weights, offsets, sorted_pairs, acc = a
    arrays.check_dtype(act, "act", arrays.FLOAT_DTYPES)
    if len(act.shape) != 2 or 0 in act.shape:
        raise ValueError(f"act must be a non-empty 2-D (pairs, intermediate) array, got shape {act.shape}")
    arrays.check_last_contiguous(act, "act")
    check_experts(wd, "down_proj", act, None, act.shape[1])
    E, C, I = wd.shape
    arrays.check_dtype(weights, "topk_weights", ("float32",))
    arrays.check_same("act", act, "topk_weights", weights, dtype=False)
    if len(weights.shape) != 2 or weights.shape[0] * weights.shape[1] != act.shape[0]:
        raise ValueError(f"topk_weights must be (tokens, slots) with tokens x slots = act's {act.shape[0]} rows, "
                         f"got shape {weights.shape}")
    arrays.check_contiguous(weights, "topk_weights")
    M, slots = weights.shape
    check_routing(offsets, sorted_pairs, act, E, M * slots)
    arrays.check_dtype(acc, "acc", (FIXED_DTYPE,))
    arrays.check_same("act", act, "acc", acc, dtype=False)
    if acc.shape != (M, C):
        raise ValueError(f"acc must be the ({M}, {C}) fixed-point residual stream, got shape {acc.shape}")
    arrays.check_contiguous(acc, "acc")
    return Binding(problem=dict(dtype=act.dtype, M=M, slots=slots, E=E, I=I, C=C),
                   arrays={"act": (0, None), "wd": (1, None), "weights": (2, (M * slots,)), "offsets": (3, None),
                           "pairs": (4, None), "acc": (5, None)})


MOE_DOWN_COMBINE = Op(
    "moe_down_combine", args=("act", "down_proj", "topk_weights", "offsets", "sorted_pairs", "acc"),
    key=dict(dtype=None, M=pow2_bucket, slots=None, E=None, I=None, C=None),
    space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(moe_down_combine_kernel, _grid, ("act", "wd", "offsets", "pairs", "weights", "acc"),
                     _constants),),
    bind=_bind)


def moe_down_combine(act, down_proj, topk_weights, offsets, sorted_pairs, acc) -> None:
    """acc[token] += sum over its slots of topk_weights[token, slot] * (act[row] @ down_proj[e]^T), in place.

    act: moe_gate_up's (M * slots, I) rows in sorted order; down_proj: [E, C, I] (transformers'
    mlp.experts.down_proj); topk_weights: the router's float32 (M, slots); offsets, sorted_pairs: moe_permute's;
    acc: int64 (M, C), a fixed-point residual stream (kernels/fixed_point.py).
    """
    MOE_DOWN_COMBINE((act, down_proj, topk_weights, offsets, sorted_pairs, acc))


def moe_down_combine_reference(act, down_proj, topk_ids, topk_weights) -> np.ndarray:
    """float64 (M, C): sum over slots of weight * act[token, slot] @ down_proj[expert]^T, act (M, slots, I)."""
    act, w = np.asarray(act, np.float64), np.asarray(down_proj, np.float64)
    ids, weights = np.asarray(topk_ids), np.asarray(topk_weights, np.float64)
    out = np.zeros((act.shape[0], w.shape[1]))
    for e in np.unique(ids):
        token, slot = np.nonzero(ids == e)
        np.add.at(out, token, weights[token, slot, None] * (act[token, slot] @ w[e].T))
    return out


if __name__ == "__main__":
    from tilekit.kernels.moe_down_combine import moe_down_combine, moe_down_combine_reference  # the package's op
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, rand
    from tilekit.kernels.fixed_point import fixed_to_float, float_to_fixed
    from tilekit.kernels.moe_permute import moe_permute_reference
    for M, slots, E, I, C, dtype in [(1, 8, 66, 1408, 2048, "bfloat16"), (300, 8, 66, 1408, 2048, "bfloat16"),
                                     (5, 3, 8, 40, 72, "float32")]:
        ids = np.stack([np.random.default_rng(r).permutation(E)[:slots] for r in range(M)]).astype(np.int32)
        offsets, order = moe_permute_reference(ids, E)
        act, w = rand((M * slots, I), dtype), rand((E, C, I), dtype, 1 / math.sqrt(I))
        weights = cupy.random.default_rng().random((M, slots), dtype=cupy.float32)
        start = np.random.default_rng(1).standard_normal((M, C))
        acc = cupy.asarray(float_to_fixed(start))
        moe_down_combine(act, w, weights, cupy.asarray(offsets), cupy.asarray(order), acc)
        pair_act = np.empty_like(host(act))
        pair_act[order] = host(act)
        ref = moe_down_combine_reference(pair_act.reshape(M, slots, I), host(w), ids, host(weights))
        err = assert_close(fixed_to_float(host(acc)) - start, ref, TOL[dtype], f"moe_down_combine M{M} {dtype}")
        print(f"moe_down_combine M{M} slots {slots} E{E} I{I} C{C} {dtype}: ok, relative error {err:.2e}")
