"""Token (plus position) embedding: out[i] = wte[ids[i]] (+ wpe[positions[i]]), one gather pass.

GPT-2 adds a learned position table; Llama has none (its positions enter through RoPE). out may be
a fixed-point residual stream (int64, see tiles.py), as a GPT-2 decode step keeps it.
"""

from __future__ import annotations

import functools
import math

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec, absent
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import FIXED_DTYPE, sync_with_previous_kernel, to_fixed


@ct.kernel
def embedding_kernel(Ids, Pos, Wte, Wpe, Out, TM: ct.Constant[int], TC: ct.Constant[int],
                     HAS_POS: ct.Constant[bool], FIXED: ct.Constant[bool]):
    """Rows TM*bid(0).. of Out[M, C], columns TC*bid(1).. ; out-of-range ids read as zero rows.
    FIXED: Out is fixed point."""
    sync_with_previous_kernel()
    pid = ct.bid(0)
    cblk = ct.bid(1)
    ids = ct.load(Ids, (pid,), (TM,), padding_mode=ct.PaddingMode.ZERO).reshape((TM, 1))
    cols = (ct.arange(TC, dtype=ct.int32) + cblk * TC).reshape((1, TC))
    row = ct.gather(Wte, (ids, cols)).astype(ct.float32)
    if HAS_POS:
        pos = ct.load(Pos, (pid,), (TM,), padding_mode=ct.PaddingMode.ZERO).reshape((TM, 1))
        row = row + ct.gather(Wpe, (pos, cols)).astype(ct.float32)
    if FIXED:
        ct.store(Out, (pid, cblk), to_fixed(row))
    else:
        ct.store(Out, (pid, cblk), row.astype(Out.dtype))


def _fits(c: dict, p: dict) -> bool:
    c_pow2 = pow2_ceil(p["C"])
    return (min(256, c_pow2) <= c["TC"] <= max(64, c_pow2) and c["TM"] <= max(1, pow2_ceil(p["M"]))
            and c["TM"] * c["TC"] <= 16384)


SPACE = SearchSpace(_fits, TM=(1, 2, 4), TC=(64, 128, 256, 512, 1024, 2048), occupancy=(2, 4))


def default_config(p: dict) -> dict:
    return dict(TM=min(4, pow2_ceil(p["M"])), TC=min(1024, max(64, pow2_ceil(p["C"]))), occupancy=4)


def _arrays(p: dict) -> dict:
    """P = 0: no position table (Llama)."""
    M, C, P = p["M"], p["C"], p["P"]
    return {"ids": ArraySpec(p["ids"], (M,), high=p["V"]),
            "pos": ArraySpec(p["ids"], (M,), high=P) if P else absent(p["ids"], 1),
            "wte": ArraySpec(p["dtype"], (p["V"], C)),
            "wpe": ArraySpec(p["dtype"], (P, C)) if P else absent(p["dtype"], 2),
            "out": ArraySpec(FIXED_DTYPE if p["fixed"] else p["dtype"], (M, C), role="out")}


def _grid(p: dict, c: dict) -> tuple:
    return (ct.cdiv(p["M"], c["TM"]), ct.cdiv(p["C"], c["TC"]), 1)


def _constants(p: dict, c: dict) -> tuple:
    return (c["TM"], c["TC"], p["P"] > 0, bool(p["fixed"]))


