"""The loader's finite check, ways of writing it, on one GPU (issue #63): GB/s of each over a 1 GiB bf16 array and a
1 GiB fp32 one, beside the pinned host-to-device copy of the same bytes.

    python diag/finite_check.py
"""

from __future__ import annotations

import cupy
import numpy as np

N_BYTES = 1 << 30


def timed(fn, repeat: int = 5) -> float:
    """Median seconds of fn() on the current stream (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(times))


def main() -> None:
    two_inputs = cupy.ReductionKernel("T x, T bits", "bool y", "(x & bits) == bits", "a || b", "y = a", "false",
                                      "two_inputs")
    flag16 = cupy.ElementwiseKernel("uint16 x", "raw int32 flag", "if ((x & 0x7f80) == 0x7f80) flag[0] = 1;",
                                    "flag16")
    flag64_bf16 = cupy.ElementwiseKernel(
        "uint64 x", "raw int32 flag",
        "unsigned long long m = x & 0x7f807f807f807f80ULL;"
        "unsigned long long e = m ^ 0x7f807f807f807f80ULL;"
        "if (((e & 0xffffULL) == 0) | (((e >> 16) & 0xffffULL) == 0) | (((e >> 32) & 0xffffULL) == 0)"
        " | ((e >> 48) == 0)) flag[0] = 1;", "flag64_bf16")
    flag64_fp32 = cupy.ElementwiseKernel(
        "uint64 x", "raw int32 flag",
        "unsigned long long e = (x & 0x7f8000007f800000ULL) ^ 0x7f8000007f800000ULL;"
        "if (((e & 0xffffffffULL) == 0) | ((e >> 32) == 0)) flag[0] = 1;", "flag64_fp32")
    rng = cupy.random.default_rng(0)
    bf16 = (rng.standard_normal(N_BYTES // 4, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
    bf16 = cupy.concatenate([bf16, bf16])
    fp32 = rng.standard_normal(N_BYTES // 4, dtype=cupy.float32).view(cupy.uint32)
    flag = cupy.zeros(1, cupy.int32)
    rows = []
    rows.append(("reduction, two inputs (bf16)", timed(lambda: two_inputs(bf16, cupy.uint16(0x7f80)))))
    rows.append(("elementwise flag, 2 B/thread (bf16)", timed(lambda: flag16(bf16, flag))))
    rows.append(("elementwise flag, 8 B/thread (bf16)", timed(lambda: flag64_bf16(bf16.view(cupy.uint64), flag))))
    rows.append(("elementwise flag, 8 B/thread (fp32)", timed(lambda: flag64_fp32(fp32.view(cupy.uint64), flag))))
    assert int(flag.get()[0]) == 0, "a finite array was flagged"
    bad = bf16.copy()
    bad[123456789] = 0x7f80
    flag64_bf16(bad.view(cupy.uint64), flag)
    assert int(flag.get()[0]) == 1, "an infinity was missed"
    host = cupy.cuda.alloc_pinned_memory(N_BYTES)
    src = np.frombuffer(host, np.uint8, N_BYTES)
    src[:] = 1
    dst = cupy.empty(N_BYTES, cupy.uint8)
    rows.append(("pinned host-to-device copy", timed(lambda: dst.set(src))))
    for name, s in rows:
        print(f"{name:40s} {s * 1e3:8.2f} ms {N_BYTES / s / 1e9:8.1f} GB/s")


if __name__ == "__main__":
    main()
