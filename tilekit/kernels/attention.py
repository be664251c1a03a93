"""Flash attention for prefill: online softmax over key tiles, never materialising T x T.

Grid: (query tiles, batch x heads). Each program keeps its BM queries in registers and walks
the key/value tiles up to the causal limit; tiles wholly below the diagonal skip the mask.
With fewer key/value heads than query heads (grouped-query attention, Llama), query head h
reads key/value head h // (H / Hkv). q, k, v may be strided views (for example slices of a fused QKV projection) as long as the
head dimension is contiguous, so GPT-2's c_attn output is read in place.
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
from tilekit.kernels.tiles import batch_head, sync_with_previous_kernel, tensor_mma

ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


@ct.function
def prefill_softmax_step(s, m_i, l_i, acc, v, qk_scale):
    """Fold one tile of raw scores s[BM, BN] and values v[BN, D] into (m, l, acc): the row max is taken before
    scaling, and the scale and the max's subtraction fuse into the exp2's argument. No -inf guard: every query sees
    key 0, so every row's max is finite from the first key tile on."""
    m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True) * qk_scale)
    p = ct.exp2(s * qk_scale - m_new, flush_to_zero=True)
    alpha = ct.exp2(m_i - m_new, flush_to_zero=True)
    l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
    acc = tensor_mma(p.astype(v.dtype), v, acc * alpha)
    return m_new, l_i, acc


