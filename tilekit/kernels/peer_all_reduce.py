"""One-shot all-reduce over the GPUs of a host through peer memory, optionally fused with the RMSNorm after it.

Tensor-parallel decode sums a few rows (one row of 4096 bf16 values at batch 1: 8 KB) twice per layer. NCCL takes
about 7 us for that on two NVLinked H100s, its latency, not its bandwidth. Here every rank's program pushes its rows
straight into each peer's inbox (stores over NVLink into memory the peers opened with CUDA IPC), raises its flag in
each peer's flag array (an acq_rel exchange at system scope: the rows are visible before the flag, and the waits
cannot start before it, as they could after a release store, which tileiras moved below them: both ranks then waited
forever), waits until every peer's flag for this call has risen in its own flag array (acquire loads), and sums the W
partials from its inbox in
rank order: every rank computes the same bits, as the ranks' residual streams must stay equal. With a norm weight it
then writes RMSNorm(sum) too, the kernel the all-reduce's output would go to next, so that launch goes.

No load or store goes through the tensor-memory engine (allow_tma=False): with TMA loads tileiras splits the kernel
into producer and consumer warps, and a producer could fetch an inbox before the consumers' acquire.

Calls are told apart by a per-program counter (epochs) that each program bumps, so a captured CUDA graph replays
with no host state; inboxes alternate by the counter's parity. A rank can run at most one call ahead of a peer
(its next call waits for the peer's flags, which the peer raises only after finishing this call, kernels on a
stream running in order), so two inboxes per sender are enough. Every rank must make the same sequence of calls
with the same row counts (the counters must agree), as it must with NCCL; a program waits only on its twins on the
other ranks, and grids stay within MAX_PROGRAMS so that all programs are resident at once.

Not a tuned op: its time is the round trip between GPUs, which a tuner timing one process cannot measure (its peers
would never answer); the tile shape follows the rows. Whether it or NCCL runs (by message size) is
tilekit.parallel's choice, measured in benchmarks/studies/tp.py.
"""

from __future__ import annotations

import cuda.tile as ct

from tilekit.autotune.arrays import FLOAT_DTYPES
from tilekit.autotune.space import pow2_ceil
from tilekit.kernels.tiles import sync_with_previous_kernel

MAX_PEERS = 7            # world sizes up to 8
MAX_PROGRAMS = 128       # flag slots per sender; at most one program per SM of any Hopper GPU
MAX_NORM_WIDTH = 8192    # a fused norm keeps a whole row in one tile
ZERO = ct.PaddingMode.ZERO
ACQ_REL, ACQUIRE, SYS = ct.MemoryOrder.ACQ_REL, ct.MemoryOrder.ACQUIRE, ct.MemoryScope.SYS


