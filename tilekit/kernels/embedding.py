"""Token plus position embedding: out[i] = wte[ids[i]] + wpe[positions[i]], one gather-add pass."""

from __future__ import annotations

import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune.compile import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import BenchCase, TunableOp
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels import arrays


@ct.kernel
def embedding_kernel(Ids, Pos, Wte, Wpe, Out, TM: ct.Constant[int], TC: ct.Constant[int]):
    """Rows TM*bid(0).. of Out[M, C], columns TC*bid(1).. ; out-of-range ids read as zero rows."""
    pid = ct.bid(0)
    cblk = ct.bid(1)
    ids = ct.load(Ids, (pid,), (TM,), padding_mode=ct.PaddingMode.ZERO).reshape((TM, 1))
    pos = ct.load(Pos, (pid,), (TM,), padding_mode=ct.PaddingMode.ZERO).reshape((TM, 1))
    cols = (ct.arange(TC, dtype=ct.int32) + cblk * TC).reshape((1, TC))
    tok = ct.gather(Wte, (ids, cols)).astype(ct.float32)
    where = ct.gather(Wpe, (pos, cols)).astype(ct.float32)
    ct.store(Out, (pid, cblk), (tok + where).astype(Out.dtype))


def _fits(c: dict, p: dict) -> bool:
    c_pow2 = pow2_ceil(p["C"])
    return (min(256, c_pow2) <= c["TC"] <= max(64, c_pow2) and c["TM"] <= max(1, pow2_ceil(p["M"]))
            and c["TM"] * c["TC"] <= 16384)


SPACE = SearchSpace(_fits, TM=(1, 2, 4), TC=(64, 128, 256, 512, 1024, 2048), occupancy=(2, 4))
FIELDS = ("dtype", "ids", "M", "C", "V", "P")


def default_config(p: dict) -> dict:
    return dict(TM=min(4, pow2_ceil(p["M"])), TC=min(1024, max(64, pow2_ceil(p["C"]))), occupancy=4)


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), ct.cdiv(p["C"], c["TC"]), 1)


def _kernel_args(ids, pos, wte, wpe, out, c: dict) -> tuple:
    return (ids, pos, wte, wpe, out, c["TM"], c["TC"])


def _signature(p: dict, c: dict):
    ids = ArraySpec(p["ids"], (p["M"],))
    wte = ArraySpec(p["dtype"], (p["V"], p["C"]))
    wpe = ArraySpec(p["dtype"], (p["P"], p["C"]))
    return [(embedding_kernel, _kernel_args(ids, ids, wte, wpe, ArraySpec(p["dtype"], (p["M"], p["C"])), c))]


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    rng = cupy.random.default_rng()
    ids = rng.integers(0, p["V"], p["M"]).astype(p["ids"])
    pos = rng.integers(0, p["P"], p["M"]).astype(p["ids"])
    wte = arrays.random_array((p["V"], p["C"]), p["dtype"], dev, rng)
    wpe = arrays.random_array((p["P"], p["C"]), p["dtype"], dev, rng)
    out = arrays.empty("cupy", dev, (p["M"], p["C"]), p["dtype"])
    return BenchCase(grid=lambda c: _grid(p, c), args=lambda c: _kernel_args(ids, pos, wte, wpe, out, c))


EMBEDDING = TunableOp("embedding", kernel=embedding_kernel, fields=FIELDS, space=SPACE,
                      default=default_config, buckets={"M": pow2_bucket}, bench=_bench,
                      signature=_signature,
                      field_defaults=dict(ids="int32"))


def embedding(ids, wte, wpe, positions=None, *, out=None):
    """wte[ids] + wpe[positions] -> ids.shape + (C,); positions default to 0..T-1 along the last axis.

    Ids and positions are device integer arrays; an id outside [0, vocab) yields a zero token row
    (validate on the host before upload where that matters).
    """
    ids = arrays.as_device_array(ids, "ids")
    wte = arrays.as_device_array(wte, "wte")
    wpe = arrays.as_device_array(wpe, "wpe")
    ii, ti, pi = arrays.info(ids, "ids"), arrays.info(wte, "wte"), arrays.info(wpe, "wpe")
    arrays.check_dtype(ii, "ids", arrays.INT_DTYPES)
    arrays.check_dtype(ti, "wte", arrays.FLOAT_DTYPES)
    arrays.check_same("wte", ti, "wpe", pi)
    arrays.check_same("ids", ii, "wte", ti, dtype=False)
    if len(ti.shape) != 2 or len(pi.shape) != 2 or ti.shape[1] != pi.shape[1]:
        raise ValueError(f"wte and wpe must be 2-D with the same width, got {ti.shape} and {pi.shape}")
    arrays.check_contiguous(ti, "wte")
    arrays.check_contiguous(pi, "wpe")
    arrays.check_contiguous(ii, "ids")
    if positions is None:
        if not ii.shape:
            raise ValueError("ids must have at least one dimension")
        if ii.shape[-1] > pi.shape[0]:
            raise ValueError(f"ids has {ii.shape[-1]} positions but wpe only {pi.shape[0]}")
        import cupy
        with cupy.cuda.Device(ii.device):
            positions = cupy.broadcast_to(cupy.arange(ii.shape[-1], dtype=ii.dtype), ii.shape).copy()
    else:
        positions = arrays.as_device_array(positions, "positions")
        qi = arrays.info(positions, "positions")
        if qi.shape != ii.shape or qi.dtype != ii.dtype or qi.device != ii.device:
            raise ValueError(f"positions must match ids ({ii.dtype} {ii.shape} on GPU {ii.device}), "
                             f"got {qi.dtype} {qi.shape} on GPU {qi.device}")
        arrays.check_contiguous(qi, "positions")
    C = ti.shape[1]
    out_shape = ii.shape + (C,)
    if out is None:
        out = arrays.empty(ti.kind, ti.device, out_shape, ti.dtype)
    else:
        out = arrays.check_out(out, "out", ti.kind, ti.device, out_shape, ti.dtype)
    M = math.prod(ii.shape)
    if M == 0:
        return out
    p = (ti.dtype, ii.dtype, M, C, ti.shape[0], pi.shape[0])
    plan = EMBEDDING.plan((ti.device,) + p)
    problem = dict(zip(FIELDS, p))
    ct.launch(arrays.stream_for(ti.kind, ti.device), _grid(problem, plan.config), plan.kernel,
              _kernel_args(ids.reshape(M), positions.reshape(M), wte, wpe, out.reshape(M, C), plan.config))
    return out


def embedding_reference(ids, wte, wpe, positions) -> np.ndarray:
    """float64 NumPy wte[ids] + wpe[positions]; ids and positions have the same shape."""
    return np.asarray(wte, np.float64)[np.asarray(ids)] + np.asarray(wpe, np.float64)[np.asarray(positions)]
