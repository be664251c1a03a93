"""Command line: python -m benchmarks [--quick|--full] [--out DIR] [--only SUITE] [--no-plots].

Progress goes to stderr; the summary table is the last thing printed to stdout. GPU libraries
are imported only after the arguments are parsed, so --help works anywhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.harness import report
from benchmarks.harness.log import Log

DEFAULT_OUT = Path("bench-results")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="tilekit kernels and GPT-2 against torch / CuPy / Hugging Face on this GPU. "
                    "Writes results.json, results.csv, summary.txt and PNG charts under --out.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="every anchor on a representative subset, about 8 minutes on an H100 (default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="every shape, every anchor variant, max-autotune epilogue compile; longer")
    ap.set_defaults(mode="quick")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                    help=f"output directory (default: {DEFAULT_OUT}/)")
    ap.add_argument("--only", choices=report.SUITES, help="run one suite only")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG charts")
    ap.add_argument("--model", action="append", metavar="PRESET",
                    help="the model suite runs this model only (repeatable; default: all of the plan's)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model:
        from benchmarks.suites.model import plan
        known = sorted({p.preset for p in plan(args.mode)})
        unknown = sorted(set(args.model) - set(known))
        if unknown:
            parser.error(f"--model {', '.join(unknown)}: the {args.mode} model suite runs {', '.join(known)}")
    return args


def calibrate(log) -> dict:
    from benchmarks.harness import timing
    log("calibrating: device-to-device copy bandwidth")
    copy = timing.copy_bandwidth()
    log(f"    copy {copy['gbs']:.0f} GB/s (memcpy {copy['memcpy_gbs']:.0f}, kernel {copy['kernel_gbs']:.0f})")
    log("calibrating: torch.matmul bf16 8192^3")
    peak = timing.matmul_peak_tflops()
    log(f"    matmul {peak:.0f} TFLOP/s")
    return {"copy_bandwidth_gbs": copy["gbs"], "copy": copy, "matmul_peak_tflops": peak}


def gpu_problem() -> str | None:
    """Why the benchmarks cannot run here, or None."""
    from tilekit.device import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason:
        return reason
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (every anchor is a torch op)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def write_outputs(out: Path, meta: dict, rows: list, plots: bool, log) -> str:
    """results.json, results.csv, summary.txt and the charts (drawn from results.json); returns the table.
    Rows are written strongest anchor first within each case."""
    rows = report.strongest_first(rows)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "results.json", meta, rows)
    report.write_csv(out / "results.csv", rows)
    table = report.format_table(rows, meta)
    (out / "summary.txt").write_text(table + "\n")
    if plots:
        from benchmarks.harness import plots as charts
        if charts.available():
            try:
                for path in charts.write_all(out / "results.json", out):
                    log(f"wrote {path}")
            except Exception as e:  # noqa: BLE001 - a chart is never worth the results
                log(f"plots failed: {type(e).__name__}: {e}")
        else:
            log("matplotlib is not installed: no plots")
    log(f"wrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.txt'}")
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    log = Log()
    problem = gpu_problem()
    if problem:
        print(f"benchmarks need a CUDA GPU with PyTorch: {problem}", file=sys.stderr)
        return 2
    from benchmarks.harness import system, timing
    from benchmarks.suites import kernels, model, overhead, tuning
    meta = system.environment(args.mode, argv)
    log(f"{meta['gpu']['name']} ({meta['gpu']['sm_count']} SMs), mode {args.mode}, out {args.out}")
    rows: list = []
    try:
        with timing.shared_stream():
            meta["calibration"] = calibrate(log)
            if args.only in (None, "kernels"):
                rows += kernels.run(args.mode, meta["calibration"], log)
            if args.only in (None, "model"):
                rows += model.run(args.mode, meta["calibration"], log, args.model)
            if args.only in (None, "tuning"):
                rows += tuning.run(args.mode, log)
            if args.only in (None, "overhead"):
                rows += overhead.run(args.mode, log)
    finally:   # an interrupted or crashed run still leaves what it measured
        meta["nvidia_smi_end"] = system.nvidia_smi(meta["gpu"].get("pci_bus_id"))
        meta["elapsed_s"] = round(time.perf_counter() - log.t0, 1)
        table = write_outputs(args.out, meta, rows, not args.no_plots, log)
    print(table, flush=True)
    return report.exit_code(rows)
