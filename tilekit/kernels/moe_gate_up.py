"""Grouped expert GEMM with SwiGLU: act[row] = silu(x[token] @ Wg[e]^T) * (x[token] @ Wu[e]^T) for every
(token, slot) pair routed to expert e, in the expert order of moe_permute.

The experts' weights are transformers' fused gate_up_proj [E, 2 * I, C] (each expert's gate rows, then its up
rows), read in place as two views; each program computes the same column tile of the gate and the up
projection with two fp32 accumulators over one stream of gathered token rows, and writes only their SwiGLU
product. A program is one row tile of one expert's run of sorted pairs and one column tile: it finds its expert
from the offsets (tiles are numbered expert by expert), so the grid is the worst case for the token count and
programs past the last tile exit at once. A decode step's tile holds one token and reads only its expert's
weights: the step streams the chosen experts' weights and nothing else.
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
from tilekit.kernels.swiglu_linear import swiglu_reference

ZERO = ct.PaddingMode.ZERO
MAX_EXPERTS = 1024


@ct.function
def expert_tile(Offsets, t, TM, EP):
    """(expert, first sorted row, end of the expert's rows) of row tile t, the tiles numbered expert by expert,
    each expert's run of Offsets[e]..Offsets[e + 1] cut into TM-row tiles; the expert is E (or more) for a t past
    the last tile."""
    e_index = ct.arange(EP, dtype=ct.int32)
    start = ct.gather(Offsets, e_index)
    end = ct.gather(Offsets, e_index + 1)
    tiles = ct.where(e_index < Offsets.shape[0] - 1, (end - start + TM - 1) // TM, 0)
    last = ct.cumsum(tiles, axis=0)
    e = ct.sum(ct.where(last <= t, 1, 0))
    mine = e_index == e
    first_tile = ct.sum(ct.where(mine, last - tiles, 0))
    return e, ct.sum(ct.where(mine, start, 0)) + (t - first_tile) * TM, ct.sum(ct.where(mine, end, 0))


@ct.function
def tile_rows(Pairs, row0, row_end, TM):
    """(sorted rows (TM,), their pairs (TM,), which rows are real (TM,)) of a tile starting at row0."""
    rows = ct.arange(TM, dtype=ct.int32) + row0
    real = rows < row_end
    return rows, ct.gather(Pairs, rows, mask=real), real


@ct.kernel
def moe_gate_up_kernel(X, Wg, Wu, Offsets, Pairs, Act, TM: ct.Constant[int], TN: ct.Constant[int],
                       TK: ct.Constant[int], EP: ct.Constant[int], SLOTS: ct.Constant[int]):
    """Act[row, tile bid(1)] for the rows of row tile bid(0); X[M, C], Wg and Wu [E, I, C], Act[pairs, I]."""
    sync_with_previous_kernel()
    e, row0, row_end = expert_tile(Offsets, ct.bid(0), TM, EP)
    if e < Wg.shape[0]:
        n = ct.bid(1)
        rows, pairs, real = tile_rows(Pairs, row0, row_end, TM)
        tokens = ct.where(real, pairs // SLOTS, X.shape[0]).reshape((TM, 1))   # padding rows read zeros
        gate = ct.zeros((TM, TN), dtype=ct.float32)
        up = ct.zeros((TM, TN), dtype=ct.float32)
        for k in range(ct.cdiv(X.shape[1], TK)):
            a = ct.gather(X, (tokens, (ct.arange(TK, dtype=ct.int32) + k * TK).reshape((1, TK))))
            wg = ct.load(Wg, (e, k, n), (1, TK, TN), order=(0, 2, 1), padding_mode=ZERO).reshape((TK, TN))
            wu = ct.load(Wu, (e, k, n), (1, TK, TN), order=(0, 2, 1), padding_mode=ZERO).reshape((TK, TN))
            gate = ct.mma(a, wg, gate)
            up = ct.mma(a, wu, up)
        out_rows = ct.where(real, rows, Act.shape[0]).reshape((TM, 1))
        cols = (ct.arange(TN, dtype=ct.int32) + n * TN).reshape((1, TN))
        ct.scatter(Act, (out_rows, cols), (gate / (1.0 + ct.exp(-gate)) * up).astype(Act.dtype))


# -- what moe_gate_up and moe_down_combine share --------------------------------------------------------

def ep(p: dict) -> int:
    """The experts padded to a power of two (the offsets tile)."""
    return max(16, pow2_ceil(p["E"]))


def rows_per_expert(p: dict) -> int:
    """Pairs per expert when they spread evenly over the experts that can be hit, as a power of two."""
    pairs = p["M"] * p["slots"]
    return pow2_ceil(ct.cdiv(pairs, min(p["E"], pairs)))


def max_tiles(p: dict, c: dict) -> int:
    """The most row tiles M * slots pairs can make: each expert hit may end in a partial tile."""
    pairs = p["M"] * p["slots"]
    return (pairs + min(p["E"], pairs) * (c["TM"] - 1)) // c["TM"]


def even_offsets(p: dict) -> tuple[int, ...]:
    """Offsets of the pairs spread evenly over the experts: what a benchmark routes."""
    pairs = p["M"] * p["slots"]
    return tuple(e * pairs // p["E"] for e in range(p["E"] + 1))


def routing_arrays(p: dict) -> dict:
    """The offsets and sorted pairs a grouped expert GEMM reads, as a benchmark makes them."""
    pairs = p["M"] * p["slots"]
    return {"offsets": ArraySpec("int32", (p["E"] + 1,), values=even_offsets(p)),
            "pairs": ArraySpec("int32", (pairs,), high=pairs)}


def check_routing(offsets, sorted_pairs, like, E: int, pairs: int) -> None:
    """moe_permute's outputs for `pairs` pairs over E experts, on `like`'s device."""
    for name, a, shape in (("offsets", offsets, (E + 1,)), ("sorted_pairs", sorted_pairs, (pairs,))):
        arrays.check_dtype(a, name, ("int32",))
        arrays.check_same("x", like, name, a, dtype=False)
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
        arrays.check_contiguous(a, name)


def check_experts(w, name: str, like, out_dim: int | None, in_dim: int) -> None:
    """Expert weights [E, out, in] of `like`'s dtype and device, rows contiguous (a view of a fused tensor)."""
    arrays.check_same("x", like, name, w)
    if len(w.shape) != 3 or w.shape[2] != in_dim or (out_dim is not None and w.shape[1] != out_dim) \
            or not 1 <= w.shape[0] <= MAX_EXPERTS:
        raise ValueError(f"{name} must be [experts, {out_dim or 'out'}, {in_dim}] with 1..{MAX_EXPERTS} experts, "
                         f"got shape {w.shape}")
    arrays.check_last_contiguous(w, name)


def _fits(c: dict, p: dict) -> bool:
    """Two accumulators (as swiglu_linear); row tiles no taller than the rows an expert gets."""
    m = rows_per_expert(p)
    few_rows = m <= 64
    item = 4 if p["dtype"] == "float32" else 2
    return ((max(16, m // 4) <= c["TM"] <= max(16, m) if few_rows else c["TM"] >= 64)
            and c["TN"] <= max(32, pow2_ceil(p["I"])) and c["TK"] <= max(32, pow2_ceil(p["C"]))
            and (few_rows or (c["TN"] >= 64 and c["TK"] <= 128))
            and c["TM"] * c["TN"] <= 128 * 128
            and (c["TM"] + 2 * c["TN"]) * c["TK"] * item <= 48 * 1024
            and (c["occupancy"] == 1 or c["TM"] * c["TN"] <= 64 * 64))     # two 64x128 programs: not for sm_100


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TN=(32, 64, 128), TK=(32, 64, 128, 256), occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """swiglu_linear's defaults on the rows an expert gets."""
    m = rows_per_expert(p)
    if m >= 128:
        return dict(TM=128, TN=64, TK=64, occupancy=1)
    return dict(TM=max(16, m), TN=32, TK=128 if p["C"] >= 128 else 64, occupancy=1)


def _arrays(p: dict) -> dict:
    dt, E, I, C, pairs = p["dtype"], p["E"], p["I"], p["C"], p["M"] * p["slots"]
    fused = (2 * I * C, C, 1)               # views of one [E, 2I, C] tensor
    return {"x": ArraySpec(dt, (p["M"], C)), "wg": ArraySpec(dt, (E, I, C), fused),
            "wu": ArraySpec(dt, (E, I, C), fused), **routing_arrays(p),
            "act": ArraySpec(dt, (pairs, I), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (max_tiles(p, c), ct.cdiv(p["I"], c["TN"]), 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TN"], c["TK"], ep(p), p["slots"])


def _bind(a: list, flags: tuple) -> Binding:
    x, wg, wu, offsets, sorted_pairs, out = a
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    if len(x.shape) != 2 or 0 in x.shape:
        raise ValueError(f"x must be a non-empty 2-D (tokens, hidden) array, got shape {x.shape}")
    arrays.check_last_contiguous(x, "x")
    M, C = x.shape
    check_experts(wg, "gate_up_proj", x, None, C)
    check_experts(wu, "gate_up_proj", x, wg.shape[1], C)
    E, I = wg.shape[:2]
    slots = sorted_pairs.shape[0] // M if len(sorted_pairs.shape) == 1 else 0
    if slots == 0 or slots * M != sorted_pairs.shape[0]:
        raise ValueError(f"sorted_pairs must hold tokens x slots pairs for the {M} tokens of x, "
                         f"got shape {sorted_pairs.shape}")
    check_routing(offsets, sorted_pairs, x, E, M * slots)
    if out is not None:
        arrays.check_out(out, "out", x, (M * slots, I))
    return Binding(problem=dict(dtype=x.dtype, M=M, slots=slots, E=E, I=I, C=C),
                   arrays={"x": (0, None), "wg": (1, None), "wu": (2, None), "offsets": (3, None),
                           "pairs": (4, None), "act": (5, None)},
                   output=(5, arrays.allocator(x.kind, x.device, (M * slots, I), x.dtype)), returns=5)


MOE_GATE_UP = Op(
    "moe_gate_up", args=("x", "gate_proj", "up_proj", "offsets", "sorted_pairs", "out"),
    optional=("out",), key=dict(dtype=None, M=pow2_bucket, slots=None, E=None, I=None, C=None),
    space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(moe_gate_up_kernel, _grid, ("x", "wg", "wu", "offsets", "pairs", "act"), _constants),),
    bind=_bind)


def moe_gate_up(x, gate_up_proj, offsets, sorted_pairs, *, out=None):
    """silu(x[token] @ Wg[e]^T) * (x[token] @ Wu[e]^T) for every (token, slot) pair, in expert order.

    x: (M, C); gate_up_proj: [E, 2I, C] (transformers' mlp.experts.gate_up_proj: expert e's gate rows, then its
    up rows); offsets (E + 1,) and sorted_pairs (M * slots,): moe_permute's order of the router's pairs.
    Returns act (M * slots, I), row r for pair sorted_pairs[r], of x's kind, or writes into `out`.
    """
    shape = getattr(gate_up_proj, "shape", ())
    if len(shape) != 3 or shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [experts, 2 * intermediate, hidden], got shape {tuple(shape)}")
    half = shape[1] // 2
    return MOE_GATE_UP((x, gate_up_proj[:, :half], gate_up_proj[:, half:], offsets, sorted_pairs, out))


def moe_gate_up_reference(x, gate_up_proj, topk_ids) -> np.ndarray:
    """float64 (M, slots, I): the SwiGLU activation of each token under each of its experts."""
    x, w = np.asarray(x, np.float64), np.asarray(gate_up_proj, np.float64)
    ids = np.asarray(topk_ids)
    half = w.shape[1] // 2
    out = np.empty(ids.shape + (half,))
    for e in np.unique(ids):
        hit = ids == e
        rows = x[np.nonzero(hit)[0]]
        out[hit] = swiglu_reference(rows @ w[e, :half].T, rows @ w[e, half:].T)
    return out


if __name__ == "__main__":
    from tilekit.kernels.moe_gate_up import moe_gate_up, moe_gate_up_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    from tilekit.kernels.moe_permute import moe_permute_reference
    for M, slots, E, I, C, dtype in [(1, 8, 66, 1408, 2048, "bfloat16"), (300, 8, 66, 1408, 2048, "bfloat16"),
                                     (5, 3, 8, 40, 72, "float32")]:
        ids = np.stack([np.random.default_rng(r).permutation(E)[:slots] for r in range(M)]).astype(np.int32)
        offsets, order = moe_permute_reference(ids, E)
        x, w = rand((M, C), dtype), rand((E, 2 * I, C), dtype, 1 / math.sqrt(C))
        act = moe_gate_up(x, w, cupy.asarray(offsets), cupy.asarray(order),
                          out=poisoned((M * slots, I), dtype))
        ref = moe_gate_up_reference(host(x), host(w), ids).reshape(M * slots, I)[order]
        err = assert_close(host(act), ref, TOL[dtype], f"moe_gate_up M{M} E{E} {dtype}")
        print(f"moe_gate_up M{M} slots {slots} E{E} I{I} C{C} {dtype}: ok, relative error {err:.2e}")
