"""One load's data path: pieces of tensors read by worker threads into a bounded ring of staging buffers, copied to
the device in order and converted there, every float tensor checked finite. The device is a GPU (CupyDevice:
pinned staging, copies and conversions on its own stream) or the host (HostDevice: NumPy outputs)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from tilekit.autotune.arrays import numpy_dtype
from tilekit.checkpoints.files import ModelFileError, TensorValueError
from tilekit.checkpoints.plan import TARGET_DTYPES, Target, check_target, convert
from tilekit.checkpoints.safetensors import DTYPES, TensorInfo
from tilekit.untrusted import quoted

# float dtype -> (the unsigned integer of its width, its exponent bits): all of them set is an infinity or a NaN
# (FP8 e4m3, which has no infinity: exponent and mantissa bits all set, its NaN codes 0x7F and 0xFF)


EXPONENT_BITS = {"bfloat16": ("uint16", 0x7F80), "float16": ("uint16", 0x7C00), "float32": ("uint32", 0x7F800000),
                 "float64": ("uint64", 0x7FF0000000000000), "float8_e4m3fn": ("uint8", 0x7F)}
FLOAT_BITS = {"F8_E4M3": "float8_e4m3fn"}     # a safetensors dtype DTYPES views as uint8 -> the float it holds


class LoadStream:
    """One load: pieces of tensors read into a ring of staging buffers by as many worker threads (each buffer
    allocated by the first read into it, so that they are pinned side by side while the first pieces are read) and
    copied to the device in order. A staging buffer is read into again only after the device has finished copying
    out of it. Everything else the device does with a tensor (its conversion or transform, its finite checks) is
    queued behind the tensor's last copy on another stream (device.after_copies), so the copies of the next tensors
    never wait for it; a converted tensor arrives in one of two scratch buffers, which a later tensor is copied into
    only once its conversion is done (device.copies_wait)."""

    SCRATCH = 2

    def __init__(self, jobs: list[tuple[TensorInfo, Target]], device, buffers: int, buffer_bytes: int, progress):
        self.jobs, self.device, self.progress = jobs, device, progress
        largest = max((info.nbytes for info, _ in jobs), default=0)
        self.size = max(1, min(buffer_bytes, largest))
        self.pieces = [(j, lo, min(lo + self.size, info.nbytes))
                       for j, (info, _) in enumerate(jobs) for lo in range(0, max(info.nbytes, 1), self.size)]
        self.ring = [None] * min(buffers, len(self.pieces))     # each made by the worker that first reads into it
        self.scratch = [None] * self.SCRATCH        # (buffer, the event its last conversion recorded)
        self.converted = 0
        self.out = {}
        self.finite_checks = []          # (tensor, problem): the slot of each in self.flags
        self.flags = device.flags(2 * len(jobs))
        for file in {id(info.file): info.file for info, _ in jobs}.values():    # read ahead: each file is read in order
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def read(self, k: int, copied) -> None:
        """Piece k into its staging buffer, once `copied()` says the device is done with that buffer."""
        if copied is not None:
            copied()
        j, lo, hi = self.pieces[k]
        info = self.jobs[j][0]
        slot = k % len(self.ring)
        if self.ring[slot] is None:        # pinned in the workers, side by side, while the first pieces are read
            self.ring[slot] = self.device.staging(self.size)
        info.file.readinto(memoryview(self.ring[slot])[:hi - lo], info.start + lo)

    def begin(self, info: TensorInfo, target: Target):
        """The tensor's output array, the raw device bytes its pieces are copied into, and the scratch slot they
        are (None: the output itself, which needs no conversion)."""
        device = self.device
        with device.context():
            out = target.out() if callable(target.out) else target.out
            if out is None:
                out = device.empty(target.shape, target.dtype)
        check_target(info.name, target, out)
        if (target.transform is None and DTYPES[info.dtype][1] == str(out.dtype) and out.flags.c_contiguous
                and out.nbytes == info.nbytes):
            return out, device.raw(out), None
        slot = self.converted % self.SCRATCH
        self.converted += 1
        buffer, converted = self.scratch[slot] or (None, None)
        if converted is not None:
            device.copies_wait(converted)      # its previous tensor's conversion has read it
        if buffer is None or buffer.nbytes < info.nbytes:
            buffer = device.empty((info.nbytes,), "uint8")
        self.scratch[slot] = (buffer, None)
        return out, buffer[:info.nbytes], slot

    def finish(self, info: TensorInfo, target: Target, out, raw, slot) -> None:
        """Behind the tensor's copies: its finite check, and for a scratch slot its conversion or transform into
        the output and the check of what that made."""
        dtype = FLOAT_BITS.get(info.dtype, DTYPES[info.dtype][1])
        with self.device.after_copies():
            self.check_finite(info, raw, "holds a value that is not finite", dtype)
            if slot is None:
                return
            src = raw.view(numpy_dtype(DTYPES[info.dtype][1])).reshape(info.shape)
            try:
                (target.transform or convert)(src, out)
            except TensorValueError as e:
                raise ModelFileError(info.file.path, f"tensor {quoted(info.name)} {e}") from None
            self.scratch[slot] = (self.scratch[slot][0], self.device.mark())
            if target.transform is None:       # (transforms check their own outputs)
                self.check_finite(info, out, f"holds a value too large for {out.dtype}")

    def run(self) -> dict:
        ring, device = self.ring, self.device
        if not ring:
            return self.out
        copied = [None] * len(ring)
        pool = ThreadPoolExecutor(len(ring), thread_name_prefix="tilekit-load")
        try:
            reads = deque(pool.submit(self.read, k, None) for k in range(len(ring)))
            done, total = 0, sum(info.nbytes for info, _ in self.jobs)
            for k, (j, lo, hi) in enumerate(self.pieces):
                info, target = self.jobs[j]
                if lo == 0:
                    out, raw, slot = self.begin(info, target)
                reads.popleft().result()
                staged = k % len(ring)
                if hi > lo:
                    copied[staged] = device.upload(ring[staged][:hi - lo], raw[lo:hi])
                if k + len(ring) < len(self.pieces):
                    reads.append(pool.submit(self.read, k + len(ring), copied[staged]))
                if hi == info.nbytes:
                    self.finish(info, target, out, raw, slot)
                    self.out[info.name] = out
                done += hi - lo
                self.progress.update(done, total)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            device.synchronize()
            self.progress.close()
        flagged = device.read_flags(self.flags)
        for (info, problem), bad in zip(self.finite_checks, flagged):   # the file's values before what conversion made
            if bad:
                raise ModelFileError(info.file.path, f"tensor {quoted(info.name)} {problem}")
        return self.out

    def check_finite(self, info: TensorInfo, array, problem: str, dtype: str | None = None) -> None:
        """Queue a check that `array` (bytes of float `dtype`, default its own) holds no infinity or NaN: its flag
        is set where it does (read once the load is done)."""
        dtype = dtype or str(array.dtype)
        if dtype in EXPONENT_BITS:
            self.device.flag_nonfinite(array, dtype, self.flags, len(self.finite_checks))
            self.finite_checks.append((info, problem))


class HostDevice:
    """The loader's device played by host memory: NumPy outputs (references, tools, CPU tests). Its methods are
    what load_tensors asks of a device; CupyDevice has the same."""

    dtypes = TARGET_DTYPES

    def staging(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def empty(self, shape, dtype: str) -> np.ndarray:
        return np.empty(shape, numpy_dtype(dtype))

    def raw(self, array) -> np.ndarray:
        """The bytes of a C-contiguous array, as a flat uint8 view."""
        return array.reshape(-1).view(np.uint8)

    def upload(self, host: np.ndarray, raw: np.ndarray) -> Callable[[], None] | None:
        """Copy host bytes into raw device bytes; returns a function waiting until `host` may be reused."""
        raw[...] = host
        return None

    def context(self):
        """What allocations run under (the copy stream on a GPU)."""
        return contextlib.nullcontext()

    def after_copies(self):
        """What the work queued behind the copies so far runs under (on a GPU: another stream, waiting for them)."""
        return contextlib.nullcontext()

    def mark(self):
        """A point in that work (an event on a GPU) that copies_wait() makes later copies wait for."""
        return None

    def copies_wait(self, mark) -> None:
        """Later copies start once the work up to `mark` is done."""

    def flags(self, n: int) -> np.ndarray:
        """n flags, one per finite check, all clear."""
        return np.zeros(max(1, n), np.int32)

    def flag_nonfinite(self, array, dtype: str, flags, slot: int) -> None:
        """Set flags[slot] if `array`, the bytes of values of float `dtype`, holds an infinity or a NaN."""
        uint, bits = EXPONENT_BITS[dtype]
        v = array.view(uint).reshape(-1) if array.ndim < 2 else array.view(uint)
        rows = max(1, (1 << 14) // max(1, v[0].size)) if v.size else 1     # blocks of about 16K values: little memory
        if any(((v[i:i + rows] & np.array(bits, uint)) == bits).any() for i in range(0, len(v), rows)):
            flags[slot] = 1

    def read_flags(self, flags) -> list[bool]:
        return [bool(f) for f in flags]

    def synchronize(self) -> None:
        pass


# The finite check's kernels: each thread reads 8 bytes (LANES values of the dtype's width) and sets the tensor's
# flag where one of them has every exponent bit set; a plain store, any thread's 1 will do (no reduction, no atomics).
_FLAG_SOURCE = """
const unsigned long long m = MASK;
#pragma unroll
for (int i = 0; i < LANES; i++) {
    if (((x >> (i * WIDTH)) & m) == m) flags[slot] = 1;
}
"""


class CupyDevice:
    """The loader's GPU side: pinned staging buffers, copies on one stream, and on another the conversions,
    transforms and finite checks, each behind its tensor's copies. No float64 targets: no GPU model computes in it,
    and on an H100 the conversions into it from bf16 and fp32 files did not match NumPy's bit for bit (a subnormal
    among the values tested)."""

    dtypes = ("bfloat16", "float16", "float32")

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)        # the copies
        self.work = cupy.cuda.Stream(non_blocking=True)          # what follows them
        self.kernels = {}

    def staging(self, nbytes: int) -> np.ndarray:
        cuda = self.cupy.cuda
        return np.frombuffer(cuda.PinnedMemoryPointer(cuda.PinnedMemory(nbytes), 0), np.uint8, nbytes)

    def empty(self, shape, dtype: str):
        with self.stream:
            return self.cupy.empty(shape, numpy_dtype(dtype))

    def raw(self, array):
        return self.cupy.ndarray((array.nbytes,), self.cupy.uint8, array.data)

    def upload(self, host: np.ndarray, raw):
        runtime = self.cupy.cuda.runtime
        runtime.memcpyAsync(raw.data.ptr, host.ctypes.data, host.nbytes, runtime.memcpyHostToDevice, self.stream.ptr)
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return event.synchronize

    def context(self):
        return self.stream

    def after_copies(self):
        self.work.wait_event(self.stream.record())
        return self.work

    def mark(self):
        return self.work.record()

    def copies_wait(self, mark) -> None:
        self.stream.wait_event(mark)

    def flags(self, n: int):
        with self.stream:
            return self.cupy.zeros(max(1, n), self.cupy.int32)

    def flag_nonfinite(self, array, dtype: str, flags, slot: int) -> None:
        uint, bits = EXPONENT_BITS[dtype]
        width = 8 * np.dtype(uint).itemsize
        wide = array.flags.c_contiguous and array.nbytes % 8 == 0 and array.data.ptr % 8 == 0
        lanes = 64 // width if wide else 1
        values = array.reshape(-1).view(self.cupy.uint64) if wide else array.view(uint)
        kernel = self.kernels.get((uint, lanes))
        if kernel is None:
            source = _FLAG_SOURCE.replace("MASK", f"{bits}ULL").replace("LANES", str(lanes)).replace("WIDTH", str(width))
            kernel = self.kernels[uint, lanes] = self.cupy.ElementwiseKernel(
                f"{'uint64' if wide else uint} x, int32 slot", "raw int32 flags", source,
                f"tilekit_flag_nonfinite_{uint}_{lanes}")
        with self.work:
            kernel(values, np.int32(slot), flags)

    def read_flags(self, flags) -> list[bool]:
        return [bool(f) for f in self.cupy.asnumpy(flags)]

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.work.synchronize()


class Progress:
    """A one-line progress bar on stderr, drawn once a task has run `after` seconds, only on a terminal. unit: "GB"
    (done and total in bytes, with the rate) or what is counted ("kernels")."""

    def __init__(self, label: str, enabled: bool = True, stream=None, after: float = 2.0, clock=time.monotonic,
                 unit: str = "GB"):
        self.stream = sys.stderr if stream is None else stream
        self.on = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.label, self.after, self.clock, self.unit = label, after, clock, unit
        self.start, self.drawn = clock(), None

    def update(self, done: int, total: int) -> None:
        if not self.on:
            return
        now = self.clock()
        if now - self.start < self.after or (self.drawn is not None and now - self.drawn < 0.1 and done < total):
            return
        if self.unit == "GB":
            rate = done / 1e9 / max(now - self.start, 1e-9)
            counts = f"{done / 1e9:.1f}/{total / 1e9:.1f} GB {rate:.1f} GB/s"
        else:
            counts = f"{done}/{total} {self.unit}"
        try:
            self.stream.write(f"\r{self.label}: {100 * done // max(total, 1):3d}% {counts} ")
            self.stream.flush()
        except OSError:                 # a closed or broken terminal: no bar, the task goes on
            self.on = False
            return
        self.drawn = now

    def close(self) -> None:
        if self.drawn is not None:
            self.drawn = None
            with contextlib.suppress(OSError):
                self.stream.write("\n")
                self.stream.flush()
