"""Ahead-of-time compilation without a GPU, and parallel pre-compilation before tuning.

`signature()` builds by hand the exact KernelSignature that cuTile's JIT infers at launch
(same calling convention, alignment and divisibility facts), so compiling it with
`export_kernel` in worker processes fills cuTile's on-disk cubin cache with the very entries
the measuring process will ask for. The same signatures let CI prove on a CPU-only machine that
every kernel compiles for sm_90 and sm_100.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import signal
import sys
import threading
import time
import types
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing import get_context
from typing import Sequence

import cuda.tile as ct
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, ConstantConstraint,
                                   KernelSignature, ScalarConstraint, export_kernel)

from tilekit.autotune.arrays import ITEMSIZE, ArraySpec, MetaArray, as_device_array, info

_DTYPES = {"bfloat16": ct.bfloat16, "float16": ct.float16, "float32": ct.float32,
           "int32": ct.int32, "int64": ct.int64, "int8": ct.int8, "uint8": ct.uint8}


def _array_constraint(spec: ArraySpec) -> tuple[ArrayConstraint, bool]:
    """(constraint, needs calling convention v2) following the JIT's inference rules."""
    itemsize = ITEMSIZE[spec.dtype]
    strides = spec.element_strides()
    order = sorted((s, n) for s, n in zip(strides, spec.shape))
    disjoint = all(s > 0 for s, _ in order) and all(
        order[i + 1][0] >= order[i][0] * order[i][1] for i in range(len(order) - 1))
    small = len(spec.shape) <= 5
    stride_constant = tuple(1 if (small and s == 1) else None for s in strides)
    shape_constant = tuple(1 if (small and n == 1) else None for n in spec.shape)
    stride_div = tuple(1 if (not small or c is not None or (s * itemsize) % 16) else 16 // itemsize
                       for s, c in zip(strides, stride_constant))
    shape_div = tuple(1 if (not small or c is not None or n % 16) else 16
                      for n, c in zip(spec.shape, shape_constant))
    constraint = ArrayConstraint(
        _DTYPES[spec.dtype], len(spec.shape), index_dtype=ct.int32, stride_lower_bound_incl=0,
        alias_groups=(), may_alias_internally=not disjoint, stride_constant=stride_constant,
        shape_constant=shape_constant, stride_divisible_by=stride_div, shape_divisible_by=shape_div,
        base_addr_divisible_by=16 if spec.aligned16 else 1)
    return constraint, any(c is not None for c in shape_constant)


def signature(kernel, args: Sequence) -> KernelSignature:
    """The KernelSignature cuTile's JIT would use to launch `kernel` with `args` (ArraySpecs for arrays)."""
    params, v2 = [], False
    annotations = kernel._annotated_function.parameter_annotations
    if len(annotations) != len(args):
        raise ValueError(f"{kernel._pyfunc.__name__} takes {len(annotations)} arguments, got {len(args)}")
    for ann, arg in zip(annotations, args):
        if isinstance(arg, ArraySpec):
            constraint, needs_v2 = _array_constraint(arg)
            params.append(constraint)
            v2 |= needs_v2
        elif getattr(ann, "constant", False):
            params.append(ConstantConstraint(arg))
        elif isinstance(arg, bool):
            params.append(ScalarConstraint(ct.bool_))
        elif isinstance(arg, int):
            params.append(ScalarConstraint(ct.int32))
        elif isinstance(arg, float):
            params.append(ScalarConstraint(ct.float32))
        else:
            raise TypeError(f"cannot describe kernel argument {arg!r}")
    cconv = CallingConvention.cutile_python_v2() if v2 else CallingConvention.cutile_python_v1()
    return KernelSignature(params, cconv)


