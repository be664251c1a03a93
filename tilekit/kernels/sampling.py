"""Next-token selection on the GPU: greedy argmax over the vocabulary, with decode bookkeeping."""

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
def greedy_kernel(Logits, Tokens, Positions, History, Finished, eos: int, BV: ct.Constant[int]):
    """Row b: token = argmax(Logits[b]) (first index on ties; eos once finished).

    Tokens[b] = token; History[b, Positions[b] + 1] = token; Positions[b] += 1; Finished[b] |= token == eos.
    """
    b = ct.bid(0)
    V = Logits.shape[1]
    best = ct.full((1, 1), -math.inf, dtype=ct.float32)
    best_i = ct.zeros((1, 1), dtype=ct.int32)
    for t in range(ct.cdiv(V, BV)):
        x = ct.load(Logits, (b, t), (1, BV), padding_mode=ct.PaddingMode.NEG_INF).astype(ct.float32)
        m = ct.max(x, axis=1, keepdims=True)
        i = ct.argmax(x, axis=1, keepdims=True).astype(ct.int32) + t * BV
        better = m > best
        best_i = ct.where(better, i, best_i)
        best = ct.where(better, m, best)
    done = ct.load(Finished, (b,), (1,)).reshape((1, 1))
    token = ct.where(done != 0, eos, best_i).reshape((1,))
    pos = ct.load(Positions, (b,), (1,))
    ct.store(Tokens, (b,), token)
    ct.scatter(History, (b, pos + 1), token)
    ct.store(Positions, (b,), pos + 1)
    ct.store(Finished, (b,), ct.where(token == eos, 1, done.reshape((1,))))


def _fits(c: dict, p: dict) -> bool:
    return c["BV"] <= max(1024, pow2_ceil(p["V"]))


SPACE = SearchSpace(_fits, BV=(1024, 2048, 4096, 8192), occupancy=(1,))
FIELDS = ("dtype", "B", "V", "L")


def default_config(p: dict) -> dict:
    return dict(BV=4096, occupancy=1)


def _kernel_args(logits, tokens, positions, history, finished, eos: int, c: dict) -> tuple:
    return (logits, tokens, positions, history, finished, int(eos), c["BV"])


def _signature(p: dict, c: dict):
    i32 = ArraySpec("int32", (p["B"],))
    return [(greedy_kernel, _kernel_args(ArraySpec(p["dtype"], (p["B"], p["V"])), i32, i32,
                                         ArraySpec("int32", (p["B"], p["L"])), i32, 0, c))]


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    logits = arrays.random_array((p["B"], p["V"]), p["dtype"], dev, cupy.random.default_rng())
    tokens, positions, finished = (cupy.zeros((p["B"],), cupy.int32) for _ in range(3))
    history = cupy.zeros((p["B"], p["L"]), cupy.int32)

    def args(c):
        positions.fill(0)   # keep the history write in bounds across repeats
        return _kernel_args(logits, tokens, positions, history, finished, -1, c)

    return BenchCase(grid=lambda c: (p["B"], 1, 1), args=args)


GREEDY = TunableOp("greedy", kernel=greedy_kernel, fields=FIELDS, space=SPACE, default=default_config,
                   buckets={"B": pow2_bucket}, bench=_bench, signature=_signature)


def greedy_step(logits, tokens, positions, history, finished, eos_id: int = -1) -> None:
    """Pick argmax tokens for each row of logits (B, V) and advance the decode state in place.

    tokens, positions, finished: int32 (B,); history: int32 (B, L) with the sequence so far; the new
    token lands at history[b, positions[b] + 1], then positions[b] += 1. Rows already finished emit
    eos_id; a row becomes finished when it emits eos_id (-1: never).
    """
    arrs = [arrays.as_device_array(a, n) for a, n in ((logits, "logits"), (tokens, "tokens"),
            (positions, "positions"), (history, "history"), (finished, "finished"))]
    li = arrays.info(arrs[0], "logits")
    arrays.check_dtype(li, "logits", arrays.FLOAT_DTYPES)
    if len(li.shape) != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {li.shape}")
    arrays.check_last_contiguous(li, "logits")
    B = li.shape[0]
    for name, a, shape in (("tokens", arrs[1], (B,)), ("positions", arrs[2], (B,)),
                           ("history", arrs[3], None), ("finished", arrs[4], (B,))):
        ai = arrays.info(a, name)
        arrays.check_dtype(ai, name, ("int32",))
        if (shape and ai.shape != shape) or (not shape and (len(ai.shape) != 2 or ai.shape[0] != B)):
            raise ValueError(f"{name} has shape {ai.shape}, expected {shape or (B, 'L')}")
        if ai.device != li.device:
            raise ValueError(f"{name} is on GPU {ai.device}, logits on GPU {li.device}")
        arrays.check_contiguous(ai, name)
    p = (li.dtype, B, li.shape[1], arrays.info(arrs[3], "history").shape[1])
    plan = GREEDY.plan((li.device,) + p)
    ct.launch(arrays.stream_for(li.kind, li.device), (B, 1, 1), plan.kernel,
              _kernel_args(*arrs, eos_id, plan.config))


def greedy_reference(logits) -> np.ndarray:
    """First index of the maximum of each row."""
    return np.argmax(np.asarray(logits, np.float64), axis=-1).astype(np.int32)
