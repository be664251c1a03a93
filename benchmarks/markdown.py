"""Markdown for the README from a results.json: `python -m benchmarks.markdown bench-results/results.json`."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(results: dict) -> str:
    meta = results["meta"]
    gpu, versions, calib = meta["gpu"], meta["versions"], meta["calibration"]
    lines = [f"{gpu['name']} ({gpu['sm_count']} SMs, driver {gpu['driver']}), {meta['date'][:10]}, "
             f"`python -m benchmarks --{meta['mode']}`; cuda-tile {versions['cuda_tile']}, tileiras "
             f"{versions['tileiras']}, torch {versions['torch']}, transformers {versions['transformers']}. "
             f"Rooflines measured in the same run: copy {calib['copy_bandwidth_gbs']:.0f} GB/s (read + write), "
             f"bf16 matmul {calib['matmul_peak_tflops']:.0f} TFLOP/s.", "",
             "| case | anchor | tilekit ms | anchor ms | anchor/tilekit | tilekit perf | % of roofline |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        if row["status"] != "ok":
            lines.append(f"| {row['label']} | {row['anchor']} | {row['status']}: {row['note']} | | | | |")
            continue
        unit = row["unit"]
        lines.append(f"| {row['label']} | {row['anchor']} | {_fmt(row['tilekit_ms'], '.3f')} | "
                     f"{_fmt(row['anchor_ms'], '.3f')} | {_fmt(row['ratio'], '.2f')}x | "
                     f"{_fmt(row['tilekit_perf'], '.1f')} {unit} | {_fmt(row['pct_roofline'], '.0f')}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.markdown RESULTS_JSON", file=sys.stderr)
        return 2
    print(render(json.loads(Path(args[0]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
