"""Decode attention: a few new query tokens per sequence against a KV cache, split over the context.

Flash-decoding in one kernel: the context of each (sequence, head) is cut into CHUNK-long splits
handled by separate programs, so even batch 1 fills the GPU. Each split writes its partial softmax
state (max, sum, unnormalised output) and counts itself in; the last split to arrive merges them all.
Given the new tokens' keys and values (k_new, v_new: views of the QKV projection), the split that
ends the context attends to them straight from there, and the merging program, which runs after
every other program's reads, writes them into the cache: the KV-cache write, the attention and the
merge are one launch. Lengths live on the device, so a CUDA graph can replay a decode step as the
cache grows; the grid depends only on the cache capacity, and splits past a sequence's length do
no work. With grouped-query attention (Hkv < H key/value heads) a program serves one key/value
head and every query head of its group, stacked as rows of one query tile, so each key and value
tile is read once per group.
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
from tilekit.kernels.attention import (LOG2E, attention_reference, batch_head, check_heads_out, check_qkv,
                                       heads_out, online_softmax_step, qkv_views)
from tilekit.kernels.dependent_launch import sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO
MAX_QUERIES = 16
MAX_ROWS = 64          # query heads per key/value head x query tokens, stacked in one tile


@ct.function
def query_rows(QP, nq, hk, group, H):
    """(query head, token) of each row of a (QP, 1) query tile of key/value head hk; rows past the
    group's G x nq address head H, which does not exist (gathers read zeros, scatters drop them)."""
    r = ct.arange(QP, dtype=ct.int32).reshape((QP, 1))
    return ct.where(r < group * nq, hk * group + r // nq, H), r % nq


@ct.kernel
def decode_attention_kernel(Q, K, V, Knew, Vnew, Lengths, Opart, Mpart, Lpart, Counter, O, qk_scale: float,
                            length_offset: int, QP: ct.Constant[int], BN: ct.Constant[int], D: ct.Constant[int],
                            CHUNK: ct.Constant[int], NEW: ct.Constant[bool]):
    """Split ct.bid(1) of (batch, key/value head) ct.bid(0); the last split to finish merges.

    Q: (B, H, nq, D); K, V: (B, Hkv, capacity, D); Lengths[b] + length_offset = valid keys, the
    last nq of which are the queries' own positions (causal among them). With NEW those nq keys
    and values come from Knew, Vnew (B, Hkv, nq, D) and are written into K and V. Row r of the
    query tile is query head hk * G + r // nq, token r % nq (G = H / Hkv).
    Opart: (B, Hkv, S, QP, D) fp32; Mpart, Lpart: (B, Hkv, S, QP) fp32; Counter: (B * Hkv,) int32,
    zero before and after each launch.
    """
    sync_with_previous_kernel()
    B, H, nq = Q.shape[0], Q.shape[1], Q.shape[2]
    b, hk = batch_head(ct.bid(0), K.shape[1])
    split = ct.bid(1)
    length = ct.load(Lengths, (b,), shape=()) + length_offset
    cached = length
    if NEW:
        cached = length - nq
    last_split = (length - 1) // CHUNK
    start = split * CHUNK
    end = ct.minimum(cached, start + CHUNK)
    head, token = query_rows(QP, nq, hk, H // K.shape[1], H)
    dims = ct.arange(D, dtype=ct.int32).reshape((1, D))
    q = ct.gather(Q, (b, head, token, dims))
    q_pos = token + (length - nq)
    m_i = ct.full((QP, 1), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((QP, 1), dtype=ct.float32)
    acc = ct.zeros((QP, D), dtype=ct.float32)
    for j in range(start // BN, ct.cdiv(end, BN)):
        k = ct.load(K, (b, hk, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
        v = ct.load(V, (b, hk, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
        s = ct.mma(q, k, ct.zeros((QP, BN), dtype=ct.float32)) * qk_scale
        k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((1, BN))
        s = ct.where((k_pos < end) & (k_pos <= q_pos), s, -math.inf)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v)
    new = ct.arange(MAX_QUERIES, dtype=ct.int32).reshape((MAX_QUERIES, 1))
    if NEW:             # the split that ends the context also attends to the new keys, read where they were made
        k_t = ct.gather(Knew, (b, hk, new.reshape((1, MAX_QUERIES)), dims.reshape((D, 1))))
        scores = ct.mma(q, k_t, ct.zeros((QP, MAX_QUERIES), dtype=ct.float32)) * qk_scale
        visible = (new.reshape((1, MAX_QUERIES)) <= token) & (new.reshape((1, MAX_QUERIES)) < nq)
        scores = ct.where(visible & (split == last_split), scores, -math.inf)
        m_i, l_i, acc = online_softmax_step(scores, m_i, l_i, acc, ct.gather(Vnew, (b, hk, new, dims)))
    ct.store(Opart, (b, hk, split, 0, 0), acc.reshape((1, 1, 1, QP, D)))
    ct.store(Mpart, (b, hk, split, 0), m_i.reshape((1, 1, 1, QP)))
    ct.store(Lpart, (b, hk, split, 0), l_i.reshape((1, 1, 1, QP)))

    arrived = ct.atomic_add(Counter, ct.bid(0), 1)        # acq_rel: our partial before it, theirs after
    last = arrived == ct.num_blocks(1) - 1
    mb = ct.where(last, b, B)                              # other programs address no sequence at all
    rows = ct.arange(QP, dtype=ct.int32).reshape((QP, 1))
    m_max = ct.full((QP, 1), -math.inf, dtype=ct.float32)
    splits = ct.minimum(last_split + 1, ct.num_blocks(1))
    for part in range(splits):
        m_max = ct.maximum(m_max, ct.gather(Mpart, (mb, hk, part, rows)))
    m_max = ct.where(m_max == -math.inf, 0.0, m_max)
    total = ct.zeros((QP, 1), dtype=ct.float32)
    out = ct.zeros((QP, D), dtype=ct.float32)
    for part in range(splits):
        w = ct.exp2(ct.gather(Mpart, (mb, hk, part, rows)) - m_max)
        total = total + ct.gather(Lpart, (mb, hk, part, rows)) * w
        out = out + ct.gather(Opart, (mb, hk, part, rows, dims)) * w
    ct.scatter(O, (mb, head, token, dims), (out / total).astype(O.dtype))
    if NEW:             # every other program has finished reading the cache: fill the new slots
        pos = new + (length - nq)
        ct.scatter(K, (mb, hk, pos, dims), ct.gather(Knew, (b, hk, new, dims)), mask=new < nq)
        ct.scatter(V, (mb, hk, pos, dims), ct.gather(Vnew, (b, hk, new, dims)), mask=new < nq)
    ct.atomic_xchg(Counter, ct.where(last, ct.bid(0), Counter.shape[0]), 0, memory_order=ct.MemoryOrder.RELAXED)


def _fits(c: dict, p: dict) -> bool:
    return c["BN"] <= c["CHUNK"] and c["CHUNK"] <= max(256, pow2_ceil(p["capacity"]))


SPACE = SearchSpace(_fits, BN=(64, 128), CHUNK=(64, 128, 256, 512, 1024, 2048), occupancy=(2, 4))


def default_config(p: dict) -> dict:
    # Aim for about two programs per SM on a 132-SM GPU.
    per_seq = max(1, 264 // max(1, p["B"] * p["Hkv"]))
    chunk = max(256, pow2_ceil(math.ceil(p["capacity"] / per_seq)))
    return dict(BN=128, CHUNK=min(2048, chunk), occupancy=4)


def _splits(p: dict, c: dict) -> int:
    return ct.cdiv(p["capacity"], c["CHUNK"])


def _qp(p: dict) -> int:
    """Rows of the query tile: the group's query heads x the new tokens."""
    return max(16, pow2_ceil(p["H"] // p["Hkv"] * p["nq"]))


def _arrays(p: dict) -> dict:
    B, H, Hkv, nq, cap, D, dt = p["B"], p["H"], p["Hkv"], p["nq"], p["capacity"], p["D"], p["dtype"]
    fused = H + 2 * Hkv
    new = qkv_views(dt, B, Hkv, nq, D, 0, fused) if p["new"] else absent(dt, 4)
    return {"q": qkv_views(dt, B, H, nq, D, 0, fused), "k": ArraySpec(dt, (B, Hkv, cap, D)),
            "v": ArraySpec(dt, (B, Hkv, cap, D)), "knew": new, "vnew": new,
            "lengths": ArraySpec("int32", (B,), fill=cap), "o": heads_out(dt, B, H, nq, D)}


def _scratch(p: dict, c: dict) -> dict:
    """Partial softmax states of the splits, and arrival counters zeroed once and left zeroed by every launch."""
    B, H, S, QP = p["B"], p["Hkv"], _splits(p, c), _qp(p)
    return {"opart": ArraySpec("float32", (B, H, S, QP, pow2_ceil(p["D"])), role="scratch"),
            "mpart": ArraySpec("float32", (B, H, S, QP), role="scratch"),
            "lpart": ArraySpec("float32", (B, H, S, QP), role="scratch"),
            "counter": ArraySpec("int32", (B * H,), role="zeros")}


def _grid(p: dict, c: dict) -> tuple:
    return (p["B"] * p["Hkv"], _splits(p, c), 1)


def _constants(p: dict, c: dict) -> tuple:
    return (_qp(p), c["BN"], pow2_ceil(p["D"]), c["CHUNK"], bool(p["new"]))


def _bind(a: list, flags: tuple) -> Binding:
    q, k_cache, v_cache, lengths, k_new, v_new, out = a
    check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"))
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
    views = {"q": (0, None), "k": (1, None), "v": (2, None), "lengths": (3, None), "o": (6, None)}
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    if k_new is not None:
        for name, new in (("k_new", k_new), ("v_new", v_new)):
            arrays.check_same("q", q, name, new)
            if new.shape != (B, Hkv, nq, D):
                raise ValueError(f"{name} must have shape {(B, Hkv, nq, D)} (batch, key/value heads, q's tokens, "
                                 f"head_dim), got {new.shape}")
            arrays.check_last_contiguous(new, name)
        views.update(knew=(4, None), vnew=(5, None))
    if out is not None:
        check_heads_out(out, q)
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, Hkv=Hkv, nq=nq, capacity=k_cache.shape[2], D=D,
                                new=int(k_new is not None)),
                   arrays=views, output=(6, arrays.allocator(q.kind, q.device, q.shape, q.dtype)), returns=6,
                   scalars={"qk_scale": (0, LOG2E / math.sqrt(D)), "length_offset": (1, 0)})


DECODE_ATTENTION = Op(
    "decode_attention", args=("q", "k_cache", "v_cache", "lengths", "k_new", "v_new", "out"),
    optional=("k_new", "v_new", "out"),
    key=dict(dtype=None, B=pow2_bucket, H=None, Hkv=None, nq=None, capacity=pow2_bucket, D=None, new=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(p["D"]), "length_offset": 0},
    # Not a dependent launch: with every kernel of a decode step launched early, kernels queue up several deep
    # and GPT-2 steps run slower (H200: gpt2-xl 2.81 ms against 2.22 sequential); one ordinary launch per
    # layer bounds that (it was the KV-cache write's until attention took that write over).
    launches=(Launch(decode_attention_kernel, _grid,
                     ("q", "k", "v", "knew", "vnew", "lengths", "opart", "mpart", "lpart", "counter", "o",
                      "qk_scale", "length_offset"), _constants, dependent=False),),
    bind=_bind, cli_defaults=dict(nq=1, new=1))


def decode_attention(q, k_cache, v_cache, lengths, *, k_new=None, v_new=None, scale: float | None = None,
                     length_offset: int = 0, out=None):
    """Attention of nq new queries per sequence against a KV cache (flash-decoding).

    q: (B, H, nq, D); k_cache, v_cache: (B, Hkv, capacity, D) (Hkv dividing H: grouped-query
    attention); lengths: int32 (B,) on the device.
    Sequence b attends to its first L = lengths[b] + length_offset positions, the last nq of which
    are the queries' own (causal among them). Given k_new and v_new (B, Hkv, nq, D), those last nq
    keys and values are written into the caches at positions L - nq .. L - 1 in the same launch
    (positions past the capacity are dropped); otherwise the caches already hold them.
    Returns (B, H, nq, D) of q's kind.
    """
    if not isinstance(length_offset, (int, np.integer)) or isinstance(length_offset, bool):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    return DECODE_ATTENTION((q, k_cache, v_cache, lengths, k_new, v_new, out), (),
                            (None if scale is None else float(scale) * LOG2E, int(length_offset)))


def decode_attention_reference(q, k_cache, v_cache, lengths, *, k_new=None, v_new=None, scale: float | None = None,
                               length_offset: int = 0) -> np.ndarray:
    """float64 NumPy decode attention: per sequence, attention over its first L = lengths[b] + offset
    keys, the last nq of them taken from k_new and v_new when given."""
    q = np.asarray(q, np.float64)
    out = np.empty(q.shape)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        k, v = (np.array(c[b:b + 1, :, :n], np.float64) for c in (k_cache, v_cache))
        if k_new is not None:
            k[:, :, n - q.shape[2]:] = np.asarray(k_new, np.float64)[b:b + 1]
            v[:, :, n - q.shape[2]:] = np.asarray(v_new, np.float64)[b:b + 1]
        out[b] = attention_reference(q[b:b + 1], k, v, causal=True, scale=scale)[0]
    return out


if __name__ == "__main__":
    from tilekit.kernels.decode_attention import decode_attention, decode_attention_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for B, H, Hkv, nq, cap, dtype, new in [(1, 25, 25, 1, 1024, "bfloat16", True), (3, 4, 4, 3, 700, "float32", False),
                                           (2, 32, 8, 1, 300, "bfloat16", True), (2, 8, 2, 3, 100, "float16", True)]:
        q, kc, vc = rand((B, H, nq, 64), dtype), rand((B, Hkv, cap, 64), dtype), rand((B, Hkv, cap, 64), dtype)
        kn, vn = (rand((B, Hkv, nq, 64), dtype) if new else None for _ in range(2))
        lengths = np.random.default_rng(0).integers(nq, cap + 1, B).astype(np.int32)
        ref = decode_attention_reference(host(q), host(kc), host(vc), lengths, k_new=None if kn is None else host(kn),
                                         v_new=None if vn is None else host(vn))
        out = decode_attention(q, kc, vc, cupy.asarray(lengths), k_new=kn, v_new=vn,
                               out=poisoned((B, H, nq, 64), dtype))
        err = assert_close(host(out), ref, TOL[dtype], f"decode_attention B{B} cap{cap} {dtype}")
        if new:
            for b, n in enumerate(lengths):
                assert np.array_equal(host(kc)[b, :, n - nq:n], host(kn)[b]), "k_new not written to the cache"
                assert np.array_equal(host(vc)[b, :, n - nq:n], host(vn)[b]), "v_new not written to the cache"
        print(f"decode_attention B{B} H{H} Hkv{Hkv} nq{nq} capacity {cap} {dtype} new {new}: ok, "
              f"relative error {err:.2e}")
