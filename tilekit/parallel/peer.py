"""Peer memory: small all-reduces (decode's, up to TILEKIT_PEER_ALL_REDUCE_BYTES) that skip NCCL where the ranks
share a host: tilekit.kernels.peer_all_reduce's one-shot kernel writes into the peers' memory directly, opened
through CUDA IPC, and fuses the RMSNorm that follows (all_reduce_norm)."""

from __future__ import annotations

import socket
import sys
import time
import zlib
from typing import Callable

import numpy as np

from tilekit.env import peer_all_reduce_bytes
from tilekit.parallel.comm import RankError


IPC_HANDLE_BYTES = 64


class PeerMemory:
    """The one-shot all-reduce's memory (tilekit.kernels.peer_all_reduce): this rank's inboxes and flags, allocated
    here and opened by every peer through CUDA IPC, and the peers' opened in turn. Built by every rank of a group
    together, through `sum_ints` (an int32 all-reduce, NCCL's): they agree on whether it is used (all ranks on one
    host, every GPU reaching every other, every peer's memory opened, TILEKIT_PEER_ALL_REDUCE_BYTES > 0 on all) and
    on the largest message it takes (the smallest setting among them), since a rank taking it while another takes
    NCCL would wait forever. `usable` says whether it was."""

    def __init__(self, rank: int, world: int, device: int, sum_ints: Callable):
        import cupy
        from tilekit.kernels.peer_all_reduce import PROGRAMS
        rt = cupy.cuda.runtime
        self.rank, self.world, self.device = rank, world, device
        self.flag_bytes = -(-world * PROGRAMS * 4 // 512) * 512
        self.ptr, self.opened, self.views = 0, {}, {}
        limit = peer_all_reduce_bytes()

        def gather(row: list[int]):
            table = np.zeros((world, len(row)), np.int32)
            table[rank] = row
            return sum_ints(table)

        if limit:
            self.size = self.flag_bytes + 2 * world * limit
            self.ptr = rt.malloc(self.size)
            rt.memset(self.ptr, 0, self.size)
            rt.deviceSynchronize()
            handle = list(rt.ipcGetMemHandle(self.ptr))
        else:
            handle = [0] * IPC_HANDLE_BYTES
        host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
        table = gather([*handle, host, device, limit])
        hosts, devices, limits = table[:, IPC_HANDLE_BYTES], table[:, IPC_HANDLE_BYTES + 1], table[:, -1]
        self.limit = int(limits.min())
        peers = [(rank + 1 + i) % world for i in range(world - 1)]
        reach = self.limit > 0 and len(set(hosts.tolist())) == 1 and len(set(devices.tolist())) == world and all(
            rt.deviceCanAccessPeer(device, int(devices[p])) for p in peers)
        agreed = gather([int(reach)]).sum() == world
        if agreed:
            failure = ""
            try:
                for p in peers:
                    self.opened[p] = rt.ipcOpenMemHandle(bytes(int(v) for v in table[p, :IPC_HANDLE_BYTES]))
                self.epochs = cupy.zeros((PROGRAMS,), np.int32)
                self.flags = self._array(self.ptr, (world * PROGRAMS,), np.int32)
                self.peer_flags = tuple(self._array(self.opened[p], (world * PROGRAMS,), np.int32) for p in peers)
                self.peers = peers
            except Exception as e:      # noqa: BLE001  (any failure: every rank falls back to NCCL together)
                failure = self._failed(e)
            if gather([int(not failure)]).sum() == world:
                try:
                    self._self_test()
                except RankError:
                    raise
                except Exception as e:  # noqa: BLE001
                    failure = self._failed(e)
            agreed = gather([int(not failure)]).sum() == world
        self.usable = bool(agreed)
        if not self.usable:
            self.close()

    def _failed(self, e: Exception) -> str:
        print(f"tilekit: rank {self.rank}: all-reduces go through NCCL only: the peer path failed here "
              f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return str(e) or type(e).__name__

    def _self_test(self, timeout: float = 30.0) -> None:
        """One all-reduce through the peer kernel whose sum is known (1 + 2 + ... + world everywhere); raises if it
        is wrong, and RankError naming TILEKIT_PEER_ALL_REDUCE_BYTES if it does not finish within `timeout` s (a
        kernel waiting on a peer that never answers cannot be stopped: the process must exit)."""
        import cupy
        x = cupy.full((3, 1000), self.rank + 1, np.float32)
        self.all_reduce(x, x)
        done = cupy.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout
        while not done.done:
            if time.monotonic() > deadline:
                raise RankError(f"rank {self.rank}: the peer all-reduce's first call did not finish within {timeout:g} "
                                "s; set TILEKIT_PEER_ALL_REDUCE_BYTES=0 to use NCCL alone")
            time.sleep(0.001)
        if not bool((x == self.world * (self.world + 1) // 2).all()):
            raise RuntimeError("the peer all-reduce's first sum was wrong")

    def _array(self, ptr: int, shape: tuple, dtype, offset: int = 0, strides: tuple | None = None):
        import cupy
        memory = cupy.cuda.UnownedMemory(ptr, self.size, self, device_id=self.device)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, offset), strides)

    def _inbox(self, ptr: int, rows: int, width: int, dtype):
        """An inbox as (2, world, rows, width): its halves and sender slots `limit` bytes apart whatever the shape."""
        item = np.dtype(dtype).itemsize
        return self._array(ptr, (2, self.world, rows, width), dtype, self.flag_bytes,
                           (self.world * self.limit, self.limit, width * item, item))

    def takes(self, x) -> bool:
        return self.usable and x.nbytes <= self.limit

    def all_reduce(self, x, out, norm=None) -> None:
        """out = the sum over ranks of x (M, N); with norm = (weight, eps, y), y = RMSNorm(out) * weight too."""
        import cuda.tile as ct
        import cupy
        from tilekit.autotune.op import DEPENDENT_LAUNCH
        from tilekit.kernels.peer_all_reduce import launch_args, peer_all_reduce_kernel
        key = (x.shape, x.dtype)
        if key not in self.views:
            self.views[key] = (self._inbox(self.ptr, *x.shape, x.dtype),
                               tuple(self._inbox(self.opened[p], *x.shape, x.dtype) for p in self.peers))
        inbox, boxes = self.views[key]
        weight, eps, y = norm if norm else (x, 0.0, out)
        grid, args = launch_args(x, out, inbox, boxes, self.flags, self.peer_flags, self.epochs, weight.reshape(-1), y,
                                 self.rank, eps, norm is not None)
        ct.launch(cupy.cuda.get_current_stream().ptr, grid, peer_all_reduce_kernel, args,
                  programmatic_dependent_launch=DEPENDENT_LAUNCH)

    def close(self) -> None:
        """Unmap the peers' memory and free this rank's; every rank's kernels must have finished (a barrier)."""
        import cupy
        rt = cupy.cuda.runtime
        self.views.clear()
        for ptr in self.opened.values():
            rt.ipcCloseMemHandle(ptr)
        self.opened = {}
        if self.ptr:
            rt.free(self.ptr)
            self.ptr = 0
        self.usable = False
