"""One timer for tilekit and its anchors: CUDA events on one shared stream, L2 flushed per rep.

Both sides must run on the same stream, or the events would time the wrong work. tilekit
launches on torch's current stream for torch tensors and on CuPy's current stream for CuPy
arrays; torch and cuBLAS run on torch's current stream. `shared_stream()` makes CuPy's current
stream torch's current stream (by default the legacy default stream, handle 0), and `measure`
refuses to run when the two differ. `measure_graph` times a CUDA-graph replay of a callable with
the same timer (GPU work only); `host_time` times the host side of eager calls; `CompileBudget`
bounds the time torch.compile anchors may spend compiling.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time

from benchmarks.harness.report import short_error

import numpy as np

FLUSH_MIN_BYTES = 256 << 20     # well above any current L2 (H100: 50 MB, B200: 126 MB)
_flush_buffers: dict[int, object] = {}


def summarize(times_ms) -> dict:
    """median / p10 / p90 (ms) of individually timed reps."""
    t = np.asarray(list(times_ms), np.float64)
    if t.size == 0:
        raise ValueError("no timings to summarize")
    return {"median_ms": float(np.median(t)), "p10_ms": float(np.percentile(t, 10)),
            "p90_ms": float(np.percentile(t, 90)), "reps": int(t.size)}


@contextlib.contextmanager
def shared_stream():
    """Run the block with CuPy's current stream set to torch's current stream."""
    import cupy
    torch_stream = None
    if "torch" in sys.modules or _torch_importable():
        import torch
        torch_stream = torch.cuda.current_stream()
    if torch_stream is None or torch_stream.cuda_stream == 0:
        stream = cupy.cuda.Stream.null                 # the legacy default stream
    else:
        try:
            stream = cupy.cuda.Stream.from_external(torch_stream)
        except Exception:  # noqa: BLE001 - older CuPy or torch without the stream protocol
            stream = cupy.cuda.ExternalStream(torch_stream.cuda_stream)
    with stream:
        yield stream


def _torch_importable() -> bool:
    return importlib.util.find_spec("torch") is not None


def _check_streams(stream) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        handle = torch.cuda.current_stream().cuda_stream
        if handle != stream.ptr:
            raise RuntimeError(f"torch's current stream ({handle:#x}) is not CuPy's ({stream.ptr:#x}); "
                               "run inside benchmarks.harness.timing.shared_stream()")


def flush_buffer():
    """A device buffer of max(256 MB, 4 x L2) bytes; writing it evicts everything from L2."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    buf = _flush_buffers.get(dev)
    if buf is None:
        l2 = int(cupy.cuda.Device(dev).attributes.get("L2CacheSize", 0))
        buf = _flush_buffers[dev] = cupy.empty(max(FLUSH_MIN_BYTES, 4 * l2), dtype=cupy.uint8)
    return buf


def measure(fn, *, flush_l2: bool, warmup: int = 5, reps: int = 30) -> dict:
    """GPU time of fn() on the current stream: each rep between two CUDA events, median of reps.

    With flush_l2 a >= 256 MB buffer is written before each rep, outside the timed region, so
    every rep starts with a cold L2. Returns dict(median_ms, p10_ms, p90_ms, reps).
    """
    import cupy
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    stream = cupy.cuda.get_current_stream()
    _check_streams(stream)
    buf = flush_buffer() if flush_l2 else None
    for _ in range(warmup):
        fn()
    starts = [cupy.cuda.Event() for _ in range(reps)]
    ends = [cupy.cuda.Event() for _ in range(reps)]
    for i in range(reps):
        if buf is not None:
            buf.fill(1 + i % 250)        # non-zero: an elementwise kernel that writes every byte
        starts[i].record(stream)
        fn()
        ends[i].record(stream)
    ends[-1].synchronize()
    return summarize(cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends))


_capture_streams: dict[int, object] = {}


def capture(fn):
    """(graph, output): fn() recorded once into a torch.cuda.CUDAGraph, CuPy's stream following torch's.

    fn runs once first on the capture stream (a side stream kept per device), so per-stream scratch,
    plans and library workspaces exist before capture; the output is returned to be kept alive with
    the graph, which writes into it on every replay.
    """
    import torch
    dev = torch.cuda.current_device()
    side = _capture_streams.setdefault(dev, torch.cuda.Stream())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), shared_stream():
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side, capture_error_mode="relaxed"), shared_stream():
        out = fn()
    return graph, out


