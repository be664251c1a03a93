"""Untuned shapes (issue #34): tilekit.linear at Llama-3.1-8B MLP shapes (W [out, in], no bias) against cuBLAS
(torch.matmul) in one run, first with the tuning databases (a shape they lack borrows the nearest tuned config,
named in each row's config source) and then with the heuristic default (TILEKIT_AUTOTUNE=off).

    python -m benchmarks.studies.untuned [--rows 1024 --rows 2048 --rows 4096] [--reps 100] [--out DIR]

Each case runs through the kernel suite's run_case (output checked against cuBLAS, then both timed as CUDA-graph
replays with L2 flushed); the ratio is cuBLAS ms / tilekit ms (> 1: tilekit faster).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.suites.kernels import Case, describe

PRESET = "llama-3.1-8b"
MLP = (("mlp.gate/up_proj", 4096, 14336), ("mlp.down_proj", 14336, 4096))   # (layer, K, N)
ROWS = (1024, 2048, 4096)
MODES = ("cached", "off")


def cases(rows=ROWS) -> list[Case]:
    """One linear_nk case per (rows, MLP layer)."""
    return [Case("linear_nk", (PRESET, layer, M, K, N)) for M in rows for layer, K, N in MLP]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.untuned", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, action="append", help=f"M, repeatable (default {', '.join(map(str, ROWS))})")
    ap.add_argument("--reps", type=int, default=100, help="timed graph replays per side (default 100)")
    ap.add_argument("--out", type=Path, help="also write results.json here")
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.rows or ()):
        ap.error("--rows must be positive")

    from benchmarks.cli import calibrate, gpu_problem
    from benchmarks.harness import report, system, timing
    from benchmarks.harness.log import Log
    from benchmarks.suites.kernels import run_case
    from benchmarks.suites.tuning import autotune_mode
    problem = gpu_problem()
    if problem:
        print(f"needs a CUDA GPU with PyTorch: {problem}", file=sys.stderr)
        return 2
    log, rows = Log(), []
    meta = system.environment("quick", list(sys.argv[1:] if argv is None else argv))
    with timing.shared_stream():
        calib = calibrate(log)
        for mode in MODES:
            with autotune_mode(mode):           # each mode's own launch plans
                for case in cases(tuple(args.rows or ROWS)):
                    for r in run_case(case, calib, reps=args.reps, log=log):
                        r.params["autotune"] = mode
                        rows.append(r)
                    timing.free_memory()
    print(f"{'case':<36} {'TILEKIT_AUTOTUNE':<16} {'tilekit ms':>10} {'cuBLAS ms':>10} {'ratio':>6}  config source")
    for r in rows:
        label = describe(Case(r.params["kind"], tuple(r.params["params"])))[0]
        if r.status != "ok":
            print(f"{label:<36} {r.params['autotune']:<16} {r.status}: {r.note}")
            continue
        print(f"{label:<36} {r.params['autotune']:<16} {r.tilekit_ms:10.4f} {r.anchor_ms:10.4f} {r.ratio:6.3f}  "
              f"{r.params.get('tilekit_config', '')}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report.write_json(args.out / "results.json", meta, rows)
    return report.exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
