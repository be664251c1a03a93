"""One-shot all-reduce over the GPUs of a host through peer memory, optionally fused with the RMSNorm after it.

Tensor-parallel decode sums a few rows (one row of 4096 bf16 values at batch 1: 8 KB) twice per layer. NCCL takes
about 7 us for that on two NVLinked H100s, its latency, not its bandwidth. Here every rank's program pushes its rows
straight into each peer's inbox (stores over NVLink into memory the peers opened with CUDA IPC), raises its flag in
each peer's flag array, waits until every peer's flag for this call has risen in its own, and sums the W partials
from its inbox in rank order: every rank computes the same bits, as the ranks' residual streams must stay equal.
With a norm weight it then writes RMSNorm(sum) too, the kernel the all-reduce's output would go to next.

The flag is raised by an acq_rel exchange at system scope (the rows are visible before it, and the waits cannot
start before it: tileiras moved a release store below them, and both ranks waited forever) and read by an atomic
acquire (one thread reads it for the CTA: with a load every thread made its own, warps left the wait at different
turns and the norm's barriers mismatched).

Unlike every other kernel (tiles.sync_with_previous_kernel), it lets the kernel after it launch only once the peers'
flags are in, not at its start: the early launch chained the next kernels' programs in behind its wait, and a decode
step of two H200s (16 layers of the Llama-3.1-8B shape) took 1.925 ms at B1 against 1.587 ms with the late launch
and 1.720 ms through NCCL (B8: 1.712, 1.648, 1.842; the same run).

No load or store goes through the tensor-memory engine (allow_tma=False): with TMA loads tileiras splits the kernel
into producer and consumer warps, and a producer could fetch an inbox before the consumers' acquire.

Calls are told apart by per-program counters (epochs) that every program bumps on every call (the grid is always
PROGRAMS programs), so a captured CUDA graph replays with no host state and all programs of a call agree on its
parity, which picks one of two halves of each inbox at fixed offsets, whatever the call's shape. A rank can run at
most one call ahead of a peer (its next call waits for the peer's flags, which the peer raises only after finishing
its previous call, kernels on a stream running in order), so two halves are enough; halves laid out by the call's
shape overlapped the previous call's and broke the models. Every rank must make the same sequence of calls, as it
must with NCCL; a program waits only on its twins on the other ranks, and PROGRAMS is below any GPU's SM count, so
all programs are resident at once. The int32 counters wrap after 2**31 - 1 calls (about 30 hours of TP=2 decode of
the 8B shape: 33 calls a step, 1.6 ms a step): flags are compared by their difference, which stays right across
the wrap (a peer's flag is at most one call ahead), and the parity is the counter's low bit.

On two H100s one decode all-reduce (8 KB) takes 5.6 us against NCCL's 7.2 (benchmarks/studies/tp.py); every
tensor-parallel model test passes with it (docs/results/tp-h100x2.txt).

Not a tuned op: its time is the round trip between GPUs, which a tuner timing one process cannot measure (its peers
would never answer); the tile shape follows the rows. Whether it or NCCL runs (by message size) is
tilekit.parallel's choice, measured in benchmarks/studies/tp.py.
"""

from __future__ import annotations

import cuda.tile as ct

from tilekit.autotune.arrays import FLOAT_DTYPES
from tilekit.autotune.space import pow2_ceil

MAX_PEERS = 7            # world sizes up to 8
PROGRAMS = 16            # every call's grid: each program sums rows pid, pid + 16, ... (its twins' on the peers)
MAX_NORM_WIDTH = 8192    # a fused norm keeps a whole row in one tile
ZERO = ct.PaddingMode.ZERO
ACQ_REL, ACQUIRE, SYS = ct.MemoryOrder.ACQ_REL, ct.MemoryOrder.ACQUIRE, ct.MemoryScope.SYS