def compile_config(module: str, op_name: str, problem: dict, config: dict, arch: str) -> float:
    """Compile every launch of one (problem, config) of an op to a cubin for `arch`; returns seconds.

    `module` declares the op (a worker process imports it). Fills cuTile's disk cache as a side
    effect (that is the point when tuning).
    """
    importlib.import_module(module)
    from tilekit.autotune.registry import registered_ops
    op = registered_ops()[op_name]
    start = time.perf_counter()
    for kernel, args in op.compile_args(problem, config):
        export_kernel(kernel, [signature(kernel, args)], io.BytesIO(), gpu_code=arch, output_format="cubin")
    return time.perf_counter() - start


def describe_error(e: Exception) -> str:
    """One line for a failed compile. cuTile's compiler errors without a source location cannot format
    themselves (their str() raises): their message stands alone then."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001
        return f"{type(e).__name__}: {getattr(e, 'message', '')}"


_main_lock = threading.Lock()


@contextlib.contextmanager
def _bare_main():
    """A spawned worker re-runs the parent's __main__ script, which in a user's unguarded script calls
    ops again (auto mode): while workers start, __main__ is a bare module, so they import only tilekit.
    One pool at a time swaps it, so the real module always comes back."""
    with _main_lock:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def compile_launch(module: str, op_name: str, config: dict, kernel_name: str, args: tuple, arch: str) -> float:
    """Compile one collected launch (precompile_launches) to a cubin for `arch`: the op's kernel named
    `kernel_name`, with the config's hints where that launch takes them; returns seconds."""
    importlib.import_module(module)
    from tilekit.autotune.registry import registered_ops
    op = registered_ops()[op_name]
    launch = next(launch for launch in op.launches if launch.kernel._pyfunc.__name__ == kernel_name)
    kernel = op.hinted(config) if launch.hinted else launch.kernel
    start = time.perf_counter()
    export_kernel(kernel, [signature(kernel, args)], io.BytesIO(), gpu_code=arch, output_format="cubin")
    return time.perf_counter() - start


def _address(a) -> int:
    if isinstance(a, MetaArray):
        return 0
    return a.data_ptr() if hasattr(a, "data_ptr") else a.data.ptr


def launch_job(op, config: dict, kernel, args: tuple) -> tuple:
    """The picklable (module, op name, config, kernel name, arguments) of one launch collected by
    collecting_launches, each device array replaced by the ArraySpec the JIT would see of it."""
    described = []
    for a in args:
        if a is None or isinstance(a, (bool, int, float, str)):
            described.append(a)
            continue
        try:
            i = info(as_device_array(a, "argument"), "argument")
        except TypeError:             # a compile-time constant that is not an array
            described.append(a)
            continue
        described.append(ArraySpec(i.dtype, tuple(i.shape), tuple(i.strides), aligned16=_address(a) % 16 == 0))
    return (op.kernel._pyfunc.__module__, op.name, dict(config), kernel._pyfunc.__name__, tuple(described))


_precompiled: set[str] = set()       # launches this process compiled ahead already (their cubins are cached)


