"""Next-token selection on the GPU: greedy argmax over the vocabulary, with decode bookkeeping."""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune.compile import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import BenchCase, TunableOp
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels import arrays


@ct.kernel
def argmax_chunk_kernel(Logits, BestVal, BestIdx, CH: ct.Constant[int]):
    """BestVal/BestIdx[b, s] = max and first argmax of Logits[b, s*CH:(s+1)*CH]."""
    b = ct.bid(0)
    s = ct.bid(1)
    x = ct.load(Logits, (b, s), (1, CH), padding_mode=ct.PaddingMode.NEG_INF).astype(ct.float32)
    ct.store(BestVal, (b, s), ct.max(x, axis=1, keepdims=True))
    ct.store(BestIdx, (b, s), ct.argmax(x, axis=1, keepdims=True).astype(ct.int32) + s * CH)


@ct.kernel
def greedy_finish_kernel(BestVal, BestIdx, Tokens, Positions, History, Finished, eos: int,
                         SP: ct.Constant[int]):
    """Row b: token = overall argmax (eos once finished); then the decode bookkeeping.

    Tokens[b] = token; History[b, Positions[b] + 1] = token; Positions[b] += 1; Finished[b] |= token == eos.
    """
    b = ct.bid(0)
    vals = ct.load(BestVal, (b, 0), (1, SP), padding_mode=ct.PaddingMode.NEG_INF)
    which = ct.argmax(vals, axis=1, keepdims=True).astype(ct.int32)
    best = ct.gather(BestIdx, (b, which)).reshape((1,))
    done = ct.load(Finished, (b,), (1,))
    token = ct.where(done != 0, eos, best)
    pos = ct.load(Positions, (b,), (1,))
    ct.store(Tokens, (b,), token)
    ct.scatter(History, (b, pos + 1), token)
    ct.store(Positions, (b,), pos + 1)
    ct.store(Finished, (b,), ct.where(token == eos, 1, done))


def _fits(c: dict, p: dict) -> bool:
    return c["CH"] <= max(256, pow2_ceil(p["V"])) and ct.cdiv(p["V"], c["CH"]) <= 1024


SPACE = SearchSpace(_fits, CH=(256, 512, 1024, 2048), occupancy=(1, 2, 4))
FIELDS = ("dtype", "B", "V", "L")


def default_config(p: dict) -> dict:
    return dict(CH=512, occupancy=2)


def _chunks(p: dict, c: dict) -> int:
    return ct.cdiv(p["V"], c["CH"])


def _split_args(logits, best_val, best_idx, c: dict) -> tuple:
    return (logits, best_val, best_idx, c["CH"])


def _finish_args(best_val, best_idx, tokens, positions, history, finished, eos: int, p: dict, c: dict) -> tuple:
    return (best_val, best_idx, tokens, positions, history, finished, int(eos), pow2_ceil(_chunks(p, c)))


def _signature(p: dict, c: dict):
    i32 = ArraySpec("int32", (p["B"],))
    part = (p["B"], _chunks(p, c))
    val, idx = ArraySpec("float32", part), ArraySpec("int32", part)
    return [(argmax_chunk_kernel, _split_args(ArraySpec(p["dtype"], (p["B"], p["V"])), val, idx, c)),
            (greedy_finish_kernel, _finish_args(val, idx, i32, i32, ArraySpec("int32", (p["B"], p["L"])), i32,
                                                0, p, c))]


def _partials(device: int, stream: int, p: dict, c: dict) -> tuple:
    """(BestVal, BestIdx) scratch per device, stream and shape."""
    shape = (p["B"], _chunks(p, c))
    return arrays.scratch("greedy.partials", device, stream, ((shape, "float32"), (shape, "int32")))


def _bench(p: dict) -> BenchCase:
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    logits = arrays.random_array((p["B"], p["V"]), p["dtype"], dev, cupy.random.default_rng())
    return BenchCase(grid=lambda c: (p["B"], _chunks(p, c), 1),
                     args=lambda c: _split_args(logits, *_partials(dev, 0, p, c), c))


GREEDY = TunableOp("greedy", kernel=argmax_chunk_kernel, fields=FIELDS, space=SPACE, default=default_config,
                   buckets={"B": pow2_bucket}, bench=_bench, signature=_signature,
                   source_of=(greedy_finish_kernel,))


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
    problem = dict(zip(FIELDS, p))
    stream = arrays.stream_for(li.kind, li.device)
    best_val, best_idx = _partials(li.device, arrays.stream_handle(stream), problem, plan.config)
    ct.launch(stream, (B, _chunks(problem, plan.config), 1), plan.kernel,
              _split_args(arrs[0], best_val, best_idx, plan.config))
    ct.launch(stream, (B, 1, 1), greedy_finish_kernel,
              _finish_args(best_val, best_idx, *arrs[1:], eos_id, problem, plan.config))


def greedy_reference(logits) -> np.ndarray:
    """First index of the maximum of each row."""
    return np.argmax(np.asarray(logits, np.float64), axis=-1).astype(np.int32)