def _bind(a: list, flags: tuple) -> Binding:
    ids, wte, wpe, positions, out = a
    arrays.check_dtype(ids, "ids", arrays.INT_DTYPES)
    arrays.check_dtype(wte, "wte", arrays.FLOAT_DTYPES)
    arrays.check_same("ids", ids, "wte", wte, dtype=False)
    if len(wte.shape) != 2:
        raise ValueError(f"wte must be 2-D (vocab, width), got shape {wte.shape}")
    for name, v in (("wte", wte), ("ids", ids)):
        arrays.check_contiguous(v, name)
    if not ids.shape:
        raise ValueError("ids must have at least one dimension")
    views, fixed = {"ids": (0, None if len(ids.shape) == 1 else (math.prod(ids.shape),))}, {}
    if wpe is None:
        if positions is not None:
            raise ValueError("positions need a position table, and wpe is None")
    else:
        arrays.check_same("wte", wte, "wpe", wpe)
        if len(wpe.shape) != 2 or wte.shape[1] != wpe.shape[1]:
            raise ValueError(f"wte and wpe must be 2-D with the same width, got {wte.shape} and {wpe.shape}")
        arrays.check_contiguous(wpe, "wpe")
        views["wpe"] = (2, None)
        if positions is None:
            if ids.shape[-1] > wpe.shape[0]:
                raise ValueError(f"ids has {ids.shape[-1]} positions but wpe only {wpe.shape[0]}")
            fixed["pos"] = _default_positions(ids)
        else:
            if positions.shape != ids.shape or positions.dtype != ids.dtype or positions.device != ids.device:
                raise ValueError(f"positions must match ids ({ids.dtype} {ids.shape} on GPU {ids.device}), "
                                 f"got {positions.dtype} {positions.shape} on GPU {positions.device}")
            arrays.check_contiguous(positions, "positions")
            views["pos"] = (3, views["ids"][1])
    C = wte.shape[1]
    out_shape = ids.shape + (C,)
    fixed_point = out is not None and out.dtype == FIXED_DTYPE
    if out is not None:
        arrays.check_out(out, "out", wte, out_shape, FIXED_DTYPE if fixed_point else wte.dtype)
    M = math.prod(ids.shape)
    views.update(wte=(1, None), out=(4, None if len(out_shape) == 2 else (M, C)))
    P = 0 if wpe is None else wpe.shape[0]
    return Binding(problem=dict(dtype=wte.dtype, ids=ids.dtype, M=M, C=C, V=wte.shape[0], P=P,
                                fixed=int(fixed_point)),
                   arrays=views, output=(4, arrays.allocator(wte.kind, wte.device, out_shape, wte.dtype)),
                   returns=4, fixed=fixed)


def _default_positions(ids: arrays.Info):
    """0..T-1 along the last axis of ids, flattened."""
    M, T = math.prod(ids.shape), ids.shape[-1]
    if ids.kind == "meta":
        return arrays.MetaArray((M,), ids.dtype, device=ids.device)
    return _positions(ids.device, ids.dtype, M, T)


@functools.cache
def _positions(device: int, dtype: str, M: int, T: int):
    """Made once per process (a captured graph may read it after its plan is forgotten)."""
    import cupy
    with cupy.cuda.Device(device):
        return cupy.tile(cupy.arange(T, dtype=dtype), M // max(T, 1))


EMBEDDING = Op(
    "embedding", args=("ids", "wte", "wpe", "positions", "out"), optional=("wpe", "positions", "out"),
    key=dict(dtype=None, ids=None, M=pow2_bucket, C=None, V=None, P=None, fixed=None), space=SPACE,
    default=default_config, arrays=_arrays,
    launches=(Launch(embedding_kernel, _grid, ("ids", "pos", "wte", "wpe", "out"), _constants),),
    bind=_bind, choices=dict(ids=("int32", "int64"), fixed=(0, 1), P=range(0, 1 << 31)),
    cli_defaults=dict(ids="int32", fixed=0))


def embedding(ids, wte, wpe=None, positions=None, *, out=None):
    """wte[ids] + wpe[positions] -> ids.shape + (C,); positions default to 0..T-1 along the last axis.
    Without a position table (wpe None, as in Llama) just the token rows wte[ids]. `out` has wte's
    dtype, or is a fixed-point residual (int64, tiles.py) that the rows are written to.

    Ids and positions are device integer arrays; an id outside [0, vocab) yields a zero token row
    (validate on the host before upload where that matters).
    """
    return EMBEDDING((ids, wte, wpe, positions, out))


def embedding_reference(ids, wte, wpe=None, positions=None) -> np.ndarray:
    """float64 NumPy wte[ids] (+ wpe[positions]); ids and positions have the same shape."""
    rows = np.asarray(wte, np.float64)[np.asarray(ids)]
    return rows if wpe is None else rows + np.asarray(wpe, np.float64)[np.asarray(positions)]


if __name__ == "__main__":
    from tilekit.kernels.embedding import embedding, embedding_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import TOL, assert_close, host, poisoned, rand
    V, P, C = 1031, 64, 1600
    for dtype in ("bfloat16", "float32"):
        wte, wpe = rand((V, C), dtype), rand((P, C), dtype)
        ids = cupy.random.randint(0, V, (3, 17)).astype(cupy.int32)
        y = embedding(ids, wte, wpe, out=poisoned((3, 17, C), dtype))
        ref = embedding_reference(host(ids), host(wte), host(wpe), np.broadcast_to(np.arange(17), (3, 17)))
        print(f"embedding (3, 17) {dtype}: ok, relative error {assert_close(host(y), ref, TOL[dtype], dtype):.2e}")
    y = embedding(ids, wte, out=poisoned((3, 17, C), dtype))
    assert np.array_equal(host(y), embedding_reference(host(ids), host(wte))), "embedding without wpe differs"
    print("embedding without a position table: ok, exact")
