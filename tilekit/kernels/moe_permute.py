"""Token permutation by expert: a stable counting sort of the (token, slot) pairs of a router's output.

The pairs p = token * slots + slot of topk_ids (M, slots) are ordered by expert, and within an expert by p:
sorted_pairs[offsets[e]:offsets[e + 1]] are expert e's pairs. Every buffer has its worst-case size (M * slots
pairs, E + 1 offsets) and nothing leaves the GPU, so a CUDA graph replays it whatever the routing. The grouped
expert GEMMs (moe_gate_up, moe_down_combine) read the offsets to find their row tiles.

Pairs are taken in chunks of CH: a chunk's histogram and each pair's rank among the chunk's pairs of its expert
come from a (CH, experts) one-hot match tile and its column sums and cumulative sums. One chunk (a decode step)
is one launch. Several chunks take three: per-chunk histograms, one program's scan of them into each chunk's
starting positions and the offsets, then the placement.
"""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel

MAX_EXPERTS = 1024


@ct.function
def chunk_match(Ids, c, CH, EP):
    """(pair indices (CH,), one-hot int32 (CH, EP) of their experts) of chunk c; pairs past the end and ids
    outside [0, EP) match no expert."""
    pairs = ct.arange(CH, dtype=ct.int32) + c * CH
    experts = ct.gather(Ids, pairs, padding_value=EP).reshape((CH, 1))
    match = ct.where(experts == ct.arange(EP, dtype=ct.int32).reshape((1, EP)), 1, 0)
    return pairs, match


@ct.kernel
def moe_count_kernel(Ids, Hist, CH: ct.Constant[int], EP: ct.Constant[int]):
    """Hist[c, e] = pairs of chunk c = bid(0) routed to expert e."""
    sync_with_previous_kernel()
    c = ct.bid(0)
    _, match = chunk_match(Ids, c, CH, EP)
    ct.store(Hist, (c, 0), ct.sum(match, axis=0, keepdims=True))


@ct.kernel
def moe_scan_kernel(Hist, Offsets, EP: ct.Constant[int]):
    """One program: Offsets[e] = pairs of experts before e, and Hist[c, e] replaced by the position of chunk c's
    first pair of expert e in the sorted order."""
    sync_with_previous_kernel()
    chunks = Hist.shape[0]
    total = ct.zeros((1, EP), dtype=ct.int32)
    for c in range(chunks):
        total = total + ct.load(Hist, (c, 0), (1, EP))
    base = ct.cumsum(total, axis=1) - total
    ct.store(Offsets, (0,), base.reshape((EP,)))
    for c in range(chunks):
        count = ct.load(Hist, (c, 0), (1, EP))
        ct.store(Hist, (c, 0), base)
        base = base + count


@ct.kernel
def moe_place_kernel(Ids, Hist, Offsets, Sorted, CH: ct.Constant[int], EP: ct.Constant[int],
                     ONE_CHUNK: ct.Constant[bool]):
    """Sorted[position of pair p] = p for the pairs of chunk bid(0); with ONE_CHUNK (every pair in this one
    program) it also counts and writes Offsets, else the start of each expert's run comes from Hist."""
    sync_with_previous_kernel()
    c = ct.bid(0)
    pairs, match = chunk_match(Ids, c, CH, EP)
    if ONE_CHUNK:
        count = ct.sum(match, axis=0, keepdims=True)
        start = ct.cumsum(count, axis=1) - count
        ct.store(Offsets, (0,), start.reshape((EP,)))
    else:
        start = ct.load(Hist, (c, 0), (1, EP))
    rank = ct.cumsum(match, axis=0) - match + start          # (CH, EP): a pair's position under its expert
    position = ct.sum(match * rank, axis=1)
    ct.scatter(Sorted, position, pairs, mask=ct.sum(match, axis=1) > 0)


def _ep(p: dict) -> int:
    """Experts padded to a power of two with room for the end offset."""
    return pow2_ceil(p["E"] + 1)


def _fits(c: dict, p: dict) -> bool:
    return c["CH"] * _ep(p) <= 32 * 1024 and c["CH"] <= max(16, pow2_ceil(p["P"]))


SPACE = SearchSpace(_fits, CH=(16, 32, 64, 128, 256, 512, 1024, 2048), occupancy=(1, 2, 4))


def default_config(p: dict) -> dict:
    """The largest chunk that fits: a decode step's pairs in one launch."""
    fitting = [ch for ch in SPACE.params["CH"] if _fits(dict(CH=ch), p)]
    return dict(CH=max(fitting) if fitting else 16, occupancy=1)


def _chunks(p: dict, c: dict) -> int:
    return ct.cdiv(p["P"], c["CH"])


def _arrays(p: dict) -> dict:
    return {"ids": ArraySpec("int32", (p["P"],), high=p["E"]),
            "offsets": ArraySpec("int32", (p["E"] + 1,), role="out"),
            "sorted": ArraySpec("int32", (p["P"],), role="out")}


