"""Communicators: what sums arrays over the ranks of one model. Communicator is the interface (all_reduce on the
current CUDA stream, so that a captured decode step holds its all-reduces); ShapeOnly stands for a rank's place in
a dry run; ThreadGroup's ranks are threads of one process summing NumPy arrays (CPU tests of the sharded models).
NCCL's is tilekit.parallel.nccl."""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import numpy as np


class RankError(RuntimeError):
    """A collective or the rendezvous failed because another rank is missing, died or disagrees."""


class Communicator:
    """Sums over the ranks of one model. all_reduce(x, out): out (default x, in place) = the sum of every rank's x,
    C-contiguous arrays of one shape and dtype, enqueued on the current stream."""

    rank: int = 0
    world_size: int = 1

    def all_reduce(self, x, out=None):
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def all_reduce_norm(self, x, weight, eps: float, y) -> bool:
        """all_reduce(x) in place and y = RMSNorm(x) * weight in one kernel, where this communicator fuses them;
        False (nothing done) where it does not."""
        return False

    def close(self, failed: bool = False) -> None:
        """Leave the group (failed: tell the other ranks this one failed)."""

    def hold(self, release: Callable[[], None]) -> None:
        """`release` (a bound method, held weakly) drops the CUDA graphs its object captured with this communicator's
        collectives; close() calls it first (NCCL lets a communicator go only once no graph holds it)."""
        self.__dict__.setdefault("holders", []).append(weakref.WeakMethod(release))

    def release_holders(self) -> None:
        for ref in self.__dict__.pop("holders", []):
            release = ref()
            if release is not None:
                release()


class ShapeOnly(Communicator):
    """A rank's place with no group: a model built to trace the kernels a rank runs (MetaArrays, the tuning
    workload) has no data to sum."""

    def __init__(self, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x, out=None):
        if not type(x).__name__ == "MetaArray":
            raise RankError("a ShapeOnly communicator only traces shapes; it cannot sum data")
        return x if out is None else out

    def barrier(self) -> None:
        pass


class ThreadGroup:
    """world_size ranks that are threads of one process, summing NumPy arrays in rank order (the same bits on
    every rank): for CPU tests. A rank that fails calls abort(); the others' next collective then raises RankError,
    as it does when one does not arrive within `timeout` seconds."""

    def __init__(self, world_size: int, timeout: float = 30.0):
        self.world_size, self.timeout = world_size, timeout
        self.slots: list = [None] * world_size
        self._barrier = threading.Barrier(world_size)

    def communicator(self, rank: int) -> "ThreadCommunicator":
        return ThreadCommunicator(self, rank)

    def abort(self) -> None:
        self._barrier.abort()

    def wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise RankError(f"rank {rank}: {what}: another rank failed or did not arrive within {self.timeout:g} s")\
                from None


class ThreadCommunicator(Communicator):
    """One thread's rank of a ThreadGroup."""

    def __init__(self, group: ThreadGroup, rank: int):
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank must lie in [0, {group.world_size}), got {rank}")
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, x, out=None):
        out = x if out is None else out
        if not x.flags.c_contiguous or x.shape != out.shape or x.dtype != out.dtype:
            raise ValueError(f"all_reduce needs C-contiguous arrays of one shape and dtype, got {x.dtype} "
                             f"{x.shape} and {out.dtype} {out.shape}")
        g = self.group
        g.slots[self.rank] = x.copy()
        g.wait(self.rank, "all_reduce")
        total = g.slots[0].astype(np.float64 if x.dtype.kind == "f" else x.dtype)
        for part in g.slots[1:]:
            total = total + part
        g.wait(self.rank, "all_reduce")
        out[...] = total
        return out

    def barrier(self) -> None:
        self.group.wait(self.rank, "barrier")

    def close(self, failed: bool = False) -> None:
        if failed:
            self.group.abort()
