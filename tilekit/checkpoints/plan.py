"""Load plans: where each checkpoint tensor goes (Target: its shape and dtype in the file, the array it fills, a
transform, the part a tensor-parallel rank reads), a file tensor kept in another form than ours (Piece), and the
check of a file's tensors against a plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from tilekit.checkpoints.safetensors import FLOATS, TensorInfo
from tilekit.parallel.splits import part_fields, part_problem, part_shape, take_part
from tilekit.untrusted import quoted

TARGET_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes. `shape`: its shape in the file. `out`: the array to write (a view of a
    larger one is fine, e.g. rows of a fused weight), a function returning one (called when the tensor is
    reached), or None for a new `dtype` array of `shape`. `transform(src, out)`, on the device, instead of
    convert(src, out): src is the file's tensor as a device array (FP8 as uint8 bits), valid only during the
    call. `accept`: the safetensors dtypes allowed. `optional`: the file may lack it. `part`: (axis, start, stop)
    or (axis, start, stop, groups), only that slice of the file's tensor is loaded (a tensor-parallel shard; `out`
    has the slice's shape; with groups g the axis is g equal blocks, e.g. a fused [q, k, v], and start:stop is
    taken from each): rows (axis 0, one group) are read alone, being contiguous in the file; another slice reads
    the tensor and keeps the slice in the device conversion (only the slice is allocated)."""

    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    out: object = None
    transform: Callable | None = None
    accept: tuple[str, ...] = FLOATS
    optional: bool = False
    part: tuple[int, ...] | None = None

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of what is written: `shape`, or its `part`."""
        return tuple(self.shape) if self.part is None else part_shape(self.shape, self.part)


def narrowed(info: TensorInfo, target: Target) -> tuple[TensorInfo, Target]:
    """A job of a sliced target as one of a whole one: rows as a shorter tensor of the file; another slice as the
    whole tensor whose transform (or conversion) takes the slice."""
    if target.part is None:
        return info, target
    axis, start, stop, groups = part_fields(target.part)
    if axis == 0 and groups == 1:
        row = info.nbytes // info.shape[0] if info.shape[0] else 0
        shape = (stop - start,) + info.shape[1:]
        return (TensorInfo(info.name, info.dtype, shape, info.file, info.start + start * row, info.start + stop * row),
                dataclasses.replace(target, shape=shape, part=None))
    inner, part = target.transform or convert, target.part
    return info, dataclasses.replace(target, shape=target.out_shape, part=None,
                                     transform=lambda src, out: inner(take_part(src, part), out))


def convert(src, out) -> None:
    """out[...] = src in out's dtype (NumPy or CuPy; CuPy 14 casts bfloat16), out possibly strided. (What overflows
    is refused after the load: LoadStream.check_finite.)"""
    with np.errstate(over="ignore"):
        out[...] = src


def tensor_problems(found: Mapping[str, tuple[str, tuple[int, ...]]], plan: Mapping[str, Target],
                    ignore: tuple[str, ...] = ()) -> list[str]:
    """Every unexpected (not ending in one of `ignore`), wrongly typed, misshapen and missing tensor of `found`
    (name -> (safetensors dtype, shape)) against `plan`; missing ones last, so a wrong prefix shows first."""
    problems = []
    for name, (dtype, shape) in found.items():
        target = plan.get(name)
        if target is None:
            if not name.endswith(ignore):
                problems.append(f"unexpected tensor {quoted(name)}")
        elif dtype not in target.accept:
            problems.append(f"tensor {quoted(name)} has dtype {dtype}, expected {' or '.join(target.accept)}")
        elif shape != tuple(target.shape):
            problems.append(f"tensor {quoted(name)} has shape {shape}, expected {tuple(target.shape)}")
    return problems + [f"missing tensor {quoted(name)} (shape {tuple(t.shape)})" for name, t in plan.items()
                       if name not in found and not t.optional]


def listing(heading: str, problems: list[str], most: int = 10) -> str:
    """`heading`, then up to `most` problems, one per indented line."""
    more = f"\n  ... and {len(problems) - most} more" if len(problems) > most else ""
    return heading + ":\n  " + "\n  ".join(problems[:most]) + more


def check_target(name: str, t: Target, out=None) -> None:
    """ValueError for a plan entry that cannot work (a caller's mistake, not the file's); `out`: the array its
    allocator made."""
    if t.dtype not in TARGET_DTYPES:
        raise ValueError(f"plan for {quoted(name)}: dtype must be one of {TARGET_DTYPES}, got {t.dtype!r}")
    if t.transform is None and any(d.startswith("F8") for d in t.accept):
        raise ValueError(f"plan for {quoted(name)}: accepting FP8 needs a transform (FP8 arrives as uint8 bits)")
    problem = t.part is not None and part_problem(tuple(t.shape), tuple(t.part))
    if problem:
        raise ValueError(f"plan for {quoted(name)}: part {t.part} is {problem}")
    out = t.out if out is None else out
    if out is not None and not callable(out) and t.transform is None and (
            tuple(out.shape) != t.out_shape or str(out.dtype) != t.dtype):
        raise ValueError(f"plan for {quoted(name)}: out is {out.dtype} {tuple(out.shape)}, expected {t.dtype} "
                         f"{t.out_shape}")


@dataclass(frozen=True)
class Piece:
    """A tensor a file keeps in another form than ours: `shape` in the file, written into ours[index] (a view) by
    `transform(src, out)` (None: copied as it is)."""

    ours: str
    shape: tuple[int, ...]
    index: tuple = ()
    transform: Callable | None = None
    part: tuple[int, ...] | None = None     # Target.part: only this slice of the file's tensor (a shard of ours)
