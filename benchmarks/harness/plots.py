"""PNG charts drawn from a results.json, so a chart always shows the rows of the table beside it.

    python -m benchmarks.harness.plots RESULTS_JSON [--suite S] [--out DIR]

writes DIR/<stem>[-<suite>]-ratio.png (anchor/tilekit per row, line at 1) and -roofline.png (achieved
TFLOP/s and GB/s, tilekit beside the case's strongest anchor, against the measured rooflines).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from benchmarks.harness.report import SUITES, strongest_first


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ratio_chart(rows: list[dict], path: Path) -> Path | None:
    """Horizontal bars of anchor_ms / tilekit_ms per measured row, a line at 1.0."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("ratio") is not None]
    if not ok:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(ok) + 1.5))
    values = [r["ratio"] for r in ok]
    ax.barh(range(len(ok)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(ok)), [f"{r['label']}  vs {r['anchor']}" for r in ok], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    from matplotlib.ticker import FormatStrFormatter
    ax.xaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%.2g"))
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("anchor time / tilekit time (> 1: tilekit faster)")
    ax.set_title("tilekit vs anchors")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def roofline_chart(rows: list[dict], meta: dict, path: Path) -> Path | None:
    """Achieved TFLOP/s (left) and GB/s (right), tilekit beside each case's first (strongest) anchor."""
    measured = _first_anchor([r for r in rows if r["status"] == "ok" and r.get("tilekit_perf") is not None])
    groups = [(unit, [r for r in measured if r["unit"] == unit]) for unit in ("TFLOP/s", "GB/s")]
    groups = [(u, g) for u, g in groups if g]
    if not groups:
        return None
    cal = meta.get("calibration", {})
    roofs = {"TFLOP/s": ("bf16 matmul peak", cal.get("matmul_peak_tflops")),
             "GB/s": ("copy bandwidth", cal.get("copy_bandwidth_gbs"))}
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 6), squeeze=False)
    for ax, (unit, group) in zip(axes[0], groups):
        xs = range(len(group))
        ax.bar([x - 0.2 for x in xs], [r["tilekit_perf"] for r in group], 0.4, label="tilekit")
        ax.bar([x + 0.2 for x in xs], [r.get("anchor_perf") or 0 for r in group], 0.4, label="anchor")
        name, roof = roofs[unit]
        if roof:
            ax.axhline(roof, color="black", linestyle="--", linewidth=1, label=f"{name} {roof:.0f}")
        ax.set_xticks(list(xs), [f"{r['label']}\nvs {r['anchor']}" for r in group], rotation=75, fontsize=6,
                      ha="right")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
        ax.set_title(f"achieved {unit}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _first_anchor(rows: list[dict]) -> list[dict]:
    """One row per case (its first measured anchor): tilekit's bar would repeat otherwise."""
    seen, out = set(), []
    for r in rows:
        key = (r["suite"], r["name"], r["label"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def write_all(results_json: Path, out_dir: Path, prefix: str = "", suite: str | None = None) -> list[Path]:
    """Both charts of the rows in results_json (of `suite` only, when given), strongest anchor first."""
    doc = json.loads(Path(results_json).read_text())
    rows = strongest_first([r for r in doc["rows"] if suite is None or r["suite"] == suite],
                           lambda r, k: r.get(k))
    made = [ratio_chart(rows, out_dir / f"{prefix}ratio.png"),
            roofline_chart(rows, doc["meta"], out_dir / f"{prefix}roofline.png")]
    return [p for p in made if p is not None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness.plots", description="charts from a results.json")
    ap.add_argument("results", type=Path)
    ap.add_argument("--suite", choices=SUITES, help="only this suite's rows")
    ap.add_argument("--out", type=Path, help="output directory (default: the JSON's)")
    args = ap.parse_args(argv)
    if not available():
        print("matplotlib is not installed", file=sys.stderr)
        return 2
    prefix = f"{args.results.stem}-" + (f"{args.suite}-" if args.suite else "")
    out_dir = args.out or args.results.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in write_all(args.results, out_dir, prefix, args.suite):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