@ct.kernel
def attention_kernel(Q, K, V, O, qk_scale: float, BM: ct.Constant[int], BN: ct.Constant[int],
                     D: ct.Constant[int], CAUSAL: ct.Constant[bool], LONGEST_FIRST: ct.Constant[bool]):
    """O = softmax(Q K^T * scale [+ causal mask]) V on (B, H, T, D) queries and (B, Hkv, T, D) keys and
    values; queries are the last Tq keys.

    The grid is (query tiles, batch x heads), or with LONGEST_FIRST (batch x heads, query tiles) walked
    from the last query tile down: blocks start in grid order, so the causal programs with the most
    key tiles start first and the short ones fill the last round instead of idling SMs."""
    sync_with_previous_kernel()
    if LONGEST_FIRST:
        pid_m = ct.num_blocks(1) - 1 - ct.bid(1)
        b, h = batch_head(ct.bid(0), Q.shape[1])
    else:
        pid_m = ct.bid(0)
        b, h = batch_head(ct.bid(1), Q.shape[1])
    hk = h // (Q.shape[1] // K.shape[1])
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
        k = ct.load(K, (b, hk, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
        v = ct.load(V, (b, hk, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
        s = tensor_mma(q, k, ct.zeros((BM, BN), dtype=ct.float32))
        m_i, l_i, acc = prefill_softmax_step(s, m_i, l_i, acc, v, qk_scale)
    for j in range(n_full, ct.cdiv(kv_end, BN)):
        k = ct.load(K, (b, hk, 0, j), (1, 1, D, BN), order=(0, 1, 3, 2), padding_mode=ZERO).reshape((D, BN))
        v = ct.load(V, (b, hk, j, 0), (1, 1, BN, D), padding_mode=ZERO).reshape((BN, D))
        s = tensor_mma(q, k, ct.zeros((BM, BN), dtype=ct.float32))
        k_pos = (ct.arange(BN, dtype=ct.int32) + j * BN).reshape((1, BN))
        visible = k_pos < Tk
        if CAUSAL:
            visible = visible & (k_pos <= q_pos)
        s = ct.where(visible, s, -math.inf)
        m_i, l_i, acc = prefill_softmax_step(s, m_i, l_i, acc, v, qk_scale)
    out = ct.truediv(acc, l_i, flush_to_zero=True, rounding_mode=ct.RoundingMode.APPROX)
    ct.store(O, (b, h, pid_m, 0), out.astype(O.dtype).reshape((1, 1, BM, D)))


def _fits(c: dict, p: dict) -> bool:
    t = pow2_ceil(p["Tq"])
    d = pow2_ceil(p["D"])
    return (c["BM"] <= max(64, t) and c["BN"] <= max(32, pow2_ceil(p["Tk"]))
            and c["BM"] * d <= 128 * 128 and c["BN"] * d <= 128 * 128
            and (c["occupancy"] <= 2 or c["BM"] == 64))       # 3-4 resident programs only with small tiles


SPACE = SearchSpace(_fits, BM=(64, 128, 256), BN=(32, 64, 128), LONGEST_FIRST=(0, 1), occupancy=(1, 2, 3, 4))


def default_config(p: dict) -> dict:
    """64 x 128 tiles, two programs per SM, at head_dim 64 and 128 alike (untuned head_dim 128, B4 H16
    T2048: 0.58x of cuDNN at one program per SM, 0.85x (H100) and 0.95x (H200) at two;
    docs/results/linear-default-h100.txt)."""
    if p["dtype"] == "float32":   # three tf32 products (tensor_mma), operands split in registers: 64x64 spills none
        return dict(BM=64, BN=64, LONGEST_FIRST=int(bool(p["causal"])), occupancy=2)   # (64x32 184 B, sm_90)
    return dict(BM=64, BN=128 if p["Tk"] >= 128 else 64, LONGEST_FIRST=int(bool(p["causal"])), occupancy=2)


def qkv_views(dtype: str, B: int, H: int, T: int, D: int, offset: int = 0, fused_heads: int | None = None
              ) -> ArraySpec:
    """(B, H, T, D) heads as views into a fused [B, T, fused_heads, D] QKV buffer (GPT-2's [B, T, 3, H, D]
    when fused_heads is None; Llama's query, key and value heads side by side); `offset` leading
    positions of that buffer's T + offset are skipped."""
    row = (3 * H if fused_heads is None else fused_heads) * D
    return ArraySpec(dtype, (B, H, T, D), ((T + offset) * row, D, row, 1))


def heads_out(dtype: str, B: int, H: int, T: int, D: int) -> ArraySpec:
    """(B, H, T, D) output heads as a view of a [B, T, H, D] buffer (the next linear's input)."""
    return ArraySpec(dtype, (B, H, T, D), (T * H * D, D, H * D, 1), role="out")


def _arrays(p: dict) -> dict:
    B, H, Hkv, Tq, Tk, D, dt = p["B"], p["H"], p["Hkv"], p["Tq"], p["Tk"], p["D"], p["dtype"]
    fused = H + 2 * Hkv
    return {"q": qkv_views(dt, B, H, Tq, D, Tk - Tq, fused), "k": qkv_views(dt, B, Hkv, Tk, D, 0, fused),
            "v": qkv_views(dt, B, Hkv, Tk, D, 0, fused), "o": heads_out(dt, B, H, Tq, D)}


def _grid(p: dict, c: dict) -> tuple:
    tiles, heads = ct.cdiv(p["Tq"], c["BM"]), p["B"] * p["H"]
    return (heads, tiles, 1) if c["LONGEST_FIRST"] else (tiles, heads, 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["BM"], c["BN"], pow2_ceil(p["D"]), bool(p["causal"]), bool(c["LONGEST_FIRST"]))


def check_qkv(q, k, v, names=("q", "k", "v"), codes: bool = False) -> None:
    """Validate (B, H, T, D) query and (B, Hkv, T, D) key/value Infos: same batch and head_dim, Hkv
    dividing H; v like k; k and v of q's dtype, or with `codes` FP8 e4m3 bits (uint8)."""
    for name, a in zip(names, (q, k, v)):
        if len(a.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, time, head_dim), got shape {a.shape}")
        arrays.check_last_contiguous(a, name)
    arrays.check_dtype(q, names[0], arrays.FLOAT_DTYPES)
    arrays.check_same(names[0], q, names[1], k, dtype=not codes)
    arrays.check_same(names[0], q, names[2], v, dtype=not codes)
    if codes:
        arrays.check_dtype(k, names[1], ("uint8",))
        arrays.check_dtype(v, names[2], ("uint8",))
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or not 1 <= k.shape[1] <= q.shape[1] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"{names[1]} shape {k.shape} does not match {names[0]} shape {q.shape}: batch and "
                         f"head_dim must be equal and its heads must divide {names[0]}'s")
    if v.shape != k.shape:
        raise ValueError(f"{names[2]} shape {v.shape} must equal {names[1]} shape {k.shape}")
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {q.shape[3]} is not supported (1..{MAX_HEAD_DIM})")


def check_kv_scales(like, k_scale, v_scale, heads: int) -> None:
    """An FP8 KV cache's per-head scales: float32 (heads,), contiguous, on `like`'s device."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise TypeError(f"an FP8 (uint8) cache needs {name}: float32 ({heads},), one scale per key/value head")
        arrays.check_dtype(scale, name, ("float32",))
        arrays.check_same("the cache", like, name, scale, dtype=False)
        if scale.shape != (heads,) or scale.strides != (1,):
            raise ValueError(f"{name} must be a contiguous float32 array of shape ({heads},), got shape "
                             f"{scale.shape}, strides {scale.strides}")


def check_heads_out(out, q) -> None:
    """A caller's (B, H, Tq, D) output: q's shape, dtype, kind and device, contiguous head_dim."""
    arrays.check_out(out, "out", q, q.shape, contiguous=False)


def _bind(a: list, flags: tuple) -> Binding:
    q, k, v, out = a
    (causal,) = flags
    check_qkv(q, k, v)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if Tk < Tq:
        raise ValueError(f"k has {Tk} positions, fewer than q's {Tq}")
    if out is not None:
        check_heads_out(out, q)
    return Binding(problem=dict(dtype=q.dtype, B=B, H=H, Hkv=k.shape[1], Tq=Tq, Tk=Tk, D=D,
                                causal=int(bool(causal))),
                   arrays={"q": (0, None), "k": (1, None), "v": (2, None), "o": (3, None)},
                   output=(3, arrays.allocator(q.kind, q.device, (B, Tq, H, D), q.dtype, (0, 2, 1, 3))),
                   returns=3, scalars={"qk_scale": (0, LOG2E / math.sqrt(D))})


ATTENTION = Op(
    "attention", args=("q", "k", "v", "out"), optional=("out",),
    key=dict(dtype=None, B=None, H=None, Hkv=None, Tq=pow2_bucket, Tk=pow2_bucket, D=None, causal=None),
    space=SPACE, default=default_config, arrays=_arrays,
    scalars=lambda p: {"qk_scale": LOG2E / math.sqrt(p["D"])},
    launches=(Launch(attention_kernel, _grid, ("q", "k", "v", "o", "qk_scale"), _constants),),
    bind=_bind, choices=dict(causal=(0, 1)), cli_defaults=dict(causal=1))


def attention(q, k, v, *, causal: bool = True, scale: float | None = None, out=None):
    """softmax(q k^T * scale) v for (B, H, T, D) queries and (B, Hkv, T, D) keys and values (Hkv
    dividing H: query head h reads key/value head h // (H / Hkv)); causal masks keys after each query.

    k and v may be longer than q (Tk >= Tq): the queries are then the last Tq positions. out, if
    given, is a (B, H, Tq, D) array (any strides with a contiguous last dimension).
    """
    return ATTENTION((q, k, v, out), (bool(causal),),
                     (None if scale is None else arrays.checked_positive(scale, "scale") * LOG2E,))


def attention_reference(q, k, v, *, causal: bool = True, scale: float | None = None) -> np.ndarray:
    """float64 NumPy attention on (B, H, T, D) queries and (B, Hkv, T, D) keys and values (query head h
    reads key/value head h // (H / Hkv)); with Tq < Tk the queries are the last Tq positions."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3] if q.ndim == 4 else 1
    k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        allowed = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)
        s = np.where(allowed, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(-1, keepdims=True)) @ v


if __name__ == "__main__":
    from tilekit.kernels.attention import attention, attention_reference  # the package's op, not this script's copy
    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    for B, H, Hkv, T, D, dtype, causal in [(2, 3, 3, 300, 64, "bfloat16", True), (1, 2, 2, 77, 128, "float16", False),
                                           (1, 2, 2, 33, 64, "float32", True), (2, 8, 2, 200, 64, "bfloat16", True)]:
        qkv = rand((B, T, H + 2 * Hkv, D), dtype).transpose(0, 2, 1, 3)
        q, k, v = qkv[:, :H], qkv[:, H:H + Hkv], qkv[:, H + Hkv:]
        out = attention(q, k, v, causal=causal, out=poisoned((B, T, H, D), dtype).transpose(0, 2, 1, 3))
        err = assert_close(host(out), attention_reference(host(q), host(k), host(v), causal=causal),
                           TOL[dtype], f"attention {B, H, T, D} {dtype}")
        print(f"attention B{B} H{H} Hkv{Hkv} T{T} D{D} {dtype} causal={causal}: ok, relative error {err:.2e}")
