"""Write new keys and values straight into a KV cache at per-sequence offsets held on the device.

An FP8 cache (uint8 e4m3 codes, one fp32 scale per head for keys and one for values) gets each value divided
by its head's scale, saturated to +-448 and rounded to e4m3, as decode_attention writes its new tokens."""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.attention import check_kv_scales, check_qkv, qkv_views
from tilekit.kernels.quantize_fp8 import fp8_bits, fp8_codes
from tilekit.kernels.tiles import batch_head, sync_with_previous_kernel


@ct.kernel
def kv_write_kernel(K, V, Kc, Vc, KScale, VScale, Start, TT: ct.Constant[int], D: ct.Constant[int],
                    FP8: ct.Constant[bool]):
    """Kc[b, h, Start[b] + t] = K[b, h, t] (and V likewise); positions past the capacity are dropped.
    With FP8 the caches hold e4m3 codes of K / KScale[h], V / VScale[h]."""
    sync_with_previous_kernel()
    tb = ct.bid(0)
    b, h = batch_head(ct.bid(1), K.shape[1])
    T = K.shape[2]
    t = (ct.arange(TT, dtype=ct.int32) + tb * TT).reshape((TT, 1))
    rows = t + ct.load(Start, (b,), shape=())
    cols = ct.arange(D, dtype=ct.int32).reshape((1, D))
    keep = t < T
    k = ct.load(K, (b, h, tb, 0), (1, 1, TT, D), padding_mode=ct.PaddingMode.ZERO).reshape((TT, D))
    v = ct.load(V, (b, h, tb, 0), (1, 1, TT, D), padding_mode=ct.PaddingMode.ZERO).reshape((TT, D))
    if FP8:
        k = fp8_bits(k.astype(ct.float32), ct.load(KScale, (h,), shape=()))
        v = fp8_bits(v.astype(ct.float32), ct.load(VScale, (h,), shape=()))
    ct.scatter(Kc, (b, h, rows, cols), k, mask=keep)
    ct.scatter(Vc, (b, h, rows, cols), v, mask=keep)


def _fits(c: dict, p: dict) -> bool:
    return c["TT"] <= max(1, pow2_ceil(p["T"]))


SPACE = SearchSpace(_fits, TT=(1, 2, 4, 8, 16, 32, 64), occupancy=(2, 4))


def default_config(p: dict) -> dict:
    return dict(TT=min(32, pow2_ceil(p["T"])), occupancy=4)


def _arrays(p: dict) -> dict:
    B, H, T, cap, D, dt = p["B"], p["H"], p["T"], p["capacity"], p["D"], p["dtype"]
    cache = "uint8" if p["fp8"] else dt
    scales = {n: ArraySpec("float32", (H,), fill=1) if p["fp8"] else absent("float32", 1)
              for n in ("k_scale", "v_scale")}
    return {"k": qkv_views(dt, B, H, T, D), "v": qkv_views(dt, B, H, T, D),
            "kc": ArraySpec(cache, (B, H, cap, D), role="out"), "vc": ArraySpec(cache, (B, H, cap, D), role="out"),
            **scales, "start": ArraySpec("int32", (B,), fill=0)}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["T"], c["TT"]), p["B"] * p["H"], 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TT"], pow2_ceil(p["D"]), bool(p["fp8"]))