@ct.kernel
def peer_all_reduce_kernel(X, Out, Inbox, Box0, Box1, Box2, Box3, Box4, Box5, Box6, Flags, Flag0, Flag1, Flag2,
                           Flag3, Flag4, Flag5, Flag6, Epochs, Weight, Y, rank: int, eps: float, TM: ct.Constant[int],
                           TN: ct.Constant[int], WORLD: ct.Constant[int], FLOAT: ct.Constant[bool],
                           NORM: ct.Constant[bool]):
    """Rows pid*TM.. of Out = the sum over ranks of X (M, N) (and Y = RMSNorm(Out) * Weight when NORM).

    Inbox (2, WORLD, M, N): this rank's, the rows its peers pushed; Box0..: the peers' inboxes (rank + 1 + i) % WORLD;
    Flags (WORLD * MAX_PROGRAMS,) int32: this rank's, raised by its peers; Flag0..: the peers'; Epochs (MAX_PROGRAMS,)
    int32: this rank's call counters. FLOAT: sums in fp32 (else in X's integer dtype, exactly)."""
    sync_with_previous_kernel()
    pid = ct.bid(0)
    N = X.shape[1]
    boxes = (Box0, Box1, Box2, Box3, Box4, Box5, Box6)
    flags = (Flag0, Flag1, Flag2, Flag3, Flag4, Flag5, Flag6)
    epoch = ct.load(Epochs, (pid,), shape=()) + 1
    parity = epoch % 2
    for j in range(ct.cdiv(N, TN)):
        part = ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO, allow_tma=False).reshape((1, 1, TM, TN))
        for i in ct.static_iter(range(WORLD - 1)):
            ct.store(boxes[i], (parity, rank, pid, j), part, allow_tma=False)
    for i in ct.static_iter(range(WORLD - 1)):       # an acq_rel exchange, not a release store: the compiler may
        ct.atomic_xchg(flags[i], rank * MAX_PROGRAMS + pid, epoch,      # sink a release store below the waits
                       memory_order=ACQ_REL, memory_scope=SYS)
    for sender in range(WORLD):
        if sender != rank:
            seen = ct.load(Flags, (sender * MAX_PROGRAMS + pid,), shape=(), memory_order=ACQUIRE, memory_scope=SYS)
            while seen < epoch:
                seen = ct.load(Flags, (sender * MAX_PROGRAMS + pid,), shape=(), memory_order=ACQUIRE,
                               memory_scope=SYS)
    for j in range(ct.cdiv(N, TN)):
        if FLOAT:
            total = ct.zeros((TM, TN), dtype=ct.float32)
        else:
            total = ct.zeros((TM, TN), dtype=X.dtype)
        for sender in range(WORLD):                            # rank order: the same sum on every rank
            if sender == rank:
                part = ct.load(X, (pid, j), (TM, TN), padding_mode=ZERO, allow_tma=False)
            else:
                part = ct.load(Inbox, (parity, sender, pid, j), (1, 1, TM, TN), padding_mode=ZERO,
                               allow_tma=False).reshape((TM, TN))
            total = total + part.astype(total.dtype)
        ct.store(Out, (pid, j), total.astype(Out.dtype), allow_tma=False)
        if NORM:
            s = total.astype(Out.dtype).astype(ct.float32)     # the stream as stored, as rms_norm would read it
            rstd = ct.rsqrt(ct.sum(s * s, axis=1, keepdims=True) / N + eps)
            w = ct.load(Weight, (0,), (TN,), padding_mode=ZERO, allow_tma=False).astype(ct.float32).reshape((1, TN))
            ct.store(Y, (pid, 0), (s * rstd * w).astype(Y.dtype), allow_tma=False)
    ct.store(Epochs, (pid,), epoch)


def tiles(rows: int, width: int, norm: bool) -> tuple[int, int, int]:
    """(TM, TN, programs): whole rows in one tile up to MAX_NORM_WIDTH (a fused norm needs them), else 4096-wide
    tiles; rows shared so that at most MAX_PROGRAMS programs run."""
    tn = pow2_ceil(width) if width <= MAX_NORM_WIDTH else 4096
    if norm and tn < width:
        raise ValueError(f"a fused norm takes rows of at most {MAX_NORM_WIDTH} values, got {width}")
    tm = pow2_ceil(-(-rows // MAX_PROGRAMS))
    return tm, tn, -(-rows // tm)


def launch_args(x, out, inbox, boxes, flags, peer_flags, epochs, weight, y, rank: int, eps: float, norm: bool):
    """(grid, arguments) of one call: x, out (M, N); inbox and boxes (2, W, M, N) of x's dtype; flags and peer_flags
    int32 (W * MAX_PROGRAMS,); epochs int32 (MAX_PROGRAMS,); weight (N,), y (M, N) when norm (else any arrays of
    x's dtype)."""
    world = len(boxes) + 1
    tm, tn, programs = tiles(x.shape[0], x.shape[1], norm)
    spare_boxes = (inbox,) * (MAX_PEERS - len(boxes))       # never touched: WORLD bounds the unrolled loops
    spare_flags = (flags,) * (MAX_PEERS - len(peer_flags))
    args = (x, out, inbox, *boxes, *spare_boxes, flags, *peer_flags, *spare_flags, epochs, weight, y, rank, eps, tm,
            tn, world, str(x.dtype) in FLOAT_DTYPES, norm)
    return (programs, 1, 1), args
