"""Markdown for the README from a results.json: `python -m benchmarks.markdown RESULTS_JSON [--suite S]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SUITES = ("kernels", "model", "tuning")
SOURCES_PREFIX = "tuned side's configs: "     # how a tuning row's note starts (benchmarks.tuning)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def header(meta: dict) -> str:
    gpu, versions, calib = meta["gpu"], meta["versions"], meta["calibration"]
    return (f"{gpu['name']} ({gpu['sm_count']} SMs, driver {gpu['driver']}), {meta['date'][:10]}, "
            f"`python -m benchmarks --{meta['mode']}`; cuda-tile {versions['cuda_tile']}, tileiras "
            f"{versions['tileiras']}, torch {versions['torch']}, transformers {versions['transformers']}. "
            f"Rooflines measured in the same run: copy {calib['copy_bandwidth_gbs']:.0f} GB/s (read + write), "
            f"bf16 matmul {calib['matmul_peak_tflops']:.0f} TFLOP/s.")


def _table(columns: list[tuple[str, str]], rows: list, cells, keep: int) -> list[str]:
    """Markdown lines: (title, alignment) columns, cells(row) per measured row; a row that did not
    run keeps its first `keep` cells and then says why."""
    lines = ["| " + " | ".join(title for title, _ in columns) + " |",
             "|" + "|".join(align for _, align in columns) + "|"]
    for row in rows:
        if row["status"] == "ok":
            line = cells(row)
        else:
            line = cells(row)[:keep] + [f"{row['status']}: {row['note']}"] + [""] * (len(columns) - keep - 1)
        lines.append("| " + " | ".join(line) + " |")
    return lines


def _anchor_rows(rows: list) -> list[str]:
    columns = [("case", "---"), ("anchor", "---"), ("tilekit ms", "---:"), ("anchor ms", "---:"),
               ("anchor/tilekit", "---:"), ("tilekit perf", "---:"), ("% of roofline", "---:")]
    return _table(columns, rows, lambda r: [
        r["label"], r["anchor"], _fmt(r["tilekit_ms"], ".3f"), _fmt(r["anchor_ms"], ".3f"),
        f"{_fmt(r['ratio'], '.2f')}x", f"{_fmt(r['tilekit_perf'], '.1f')} {r['unit']}",
        f"{_fmt(r['pct_roofline'], '.0f')}%"], keep=2)


def _tuning_rows(rows: list) -> list[str]:
    columns = [("case", "---"), ("untuned ms (TILEKIT_AUTOTUNE=off)", "---:"), ("tuned ms", "---:"),
               ("untuned/tuned", "---:"), ("where the tuned configs came from", "---")]
    return _table(columns, rows, lambda r: [
        r["label"], _fmt(r["anchor_ms"], ".3f"), _fmt(r["tilekit_ms"], ".3f"), f"{_fmt(r['ratio'], '.2f')}x",
        r["note"].removeprefix(SOURCES_PREFIX)], keep=1)


def render(results: dict, suite: str | None = None) -> str:
    """The run's header line and one table of its rows (of `suite` only, when given)."""
    rows = [r for r in results["rows"] if suite is None or r["suite"] == suite]
    table = _tuning_rows(rows) if rows and all(r["suite"] == "tuning" for r in rows) else _anchor_rows(rows)
    return "\n".join([header(results["meta"]), ""] + table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.markdown",
                                 description="a README table from a benchmark results.json")
    ap.add_argument("results", type=Path)
    ap.add_argument("--suite", choices=SUITES, help="only this suite's rows")
    args = ap.parse_args(argv)
    print(render(json.loads(args.results.read_text()), args.suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
