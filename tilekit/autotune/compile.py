"""Ahead-of-time compilation without a GPU, and parallel pre-compilation before tuning.

`signature()` builds by hand the exact KernelSignature that cuTile's JIT infers at launch
(same calling convention, alignment and divisibility facts), so compiling it with
`export_kernel` in worker processes fills cuTile's on-disk cubin cache with the very entries
the measuring process will ask for. The same signatures let CI prove on a CPU-only machine that
every kernel compiles for sm_90 and sm_100.
"""

from __future__ import annotations

import io
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Sequence

import cuda.tile as ct
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, ConstantConstraint,
                                   KernelSignature, ScalarConstraint, export_kernel)

_DTYPES = {"bfloat16": ct.bfloat16, "float16": ct.float16, "float32": ct.float32,
           "int32": ct.int32, "int64": ct.int64, "uint8": ct.uint8}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8, "uint8": 1}


@dataclass(frozen=True)
class ArraySpec:
    """What the JIT sees of an array argument: dtype, shape, element strides, base alignment."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None   # None: C-contiguous
    aligned16: bool = True                   # allocations are 256-byte aligned

    def element_strides(self) -> tuple[int, ...]:
        if self.strides is not None:
            return tuple(self.strides)
        strides, step = [], 1
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        return tuple(reversed(strides))


def _array_constraint(spec: ArraySpec) -> tuple[ArrayConstraint, bool]:
    """(constraint, needs calling convention v2) following the JIT's inference rules."""
    itemsize = _ITEMSIZE[spec.dtype]
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


def compile_config(op_name: str, problem: dict, config: dict, arch: str) -> float:
    """Compile one (problem, config) of an op to a cubin for `arch`; returns seconds taken.

    Fills cuTile's disk cache as a side effect (that is the point when tuning).
    """
    from tilekit.autotune.op import registered_ops
    op = registered_ops()[op_name]
    start = time.perf_counter()
    for kernel, args in op.signature(problem, config):
        plan_kernel = op.make_plan(config).kernel if kernel is op.kernel else kernel
        export_kernel(plan_kernel, [signature(plan_kernel, args)], io.BytesIO(),
                      gpu_code=arch, output_format="cubin")
    return time.perf_counter() - start


def precompile(tasks: Sequence[tuple[str, dict, dict]], arch: str, *, workers: int | None = None,
               deadline: float | None = None, progress=None) -> tuple[set[int], dict[int, str]]:
    """Compile (op name, problem, config) tasks in parallel processes.

    Returns (indices that compiled, {index: error}). Tasks unfinished at `deadline`
    (time.monotonic) are left out; `progress(index)` is called as each finishes.
    """
    workers = workers or max(1, min(len(tasks), (os.cpu_count() or 2) - 1, 16))
    ok, errors = set(), {}

    def record(i, run):
        try:
            run()
            ok.add(i)
        except Exception as e:  # a config the compiler rejects is simply not a candidate
            errors[i] = f"{type(e).__name__}: {e}"
        if progress:
            progress(i)

    if workers == 1:
        for i, task in enumerate(tasks):
            if deadline is not None and time.monotonic() > deadline:
                break
            record(i, lambda: compile_config(*task, arch))
        return ok, errors
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(compile_config, *task, arch): i for i, task in enumerate(tasks)}
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for future in as_completed(futures, timeout=remaining):
                record(futures[future], future.result)
        except (FutureTimeout, KeyboardInterrupt):
            for future in futures:
                future.cancel()
            if not isinstance(sys.exc_info()[1], FutureTimeout):
                raise
    return ok, errors
