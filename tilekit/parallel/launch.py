"""Starting ranks: launch() runs a command as N ranks on this host with torchrun's variables set (`tilekit generate
--tp N`), and ranks() says whether this process is one rank of a launched group or must start them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Mapping, Sequence

from tilekit.device import gpu_unavailable_reason
from tilekit.env import Distributed, distributed


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


def placement(tp: int | None, on_gpu: bool) -> tuple[Distributed | None, bool]:
    """(this process's place among tensor-parallel ranks or None, whether to start `tp` ranks here): tp alone (> 1)
    starts tp ranks; under torchrun's variables this process is one rank, and tp, if given, must agree. Either needs
    `on_gpu` and GPUs (tp of them), checked before any rank starts; ValueError naming what is wrong otherwise."""
    dist = distributed()
    if dist is not None and tp is not None and tp != dist.world_size:
        raise ValueError(f"--tp {tp} but WORLD_SIZE={dist.world_size}: a rank runs with as many ranks as the "
                         "launcher started")
    start = dist is None and tp is not None and tp > 1
    if not start and (dist is None or dist.world_size == 1):
        return None, False
    if not on_gpu:
        raise ValueError("tensor parallelism (--tp or WORLD_SIZE) needs --device cuda")
    reason = gpu_unavailable_reason()
    if reason:
        raise ValueError(f"tensor parallelism needs GPUs: {reason}")
    if start:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if count < tp:
            raise ValueError(f"--tp {tp} needs {tp} GPUs, this host shows {count}")
    return dist, start