@ct.kernel
def peer_all_reduce_kernel(X, Out, Inbox, Box0, Box1, Box2, Box3, Box4, Box5, Box6, Flags, Flag0, Flag1, Flag2,
                           Flag3, Flag4, Flag5, Flag6, Epochs, Weight, Y, rank: int, eps: float, TN: ct.Constant[int],
                           WORLD: ct.Constant[int], FLOAT: ct.Constant[bool], NORM: ct.Constant[bool]):
    """Rows pid, pid + PROGRAMS, ... of Out = the sum over ranks of X (M, N) (and Y = RMSNorm(Out) * Weight when
    NORM).

    Inbox (2, WORLD, M, N): this rank's, the rows its peers pushed, its parity halves and sender slots at fixed
    offsets (strides that do not follow M and N); Box0..: the peers' inboxes (rank + 1 + i) % WORLD; Flags
    (WORLD * PROGRAMS,) int32: this rank's, raised by its peers; Flag0..: the peers'; Epochs (PROGRAMS,) int32: this
    rank's call counters. FLOAT: sums in fp32 (else in X's integer dtype, exactly)."""
    ct.grid_dependency_control_wait()                   # its dependents launch once the peers are in: module doc
    pid = ct.bid(0)
    M = X.shape[0]
    N = X.shape[1]
    boxes = (Box0, Box1, Box2, Box3, Box4, Box5, Box6)
    flags = (Flag0, Flag1, Flag2, Flag3, Flag4, Flag5, Flag6)
    epoch = ct.load(Epochs, (pid,), shape=()) + 1            # every program counts every call: one parity per call
    parity = epoch & 1                                       # (wraps past 2**31 - 1 calls: module doc)
    for row in range(pid, M, PROGRAMS):
        for j in range(ct.cdiv(N, TN)):
            part = ct.load(X, (row, j), (1, TN), padding_mode=ZERO, allow_tma=False).reshape((1, 1, 1, TN))
            for i in ct.static_iter(range(WORLD - 1)):
                ct.store(boxes[i], (parity, rank, row, j), part, allow_tma=False)
    for i in ct.static_iter(range(WORLD - 1)):       # the flags' orders: see the module doc
        ct.atomic_xchg(flags[i], rank * PROGRAMS + pid, epoch, memory_order=ACQ_REL, memory_scope=SYS)
    for sender in range(WORLD):
        if sender != rank:
            seen = ct.atomic_or(Flags, sender * PROGRAMS + pid, 0, memory_order=ACQUIRE, memory_scope=SYS)
            while seen - epoch < 0:          # seen < epoch, across the wrap (cuTile's int32 arithmetic wraps)
                seen = ct.atomic_or(Flags, sender * PROGRAMS + pid, 0, memory_order=ACQUIRE, memory_scope=SYS)
    ct.grid_dependency_control_launch_dependents()
    for row in range(pid, M, PROGRAMS):
        for j in range(ct.cdiv(N, TN)):
            if FLOAT:
                total = ct.zeros((1, TN), dtype=ct.float32)
            else:
                total = ct.zeros((1, TN), dtype=X.dtype)
            for sender in range(WORLD):                        # rank order: the same sum on every rank
                if sender == rank:
                    part = ct.load(X, (row, j), (1, TN), padding_mode=ZERO, allow_tma=False)
                else:
                    part = ct.load(Inbox, (parity, sender, row, j), (1, 1, 1, TN), padding_mode=ZERO,
                                   allow_tma=False).reshape((1, TN))
                total = total + part.astype(total.dtype)
            ct.store(Out, (row, j), total.astype(Out.dtype), allow_tma=False)
            if NORM:
                s = total.astype(Out.dtype).astype(ct.float32)  # the stream as stored, as rms_norm would read it
                rstd = ct.rsqrt(ct.sum(s * s, axis=1, keepdims=True) / N + eps)
                w = ct.load(Weight, (0,), (TN,), padding_mode=ZERO, allow_tma=False).astype(ct.float32)
                ct.store(Y, (row, 0), (s * rstd * w.reshape((1, TN))).astype(Y.dtype), allow_tma=False)
    ct.store(Epochs, (pid,), epoch)


def tile_width(width: int, norm: bool) -> int:
    """Whole rows in one tile up to MAX_NORM_WIDTH (a fused norm needs them), else 4096-wide tiles."""
    if norm and width > MAX_NORM_WIDTH:
        raise ValueError(f"a fused norm takes rows of at most {MAX_NORM_WIDTH} values, got {width}")
    return pow2_ceil(width) if width <= MAX_NORM_WIDTH else 4096


def launch_args(x, out, inbox, boxes, flags, peer_flags, epochs, weight, y, rank: int, eps: float, norm: bool):
    """(grid, arguments) of one call: x, out (M, N); inbox and boxes (2, W, M, N) views of x's dtype; flags and
    peer_flags int32 (W * PROGRAMS,); epochs int32 (PROGRAMS,); weight (N,), y (M, N) when norm (else any arrays of
    x's dtype)."""
    world = len(boxes) + 1
    spare_boxes = (inbox,) * (MAX_PEERS - len(boxes))       # never touched: WORLD bounds the unrolled loops
    spare_flags = (flags,) * (MAX_PEERS - len(peer_flags))
    args = (x, out, inbox, *boxes, *spare_boxes, flags, *peer_flags, *spare_flags, epochs, weight, y, rank, eps,
            tile_width(x.shape[1], norm), world, str(x.dtype) in FLOAT_DTYPES, norm)
    return (PROGRAMS, 1, 1), args
