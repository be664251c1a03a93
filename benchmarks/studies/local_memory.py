"""Registers spilled to local memory by a kernel config, read from its cubin: runs on a CPU (tileiras only).

    python -m benchmarks.studies.local_memory [--arch sm_90] [--dtype float32]

For each op and problem of CASES, the default config of `--dtype` and a few fixed ones are compiled ahead of time
and each launch's per-thread stack frame (local memory: spilled registers) and static shared memory are read
from the cubin's attributes. fp32 products run on FMA units with the operand tiles in registers, so there the
frame is what the tile costs (docs/results/fp32-tiles-sm90.txt).
"""

from __future__ import annotations

import argparse
import io
import struct
import sys

FRAME_ATTRIBUTE = 0x11          # EIATTR_FRAME_SIZE: per-thread stack bytes of a kernel

CASES = {   # op -> (problem, fixed configs besides the default)
    "linear": [(dict(M=1024, N=2304, K=768, wt="kn", bias=1, act="none", res=0, tf32=0),
                [dict(TM=128, TN=128, TK=64), dict(TM=64, TN=64, TK=64), dict(TM=64, TN=64, TK=32),
                 dict(TM=64, TN=32, TK=32), dict(TM=32, TN=32, TK=32)]),
               (dict(M=1, N=50257, K=768, wt="nk", bias=0, act="none", res=0, tf32=0),
                [dict(TM=16, TN=32, TK=128), dict(TM=16, TN=32, TK=32)])],
    "attention": [(dict(B=1, H=12, Hkv=12, Tq=128, Tk=128, D=64, causal=1),
                   [dict(BM=64, BN=128, LONGEST_FIRST=1, occupancy=2), dict(BM=64, BN=64, LONGEST_FIRST=1, occupancy=2)])],
    "decode_attention": [(dict(B=1, H=12, Hkv=12, nq=1, capacity=256, D=64, new_kv=1, fp8=0),
                          [dict(BN=128, PROGRAMS=1, occupancy=4)]),
                         (dict(B=8, H=32, Hkv=8, nq=1, capacity=32768, D=128, new_kv=1, fp8=0),
                          [dict(BN=128, PROGRAMS=256, occupancy=4), dict(BN=128, PROGRAMS=256, occupancy=1),
                           dict(BN=64, PROGRAMS=256, occupancy=1),
                           dict(BN=128, PROGRAMS=256, occupancy=4, num_worker_warps=8)]),
                         (dict(B=8, H=32, Hkv=8, nq=1, capacity=32768, D=128, new_kv=1, fp8=1),
                          [dict(BN=128, PROGRAMS=256, occupancy=4), dict(BN=128, PROGRAMS=256, occupancy=1),
                           dict(BN=64, PROGRAMS=256, occupancy=1)])],
    "mla_decode_attention": [(dict(B=1, H=16, nq=1, capacity=256, R=512, P=64, new_kv=1),
                              [dict(HP=16, BN=32, CHUNK=64, occupancy=1)])],
    "residual_linear": [(dict(M=1, N=768, K=768, bias=1), [dict(TM=16, TN=64, TK=128, SPLIT_K=4, occupancy=1)])],
    "swiglu_linear": [(dict(M=1, N=8192, K=2048), [dict(TM=16, TN=32, TK=128, GROUP_M=8, occupancy=1,
                                                         num_worker_warps=0)])],
}
LINEAR_PLAIN = dict(GROUP_M=8, SPLIT_K=1, PERSISTENT=0, occupancy=1, num_ctas=1, num_worker_warps=0)


def cubin_usage(cubin: bytes) -> tuple[int, int]:
    """(per-thread frame bytes, static shared memory bytes) of a single-kernel cubin (ELF64)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_off = sections[names_at][4]
    frame = shared = 0
    for name_at, kind, _, _, off, size in sections:
        name = cubin[names_off + name_at:cubin.index(b"\0", names_off + name_at)].decode()
        if name.startswith(".nv.shared.") and ".reserved" not in name:
            shared += size
        if name.startswith(".nv.info"):
            blob, i = cubin[off:off + size], 0
            while i + 4 <= len(blob):
                form, attribute, length = blob[i], blob[i + 1], struct.unpack_from("<H", blob, i + 2)[0]
                if form == 0x04:       # attribute with a value of `length` bytes (symbol, value)
                    if attribute == FRAME_ATTRIBUTE:
                        frame = max(frame, struct.unpack_from("<I", blob, i + 4 + length - 4)[0])
                    i += 4 + length
                else:                  # 2-byte value or none
                    i += 4 if form == 0x03 else 2
    return frame, shared


def usage(op, problem: dict, config: dict, arch: str) -> list[tuple[str, int, int]]:
    """(kernel, frame bytes, shared bytes) of every launch of `config` on `problem`."""
    from cuda.tile.compilation import export_kernel

    from tilekit.autotune.compile import signature
    rows = []
    for kernel, args in op.compile_args(problem, config):
        out = io.BytesIO()
        export_kernel(kernel, [signature(kernel, args)], out, gpu_code=arch, output_format="cubin")
        rows.append((kernel._pyfunc.__name__, *cubin_usage(out.getvalue())))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.local_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = ap.parse_args(argv)
    import tilekit.kernels  # noqa: F401  (declares the ops)
    from tilekit.autotune.registry import registered_ops
    print(f"{args.arch} {args.dtype}: per-thread local memory (spilled registers) and static shared memory")
    for name, cases in CASES.items():
        op = registered_ops()[name]
        for problem, fixed in cases:
            p = op.tuning_problem(dict(problem, dtype=args.dtype))
            shape = ",".join(f"{k}={v}" for k, v in problem.items())
            for label, config in [("default", op.default(p))] + [("fixed", f) for f in fixed]:
                config = dict(LINEAR_PLAIN, **config) if name == "linear" and label == "fixed" else config
                for kernel, frame, shared in usage(op, p, config, args.arch):
                    tiles = {k: v for k, v in config.items()
                             if k[0] in "TB" or k in ("SPLIT_K", "PROGRAMS", "occupancy", "num_worker_warps")}
                    print(f"{name:<17}{shape:<58}{label:<8}{str(tiles):<60}{kernel:<26}"
                          f"frame {frame:>6} B  shared {shared:>7} B", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
