"""Tensor parallelism's processes and communication: one model split across the GPUs of a host, one process
(rank) per GPU.

A Communicator sums arrays over the ranks: all_reduce(x, out) on the current CUDA stream, so that a captured
decode step holds its all-reduces and stays one graph replay per rank. NcclCommunicator uses CuPy's NCCL binding
(cupy.cuda.nccl): it takes raw pointers and a stream, needs no torch in the process, and CuPy is what the models
already run on (torch.distributed would bring a second allocator and stream model into every rank). Small
messages (decode's, up to TILEKIT_PEER_ALL_REDUCE_BYTES) skip NCCL where the ranks share a host: PeerMemory's
one-shot all-reduce kernel writes into the peers' memory directly, and fuses the RMSNorm that follows
(all_reduce_norm). ThreadGroup is the same interface for ranks that are threads of one process, on NumPy
arrays: CPU tests of the sharded models.

Ranks find each other through torchrun's variables (tilekit.env.distributed: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so torchrun, Slurm and mpirun wrappers start them; launch() starts them itself
(`tilekit generate --tp N`). Link is the rendezvous: rank 0 listens at MASTER_ADDR:MASTER_PORT, every rank connects
within a timeout, the world sizes are compared (a mismatch is an error on every rank) and rank 0 hands out NCCL's
unique id. The connections stay open as a watchdog: a rank whose process dies closes them, and every other rank
then exits with an error naming it, even one blocked inside an NCCL or peer all-reduce kernel that would otherwise
wait forever.
"""

from __future__ import annotations

import gc
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
import zlib
from typing import Callable, Mapping, Sequence

import numpy as np

from tilekit.autotune.arrays import FLOAT_DTYPES
from tilekit.env import Distributed, distributed, peer_all_reduce_bytes
from tilekit.untrusted import quoted, shown

RENDEZVOUS_TIMEOUT = 120.0    # seconds for every rank to arrive (model loading happens after)
EXIT_PEER_LOST = 75           # a rank's exit status when another rank died


class RankError(RuntimeError):
    """A collective or the rendezvous failed because another rank is missing, died or disagrees."""


# -- how a model splits over ranks ---------------------------------------------------------------------------

