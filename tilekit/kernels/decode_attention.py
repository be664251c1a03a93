"""Decode attention: a few new query tokens per sequence against a KV cache, split over the context.

Flash-decoding: the context of each (sequence, head) is cut into CHUNK-long splits handled by
separate programs, so even batch 1 fills the GPU; each split writes its partial softmax state
(max, sum, unnormalised output) and a small second kernel merges the splits. Lengths live on the
device, so a CUDA graph can replay a decode step as the cache grows; the grid depends only on the
cache capacity, and splits past a sequence's length exit at once. With grouped-query attention
(Hkv < H key/value heads) a program serves one key/value head and every query head of its group,
stacked as rows of one query tile, so each key and value tile is read once per group.
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
def decode_split_kernel(Q, K, V, Lengths, Opart, Mpart, Lpart, qk_scale: float, length_offset: int,
                        QP: ct.Constant[int], BN: ct.Constant[int], D: ct.Constant[int],
                        CHUNK: ct.Constant[int]):
    """Partial attention of split ct.bid(1) for (batch, key/value head) ct.bid(0).

    Q: (B, H, nq, D); K, V: (B, Hkv, capacity, D); Lengths[b] + length_offset = valid keys, the
    last nq of which are the queries' own positions (causal among them). Row r of the query tile
    is query head hk * G + r // nq, token r % nq (G = H / Hkv).
    Opart: (B, Hkv, S, QP, D) fp32; Mpart, Lpart: (B, Hkv, S, QP) fp32.
    """
    sync_with_previous_kernel()
    b, hk = batch_head(ct.bid(0), K.shape[1])
    split = ct.bid(1)
    nq = Q.shape[2]
    length = ct.load(Lengths, (b,), shape=()) + length_offset
    start = split * CHUNK
    end = ct.minimum(length, start + CHUNK)
    head, token = query_rows(QP, nq, hk, Q.shape[1] // K.shape[1], Q.shape[1])
    q = ct.gather(Q, (b, head, token, ct.arange(D, dtype=ct.int32).reshape((1, D))))
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
    ct.store(Opart, (b, hk, split, 0, 0), acc.reshape((1, 1, 1, QP, D)))
    ct.store(Mpart, (b, hk, split, 0), m_i.reshape((1, 1, 1, QP)))
    ct.store(Lpart, (b, hk, split, 0), l_i.reshape((1, 1, 1, QP)))


@ct.kernel
def decode_merge_kernel(Opart, Mpart, Lpart, O, QP: ct.Constant[int], D: ct.Constant[int]):
    """O[b, heads of kv head hk] = the merge of the partial softmax states of all splits of (batch,
    key/value head) ct.bid(0)."""
    sync_with_previous_kernel()
    b, hk = batch_head(ct.bid(0), Mpart.shape[1])
    S = Mpart.shape[2]
    m_max = ct.full((QP, 1), -math.inf, dtype=ct.float32)
    for s in range(S):
        m_max = ct.maximum(m_max, ct.load(Mpart, (b, hk, s, 0), (1, 1, 1, QP)).reshape((QP, 1)))
    m_max = ct.where(m_max == -math.inf, 0.0, m_max)
    total = ct.zeros((QP, 1), dtype=ct.float32)
    out = ct.zeros((QP, D), dtype=ct.float32)
    for s in range(S):
        w = ct.exp2(ct.load(Mpart, (b, hk, s, 0), (1, 1, 1, QP)).reshape((QP, 1)) - m_max)
        total = total + ct.load(Lpart, (b, hk, s, 0), (1, 1, 1, QP)).reshape((QP, 1)) * w
        out = out + ct.load(Opart, (b, hk, s, 0, 0), (1, 1, 1, QP, D)).reshape((QP, D)) * w
    H = O.shape[1]
    head, token = query_rows(QP, O.shape[2], hk, H // Mpart.shape[1], H)
    ct.scatter(O, (b, head, token, ct.arange(D, dtype=ct.int32).reshape((1, D))), (out / total).astype(O.dtype))


def _fits(c: dict, p: dict) -> bool:
    return c["BN"] <= c["CHUNK"] and c["CHUNK"] <= max(256, pow2_ceil(p["capacity"]))


SPACE = SearchSpace(_fits, BN=(64, 128), CHUNK=(128, 256, 512, 1024, 2048), occupancy=(2, 4))


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
    return {"q": qkv_views(dt, B, H, nq, D, 0, H + 2 * Hkv), "k": ArraySpec(dt, (B, Hkv, cap, D)),
            "v": ArraySpec(dt, (B, Hkv, cap, D)), "lengths": ArraySpec("int32", (B,), fill=cap),
            "o": heads_out(dt, B, H, nq, D)}


def _scratch(p: dict, c: dict) -> dict:
    """Partial softmax states of the splits, merged by the second kernel."""
    B, H, S, QP = p["B"], p["Hkv"], _splits(p, c), _qp(p)
    return {"opart": ArraySpec("float32", (B, H, S, QP, pow2_ceil(p["D"])), role="scratch"),
            "mpart": ArraySpec("float32", (B, H, S, QP), role="scratch"),
            "lpart": ArraySpec("float32", (B, H, S, QP), role="scratch")}


def _split_grid(p: dict, c: dict) -> tuple:
    return (p["B"] * p["Hkv"], _splits(p, c), 1)


def _split_constants(p: dict, c: dict) -> tuple:
    return (_qp(p), c["BN"], pow2_ceil(p["D"]), c["CHUNK"])


def _merge_grid(p: dict, c: dict) -> tuple:
    return (p["B"] * p["Hkv"], 1, 1)


def _merge_constants(p: dict, c: dict) -> tuple:
    return (_qp(p), pow2_ceil(p["D"]))


def _bind(a: list, flags: tuple) -> Binding:
    q, k_cache, v_cache, lengths, out = a
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
    if out is not None:
        check_heads_out(out, q)
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, Hkv=Hkv, nq=nq, capacity=k_cache.shape[2], D=D),
                   arrays={"q": (0, None), "k": (1, None), "v": (2, None), "lengths": (3, None), "o": (4, None)},
                   output=(4, arrays.allocator(q.kind, q.device, q.shape, q.dtype)), returns=4,
                   scalars={"qk_scale": (0, LOG2E / math.sqrt(D)), "length_offset": (1, 0)})


DECODE_ATTENTION = Op(
    "decode_attention", args=("q", "k_cache", "v_cache", "lengths", "out"), optional=("out",),
    key=dict(dtype=None, B=pow2_bucket, H=None, Hkv=None, nq=None, capacity=pow2_bucket, D=None),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(p["D"]), "length_offset": 0},
    launches=(Launch(decode_split_kernel, _split_grid,
                     ("q", "k", "v", "lengths", "opart", "mpart", "lpart", "qk_scale", "length_offset"),
                     _split_constants),
              Launch(decode_merge_kernel, _merge_grid, ("opart", "mpart", "lpart", "o"), _merge_constants,
                     hinted=False)),
    bind=_bind, cli_defaults=dict(nq=1))


def decode_attention(q, k_cache, v_cache, lengths, *, scale: float | None = None, length_offset: int = 0,
                     out=None):
    """Attention of nq new queries per sequence against a KV cache (flash-decoding).

    q: (B, H, nq, D); k_cache, v_cache: (B, Hkv, capacity, D) (Hkv dividing H: grouped-query
    attention); lengths: int32 (B,) on the device.
    Sequence b attends to its first lengths[b] + length_offset cached positions, the last nq of
    which are the queries' own (causal among them). Returns (B, H, nq, D) of q's kind.
    """
    if not isinstance(length_offset, (int, np.integer)) or isinstance(length_offset, bool):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    return DECODE_ATTENTION((q, k_cache, v_cache, lengths, out), (),
                            (None if scale is None else float(scale) * LOG2E, int(length_offset)))


def decode_attention_reference(q, k_cache, v_cache, lengths, *, scale: float | None = None,
                               length_offset: int = 0) -> np.ndarray:
    """float64 NumPy decode attention: per sequence, attention over its first lengths[b] + offset keys."""
    q = np.asarray(q, np.float64)
    out = np.empty(q.shape)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        out[b] = attention_reference(q[b:b + 1], np.asarray(k_cache[b:b + 1])[:, :, :n],
                                     np.asarray(v_cache[b:b + 1])[:, :, :n], causal=True, scale=scale)[0]
    return out


if __name__ == "__main__":
    from tilekit.kernels.decode_attention import decode_attention, decode_attention_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for B, H, Hkv, nq, cap, dtype in [(1, 25, 25, 1, 1024, "bfloat16"), (3, 4, 4, 3, 700, "float32"),
                                      (2, 32, 8, 1, 300, "bfloat16"), (2, 8, 2, 3, 100, "float16")]:
        q, kc, vc = rand((B, H, nq, 64), dtype), rand((B, Hkv, cap, 64), dtype), rand((B, Hkv, cap, 64), dtype)
        lengths = np.random.default_rng(0).integers(nq, cap + 1, B).astype(np.int32)
        out = decode_attention(q, kc, vc, cupy.asarray(lengths), out=poisoned((B, H, nq, 64), dtype))
        ref = decode_attention_reference(host(q), host(kc), host(vc), lengths)
        err = assert_close(host(out), ref, TOL[dtype], f"decode_attention B{B} cap{cap} {dtype}")
        print(f"decode_attention B{B} H{H} Hkv{Hkv} nq{nq} capacity {cap} {dtype}: ok, relative error {err:.2e}")