def measure_graph(fn, *, flush_l2: bool, warmup: int = 5, reps: int = 30) -> dict:
    """measure() of graph replays of fn() (see capture): the GPU time of fn's work alone.

    A callable that cannot be captured (CuPy refuses cuBLAS calls under capture) is timed eagerly
    instead; the result then holds `eager`, the reason."""
    try:
        graph, out = capture(fn)
    except Exception as e:  # noqa: BLE001
        return dict(measure(fn, flush_l2=flush_l2, warmup=warmup, reps=reps),
                    eager=f"timed eagerly, graph capture failed: {short_error(e)}")
    try:
        return measure(graph.replay, flush_l2=flush_l2, warmup=warmup, reps=reps)
    finally:
        del graph, out


def host_time(fn, *, calls: int = 1000, sync_every: int = 100) -> dict:
    """Host time of one eager fn() (perf_counter_ns, in ms): median of `calls` calls after one warm-up.

    The device is synchronized before the first call and every `sync_every` calls, outside the timed
    calls, so a small problem's GPU work never backs the launch queue up into the host's time.
    """
    fn()
    times = []
    for i in range(calls):
        if i % sync_every == 0:
            synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    synchronize()
    return summarize(times)


class CompileBudget:
    """Seconds a torch.compile anchor may spend in first calls (compiles); once they are spent, or
    once a compile failed, `skip_reason()` says why its later shapes are skipped."""

    def __init__(self, seconds: float):
        self.seconds, self.spent, self.failure = seconds, 0.0, None

    def skip_reason(self) -> str | None:
        if self.failure:
            return f"torch.compile failed on an earlier shape ({self.failure})"
        if self.spent > self.seconds:
            return f"compile budget spent ({self.spent:.0f} s > {self.seconds:.0f} s)"
        return None

    def first_call(self, fn):
        """fn() (the call that compiles), its seconds charged to the budget; (result, seconds)."""
        t0 = time.perf_counter()
        try:
            out = fn()
            synchronize()
        except Exception as e:
            self.failure = short_error(e)
            raise
        finally:
            seconds = time.perf_counter() - t0
            self.spent += seconds
        return out, seconds


def synchronize() -> None:
    """Wait for all work on the current device, whichever stream or library issued it."""
    import cupy
    cupy.cuda.runtime.deviceSynchronize()


def wall_time(fn, *, warmup: int = 1, runs: int = 3) -> dict:
    """Host wall time (perf_counter) of fn(), device-synchronized before and after; median of runs."""
    for _ in range(warmup):
        synchronize()
        fn()
    synchronize()
    times = []
    for _ in range(runs):
        synchronize()
        t0 = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return summarize(times)


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> dict:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / median time, in GB/s.

    Two copies are timed (cudaMemcpyAsync and an 8-byte-per-thread CuPy kernel); `gbs` is the
    faster of the two, the roofline used for memory-bound rows.
    """
    import cupy
    n = nbytes // 8
    src = cupy.arange(n, dtype=cupy.int64)
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream()
    copy_kernel = cupy.ElementwiseKernel("T x", "T y", "y = x", "tilekit_bench_copy")
    moved = 2 * n * 8
    memcpy = measure(lambda: dst.data.copy_from_device_async(src.data, n * 8, stream),
                     flush_l2=False, warmup=3, reps=reps)
    kernel = measure(lambda: copy_kernel(src, dst), flush_l2=False, warmup=3, reps=reps)
    if not bool((dst == src).all()):
        raise RuntimeError("copy bandwidth probe produced a wrong copy")
    result = {"bytes_moved": moved, "memcpy_gbs": gbs(moved, memcpy["median_ms"]),
              "kernel_gbs": gbs(moved, kernel["median_ms"])}
    result["gbs"] = max(result["memcpy_gbs"], result["kernel_gbs"])
    return result


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    """torch.matmul bf16 n^3 on random data with the same timer: 2 n^3 / median time."""
    import torch
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = measure(lambda: torch.matmul(a, b), flush_l2=False, warmup=5, reps=reps)
    return tflops(2 * n ** 3, t["median_ms"])


def gbs(nbytes: float, ms: float) -> float:
    """GB/s (1e9 bytes per second) for nbytes moved in ms milliseconds."""
    return nbytes / ms / 1e6


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s for flops in ms milliseconds."""
    return flops / ms / 1e9


def free_memory() -> None:
    """Return finished cases' buffers to torch's and CuPy's allocators, so later cases see the same free memory."""
    import gc
    gc.collect()
    try:
        import torch
        torch.cuda.empty_cache()
    except ImportError:
        pass
    try:
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    except ImportError:
        pass
