"""Flash attention for prefill: online softmax over key tiles, never materialising T x T.

Grid: (query tiles, batch x heads). Each program keeps its BM queries in registers and walks
the key/value tiles up to the causal limit; tiles wholly below the diagonal skip the mask.
q, k, v may be strided views (for example slices of a fused QKV projection) as long as the
head dimension is contiguous, so GPT-2's c_attn output is read in place.
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

ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


@ct.function
def online_softmax_step(s, m_i, l_i, acc, v):
    """Fold one tile of log2-scaled scores s[BM, BN] and values v[BN, D] into (m, l, acc)."""
    m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True))
    m_safe = ct.where(m_new == -math.inf, 0.0, m_new)   # rows with nothing visible yet stay at 0
    p = ct.exp2(s - m_safe)
    alpha = ct.exp2(m_i - m_safe)
    l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
    acc = ct.mma(p.astype(v.dtype), v, acc * alpha)
    return m_new, l_i, acc


@ct.kernel
def attention_kernel(Q, K, V, O, qk_scale: float, BM: ct.Constant[int], BN: ct.Constant[int],
                     D: ct.Constant[int], CAUSAL: ct.Constant[bool]):
    """O = softmax(Q K^T * scale [+ causal mask]) V on (B, H, T, D) arrays; queries are the last Tq keys."""
    pid_m = ct.bid(0)
    bh = ct.bid(1)
    H = Q.shape[1]
    b = bh // H
    h = bh % H
    Tq = Q.shape[2]
    Tk = K.shape[2]
    offset = Tk - Tq
    q = ct.load(Q, (b, h, pid_m, 0), (1, 1, BM, D), padding_mode=ZERO).reshape((BM, D))
    q_pos = (ct.arange(BM, dtype=ct.int32) + (pid_m * BM + offset)).reshape((BM, 1))
    m_i = ct.full((BM, 1), -math.inf, dtype=ct.float32)
    l_i = ct.zeros((BM, 1), dtype=ct.float32)
    acc = ct.zeros((BM, D), dtype=ct.float32)
    if CAUSAL:
        kv_end = ct.minimum(Tk, (pid_m + 1) * BM + offset)
        n_full = ct.minimum(pid_m * BM + offset + 1, Tk) // BN
    else:
        kv_end = Tk
        n_full = Tk // BN
    for j in range(n_full):
        k = ct.load(K, (b, h, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
        v = ct.load(V, (b, h, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
        s = ct.mma(q, k, ct.zeros((BM, BN), dtype=ct.float32)) * qk_scale
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v)
    for j in range(n_full, ct.cdiv(kv_end, BN)):
        k = ct.load(K, (b, h, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
        v = ct.load(V, (b, h, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
        s = ct.mma(q, k, ct.zeros((BM, BN), dtype=ct.float32)) * qk_scale
        k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((1, BN))
        visible = k_pos < Tk
        if CAUSAL:
            visible = visible & (k_pos <= q_pos)
        s = ct.where(visible, s, -math.inf)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v)
    out = acc / l_i
    ct.store(O, (b, h, pid_m, 0), out.astype(O.dtype).reshape((1, 1, BM, D)))


def _fits(c: dict, p: dict) -> bool:
    t = pow2_ceil(p["Tq"])
    d = pow2_ceil(p["D"])
    return (c["BM"] <= max(64, t) and c["BN"] <= max(32, pow2_ceil(p["Tk"]))
            and c["BM"] * d <= 128 * 128 and c["BN"] * d <= 128 * 128)


SPACE = SearchSpace(_fits, BM=(64, 128, 256), BN=(32, 64, 128), occupancy=(1, 2))
FIELDS = ("dtype", "B", "H", "Tq", "Tk", "D", "causal")


def default_config(p: dict) -> dict:
    return dict(BM=64, BN=128 if p["Tk"] >= 128 else 64, occupancy=2 if pow2_ceil(p["D"]) <= 64 else 1)


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["Tq"], c["BM"]), p["B"] * p["H"], 1)


def _kernel_args(q, k, v, o, scale: float, p: dict, c: dict) -> tuple:
    return (q, k, v, o, float(scale * LOG2E), c["BM"], c["BN"], pow2_ceil(p["D"]), bool(p["causal"]))


def _qkv_specs(p: dict) -> tuple:
    """q, k, v, o as views into one fused [B, T, 3, H, D] QKV buffer, as GPT-2 produces them."""
    B, H, Tq, Tk, D = p["B"], p["H"], p["Tq"], p["Tk"], p["D"]
    row = 3 * H * D
    k = ArraySpec(p["dtype"], (B, H, Tk, D), (Tk * row, D, row, 1))
    q = ArraySpec(p["dtype"], (B, H, Tq, D), (Tq * row, D, row, 1))
    o = ArraySpec(p["dtype"], (B, H, Tq, D), (Tq * H * D, D, H * D, 1))
    return q, k, k, o


def _signature(p: dict, c: dict):
    q, k, v, o = _qkv_specs(p)
    return [(attention_kernel, _kernel_args(q, k, v, o, 1.0, p, c))]


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    B, H, Tq, Tk, D = p["B"], p["H"], p["Tq"], p["Tk"], p["D"]
    qkv = arrays.random_array((B, Tk, 3, H, D), p["dtype"], dev, cupy.random.default_rng())
    q = qkv[:, Tk - Tq:, 0].transpose(0, 2, 1, 3)
    k = qkv[:, :, 1].transpose(0, 2, 1, 3)
    v = qkv[:, :, 2].transpose(0, 2, 1, 3)
    o = arrays.empty("cupy", dev, (B, Tq, H, D), p["dtype"]).transpose(0, 2, 1, 3)
    scale = 1 / math.sqrt(D)
    return BenchCase(grid=lambda c: _grid(p, c), args=lambda c: _kernel_args(q, k, v, o, scale, p, c))


ATTENTION = TunableOp("attention", kernel=attention_kernel, fields=FIELDS, space=SPACE,
                      default=default_config, buckets={"Tq": pow2_bucket, "Tk": pow2_bucket},
                      bench=_bench, signature=_signature, source_of=(online_softmax_step,),
                      field_defaults=dict(causal=1))


def check_qkv(q, k, v, names=("q", "k", "v")):
    """Validate (B, H, T, D) query/key/value arrays; returns their Infos."""
    infos = []
    for name, a in zip(names, (q, k, v)):
        i = arrays.info(a, name)
        if len(i.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, time, head_dim), got shape {i.shape}")
        arrays.check_last_contiguous(i, name)
        infos.append(i)
    qi, ki, vi = infos
    arrays.check_dtype(qi, names[0], arrays.FLOAT_DTYPES)
    arrays.check_same(names[0], qi, names[1], ki)
    arrays.check_same(names[0], qi, names[2], vi)
    if ki.shape[:2] != qi.shape[:2] or ki.shape[3] != qi.shape[3]:
        raise ValueError(f"{names[1]} shape {ki.shape} does not match {names[0]} shape {qi.shape} "
                         f"in batch, heads or head_dim")
    if vi.shape != ki.shape:
        raise ValueError(f"{names[2]} shape {vi.shape} must equal {names[1]} shape {ki.shape}")
    D = qi.shape[3]
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} is not supported (1..{MAX_HEAD_DIM})")
    return qi, ki, vi


def attention(q, k, v, *, causal: bool = True, scale: float | None = None, out=None):
    """softmax(q k^T * scale) v for (B, H, T, D) arrays; causal masks keys after each query.

    k and v may be longer than q (Tk >= Tq): the queries are then the last Tq positions. out, if
    given, is a (B, H, Tq, D) array (any strides with a contiguous last dimension).
    """
    q, k, v = (arrays.as_device_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    qi, ki, _ = check_qkv(q, k, v)
    B, H, Tq, D = qi.shape
    Tk = ki.shape[2]
    if Tk < Tq:
        raise ValueError(f"k has {Tk} positions, fewer than q's {Tq}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if out is None:
        out = arrays.empty(qi.kind, qi.device, (B, Tq, H, D), qi.dtype).transpose(1, 2) \
            if qi.kind == "torch" else arrays.empty(qi.kind, qi.device, (B, Tq, H, D), qi.dtype).transpose(0, 2, 1, 3)
    else:
        out = arrays.as_device_array(out, "out")
        oi = arrays.info(out, "out")
        if oi.shape != qi.shape or oi.dtype != qi.dtype or oi.device != qi.device:
            raise ValueError(f"out must be a {qi.dtype} array of shape {qi.shape} on GPU {qi.device}")
        arrays.check_last_contiguous(oi, "out")
    if B * H * Tq == 0 or Tk == 0:
        return out
    p = (qi.dtype, B, H, Tq, Tk, D, int(causal))
    plan = ATTENTION.plan((qi.device,) + p)
    problem = dict(zip(FIELDS, p))
    ct.launch(arrays.stream_for(qi.kind, qi.device), _grid(problem, plan.config), plan.kernel,
              _kernel_args(q, k, v, out, scale, problem, plan.config))
    return out


def attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """float64 NumPy attention on (B, H, T, D); with Tq < Tk the queries are the last Tq positions."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        allowed = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)
        s = np.where(allowed, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v
