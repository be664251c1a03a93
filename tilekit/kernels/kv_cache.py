"""Write new keys and values straight into a KV cache at per-sequence offsets held on the device."""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune.compile import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import BenchCase, TunableOp
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels import arrays
from tilekit.kernels.attention import check_qkv


@ct.kernel
def kv_write_kernel(K, V, Kc, Vc, Start, TT: ct.Constant[int], D: ct.Constant[int]):
    """Kc[b, h, Start[b] + t] = K[b, h, t] (and V likewise); positions past the capacity are dropped."""
    tb = ct.bid(0)
    bh = ct.bid(1)
    H = K.shape[1]
    b = bh // H
    h = bh % H
    T = K.shape[2]
    t = (ct.arange(TT, dtype=ct.int32) + tb * TT).reshape((TT, 1))
    rows = t + ct.load(Start, (b,), shape=())
    cols = ct.arange(D, dtype=ct.int32).reshape((1, D))
    keep = t < T
    k = ct.load(K, (b, h, tb, 0), (1, 1, TT, D), padding_mode=ct.PaddingMode.ZERO).reshape((TT, D))
    v = ct.load(V, (b, h, tb, 0), (1, 1, TT, D), padding_mode=ct.PaddingMode.ZERO).reshape((TT, D))
    ct.scatter(Kc, (b, h, rows, cols), k, mask=keep)
    ct.scatter(Vc, (b, h, rows, cols), v, mask=keep)


def _fits(c: dict, p: dict) -> bool:
    return c["TT"] <= max(1, pow2_ceil(p["T"]))


SPACE = SearchSpace(_fits, TT=(1, 2, 4, 8, 16, 32, 64), occupancy=(2, 4))
FIELDS = ("dtype", "B", "H", "T", "capacity", "D")


def default_config(p: dict) -> dict:
    return dict(TT=min(32, pow2_ceil(p["T"])), occupancy=4)


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["T"], c["TT"]), p["B"] * p["H"], 1)


def _kernel_args(k, v, kc, vc, start, p: dict, c: dict) -> tuple:
    return (k, v, kc, vc, start, c["TT"], pow2_ceil(p["D"]))


def _signature(p: dict, c: dict):
    B, H, T, cap, D = p["B"], p["H"], p["T"], p["capacity"], p["D"]
    row = 3 * H * D
    k = ArraySpec(p["dtype"], (B, H, T, D), (T * row, D, row, 1))
    cache = ArraySpec(p["dtype"], (B, H, cap, D))
    return [(kv_write_kernel, _kernel_args(k, k, cache, cache, ArraySpec("int32", (B,)), p, c))]


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    rng = cupy.random.default_rng()
    B, H, T, cap, D = p["B"], p["H"], p["T"], p["capacity"], p["D"]
    qkv = arrays.random_array((B, T, 3, H, D), p["dtype"], dev, rng)
    k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in (1, 2))
    kc = arrays.empty("cupy", dev, (B, H, cap, D), p["dtype"])
    vc = arrays.empty("cupy", dev, (B, H, cap, D), p["dtype"])
    start = cupy.zeros((B,), dtype=cupy.int32)
    return BenchCase(grid=lambda c: _grid(p, c), args=lambda c: _kernel_args(k, v, kc, vc, start, p, c))


KV_WRITE = TunableOp("kv_write", kernel=kv_write_kernel, fields=FIELDS, space=SPACE, default=default_config,
                     buckets={"T": pow2_bucket, "capacity": pow2_bucket}, bench=_bench, signature=_signature)


def write_kv(k, v, k_cache, v_cache, start) -> None:
    """k_cache[b, :, start[b] + t] = k[b, :, t] and likewise for v; k, v: (B, H, T, D), start: int32 (B,)."""
    k, v, k_cache, v_cache, start = (arrays.as_device_array(a, n) for a, n in (
        (k, "k"), (v, "v"), (k_cache, "k_cache"), (v_cache, "v_cache"), (start, "start")))
    ki, _, _ = check_qkv(k, v, v, ("k", "v", "v"))
    ci, _, _ = check_qkv(k_cache, v_cache, v_cache, ("k_cache", "v_cache", "v_cache"))
    arrays.check_same("k", ki, "k_cache", ci)
    if ci.shape[:2] != ki.shape[:2] or ci.shape[3] != ki.shape[3]:
        raise ValueError(f"k_cache shape {ci.shape} does not fit k shape {ki.shape}")
    si = arrays.info(start, "start")
    arrays.check_dtype(si, "start", ("int32",))
    B, H, T, D = ki.shape
    if si.shape != (B,) or si.device != ki.device:
        raise ValueError(f"start must be an int32 array of shape ({B},) on GPU {ki.device}")
    if B * H * T == 0:
        return
    p = (ki.dtype, B, H, T, ci.shape[2], D)
    plan = KV_WRITE.plan((ki.device,) + p)
    problem = dict(zip(FIELDS, p))
    ct.launch(arrays.stream_for(ki.kind, ki.device), _grid(problem, plan.config), plan.kernel,
              _kernel_args(k, v, k_cache, v_cache, start, problem, plan.config))


def write_kv_reference(k, v, k_cache, v_cache, start) -> tuple[np.ndarray, np.ndarray]:
    """NumPy copy of the caches with the new keys and values written in."""
    kc, vc = np.array(k_cache, np.float64), np.array(v_cache, np.float64)
    for b, s in enumerate(np.asarray(start)):
        n = max(0, min(k.shape[2], kc.shape[2] - s))
        kc[b, :, s:s + n] = np.asarray(k, np.float64)[b, :, :n]
        vc[b, :, s:s + n] = np.asarray(v, np.float64)[b, :, :n]
    return kc, vc
