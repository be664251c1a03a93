"""Next-token selection on the GPU: greedy argmax over the vocabulary, with decode bookkeeping."""

from __future__ import annotations

import cuda.tile as ct
import numpy as np

from tilekit.autotune import arrays
from tilekit.autotune.arrays import ArraySpec
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace, pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel


@ct.kernel
def argmax_chunk_kernel(Logits, BestVal, BestIdx, CH: ct.Constant[int]):
    """BestVal/BestIdx[b, s] = max and first argmax of Logits[b, s*CH:(s+1)*CH]."""
    sync_with_previous_kernel()
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
    sync_with_previous_kernel()
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


def default_config(p: dict) -> dict:
    return dict(CH=512, occupancy=2)


def _chunks(p: dict, c: dict) -> int:
    return ct.cdiv(p["V"], c["CH"])


def _arrays(p: dict) -> dict:
    B, i32 = p["B"], ArraySpec("int32", (p["B"],), role="out")
    return {"logits": ArraySpec(p["dtype"], (B, p["V"])), "tokens": i32, "positions": i32, "finished": i32,
            "history": ArraySpec("int32", (B, p["L"]), role="out")}


def _scratch(p: dict, c: dict) -> dict:
    """Each chunk's maximum and its first index, reduced by the finishing kernel."""
    shape = (p["B"], _chunks(p, c))
    return {"best_val": ArraySpec("float32", shape, role="scratch"),
            "best_idx": ArraySpec("int32", shape, role="scratch")}


def _chunk_grid(p: dict, c: dict) -> tuple:
    return (p["B"], _chunks(p, c), 1)


def _chunk_constants(p: dict, c: dict) -> tuple:
    return (c["CH"],)


def _finish_grid(p: dict, c: dict) -> tuple:
    return (p["B"], 1, 1)


def _finish_constants(p: dict, c: dict) -> tuple:
    return (pow2_ceil(_chunks(p, c)),)


def _bind(a: list, flags: tuple) -> Binding:
    logits, *state = a
    arrays.check_dtype(logits, "logits", arrays.FLOAT_DTYPES)
    if len(logits.shape) != 2:
        raise ValueError(f"logits must be 2-D (batch, vocab), got shape {logits.shape}")
    arrays.check_last_contiguous(logits, "logits")
    if logits.shape[1] < 1:
        raise ValueError(f"logits has no vocabulary to choose from (shape {logits.shape})")
    B = logits.shape[0]
    for name, s in zip(("tokens", "positions", "history", "finished"), state):
        arrays.check_dtype(s, name, ("int32",))
        expected = None if name == "history" else (B,)
        if (expected and s.shape != expected) or (not expected and (len(s.shape) != 2 or s.shape[0] != B)):
            raise ValueError(f"{name} has shape {s.shape}, expected {expected or (B, 'L')}")
        if s.device != logits.device:
            raise ValueError(f"{name} is on GPU {s.device}, logits on GPU {logits.device}")
        arrays.check_contiguous(s, name)
    return Binding(problem=dict(dtype=logits.dtype, B=B, V=logits.shape[1], L=state[2].shape[1]),
                   arrays={n: (i, None) for i, n in enumerate(("logits", "tokens", "positions", "history",
                                                                "finished"))},
                   scalars={"eos": (0, -1)})


GREEDY_STEP = Op(
    "greedy_step", args=("logits", "tokens", "positions", "history", "finished"),
    key=dict(dtype=None, B=pow2_bucket, V=None), extras=dict(L=lambda p: 1025),
    space=SPACE, default=default_config, arrays=_arrays, scratch=_scratch, scalars=lambda p: {"eos": -1},
    launches=(Launch(argmax_chunk_kernel, _chunk_grid, ("logits", "best_val", "best_idx"), _chunk_constants),
              Launch(greedy_finish_kernel, _finish_grid,
                     ("best_val", "best_idx", "tokens", "positions", "history", "finished", "eos"),
                     _finish_constants, hinted=False)),
    bind=_bind)


def greedy_step(logits, tokens, positions, history, finished, eos_id: int = -1) -> None:
    """Pick argmax tokens for each row of logits (B, V) and advance the decode state in place.

    tokens, positions, finished: int32 (B,); history: int32 (B, L) with the sequence so far; the new
    token lands at history[b, positions[b] + 1], then positions[b] += 1. Rows already finished emit
    eos_id; a row becomes finished when it emits eos_id (-1: never).
    """
    if not isinstance(eos_id, (int, np.integer)) or isinstance(eos_id, bool):
        raise TypeError(f"eos_id must be an int, got {type(eos_id).__name__}")
    GREEDY_STEP((logits, tokens, positions, history, finished), (), (int(eos_id),))


def greedy_reference(logits) -> np.ndarray:
    """First index of the maximum of each row."""
    return np.argmax(np.asarray(logits, np.float64), axis=-1).astype(np.int32)


if __name__ == "__main__":
    from tilekit.kernels.greedy_step import greedy_step, greedy_reference  # the package's op, not this script's copy
    import cupy

    from tilekit.kernels.checks import host, rand
    for B, V in [(1, 50257), (9, 1031)]:
        logits = rand((B, V), "float32")
        tokens, positions = cupy.zeros(B, cupy.int32), cupy.zeros(B, cupy.int32)
        history, finished = cupy.zeros((B, 8), cupy.int32), cupy.zeros(B, cupy.int32)
        greedy_step(logits, tokens, positions, history, finished)
        assert host(tokens).tolist() == greedy_reference(host(logits)).tolist(), "greedy tokens differ"
        print(f"greedy_step B{B} V{V}: ok, exact")
