"""Mixture-of-experts router: gate GEMM, softmax, top-k, renormalisation and routed scaling in one kernel.

Each program takes TM tokens: their expert logits x @ W^T (fp32 accumulation over bf16/fp16 products, which are
exact, so as Hugging Face's float32 gate up to summation order; float32 inputs multiply in float32), the softmax
over the experts, then k rounds of argmax (ties go to the lowest expert index), so the chosen experts come out
in descending probability. Optionally the k probabilities are renormalised to sum to 1; then they are multiplied
by `scale` (routed_scaling_factor). `shared` always-on experts may be appended after the routed ones as extra
slots (ids E, E + 1, ..., weight 1), so that one grouped GEMM over E + shared experts serves both.

With few tokens (a decode step) the gate's weights are the work: SPLIT_K programs share each row tile, each
summing a slice of the hidden dimension into its own fp32 partial logits; the last to arrive (counted in
Counter[tile], left at zero) adds them in a fixed order and routes. Nothing leaves the GPU: a CUDA graph of
a decode step replays it.
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
from tilekit.kernels.tiles import lends_split_k, sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
MAX_EXPERTS = 256
MAX_SLOTS = 32          # routed + shared experts per token


@ct.kernel
def moe_router_kernel(X, W, Ids, Weights, Partial, Counter, scale: float, TM: ct.Constant[int],
                      TK: ct.Constant[int], EP: ct.Constant[int], KP: ct.Constant[int], K: ct.Constant[int],
                      SHARED: ct.Constant[int], SPLIT_K: ct.Constant[int], RENORM: ct.Constant[bool]):
    """Ids, Weights[M, K + SHARED] of the tokens X[M, C] under the gate W[E, C]; program bid(0) = tile * SPLIT_K
    + split sums hidden-dimension tiles split * per_split.. of row tile `tile`."""
    sync_with_previous_kernel()
    tile = ct.bid(0) // SPLIT_K
    split = ct.bid(0) % SPLIT_K
    M = X.shape[0]
    E = W.shape[0]
    k_tiles = ct.cdiv(X.shape[1], TK)
    per_split = ct.cdiv(k_tiles, SPLIT_K)
    logits = ct.zeros((TM, EP), dtype=ct.float32)
    for k in range(split * per_split, ct.minimum(k_tiles, (split + 1) * per_split)):
        a = ct.load(X, (tile, k), (TM, TK), padding_mode=ZERO)
        b = ct.load(W, (k, 0), (TK, EP), order=(1, 0), padding_mode=ZERO)
        logits = ct.mma(a, b, logits)
    rows = (ct.arange(TM, dtype=ct.int32) + tile * TM).reshape((TM, 1))
    cols = ct.arange(EP, dtype=ct.int32).reshape((1, EP))
    if SPLIT_K > 1:
        ct.scatter(Partial, (split, rows, cols), logits)      # plain stores, which the release below orders
        arrived = ct.atomic_add(Counter, tile, 1)       # acq_rel: our partial before it, theirs after
        last = arrived == SPLIT_K - 1
        rows = ct.where(last, rows, M)                   # other programs address no row at all
        logits = ct.zeros((TM, EP), dtype=ct.float32)
        for s in range(SPLIT_K):
            logits = logits + ct.gather(Partial, (s, rows, cols))
        ct.atomic_xchg(Counter, ct.where(last, tile, Counter.shape[0]), 0, memory_order=ct.MemoryOrder.RELAXED)

    logits = ct.where(cols < E, logits, -math.inf)
    p = ct.exp(logits - ct.max(logits, axis=1, keepdims=True))
    scores = ct.where(cols < E, p / ct.sum(p, axis=1, keepdims=True), -1.0)
    slots = ct.arange(KP, dtype=ct.int32).reshape((1, KP))
    ids = ct.zeros((TM, KP), dtype=ct.int32)
    weights = ct.zeros((TM, KP), dtype=ct.float32)
    for i in range(K):
        best = ct.argmax(scores, axis=1, keepdims=True).astype(ct.int32)
        ids = ct.where(slots == i, best, ids)
        weights = ct.where(slots == i, ct.max(scores, axis=1, keepdims=True), weights)
        scores = ct.where(cols == best, -1.0, scores)
    if RENORM:
        weights = weights / (ct.sum(weights, axis=1, keepdims=True) + 1e-20)
    weights = weights * scale
    for j in range(SHARED):
        ids = ct.where(slots == K + j, E + j, ids)
        weights = ct.where(slots == K + j, 1.0, weights)
    ct.scatter(Ids, (rows, slots), ids)
    ct.scatter(Weights, (rows, slots), weights)


def _ep(p: dict) -> int:
    return max(16, pow2_ceil(p["E"]))


def _fits(c: dict, p: dict) -> bool:
    item = 4 if p["dtype"] == "float32" else 2
    m = pow2_ceil(p["M"])
    return (max(16, min(m, 128) // 4) <= c["TM"] <= max(16, m) and c["TK"] <= max(64, pow2_ceil(p["C"]))
            and c["TM"] * _ep(p) <= 128 * 128
            and (c["TM"] + _ep(p)) * c["TK"] * item <= 128 * 1024
            and (c["SPLIT_K"] == 1 or (ct.cdiv(p["M"], c["TM"]) <= 8 and c["SPLIT_K"] <= ct.cdiv(p["C"], c["TK"])))
            and (c["occupancy"] == 1 or c["TM"] * _ep(p) <= 64 * 128))


SPACE = SearchSpace(_fits, TM=(16, 32, 64, 128), TK=(64, 128, 256, 512), SPLIT_K=(1, 2, 4, 8, 16),
                    occupancy=(1, 2))


def default_config(p: dict) -> dict:
    """Up to 64 tokens per program; with few tokens, the hidden dimension split over up to 8 programs of
    two 128-wide steps or more."""
    item = 4 if p["dtype"] == "float32" else 2
    tm = min(64 if _ep(p) <= 128 else 32, max(16, pow2_ceil(p["M"])))
    tk = 128 if (tm + _ep(p)) * 128 * item <= 64 * 1024 else 64
    split = 1 << (min(8, ct.cdiv(p["C"], 2 * tk)).bit_length() - 1) if ct.cdiv(p["M"], tm) <= 2 else 1
    return dict(TM=tm, TK=tk, SPLIT_K=split, occupancy=1)


def _slots(p: dict) -> int:
    return p["K"] + p["shared"]


def _arrays(p: dict) -> dict:
    M, dt = p["M"], p["dtype"]
    return {"x": ArraySpec(dt, (M, p["C"])), "w": ArraySpec(dt, (p["E"], p["C"])),
            "ids": ArraySpec("int32", (M, _slots(p)), role="out"),
            "weights": ArraySpec("float32", (M, _slots(p)), role="out")}


def _tiles(p: dict, c: dict) -> int:
    return ct.cdiv(p["M"], c["TM"])


def _scratch(p: dict, c: dict) -> dict:
    """Split-K partial logits, and arrival counters zeroed once and left zeroed by every launch."""
    if c["SPLIT_K"] == 1:
        return {"partial": absent("float32", 3), "counter": absent("int32", 1)}
    return {"partial": ArraySpec("float32", (c["SPLIT_K"], p["M"], _ep(p)), role="scratch"),
            "counter": ArraySpec("int32", (_tiles(p, c),), role="zeros")}


def _grid(p: dict, c: dict) -> tuple:
    return (_tiles(p, c) * c["SPLIT_K"], 1, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TK"], _ep(p), max(16, pow2_ceil(_slots(p))), p["K"], p["shared"], c["SPLIT_K"],
            bool(p["renorm"]))


def _bind(a: list, flags: tuple) -> Binding:
    x, w, ids, weights = a
    top_k, shared, renormalize = flags
    arrays.check_dtype(x, "x", arrays.FLOAT_DTYPES)
    arrays.check_same("x", x, "gate_weight", w)
    if len(x.shape) < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {x.shape}")
    C = x.shape[-1]
    if len(w.shape) != 2 or w.shape[1] != C or not 1 <= w.shape[0] <= MAX_EXPERTS:
        raise ValueError(f"gate_weight must be [experts, {C}] with 1..{MAX_EXPERTS} experts, got shape {w.shape}")
    E = w.shape[0]
    for name, value, low, high in (("top_k", top_k, 1, E), ("shared", shared, 0, MAX_SLOTS)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    if top_k + shared > MAX_SLOTS:
        raise ValueError(f"top_k + shared = {top_k + shared} exceeds {MAX_SLOTS} experts per token")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    arrays.check_last_contiguous(x, "x")
    arrays.check_contiguous(w, "gate_weight")
    M = math.prod(x.shape[:-1])
    out_shape = x.shape[:-1] + (top_k + shared,)
    for name, out, dtype in (("topk_ids", ids, "int32"), ("topk_weights", weights, "float32")):
        arrays.check_out(out, name, x, out_shape, dtype)
    flat = None if len(out_shape) == 2 else (M, top_k + shared)
    return Binding(problem=dict(dtype=x.dtype, M=M, E=E, C=C, K=top_k, shared=shared, renorm=int(renormalize)),
                   arrays={"x": (0, None if len(x.shape) == 2 else (M, C)), "w": (1, None), "ids": (2, flat),
                           "weights": (3, flat)},
                   scalars={"scale": (0, 1.0)})


MOE_ROUTER = Op(
    "moe_router", args=("x", "gate_weight", "topk_ids", "topk_weights"),
    key=dict(dtype=None, M=pow2_bucket, E=None, C=None, K=None, shared=None, renorm=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch, scalars=lambda p: {"scale": 1.0},
    launches=(Launch(moe_router_kernel, _grid, ("x", "w", "ids", "weights", "partial", "counter", "scale"),
                     _constants),),
    bind=_bind, choices=dict(renorm=(0, 1), shared=range(0, MAX_SLOTS + 1)), cli_defaults=dict(shared=0, renorm=0),
    borrowable=lends_split_k)


def moe_router(x, gate_weight, top_k: int, *, renormalize: bool = False, scale: float = 1.0, shared: int = 0,
               topk_ids=None, topk_weights=None):
    """The experts each token of x (..., C) is routed to, and their weights, by softmax(x @ gate_weight^T).

    gate_weight: [E, C] (Hugging Face's mlp.gate.weight), of x's dtype. Returns (topk_ids int32, topk_weights
    float32), each (..., top_k + shared): the top_k experts in descending probability (ties: the lower index),
    their probabilities (renormalised to sum 1 if asked) times `scale`, then the `shared` always-on experts
    E, E + 1, ... with weight 1. Written into topk_ids / topk_weights when given (arrays of x's kind).
    """
    for name, value in (("top_k", top_k), ("shared", shared)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    shape = tuple(getattr(x, "shape", (0,))[:-1]) + (top_k + shared,)
    if topk_ids is None:
        topk_ids = arrays.new_like(x, "x", shape, "int32")
    if topk_weights is None:
        topk_weights = arrays.new_like(x, "x", shape, "float32")
    MOE_ROUTER((x, gate_weight, topk_ids, topk_weights), (top_k, shared, renormalize),
               (arrays.checked_positive(scale, "scale"),))
    return topk_ids, topk_weights


def moe_router_reference(x, gate_weight, top_k: int, *, renormalize: bool = False, scale: float = 1.0,
                         shared: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """float64 (ids int32, weights) of moe_router: experts by descending probability, ties to the lower index."""
    logits = np.asarray(x, np.float64) @ np.asarray(gate_weight, np.float64).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[..., :top_k]
    weights = np.take_along_axis(p, ids, -1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    E = p.shape[-1]
    lead = ids.shape[:-1]
    ids = np.concatenate([ids, np.broadcast_to(E + np.arange(shared), lead + (shared,))], -1)
    weights = np.concatenate([weights * scale, np.ones(lead + (shared,))], -1)
    return ids.astype(np.int32), weights


if __name__ == "__main__":
    from tilekit.kernels.moe_router import moe_router, moe_router_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import host, rand
    for M, E, C, k, shared, dtype in [(1, 64, 2048, 6, 2, "bfloat16"), (300, 64, 2048, 6, 2, "bfloat16"),
                                      (5, 8, 72, 3, 0, "float32")]:
        x, w = rand((M, C), dtype), rand((E, C), dtype, 1 / math.sqrt(C))
        ids, weights = moe_router(x, w, k, shared=shared, scale=2.5)
        ref_ids, ref_w = moe_router_reference(host(x), host(w), k, shared=shared, scale=2.5)
        agree = np.mean(np.all(np.sort(host(ids), -1) == np.sort(ref_ids, -1), -1))
        print(f"moe_router M{M} E{E} C{C} k{k}+{shared} {dtype}: {agree:.3f} of rows choose the reference's experts")