def _scratch(p: dict, c: dict) -> dict:
    if _chunks(p, c) == 1:
        return {"hist": absent("int32", 2)}
    return {"hist": ArraySpec("int32", (_chunks(p, c), _ep(p)), role="scratch")}


def _several(p: dict, c: dict) -> tuple:
    """The counting and scan launches: none for one chunk."""
    return (_chunks(p, c) if _chunks(p, c) > 1 else 0, 1, 1)


def _scan_grid(p: dict, c: dict) -> tuple:
    return (1 if _chunks(p, c) > 1 else 0, 1, 1)


def _place_grid(p: dict, c: dict) -> tuple:
    return (_chunks(p, c), 1, 1)


def _count_constants(p: dict, c: dict) -> tuple:
    return (c["CH"], _ep(p))


def _scan_constants(p: dict, c: dict) -> tuple:
    return (_ep(p),)


def _place_constants(p: dict, c: dict) -> tuple:
    return (c["CH"], _ep(p), _chunks(p, c) == 1)


def _bind(a: list, flags: tuple) -> Binding:
    ids, offsets, sorted_pairs = a
    (n_experts,) = flags
    arrays.check_dtype(ids, "topk_ids", ("int32",))
    if len(ids.shape) < 1 or 0 in ids.shape:
        raise ValueError(f"topk_ids must be a non-empty (..., slots) array, got shape {ids.shape}")
    arrays.check_contiguous(ids, "topk_ids")
    if not isinstance(n_experts, int) or isinstance(n_experts, bool) or not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"n_experts must be an int in [1, {MAX_EXPERTS}], got {n_experts!r}")
    P = int(np.prod(ids.shape))
    arrays.check_out(offsets, "offsets", ids, (n_experts + 1,))
    arrays.check_out(sorted_pairs, "sorted_pairs", ids, (P,))
    return Binding(problem=dict(P=P, E=n_experts),
                   arrays={"ids": (0, None if len(ids.shape) == 1 else (P,)), "offsets": (1, None),
                           "sorted": (2, None)})


MOE_PERMUTE = Op(
    "moe_permute", args=("topk_ids", "offsets", "sorted_pairs"),
    key=dict(P=pow2_bucket, E=None), space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    launches=(Launch(moe_count_kernel, _several, ("ids", "hist"), _count_constants, hinted=False),
              Launch(moe_scan_kernel, _scan_grid, ("hist", "offsets"), _scan_constants, hinted=False),
              Launch(moe_place_kernel, _place_grid, ("ids", "hist", "offsets", "sorted"), _place_constants)),
    bind=_bind)


def moe_permute(topk_ids, n_experts: int, *, offsets=None, sorted_pairs=None):
    """Order the (token, slot) pairs of topk_ids (..., slots; int32 expert ids in [0, n_experts)) by expert.

    Returns (offsets int32 (n_experts + 1,), sorted_pairs int32 (pairs,)): the pairs p = token * slots + slot
    routed to expert e, ascending, are sorted_pairs[offsets[e]:offsets[e + 1]]. Written into offsets /
    sorted_pairs when given (arrays of topk_ids' kind).
    """
    if not isinstance(n_experts, int) or isinstance(n_experts, bool):
        raise TypeError(f"n_experts must be an int, got {type(n_experts).__name__}")
    if offsets is None:
        offsets = arrays.new_like(topk_ids, "topk_ids", (n_experts + 1,), "int32")
    if sorted_pairs is None:
        sorted_pairs = arrays.new_like(topk_ids, "topk_ids", (int(np.prod(topk_ids.shape)),), "int32")
    MOE_PERMUTE((topk_ids, offsets, sorted_pairs), (n_experts,))
    return offsets, sorted_pairs


def moe_permute_reference(topk_ids, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy (offsets, sorted_pairs) of moe_permute: a stable sort of the flattened ids."""
    flat = np.asarray(topk_ids).reshape(-1)
    counts = np.bincount(flat, minlength=n_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return offsets, np.argsort(flat, kind="stable").astype(np.int32)


if __name__ == "__main__":
    from tilekit.kernels.moe_permute import moe_permute, moe_permute_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import host
    for M, slots, E in [(1, 8, 66), (4096, 8, 66), (77, 3, 8)]:
        ids = np.stack([np.random.default_rng(M).permutation(E)[:slots] for _ in range(M)]).astype(np.int32)
        offsets, order = moe_permute(cupy.asarray(ids), E)
        ref_offsets, ref_order = moe_permute_reference(ids, E)
        assert np.array_equal(host(offsets), ref_offsets) and np.array_equal(host(order), ref_order), "differs"
        print(f"moe_permute M{M} slots {slots} E{E}: ok, exact")
