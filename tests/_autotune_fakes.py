"""A fake op, devices and entries for CPU tests of the tuning database and dispatch."""

from __future__ import annotations

import itertools
import os

from tilekit.autotune.arrays import MetaArray
from tilekit.autotune.keys import pow2_bucket
from tilekit.autotune.op import Binding, Launch, Op
from tilekit.autotune.space import SearchSpace
from tilekit.device import DeviceInfo, toolchain

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", "sm_90", 132)
H100_PCIE = DeviceInfo("NVIDIA H100 PCIe", "sm_90", 114)
H200 = DeviceInfo("NVIDIA H200", "sm_90", 132)
B200 = DeviceInfo("NVIDIA B200", "sm_100", 148)

SPACE = SearchSpace(A=(1, 2, 4), occupancy=(1, 2))
DEFAULT = {"A": 1, "occupancy": 1}

_names = itertools.count()


def fake_kernel_body(x):
    """Stands in for a cuTile kernel's Python function: only its source matters (kernel_hash)."""
    return x + 1


def other_kernel_body(x):
    return x + 2


class FakeKernel:
    def __init__(self, func=fake_kernel_body):
        self._pyfunc = func
        self.hint_calls: list[dict] = []

    def replace_hints(self, **hints):
        self.hint_calls.append(hints)
        return self


def _grid(p, c):
    return (1, 1, 1)


def _constants(p, c):
    return (c["A"],)


def _no_arrays(p):
    return {}


def _bind(infos, flags):
    (x,) = infos
    return Binding(problem=dict(dtype=x.dtype, M=x.shape[0], N=x.shape[1]), arrays={})


def make_op(space: SearchSpace = SPACE, func=fake_kernel_body, key=None, choices=None, borrowable=None) -> Op:
    """A new op with a unique name (the registry is keyed by name), taking one 2-D array x; its key is
    (dtype, M bucketed, N) unless given."""
    return Op(f"fake_xyz{os.getpid()}_{next(_names)}", args=("x",), key=key or dict(dtype=None, M=pow2_bucket, N=None),
              space=space, default=lambda p: dict(DEFAULT), arrays=_no_arrays,
              launches=(Launch(FakeKernel(func), _grid, (), _constants),), bind=_bind, choices=choices,
              borrowable=borrowable)


def call_config(op: Op, M: int = 1000, N: int = 768, dtype: str = "bfloat16", device: int = 0) -> dict:
    """The config a call of `op` on an (M, N) array of `device` runs (a MetaArray: nothing launches)."""
    return op.plan_for((MetaArray((M, N), dtype, device=device),))[0].config


def entry(op: Op, config: dict, device: DeviceInfo = H100, time_us: float = 10.0,
          **overrides) -> dict:
    """An entry shaped like the tuner's `_entry`."""
    e = {"config": dict(config), "time_us": time_us, "default_config": dict(DEFAULT),
         "default_time_us": 20.0, "kernel_hash": op.kernel_hash(), "space_hash": op.space_hash(),
         "toolchain": toolchain(), "device": device.as_dict(), "candidates": len(op.space),
         "measured": len(op.space), "tuned_at": "2025-01-01T00:00:00+00:00"}
    e.update(overrides)
    return e


def admitted_config(op: Op, problem: dict) -> dict:
    """A config an entry for `problem` may hold: the op's default for it, checked to be one its space admits there."""
    tuning = op.tuning_problem(problem)
    config = op.default(tuning)
    assert op.space.admits(config, tuning), f"{op.name}: the default {config} is no candidate for {problem}"
    return config


def problem(M: int = 1024, N: int = 768, dtype: str = "bfloat16") -> dict:
    return {"dtype": dtype, "M": M, "N": N}


def run_together(target, args_list, timeout: float = 120) -> list[int | None]:
    """Start one spawned process per args tuple, release them at once, and return their exit codes.

    target(*args, start) must wait on the `start` event before doing its work, so that the
    processes really overlap.
    """
    import multiprocessing
    import time
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=target, args=(*args, start)) for args in args_list]
    for p in procs:
        p.start()
    time.sleep(0.2)
    start.set()
    for p in procs:
        p.join(timeout)
    return [p.exitcode for p in procs]
