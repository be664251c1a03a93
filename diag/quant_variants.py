"""quant_linear's products and configs at the Llama-3.1-8B linear shapes, against cuBLAS, on one GPU (issue #34).

    python diag/quant_variants.py [--only qkv,down] [--rows 1,8] [--out DIR]

Problems: qkv (N 6144, K 4096), o (4096, 4096), gate_up as the fused SwiGLU (W [2 x 14336, 4096], output 14336) and
down (4096, 14336); weight-only int8 and fp8 with per-channel scales at M = 1, 8, 32, W8A8 fp8 (quantize_fp8 then
quant_linear) at M = 8192. Per problem a short list of configs: the new default, the old default (MMA with
transposed weight loads; for W8A8 the one-warpgroup 128x128 tile), and SWAP / FMA / promotion variants from the
search space. All compile in parallel first. Each runs once into a NaN-poisoned output checked against a float64
reference of the dequantized weights on the GPU (tilekit.kernels.checks' TOL and ROW_SLACK; a failed check is a
FAIL row and is not timed), then is timed with CUDA events after an L2 flush (benchmarks.harness.timing.measure,
median of 30). Anchors on the same shapes: torch bf16 matmul of the dequantized weights (cuBLAS), torch._scaled_mm
(fp8, row-wise scales, fast accumulation) and torch._int_mm (int8 x int8, M >= 32). Columns: us, GB/s of the
weights (codes and scales; quantize_fp8: x read and its codes written), % of the measured copy bandwidth,
TFLOP/s, speed-up over bf16 cuBLAS, relative error.
About 2-3 minutes on an H100 (most of it compiling).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qkv": (6144, 4096, None), "o": (4096, 4096, None), "gate_up": (14336, 4096, "swiglu"),
          "down": (4096, 14336, None)}
DECODE_ROWS = (1, 8, 32)
PREFILL_ROWS = 8192


def few_row_configs(p: dict) -> dict[str, dict]:
    """name -> config for a decode problem: defaults, then SWAP and FMA variants (those in the search space), split
    over K until about MIN_PROGRAMS programs as the default does."""
    import cuda.tile as ct

    from tilekit.kernels.quant_linear import FMA, MIN_PROGRAMS, MIN_SPLIT_TILES, MMA, SPACE, SWAP, default_config
    m = 1 << (p["M"] - 1).bit_length()
    base = dict(GROUP_M=8, PROMOTE=1, occupancy=1, num_worker_warps=0)

    def split(tn, tk):
        tiles, k_tiles, s = ct.cdiv(p["N"], tn), ct.cdiv(p["K"], tk), 1
        while s < 16 and 2 * s * MIN_SPLIT_TILES <= k_tiles and tiles * s < MIN_PROGRAMS:
            s *= 2
        return s

    out = {"default": default_config(p),
           "old default": dict(base, MODE=MMA, TM=max(16, m), TN=32, TK=128, SPLIT_K=split(32, 128))}
    for tn in (32, 64, 128):
        for tk in (128, 256, 512):
            out[f"swap {tn}x{tk}"] = dict(base, MODE=SWAP, TM=max(16, m), TN=tn, TK=tk, SPLIT_K=split(tn, tk))
    out["swap 64x128 no split"] = dict(base, MODE=SWAP, TM=max(16, m), TN=64, TK=128, SPLIT_K=1)
    if m <= 4:
        for tn in (16, 32, 64):
            for tk in (128, 256, 512):
                out[f"fma {tn}x{tk}"] = dict(base, MODE=FMA, TM=m, TN=tn, TK=tk, SPLIT_K=split(tn, tk))
    for tn, tk in ((32, 256), (64, 128)):
        out[f"mma {tn}x{tk}"] = dict(base, MODE=MMA, TM=max(16, m), TN=tn, TK=tk, SPLIT_K=split(tn, tk))
    candidates = SPACE.candidates(p)
    return {k: c for k, c in out.items() if k == "old default" or c in candidates}


def w8a8_configs(p: dict) -> dict[str, dict]:
    """name -> config for a W8A8 problem: defaults, then tile shapes and promotion intervals."""
    from tilekit.kernels.quant_linear import MMA, SPACE, SWAP, default_config
    halves = 2 if p["act"] == "swiglu" else 1
    base = dict(GROUP_M=8, SPLIT_K=1, occupancy=1)
    out = {"default": default_config(p),
           "old default": dict(base, MODE=MMA, TM=128, TN=128 // halves, TK=128, PROMOTE=1, num_worker_warps=0)}
    for mode, tm, tn, tk, promote, warps in (
            (MMA, 128, 128, 64, 2, 8), (MMA, 128, 128, 64, 4, 8), (MMA, 128, 128, 128, 2, 8),
            (MMA, 128, 64, 128, 1, 0), (MMA, 64, 128, 128, 1, 0), (MMA, 128, 64, 64, 2, 8), (MMA, 64, 64, 128, 2, 0),
            (SWAP, 128, 128, 128, 1, 8), (SWAP, 128, 128, 64, 2, 8), (SWAP, 128, 64, 128, 1, 0),
            (SWAP, 128, 64, 128, 1, 8)):
        out[f"{['mma', 'swap'][mode]} {tm}x{tn}x{tk} p{promote} w{warps}"] = dict(
            base, MODE=mode, TM=tm, TN=tn, TK=tk, PROMOTE=promote, num_worker_warps=warps)
    candidates = SPACE.candidates(p)
    return {k: c for k, c in out.items() if k == "old default" or c in candidates}


def label(c: dict) -> str:
    return (f"{['mma', 'swap', 'fma'][c['MODE']]} {c['TM']}x{c['TN']}x{c['TK']} s{c['SPLIT_K']} p{c['PROMOTE']} "
            f"o{c['occupancy']} w{c['num_worker_warps']}")


def errors(out, ref) -> tuple[float, float]:
    """(relative error of the whole output, worst row's), as tilekit.kernels.checks computes them, on the GPU."""
    import torch
    out = out.double()
    if not bool(torch.isfinite(out).all()):
        return math.inf, math.inf
    whole = float(torch.linalg.norm(out - ref) / max(float(torch.linalg.norm(ref)), 1e-30))
    norms = torch.linalg.norm(ref, dim=1)
    floor = max(1e-3 * float(torch.sqrt(torch.mean(norms ** 2))), 1e-30)
    rows = torch.linalg.norm(out - ref, dim=1) / torch.clamp(norms, min=floor)
    return whole, float(rows.max())


def run_problem(shape: str, M: int, kind: str, configs: dict, broken: dict, copy_gbs: float, results: list) -> None:
    """Anchors and every config of one problem: rows printed and appended to results."""
    import torch

    from benchmarks.harness.timing import measure
    from tilekit.kernels import quant_linear, quantize_fp8
    from tilekit.kernels.checks import ROW_SLACK, TOL
    from tilekit.kernels.quant_linear import QUANT_LINEAR
    tol = TOL["bfloat16"]
    N, K, act = SHAPES[shape]
    rows_w = 2 * N if act else N
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    if kind == "int8":
        w = torch.randint(-127, 128, (rows_w, K), dtype=torch.int8, device="cuda")
        values = w.double()
        s = (torch.rand(rows_w, device="cuda") + 0.5) / K ** 0.5 / 64
    else:
        w8 = torch.randn(rows_w, K, device="cuda").to(torch.float8_e4m3fn)
        w, values = w8.view(torch.uint8), w8.double()
        s = (torch.rand(rows_w, device="cuda") + 0.5) / K ** 0.5
    s = s.float()
    wdq = values * s.double()[:, None]
    w8a8 = M >= 128
    if w8a8:
        xq = torch.empty(M, K, dtype=torch.uint8, device="cuda")
        xs = torch.empty(M, 1, dtype=torch.float32, device="cuda")
        quantize_fp8(x, xq, xs)
        xref = xq.view(torch.float8_e4m3fn).double() * xs.double()
    else:
        xref = x.double()
    ref = xref @ wdq.T
    if act:
        ref = torch.nn.functional.silu(ref[:, :N]) * ref[:, N:]
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    weight_bytes = w.numel() + 4 * s.numel()
    flops = 2 * M * rows_w * K

    def row(variant, cfg, ms, err="", nbytes=weight_bytes):
        gbs = nbytes / ms / 1e6
        line = (f"{shape:8s} {M:5d} {kind + (' w8a8' if w8a8 and variant != 'quantize_fp8' else ''):9s} "
                f"{variant:24s} {cfg:34s} {ms * 1e3:8.1f} {gbs:6.0f} {100 * gbs / copy_gbs:5.0f} "
                f"{flops / ms / 1e9:7.1f} {bf16_ms / ms:6.2f} {err:>8s}")
        print(line, flush=True)
        results.append(dict(shape=shape, M=M, kind=kind, w8a8=w8a8, variant=variant, config=cfg, us=ms * 1e3,
                            weight_gbs=gbs, pct_copy=100 * gbs / copy_gbs, vs_bf16=bf16_ms / ms, err=err))

    wb = wdq.to(torch.bfloat16)           # cuBLAS's operand: the dequantized weights in bf16
    bf16_ms = measure(lambda: torch.matmul(x, wb.T), flush_l2=True)["median_ms"]
    row("torch bf16 (cuBLAS)", "", bf16_ms)
    anchors = {}
    if kind == "fp8":
        xf8 = (xq.view(torch.float8_e4m3fn) if w8a8 else x.to(torch.float8_e4m3fn))
        ones = torch.ones(M, 1, device="cuda")
        anchors["torch._scaled_mm"] = lambda: torch._scaled_mm(
            xf8, w.view(torch.float8_e4m3fn).T, scale_a=ones, scale_b=s.view(1, -1),
            out_dtype=torch.bfloat16, use_fast_accum=True)
    elif M >= 32:
        x8 = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        anchors["torch._int_mm"] = lambda: torch._int_mm(x8, w.T)
    for name, fn in anchors.items():
        try:
            row(name, "", measure(fn, flush_l2=True)["median_ms"])
        except (RuntimeError, TypeError, NotImplementedError) as e:
            print(f"{shape:8s} {M:5d} {kind:9s} {name}: did not run ({type(e).__name__}: {str(e)[:80]})")
    if w8a8:
        row("quantize_fp8", "(GB/s: x read, codes written)", measure(lambda: quantize_fp8(x, xq, xs),
                                                                     flush_l2=True)["median_ms"],
            nbytes=3 * M * K + 4 * M)

    def call():
        if w8a8:
            return quant_linear(xq, w, s, weight_dtype="fp8", x_scale=xs, activation=act, out=y)
        return quant_linear(x, w, s, weight_dtype=kind, activation=act, out=y)

    for variant, c in configs.items():
        key = (shape, M, kind, json.dumps(c, sort_keys=True))
        if key in broken:
            print(f"{shape:8s} {M:5d} {kind:9s} {variant:24s} {label(c):34s} COMPILE FAILED: {broken[key][:90]}")
            continue
        with QUANT_LINEAR.pinned(c):
            y.view(torch.int16).fill_(0x7FC0)           # NaN
            call()
            whole, worst = errors(y, ref)
            err = f"{whole:.1e}"
            if not (whole < tol and worst < ROW_SLACK * tol):
                print(f"{shape:8s} {M:5d} {kind:9s} {variant:24s} {label(c):34s} FAIL: relative error "
                      f"{whole:.3g}, worst row {worst:.3g} (tolerance {tol}, rows {ROW_SLACK * tol})")
                results.append(dict(shape=shape, M=M, kind=kind, variant=variant, config=label(c),
                                    failed=True, err=whole, worst_row=worst))
                continue
            row(variant, label(c), measure(call, flush_l2=True)["median_ms"], err)

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated shapes (qkv, o, gate_up, down)")
    parser.add_argument("--rows", help="comma-separated row counts (default 1,8,32,8192)")
    parser.add_argument("--out", type=Path, help="folder for quant_variants.json")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.harness.timing import copy_bandwidth, shared_stream
    from tilekit.autotune.compile import precompile
    from tilekit.kernels.quant_linear import QUANT_LINEAR

    shapes = {k: v for k, v in SHAPES.items() if not args.only or k in args.only.split(",")}
    rows = [int(r) for r in args.rows.split(",")] if args.rows else [*DECODE_ROWS, PREFILL_ROWS]
    copy_gbs = copy_bandwidth()["gbs"]
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s")

    problems = []          # (shape, M, kind, problem, {name: config})
    for shape, (N, K, act) in shapes.items():
        for M in rows:
            for kind in (("fp8",) if M >= 128 else ("int8", "fp8")):
                p = QUANT_LINEAR.tuning_problem(dict(dtype="bfloat16", M=M, N=N, K=K, wq=kind, scale="channel",
                                                     xq="fp8" if M >= 128 else "none", act=act or "none", bias=0,
                                                     res=0))
                problems.append((shape, M, kind, p, w8a8_configs(p) if M >= 128 else few_row_configs(p)))
    tasks = [(QUANT_LINEAR, p, c) for *_, p, configs in problems for c in configs.values()]
    print(f"compiling {len(tasks)} configs ...", flush=True)
    _, failed = precompile(tasks, "sm_%d%d" % torch.cuda.get_device_capability())
    owner = [(shape, M, kind) for shape, M, kind, _, configs in problems for _ in configs]
    broken = {(*owner[i], json.dumps(tasks[i][2], sort_keys=True)): e for i, e in failed.items()}

    results = []
    header = f"{'shape':8s} {'M':>5s} {'kind':9s} {'variant':24s} {'config':34s} {'us':>8s} {'GB/s':>6s} " \
             f"{'%copy':>5s} {'TFLOP/s':>7s} {'x bf16':>6s} {'err':>8s}"
    print(header)
    with shared_stream():
        for shape, M, kind, _, configs in problems:
            run_problem(shape, M, kind, configs, broken, copy_gbs, results)
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quant_variants.json").write_text(json.dumps(dict(copy_gbs=copy_gbs, rows=results), indent=1))
    failures = [r for r in results if r.get("failed")]
    print(f"{len(failures)} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
