"""Decode attention: a few new query tokens per sequence against a KV cache, split over the context.

Flash-decoding: the context of each (sequence, head) is cut into CHUNK-long splits handled by
separate programs, so even batch 1 fills the GPU; each split writes its partial softmax state
(max, sum, unnormalised output) and a small second kernel merges the splits. Lengths live on the
device, so a CUDA graph can replay a decode step as the cache grows; the grid depends only on the
cache capacity, and splits past a sequence's length exit at once.
"""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune.compile import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import BenchCase, TunableOp
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels import arrays
from tilekit.kernels.attention import LOG2E, attention_reference, check_qkv, online_softmax_step

ZERO = ct.PaddingMode.ZERO
MAX_QUERIES = 16


@ct.kernel
def decode_split_kernel(Q, K, V, Lengths, Opart, Mpart, Lpart, qk_scale: float, length_offset: int,
                        QP: ct.Constant[int], BN: ct.Constant[int], D: ct.Constant[int],
                        CHUNK: ct.Constant[int]):
    """Partial attention of split ct.bid(1) for (batch, head) ct.bid(0).

    Q: (B, H, nq, D); K, V: (B, H, capacity, D); Lengths[b] + length_offset = valid keys, the
    last nq of which are the queries' own positions (causal among them).
    Opart: (B, H, S, QP, D) fp32; Mpart, Lpart: (B, H, S, QP) fp32.
    """
    bh = ct.bid(0)
    split = ct.bid(1)
    H = Q.shape[1]
    b = bh // H
    h = bh % H
    nq = Q.shape[2]
    length = ct.load(Lengths, (b,), shape=()) + length_offset
    start = split * CHUNK
    end = ct.minimum(length, start + CHUNK)
    q = ct.load(Q, (b, h, 0, 0), (1, 1, QP, D), padding_mode=ZERO).reshape((QP, D))
    q_pos = (ct.arange(QP, dtype=ct.int32) + (length - nq)).reshape((QP, 1))
    m_i = ct.full((QP, 1), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((QP, 1), dtype=ct.float32)
    acc = ct.zeros((QP, D), dtype=ct.float32)
    for j in range(start // BN, ct.cdiv(end, BN)):
        k = ct.load(K, (b, h, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
        v = ct.load(V, (b, h, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
        s = ct.mma(q, k, ct.zeros((QP, BN), dtype=ct.float32)) * qk_scale
        k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((1, BN))
        s = ct.where((k_pos < end) & (k_pos <= q_pos), s, -math.inf)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v)
    ct.store(Opart, (b, h, split, 0, 0), acc.reshape((1, 1, 1, QP, D)))
    ct.store(Mpart, (b, h, split, 0), m_i.reshape((1, 1, 1, QP)))
    ct.store(Lpart, (b, h, split, 0), l_i.reshape((1, 1, 1, QP)))


@ct.kernel
def decode_merge_kernel(Opart, Mpart, Lpart, O, QP: ct.Constant[int], D: ct.Constant[int]):
    """O[b, h] = the merge of the partial softmax states of all splits of (batch, head) ct.bid(0)."""
    bh = ct.bid(0)
    H = O.shape[1]
    b = bh // H
    h = bh % H
    S = Mpart.shape[2]
    m_max = ct.full((QP, 1), -math.inf, dtype=ct.float32)
    for s in range(S):
        m_max = ct.maximum(m_max, ct.load(Mpart, (b, h, s, 0), (1, 1, 1, QP)).reshape((QP, 1)))
    m_max = ct.where(m_max == -math.inf, 0.0, m_max)
    total = ct.zeros((QP, 1), dtype=ct.float32)
    out = ct.zeros((QP, D), dtype=ct.float32)
    for s in range(S):
        w = ct.exp2(ct.load(Mpart, (b, h, s, 0), (1, 1, 1, QP)).reshape((QP, 1)) - m_max)
        total = total + ct.load(Lpart, (b, h, s, 0), (1, 1, 1, QP)).reshape((QP, 1)) * w
        out = out + ct.load(Opart, (b, h, s, 0, 0), (1, 1, 1, QP, D)).reshape((QP, D)) * w
    ct.store(O, (b, h, 0, 0), (out / total).astype(O.dtype).reshape((1, 1, QP, D)))


def _fits(c: dict, p: dict) -> bool:
    return c["BN"] <= c["CHUNK"] and c["CHUNK"] <= max(256, pow2_ceil(p["capacity"]))


SPACE = SearchSpace(_fits, BN=(64, 128), CHUNK=(128, 256, 512, 1024, 2048), occupancy=(2, 4))
FIELDS = ("dtype", "B", "H", "nq", "capacity", "D")


def default_config(p: dict) -> dict:
    # Aim for about two programs per SM on a 132-SM GPU.
    per_seq = max(1, 264 // (p["B"] * p["H"]))
    chunk = max(256, pow2_ceil(math.ceil(p["capacity"] / per_seq)))
    return dict(BN=128, CHUNK=min(2048, chunk), occupancy=4)


def _splits(p: dict, c: dict) -> int:
    return ct.cdiv(p["capacity"], c["CHUNK"])


def _qp(p: dict) -> int:
    return max(16, pow2_ceil(p["nq"]))


def _split_args(q, k, v, lengths, opart, mpart, lpart, scale, offset, p, c) -> tuple:
    return (q, k, v, lengths, opart, mpart, lpart, float(scale * LOG2E), int(offset), _qp(p), c["BN"],
            pow2_ceil(p["D"]), c["CHUNK"])


def _merge_args(opart, mpart, lpart, o, p, c) -> tuple:
    return (opart, mpart, lpart, o, _qp(p), pow2_ceil(p["D"]))


def _partial_shapes(p: dict, c: dict) -> tuple:
    B, H, S, QP = p["B"], p["H"], _splits(p, c), _qp(p)
    return (B, H, S, QP, pow2_ceil(p["D"])), (B, H, S, QP)


def _signature(p: dict, c: dict):
    B, H, nq, cap, D = p["B"], p["H"], p["nq"], p["capacity"], p["D"]
    row = 3 * H * D
    q = ArraySpec(p["dtype"], (B, H, nq, D), (nq * row, D, row, 1))
    kv = ArraySpec(p["dtype"], (B, H, cap, D))
    o = ArraySpec(p["dtype"], (B, H, nq, D), (nq * H * D, D, H * D, 1))
    lengths = ArraySpec("int32", (B,))
    op_shape, ml_shape = _partial_shapes(p, c)
    opart, ml = ArraySpec("float32", op_shape), ArraySpec("float32", ml_shape)
    return [(decode_split_kernel, _split_args(q, kv, kv, lengths, opart, ml, ml, 1.0, 0, p, c)),
            (decode_merge_kernel, _merge_args(opart, ml, ml, o, p, c))]


def _partials(device: int, stream: int, p: dict, c: dict) -> tuple:
    """Scratch (Opart, Mpart, Lpart), one set per device, stream and shape (streams never share)."""
    op_shape, ml_shape = _partial_shapes(p, c)
    specs = ((op_shape, "float32"), (ml_shape, "float32"), (ml_shape, "float32"))
    return arrays.scratch("decode_attention.partials", device, stream, specs)


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    rng = cupy.random.default_rng()
    B, H, nq, cap, D = p["B"], p["H"], p["nq"], p["capacity"], p["D"]
    q = arrays.random_array((B, nq, 3, H, D), p["dtype"], dev, rng)[:, :, 0].transpose(0, 2, 1, 3)
    k = arrays.random_array((B, H, cap, D), p["dtype"], dev, rng)
    v = arrays.random_array((B, H, cap, D), p["dtype"], dev, rng)
    lengths = cupy.full((B,), cap, dtype=cupy.int32)

    def args(c):
        return _split_args(q, k, v, lengths, *_partials(dev, 0, p, c), 1 / math.sqrt(D), 0, p, c)

    return BenchCase(grid=lambda c: (B * H, _splits(p, c), 1), args=args)


DECODE_ATTENTION = TunableOp("decode_attention", kernel=decode_split_kernel, fields=FIELDS, space=SPACE,
                             default=default_config, buckets={"B": pow2_bucket, "capacity": pow2_bucket},
                             bench=_bench, signature=_signature,
                             source_of=(decode_merge_kernel, online_softmax_step),
                             field_defaults=dict(nq=1))


def decode_attention(q, k_cache, v_cache, lengths, *, scale: float | None = None, length_offset: int = 0,
                     out=None):
    """Attention of nq new queries per sequence against a KV cache (flash-decoding).

    q: (B, H, nq, D); k_cache, v_cache: (B, H, capacity, D); lengths: int32 (B,) on the device.
    Sequence b attends to its first lengths[b] + length_offset cached positions, the last nq of
    which are the queries' own (causal among them). Returns (B, H, nq, D) of q's kind.
    """
    q, k_cache, v_cache, lengths = (arrays.as_device_array(a, n) for a, n in (
        (q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (lengths, "lengths")))
    qi, ki, _ = check_qkv(q, k_cache, v_cache, ("q", "k_cache", "v_cache"))
    B, H, nq, D = qi.shape
    li = arrays.info(lengths, "lengths")
    arrays.check_dtype(li, "lengths", ("int32",))
    if li.shape != (B,) or li.device != qi.device:
        raise ValueError(f"lengths must be an int32 array of shape ({B},) on GPU {qi.device}, "
                         f"got shape {li.shape} on GPU {li.device}")
    if not 1 <= nq <= MAX_QUERIES:
        raise ValueError(f"q holds {nq} query tokens per sequence; decode_attention takes 1..{MAX_QUERIES} "
                         f"(use attention() for prefill)")
    if not isinstance(length_offset, int):
        raise TypeError(f"length_offset must be an int, got {type(length_offset).__name__}")
    capacity = ki.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if out is None:
        out = arrays.empty(qi.kind, qi.device, qi.shape, qi.dtype)
    else:
        out = arrays.as_device_array(out, "out")
        oi = arrays.info(out, "out")
        if oi.shape != qi.shape or oi.dtype != qi.dtype or oi.device != qi.device:
            raise ValueError(f"out must be a {qi.dtype} array of shape {qi.shape} on GPU {qi.device}")
        arrays.check_last_contiguous(oi, "out")
    if B * H == 0:
        return out
    p = (qi.dtype, B, H, nq, capacity, D)
    plan = DECODE_ATTENTION.plan((qi.device,) + p)
    problem = dict(zip(FIELDS, p))
    stream = arrays.stream_for(qi.kind, qi.device)
    opart, mpart, lpart = _partials(qi.device, arrays.stream_handle(stream), problem, plan.config)
    ct.launch(stream, (B * H, _splits(problem, plan.config), 1), plan.kernel,
              _split_args(q, k_cache, v_cache, lengths, opart, mpart, lpart, scale, length_offset,
                          problem, plan.config))
    ct.launch(stream, (B * H, 1, 1), decode_merge_kernel,
              _merge_args(opart, mpart, lpart, out, problem, plan.config))
    return out


def decode_attention_reference(q, k_cache, v_cache, lengths, *, scale: float | None = None,
                               length_offset: int = 0) -> np.ndarray:
    """float64 NumPy decode attention: per sequence, attention over its first lengths[b] + offset keys."""
    q = np.asarray(q, np.float64)
    out = np.empty(q.shape)
    for b, n in enumerate(np.asarray(lengths) + length_offset):
        out[b] = attention_reference(q[b:b + 1], np.asarray(k_cache[b:b + 1])[:, :, :n],
                                     np.asarray(v_cache[b:b + 1])[:, :, :n], causal=True, scale=scale)[0]
    return out
