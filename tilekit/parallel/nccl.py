"""NCCL's communicator, through CuPy's binding (cupy.cuda.nccl): it takes raw pointers and a stream, needs no
torch in the process, and CuPy is what the models already run on (torch.distributed would bring a second allocator
and stream model into every rank). Ranks find each other through tilekit.parallel.rendezvous."""

from __future__ import annotations

import gc
import os
import sys
import threading

import numpy as np

from tilekit.autotune.arrays import FLOAT_DTYPES
from tilekit.env import Distributed, distributed
from tilekit.parallel.comm import Communicator
from tilekit.parallel.peer import PeerMemory
from tilekit.parallel.rendezvous import RENDEZVOUS_TIMEOUT, Link


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
