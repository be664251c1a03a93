"""Why tuning matters: how much faster each tuned config is than the heuristic default it replaced.

    python -m benchmarks.studies.tuning_stats [TUNING_FILE ...]     (default: every tuning_db/*/*.json)

prints a markdown table of default_time_us / time_us (both measured in the same tuning run) over all
tuned entries of each file, and per op: count, how many changed the config, worst (least), quartiles,
median and best. Entries whose default was never timed are counted apart. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SHIPPED = Path(__file__).resolve().parents[2] / "tuning_db"


def speedup(entry: dict) -> float | None:
    """default_time_us / time_us of one entry; None when its default was not timed."""
    if entry.get("default_time_us") and entry.get("time_us"):
        return entry["default_time_us"] / entry["time_us"]
    return None


def distribution(values: list[float]) -> dict:
    """count, worst (least), q1, median, q3 and best (greatest) of speedups."""
    v = np.asarray(values, np.float64)
    q = np.percentile(v, [0, 25, 50, 75, 100]) if v.size else [None] * 5
    return dict(zip(("worst", "q1", "median", "q3", "best"), (None if x is None else float(x) for x in q)),
                count=int(v.size))


def table(paths: list[Path]) -> str:
    """The markdown table: per file one 'all ops' row, then one row per op."""
    lines = ["| tuning file | op | entries | default timed | config changed | worst | q1 | median | q3 | best |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for path in paths:
        entries = json.loads(Path(path).read_text())["entries"]
        ops = sorted({key.split("/")[0] for key in entries})
        for name, op in [("all ops", None)] + [(op, op) for op in ops]:
            chosen = [e for key, e in entries.items() if op is None or key.split("/")[0] == op]
            d = distribution([x for e in chosen if (x := speedup(e)) is not None])
            changed = sum(e.get("config") != e.get("default_config") for e in chosen)
            stats = ["-" if d[f] is None else f"{d[f]:.2f}x" for f in ("worst", "q1", "median", "q3", "best")]
            lines.append(f"| {Path(path).parent.name}/{Path(path).name} | {name} | {len(chosen)} | {d['count']} | "
                         f"{changed} | " + " | ".join(stats) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.tuning_stats",
                                 description="default / tuned kernel time over every entry of tuning files")
    ap.add_argument("files", nargs="*", type=Path, help="tuning files (default: every tuning_db/*/*.json)")
    args = ap.parse_args(argv)
    files = args.files or sorted(SHIPPED.glob("*/*.json"))
    if not files:
        ap.error(f"no tuning files given and none under {SHIPPED}")
    print(table(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