def span(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items split as evenly as possible (the first n % world get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


VOCAB_GRANULE = 64     # vocabulary slices start at multiples of this many entries


def vocab_span(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's vocabulary rows: span() of whole VOCAB_GRANULE blocks, so that each rank's columns
    of the logits start 128-byte aligned (bf16) however odd the vocabulary (GPT-2's 50257)."""
    blocks = -(-vocab // VOCAB_GRANULE)
    if blocks < world:
        raise ValueError(f"vocab_size ({vocab}) has fewer blocks of {VOCAB_GRANULE} than the tensor-parallel size "
                         f"{world}")
    start, stop = span(blocks, rank, world)
    return min(vocab, start * VOCAB_GRANULE), min(vocab, stop * VOCAB_GRANULE)


def even_span(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """span() of n items that must split evenly; ValueError naming `what` otherwise."""
    if n % world:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {world}")
    return span(n, rank, world)


def kv_head_span(kv_heads: int, heads: int, rank: int, world: int) -> tuple[int, int]:
    """The key/value heads rank holds when its query heads are span(heads): its share when they split evenly,
    else (fewer key/value heads than ranks) the one head its query heads share, replicated over world / kv_heads
    ranks."""
    even_span(heads, rank, world, "the number of attention heads")
    if kv_heads % world == 0:
        return span(kv_heads, rank, world)
    if world % kv_heads:
        raise ValueError(f"the number of key/value heads ({kv_heads}) neither divides by nor divides the "
                         f"tensor-parallel size {world}")
    head = rank * kv_heads // world
    return head, head + 1


# -- communicators ----------------------------------------------------------------------------------------

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


# -- rendezvous and watchdog ------------------------------------------------------------------------------

def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _receive(sock: socket.socket, deadline: float, what: str) -> dict:
    """One JSON line from sock before `deadline` (time.monotonic); RankError naming `what` otherwise."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RankError(f"{what}: no answer in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except socket.timeout:
            raise RankError(f"{what}: no answer in time") from None
        if not chunk:
            raise RankError(f"{what}: the connection closed (that rank exited)")
        data += chunk
        if len(data) > 1 << 20:
            raise RankError(f"{what}: an oversized message")
    try:
        message = json.loads(data)
    except ValueError:
        raise RankError(f"{what}: a message that is not JSON") from None
    if not isinstance(message, dict):
        raise RankError(f"{what}: a message that is not a JSON object")
    return message


class Link:
    """The ranks' TCP rendezvous at MASTER_ADDR:MASTER_PORT, then their watchdog (see the module doc).

    connect() returns once every rank has arrived with the same WORLD_SIZE; `payload` (rank 0's: e.g. NCCL's
    unique id, any JSON value) reaches every rank as .payload. After it, a rank whose peer's connection drops
    without a goodbye calls on_lost(message) (default: print it and exit the process with EXIT_PEER_LOST)."""

    def __init__(self, dist: Distributed, socks: dict[int, socket.socket], payload, on_lost: Callable[[str], None]):
        self.dist, self.socks, self.payload, self.on_lost = dist, socks, payload, on_lost
        self.closing = False
        self.said_bye: set[int] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._watch, name="tilekit-rank-watchdog", daemon=True)
        self.thread.start()

    @classmethod
    def connect(cls, dist: Distributed, payload=None, *, timeout: float = RENDEZVOUS_TIMEOUT,
                on_lost: Callable[[str], None] | None = None) -> "Link":
        deadline = time.monotonic() + timeout
        where = f"MASTER_ADDR={dist.master_addr} MASTER_PORT={dist.master_port}"
        on_lost = on_lost or _exit_lost
        if dist.rank == 0:
            socks = cls._gather(dist, payload, deadline, where, timeout)
            return cls(dist, socks, payload, on_lost)
        sock = cls._dial(dist, deadline, where, timeout)
        try:
            _send(sock, {"rank": dist.rank, "world_size": dist.world_size})
            # rank 0 answers by its own deadline, which may come up to `timeout` after ours (it may have started
            # later): wait that long too, so that a missing rank is reported as rank 0 saw it
            reply = _receive(sock, deadline + timeout, f"rank {dist.rank}: rendezvous with rank 0 at {where}")
        except BaseException:
            sock.close()
            raise
        if "error" in reply:
            sock.close()
            raise RankError(f"rank {dist.rank}: {shown(reply['error'])}")
        return cls(dist, {0: sock}, reply.get("payload"), on_lost)

    @staticmethod
    def _dial(dist: Distributed, deadline: float, where: str, timeout: float) -> socket.socket:
        """A connection to rank 0, retried until `deadline` (rank 0 may start later)."""
        last = None
        while time.monotonic() < deadline:
            try:
                return socket.create_connection((dist.master_addr, dist.master_port),
                                                timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except OSError as e:
                last = e
                time.sleep(0.2)
        raise RankError(f"rank {dist.rank}: rank 0 did not answer at {where} within {timeout:g} s ({last})")

    @staticmethod
    def _gather(dist: Distributed, payload, deadline: float, where: str, timeout: float) -> dict:
        """Rank 0: accept every other rank, check their world sizes and ranks, answer each."""
        server = socket.create_server(("", dist.master_port), reuse_port=False)
        socks: dict[int, socket.socket] = {}
        try:
            problem = None
            pending = []
            while len(socks) + len(pending) < dist.world_size - 1:
                left = deadline - time.monotonic()
                if left <= 0:       # the ranks that came are told too, not left waiting for their own timeout
                    missing = sorted(set(range(1, dist.world_size)) - set(socks))
                    problem = f"ranks {missing} did not arrive at {where} within {timeout:g} s"
                    break
                server.settimeout(left)
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    continue
                try:
                    hello = _receive(sock, deadline, "rank 0: rendezvous")
                except RankError:
                    sock.close()
                    continue
                rank, world = hello.get("rank"), hello.get("world_size")     # from whatever connected: untrusted
                if world != dist.world_size:
                    problem = f"rank {quoted(rank)} has WORLD_SIZE={quoted(world)} but rank 0 has WORLD_SIZE=" \
                              f"{dist.world_size}"
                    pending.append(sock)
                elif type(rank) is not int or not 0 < rank < dist.world_size or rank in socks:
                    problem = f"two ranks claim RANK={rank}" if type(rank) is int and rank in socks else \
                        f"a rank claims RANK={quoted(rank)}"
                    pending.append(sock)
                else:
                    socks[rank] = sock
                if problem:
                    break
            for sock in list(socks.values()) + pending:
                _send(sock, {"error": problem} if problem else {"payload": payload})
            if problem:
                for sock in list(socks.values()) + pending:
                    sock.close()
                raise RankError(f"rank 0: {problem}")
            return socks
        finally:
            server.close()

    def _watch(self) -> None:
        """Wait on the peers' connections; a drop without goodbye is a lost rank."""
        socks = dict(self.socks)
        while socks:
            try:
                ready, _, _ = select.select(list(socks.values()), [], [], 0.5)
            except (OSError, ValueError):       # closed by close(): this rank is leaving
                return
            for sock in ready:
                peer = next(r for r, s in socks.items() if s is sock)
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if data:
                    for line in data.splitlines():
                        with self.lock:
                            try:
                                message = json.loads(line)
                            except ValueError:
                                message = {}
                            message = message if isinstance(message, dict) else {}
                            if message.get("bye"):
                                self.said_bye.add(peer)
                            elif message.get("failed"):
                                self._lost(f"rank {self.dist.rank}: rank {peer} failed: {shown(message['failed'])}")
                    continue
                del socks[peer]
                with self.lock:
                    if peer not in self.said_bye and not self.closing:
                        self._lost(f"rank {self.dist.rank}: rank {peer} exited without closing the group (it died "
                                   "or was killed); stopping")

    def _lost(self, message: str) -> None:
        self.closing = True
        self.on_lost(message)

    def close(self, failed: str | None = None, timeout: float = 30.0) -> None:
        """Say goodbye (or that this rank failed, naming why) and close; rank 0 first waits for the others'."""
        with self.lock:
            if self.closing:
                return
            self.closing = failed is not None
        for sock in self.socks.values():
            try:
                _send(sock, {"failed": failed} if failed else {"bye": True})
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        if self.dist.rank == 0 and not failed:
            while len(self.said_bye) < len(self.socks) and time.monotonic() < deadline and self.thread.is_alive():
                time.sleep(0.01)
        self.closing = True
        for sock in self.socks.values():
            sock.close()


def _exit_lost(message: str) -> None:
    print(f"tilekit: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


# -- peer memory ------------------------------------------------------------------------------------------

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


# -- NCCL ------------------------------------------------------------------------------------------------

NCCL_DTYPES = {"int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}   # nccl.h
NCCL_SUM = 0


def load_nccl() -> tuple[object, str]:
    """(cupy.cuda.nccl, how it was found): CuPy's binding as it loads, else after preloading the libnccl.so.2 that
    PyTorch's nvidia-nccl wheels ship (site-packages/nvidia/nccl/lib or nvidia/cu13/lib) with RTLD_GLOBAL.
    RuntimeError naming both tries if neither works."""
    import ctypes
    import glob
    import importlib
    import importlib.util
    try:
        from cupy.cuda import nccl
        if getattr(nccl, "available", True):
            return nccl, "cupy.cuda.nccl"
        first = "cupy.cuda.nccl.available is False"
    except ImportError as e:
        first = str(e)
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = sorted(path for root in roots       # nvidia/nccl/lib (cu12 wheels), nvidia/cu13/lib
                   for path in glob.glob(os.path.join(root, "*", "lib", "libnccl.so.2")))
    if not found:
        raise RuntimeError(f"NCCL is not available: CuPy's binding failed ({first}) and no libnccl.so.2 of an "
                           "nvidia-nccl wheel (PyTorch installs one) was found under site-packages/nvidia; install "
                           "nvidia-nccl-cu13 (or -cu12, matching CuPy's CUDA) or NCCL")
    try:
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise RuntimeError(f"NCCL is not available: CuPy's binding failed ({first}), and {found[0]} could not be "
                           f"loaded ({e})") from None
    for name in [n for n in sys.modules if n.startswith("cupy.cuda.nccl") or n.endswith("libs.nccl")]:
        del sys.modules[name]
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
        if not getattr(nccl, "available", True):
            raise ImportError("cupy.cuda.nccl.available is False")
    except ImportError as e:
        raise RuntimeError(f"NCCL is not available: CuPy's binding failed ({first}), and again after preloading "
                           f"{found[0]} ({e})") from None
    return nccl, f"cupy.cuda.nccl with {found[0]} preloaded"


def nccl_unique_id(payload):
    """Rank 0's NCCL unique id as its binding takes it (CuPy 14: bytes; older: a tuple of ints), from the
    rendezvous payload {"id": [ints], "bytes": bool}; anything else is refused."""
    values = payload.get("id") if isinstance(payload, dict) else None
    if (not isinstance(values, list) or not 0 < len(values) <= 1024
            or not all(isinstance(v, int) and not isinstance(v, bool) and -128 <= v <= 255 for v in values)):
        raise RuntimeError(f"rank 0 sent no usable NCCL unique id (got {str(payload)[:80]})")
    return bytes(v % 256 for v in values) if payload.get("bytes") is True else tuple(values)


class NcclCommunicator(Communicator):
    """A rank of an NCCL group on GPU LOCAL_RANK, joined through a Link (its rendezvous and watchdog).
    NCCL_NVLS_ENABLE defaults to 0 (no NVLink multicast: its buffers take GPU memory and it is not needed for
    two-rank all-reduces of decode's small messages)."""

    def __init__(self, dist: Distributed, *, timeout: float = RENDEZVOUS_TIMEOUT):
        import cupy
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.nccl, self.found = load_nccl()
        if dist.local_rank >= cupy.cuda.runtime.getDeviceCount():
            raise ValueError(f"LOCAL_RANK={dist.local_rank} but this host has "
                             f"{cupy.cuda.runtime.getDeviceCount()} GPUs")
        cupy.cuda.Device(dist.local_rank).use()
        self.rank, self.world_size = dist.rank, dist.world_size
        unique = self.nccl.get_unique_id() if dist.rank == 0 else None
        payload = None if unique is None else {"id": list(unique), "bytes": isinstance(unique, bytes)}
        self.link = Link.connect(dist, payload, timeout=timeout)
        self.comm = self.nccl.NcclCommunicator(dist.world_size, nccl_unique_id(self.link.payload), dist.rank)
        self.peers = PeerMemory(dist.rank, dist.world_size, dist.local_rank, self._sum_ints)

    def all_reduce(self, x, out=None):
        import cupy
        out = x if out is None else out
        if not (x.flags.c_contiguous and out.flags.c_contiguous) or x.shape != out.shape or x.dtype != out.dtype:
            raise ValueError(f"all_reduce needs C-contiguous arrays of one shape and dtype, got {x.dtype} "
                             f"{x.shape} and {out.dtype} {out.shape}")
        if x.dtype.name not in NCCL_DTYPES:
            raise ValueError(f"all_reduce: NCCL has no {x.dtype.name}")
        if x.size and self.peers.takes(x):
            rows = (-1, x.shape[-1] if x.ndim else 1)
            self.peers.all_reduce(x.reshape(rows), out.reshape(rows))
        else:
            self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, NCCL_DTYPES[x.dtype.name], NCCL_SUM,
                                cupy.cuda.get_current_stream().ptr)
        return out

    def all_reduce_norm(self, x, weight, eps: float, y) -> bool:
        from tilekit.kernels.peer_all_reduce import MAX_NORM_WIDTH
        fits = (x.ndim == 2 and x.flags.c_contiguous and x.dtype.name in FLOAT_DTYPES
                and 0 < x.shape[1] <= MAX_NORM_WIDTH and weight.shape == (x.shape[1],) and weight.dtype == x.dtype
                and y.shape == x.shape and y.dtype == x.dtype and y.flags.c_contiguous)
        if not (fits and self.peers.takes(x)):
            return False
        self.peers.all_reduce(x, x, (weight, float(eps), y))
        return True

    def _sum_ints(self, table: np.ndarray) -> np.ndarray:
        """An int32 host table summed over the ranks through NCCL (the peer memory's setup)."""
        import cupy
        dev = cupy.asarray(table, dtype=cupy.int32)
        self.comm.allReduce(dev.data.ptr, dev.data.ptr, dev.size, NCCL_DTYPES["int32"], NCCL_SUM,
                            cupy.cuda.get_current_stream().ptr)
        return cupy.asnumpy(dev)

    def barrier(self) -> None:
        self._sum_ints(np.ones((1,), np.int32))

    def close(self, failed: bool = False, timeout: float = 30.0) -> None:
        """Leave the group. The graphs of the models holding this communicator are dropped and this GPU's work
        finished while the watchdog still watches the other ranks; then NCCL's communicator is destroyed in a daemon
        thread waited on for `timeout` s (a graph held elsewhere keeps NCCL waiting: a warning says so, and the
        process still exits, NCCL's resources with it)."""
        import cupy
        if failed:
            self.link.close("an error on that rank")
            return
        self.release_holders()
        gc.collect()
        cupy.cuda.runtime.deviceSynchronize()
        if self.peers.usable:
            self.barrier()      # no peer still writes into this rank's inboxes
            self.peers.close()
        self.link.close()
        device = cupy.cuda.Device().id

        def destroy():
            cupy.cuda.Device(device).use()
            self.comm.destroy()
        done = threading.Thread(target=destroy, name="tilekit-nccl-destroy", daemon=True)
        done.start()
        done.join(timeout)
        if done.is_alive():
            print(f"tilekit: rank {self.rank}: NCCL's communicator was not destroyed within {timeout:g} s (a CUDA graph "
                  "captured with its all-reduces is still alive); it goes when the process exits", file=sys.stderr,
                  flush=True)


def join(timeout: float = RENDEZVOUS_TIMEOUT) -> NcclCommunicator | None:
    """This process's NCCL rank as torchrun's variables place it; None when they are unset (one process)."""
    dist = distributed()
    return None if dist is None else NcclCommunicator(dist, timeout=timeout)


# -- launching ranks ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world_size: int, argv: Sequence[str], *, quiet_ranks: bool = True, grace: float = 10.0,
           program: Sequence[str] = (sys.executable, "-m", "tilekit"), env: Mapping[str, str] | None = None) -> int:
    """Run `program argv` (`python -m tilekit argv`) as world_size ranks on this host (torchrun's variables set,
    MASTER_ADDR 127.0.0.1 and a free port; `env` over this process's environment); rank 0's output is shown, the
    others' stdout dropped when quiet_ranks.
    When a rank exits with an error the others are stopped (SIGTERM, then SIGKILL after `grace` s) and its status
    returned, after a line naming it; 0 when all succeed."""
    if world_size < 1:
        raise ValueError(f"the tensor-parallel size must be positive, got {world_size}")
    port = free_port()
    procs = []
    for rank in range(world_size):
        variables = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                     "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "NCCL_NVLS_ENABLE": "0"}
        stdout = subprocess.DEVNULL if rank and quiet_ranks else None
        procs.append(subprocess.Popen([*program, *argv], env=variables, stdout=stdout))
    status = 0
    try:
        while [p.poll() for p in procs].count(None):
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                rank, status = failed[0]
                print(f"tilekit: rank {rank} exited with status {status}; stopping the other ranks", file=sys.stderr,
                      flush=True)
                break
            time.sleep(0.05)
    finally:
        _stop([p for p in procs if p.poll() is None], grace)
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return status


def _stop(procs: list, grace: float) -> None:
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