def precompile_launches(collected, arch: str, *, workers: int | None = None, timeout_s: float | None = None,
                        progress=None) -> tuple[int, dict[int, str]]:
    """Compile the distinct launches of collecting_launches() (one per cubin: _compiled_as) in parallel processes, so
    that running them next finds every cubin in cuTile's cache; launches this process compiled ahead before are
    skipped (no pool starts when none is left). After timeout_s seconds the workers still compiling are stopped.
    progress(done, total, name, error) follows each launch as it ends (name: kernel and config; error: None or why it
    failed). Returns (how many launches it set out to compile, {index: why one is not compiled}, each naming its
    kernel and config); a launch not compiled here compiles on its first run as before."""
    jobs, keys, seen = [], [], set(_precompiled)
    for op, config, kernel, args in collected:
        job = launch_job(op, config, kernel, args) + (arch,)
        key = repr((_compiled_as(kernel, job), os.environ.get("CUDA_TILE_CACHE_DIR")))    # the cache the workers fill
        if key not in seen:
            seen.add(key)
            jobs.append(job)
            keys.append(key)
    if not jobs:
        return 0, {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    names = [f"{job[1]}.{job[3]} {job[2]}" for job in jobs]
    ended = []

    def ended_one(i: int, error: str | None) -> None:
        ended.append(i)
        if progress:
            progress(len(ended), len(jobs), names[i], error)
    ok, errors = _run_pool(compile_launch, jobs, workers, deadline, ended_one)
    _precompiled.update(keys[i] for i in ok)
    for i in range(len(jobs)):
        if i in errors:
            errors[i] = f"{names[i]}: {errors[i]}"
        elif i not in ok:
            errors[i] = f"{names[i]}: not compiled within {timeout_s:g} s"
    return len(jobs), errors


def _compiled_as(kernel, job: tuple) -> tuple:
    """What one cubin serves: the job with its arguments as the JIT's signature sees them (launches whose arrays
    differ only in sizes of the same divisibility compile once)."""
    try:
        described = repr(signature(kernel, job[4]))
    except Exception:  # noqa: BLE001 - an argument signature() cannot describe: the worker reports what is wrong
        described = repr(job[4])
    return job[:4] + (described,) + job[5:]


def precompile(tasks: Sequence[tuple], arch: str, *, workers: int | None = None,
               deadline: float | None = None, progress=None) -> tuple[set[int], dict[int, str]]:
    """Compile (op, problem, config) tasks in parallel processes.

    Returns (indices that compiled, {index: error}). Tasks unfinished at `deadline`
    (time.monotonic) are left out; `progress(index)` is called as each finishes.
    """
    jobs = [(op.kernel._pyfunc.__module__, op.name, problem, config, arch) for op, problem, config in tasks]
    return _run_pool(compile_config, jobs, workers, deadline, progress and (lambda i, error: progress(i)))


def _run_pool(fn, jobs: list[tuple], workers: int | None, deadline: float | None = None,
              progress=None) -> tuple[set[int], dict[int, str]]:
    """fn(*job) for every job in spawned worker processes (in this one for workers=1); progress(index, error or None)
    as each ends."""
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 16))
    ok, errors = set(), {}

    def record(i, run):
        try:
            run()
            ok.add(i)
        except Exception as e:  # a config the compiler rejects is simply not a candidate
            errors[i] = describe_error(e)
        if progress:
            progress(i, errors.get(i))

    if workers == 1:
        for i, job in enumerate(jobs):
            if deadline is not None and time.monotonic() > deadline:
                break
            record(i, lambda: fn(*job))
        return ok, errors
    # each worker leads a process group of its own, so that stopping it also stops the compiler it runs
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=os.setpgrp)
    futures = {}
    try:
        with _bare_main():                  # workers start as tasks are submitted
            futures = {pool.submit(fn, *job): i for i, job in enumerate(jobs)}
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        for future in as_completed(futures, timeout=remaining):
            record(futures[future], future.result)
    except FutureTimeout:
        for future, i in futures.items():      # those that ended while the last one was recorded
            if future.done() and not future.cancelled() and i not in ok and i not in errors:
                record(i, future.result)
        _stop(pool)
    except BaseException:               # Ctrl-C: the compiles still running are stopped, not waited for
        _stop(pool)
        raise
    else:
        pool.shutdown()
    return ok, errors


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now: queued jobs cancelled, each worker's process group (the worker and the compiler it runs, which
    may take minutes) terminated, then killed if it has not ended within seconds."""
    processes = list((getattr(pool, "_processes", None) or {}).values())   # no public handle before Python 3.14
    pool.shutdown(wait=False, cancel_futures=True)
    for sig in (signal.SIGTERM, signal.SIGKILL):             # SIGKILL: what outlived the SIGTERM
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
                os.killpg(process.pid, sig)          # the worker's group: its compiler too
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)             # a worker still starting is not in its group yet
        deadline = time.monotonic() + 5
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
