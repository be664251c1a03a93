"""Write new keys and values into a paged KV cache: token t of a flattened batch goes to the cache slot slots[t]
(block slots[t] // BLOCK, offset slots[t] % BLOCK), a negative slot meaning no write (a padded row).

The cache is a pool of blocks, (blocks, heads, BLOCK, D) for keys and the same for values: a block holds BLOCK
consecutive positions of one sequence, every head's (tilekit.engine.paged). An FP8 pool (uint8 e4m3 codes, one
fp32 scale per head for keys and one for values) gets each value divided by its head's scale, saturated to +-448
and rounded to e4m3, as write_kv and decode_attention write theirs."""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.attention import check_kv_scales
from tilekit.kernels.quantize_fp8 import fp8_bits, fp8_codes
from tilekit.kernels.tiles import sync_with_previous_kernel

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def paged_kv_write_kernel(K, V, Kc, Vc, KScale, VScale, Slots, TT: ct.Constant[int], D: ct.Constant[int],
                          FP8: ct.Constant[bool]):
    """Kc[s // BLOCK, h, s % BLOCK] = K[t, h] with s = Slots[t] >= 0, for TT tokens ct.bid(0) and head ct.bid(1);
    K, V: (T, H, D) rows (views of a fused QKV buffer); Kc, Vc: (blocks, H, BLOCK, D)."""
    sync_with_previous_kernel()
    tb = ct.bid(0)
    h = ct.bid(1)
    T = K.shape[0]
    block = Kc.shape[2]
    t = (ct.arange(TT, dtype=ct.int32) + tb * TT).reshape((TT, 1))
    slot = ct.load(Slots, (tb,), (TT,), padding_mode=ZERO).reshape((TT, 1))
    keep = (t < T) & (slot >= 0)
    cols = ct.arange(D, dtype=ct.int32).reshape((1, D))
    k = ct.load(K, (tb, h, 0), (TT, 1, D), padding_mode=ZERO).reshape((TT, D))
    v = ct.load(V, (tb, h, 0), (TT, 1, D), padding_mode=ZERO).reshape((TT, D))
    if FP8:
        k = fp8_bits(k.astype(ct.float32), ct.load(KScale, (h,), shape=()))
        v = fp8_bits(v.astype(ct.float32), ct.load(VScale, (h,), shape=()))
    ct.scatter(Kc, (slot // block, h, slot % block, cols), k, mask=keep)
    ct.scatter(Vc, (slot // block, h, slot % block, cols), v, mask=keep)


def _fits(c: dict, p: dict) -> bool:
    return c["TT"] <= max(1, pow2_ceil(p["T"]))


SPACE = SearchSpace(_fits, TT=(1, 2, 4, 8, 16, 32, 64), occupancy=(2, 4))


def default_config(p: dict) -> dict:
    return dict(TT=min(32, pow2_ceil(p["T"])), occupancy=4)


def token_rows(dtype: str, T: int, H: int, D: int, fused_heads: int | None = None) -> ArraySpec:
    """(T, H, D) heads of T tokens as a view of a fused [T, fused_heads, D] QKV buffer (fused_heads None: 3 H)."""
    row = (3 * H if fused_heads is None else fused_heads) * D
    return ArraySpec(dtype, (T, H, D), (row, D, 1))


def _arrays(p: dict) -> dict:
    T, H, D, dt, blocks, block = p["T"], p["H"], p["D"], p["dtype"], p["blocks"], p["block"]
    pool = "uint8" if p["fp8"] else dt
    scales = {n: ArraySpec("float32", (H,), fill=1) if p["fp8"] else absent("float32", 1)
              for n in ("k_scale", "v_scale")}
    return {"k": token_rows(dt, T, H, D), "v": token_rows(dt, T, H, D),
            "kc": ArraySpec(pool, (blocks, H, block, D), role="out"),
            "vc": ArraySpec(pool, (blocks, H, block, D), role="out"), **scales,
            "slots": ArraySpec("int32", (T,), values=tuple(range(T)))}      # distinct slots: one writer each


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["T"], c["TT"]), p["H"], 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TT"], pow2_ceil(p["D"]), bool(p["fp8"]))


def check_pool(pool, name: str, like, heads: int, D: int, codes: bool) -> None:
    """A paged pool (blocks, heads, BLOCK, D) of like's dtype (uint8 FP8 codes when `codes`) on like's GPU."""
    arrays.check_dtype(pool, name, ("uint8",) if codes else (like.dtype,))
    if len(pool.shape) != 4 or pool.shape[1] != heads or pool.shape[3] != D or pool.shape[2] < 1:
        raise ValueError(f"{name} must be a (blocks, {heads}, block, {D}) pool, got shape {pool.shape}")
    if pool.device != like.device:
        raise ValueError(f"{name} is on GPU {pool.device}, {like.dtype} inputs on GPU {like.device}")
    arrays.check_contiguous(pool, name)


def _bind(a: list, flags: tuple) -> Binding:
    k, v, k_pool, v_pool, slots, k_scale, v_scale = a
    fp8 = k_pool.dtype == "uint8"
    for x, name in ((k, "k"), (v, "v")):
        arrays.check_dtype(x, name, arrays.FLOAT_DTYPES)
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be (tokens, heads, head_dim), got shape {x.shape}")
        arrays.check_last_contiguous(x, name)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v must match k ({k.dtype} {k.shape}), got {v.dtype} {v.shape}")
    T, H, D = k.shape
    check_pool(k_pool, "k_pool", k, H, D, fp8)
    check_pool(v_pool, "v_pool", k, H, D, fp8)
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool must have k_pool's shape {k_pool.shape}, got {v_pool.shape}")
    arrays.check_dtype(slots, "slots", ("int32",))
    if slots.shape != (T,) or slots.device != k.device:
        raise ValueError(f"slots must be an int32 array of shape ({T},) on GPU {k.device}")
    views = {"k": (0, None), "v": (1, None), "kc": (2, None), "vc": (3, None), "slots": (4, None)}
    if fp8:
        check_kv_scales(k, k_scale, v_scale, H)
        views.update(k_scale=(5, None), v_scale=(6, None))
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with an FP8 (uint8) pool; k_pool has dtype {k_pool.dtype}")
    return Binding(problem=dict(dtype=k.dtype, T=T, H=H, D=D, fp8=int(fp8), blocks=k_pool.shape[0],
                                block=k_pool.shape[2]), arrays=views)


PAGED_WRITE_KV = Op(
    "paged_write_kv", args=("k", "v", "k_pool", "v_pool", "slots", "k_scale", "v_scale"),
    optional=("k_scale", "v_scale"),
    key=dict(dtype=None, T=pow2_bucket, H=None, D=None, fp8=None),
    extras=dict(blocks=lambda p: -(-p["T"] // 64) + 1, block=lambda p: 64),
    space=SPACE, default=default_config, arrays=_arrays,
    launches=(Launch(paged_kv_write_kernel, _grid, ("k", "v", "kc", "vc", "k_scale", "v_scale", "slots"), _constants,
                     dependent=False),),
    bind=_bind, choices=dict(fp8=(0, 1)), cli_defaults=dict(fp8=0))


def paged_write_kv(k, v, k_pool, v_pool, slots, *, k_scale=None, v_scale=None) -> None:
    """k_pool[s // BLOCK, :, s % BLOCK] = k[t] with s = slots[t] (skipped where negative), and likewise for v;
    k, v: (T, H, D) (rows may be views of a fused QKV buffer), pools (blocks, H, BLOCK, D), slots int32 (T,).
    An FP8 pool (uint8 e4m3 codes) takes k_scale, v_scale: float32 (H,), one scale per head."""
    PAGED_WRITE_KV((k, v, k_pool, v_pool, slots, k_scale, v_scale))


def paged_write_kv_reference(k, v, k_pool, v_pool, slots, *, k_scale=None, v_scale=None) -> tuple:
    """NumPy copies of the pools with the new keys and values written in (an FP8 pool: as uint8 codes)."""
    if k_scale is not None:        # fp8_codes takes (B, H, T, D): the tokens as T of one sequence
        k = fp8_codes(np.asarray(k).transpose(1, 0, 2)[None], k_scale)[0].transpose(1, 0, 2)
        v = fp8_codes(np.asarray(v).transpose(1, 0, 2)[None], v_scale)[0].transpose(1, 0, 2)
    kp, vp = np.array(k_pool), np.array(v_pool)
    if k_scale is None:
        kp, vp = kp.astype(np.float64), vp.astype(np.float64)
    block = kp.shape[2]
    for t, s in enumerate(np.asarray(slots)):
        if s >= 0:
            kp[s // block, :, s % block] = np.asarray(k)[t]
            vp[s // block, :, s % block] = np.asarray(v)[t]
    return kp, vp


if __name__ == "__main__":
    from tilekit.kernels.paged_write_kv import paged_write_kv, paged_write_kv_reference  # the package's op
    import cupy

    from tilekit.kernels.checks import host, rand
    T, H, D, blocks, block = 37, 4, 64, 9, 16
    qkv = rand((T, 3, H, D), "bfloat16")
    k, v = qkv[:, 1], qkv[:, 2]
    kp, vp = rand((blocks, H, block, D), "bfloat16"), rand((blocks, H, block, D), "bfloat16")
    slots = np.random.default_rng(0).permutation(blocks * block)[:T].astype(np.int32)
    slots[3] = -1
    ref_k, ref_v = paged_write_kv_reference(host(k), host(v), host(kp), host(vp), slots)
    paged_write_kv(k, v, kp, vp, cupy.asarray(slots))
    assert np.array_equal(host(kp), ref_k) and np.array_equal(host(vp), ref_v), "paged_write_kv differs"
    print("paged_write_kv: ok, exact")