def _bind(a: list, flags: tuple) -> Binding:
    k, v, k_cache, v_cache, start, k_scale, v_scale = a
    fp8 = k_cache.dtype == "uint8"
    check_qkv(k, v, v, ("k", "v", "v"))
    check_qkv(k, k_cache, v_cache, ("k", "k_cache", "v_cache"), codes=fp8)
    if k_cache.shape[:2] != k.shape[:2]:
        raise ValueError(f"k_cache shape {k_cache.shape} does not fit k shape {k.shape}")
    arrays.check_dtype(start, "start", ("int32",))
    B, H, T, D = k.shape
    if start.shape != (B,) or start.device != k.device:
        raise ValueError(f"start must be an int32 array of shape ({B},) on GPU {k.device}")
    views = {"k": (0, None), "v": (1, None), "kc": (2, None), "vc": (3, None), "start": (4, None)}
    if fp8:
        check_kv_scales(k, k_scale, v_scale, H)
        views.update(k_scale=(5, None), v_scale=(6, None))
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale and v_scale go with an FP8 (uint8) cache; k_cache has dtype {k_cache.dtype}")
    return Binding(problem=dict(dtype=k.dtype, B=B, H=H, T=T, D=D, capacity=k_cache.shape[2], fp8=int(fp8)),
                   arrays=views)


WRITE_KV = Op(
    "write_kv", args=("k", "v", "k_cache", "v_cache", "start", "k_scale", "v_scale"), optional=("k_scale", "v_scale"),
    key=dict(dtype=None, B=None, H=None, T=pow2_bucket, D=None, fp8=None),
    extras=dict(capacity=lambda p: -(-p["T"] // 64) * 64),
    space=SPACE, default=default_config, arrays=_arrays,
    # Not a dependent launch: one ordinary launch per layer keeps early-launched kernels from queueing
    # several deep (measured on decode steps when this op wrote their cache: H200 gpt2-xl 2.81 ms with every
    # launch dependent against 2.13 with this one ordinary); prefill keeps it so. Decode attention now
    # writes the decode step's cache and plays this part there.
    launches=(Launch(kv_write_kernel, _grid, ("k", "v", "kc", "vc", "k_scale", "v_scale", "start"), _constants,
                     dependent=False),),
    bind=_bind, choices=dict(fp8=(0, 1)), cli_defaults=dict(fp8=0))


def write_kv(k, v, k_cache, v_cache, start, *, k_scale=None, v_scale=None) -> None:
    """k_cache[b, :, start[b] + t] = k[b, :, t] and likewise for v; k, v: (B, H, T, D), start: int32 (B,).
    An FP8 cache (uint8 e4m3 codes) takes k_scale, v_scale: float32 (H,), one scale per head."""
    WRITE_KV((k, v, k_cache, v_cache, start, k_scale, v_scale))


def write_kv_reference(k, v, k_cache, v_cache, start, *, k_scale=None, v_scale=None) -> tuple[np.ndarray, np.ndarray]:
    """NumPy copy of the caches with the new keys and values written in (an FP8 cache: as uint8 codes)."""
    if k_scale is not None:
        k, v = fp8_codes(k, k_scale), fp8_codes(v, v_scale)
    kc, vc = np.array(k_cache), np.array(v_cache)
    kc, vc = (kc, vc) if k_scale is not None else (kc.astype(np.float64), vc.astype(np.float64))
    for b, s in enumerate(np.asarray(start)):
        n = max(0, min(k.shape[2], kc.shape[2] - s))
        kc[b, :, s:s + n] = np.asarray(k)[b, :, :n]
        vc[b, :, s:s + n] = np.asarray(v)[b, :, :n]
    return kc, vc


if __name__ == "__main__":
    from tilekit.kernels.write_kv import write_kv, write_kv_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import host, rand
    B, H, T, cap, D = 3, 2, 5, 9, 64
    qkv = rand((B, T, 3, H, D), "bfloat16")
    k, v = qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)
    kc, vc = rand((B, H, cap, D), "bfloat16"), rand((B, H, cap, D), "bfloat16")
    start = np.array([0, 2, 6], np.int32)      # the last one runs past the capacity: clipped
    ref_k, ref_v = write_kv_reference(host(k), host(v), host(kc), host(vc), start)
    write_kv(k, v, kc, vc, cupy.asarray(start))
    assert np.array_equal(host(kc), ref_k) and np.array_equal(host(vc), ref_v), "write_kv differs"
    print("write_kv: ok, exact")
