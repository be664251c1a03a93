"""PNG charts of a run: speed ratio per case, and achieved throughput against the measured rooflines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from benchmarks.report import Row


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ratio_chart(rows: list[Row], path: Path) -> Path | None:
    """Horizontal bars of anchor_ms / tilekit_ms per measured row, a line at 1.0."""
    ok = [r for r in rows if r.status == "ok" and r.ratio is not None]
    if not ok:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(ok) + 1.5))
    labels = [f"{r.label}  vs {r.anchor}" for r in ok]
    values = [r.ratio for r in ok]
    colors = ["tab:green" if v >= 1 else "tab:red" for v in values]
    ax.barh(range(len(ok)), values, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(ok)), labels, fontsize=7)
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


def roofline_chart(rows: list[Row], meta: dict, path: Path) -> Path | None:
    """Achieved TFLOP/s (left) and GB/s (right), tilekit beside its first anchor, roofline dashed."""
    measured = _first_anchor([r for r in rows if r.status == "ok" and r.tilekit_perf is not None])
    groups = [(unit, [r for r in measured if r.unit == unit])
              for unit in ("TFLOP/s", "GB/s")]
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
        ax.bar([x - 0.2 for x in xs], [r.tilekit_perf for r in group], 0.4, label="tilekit")
        ax.bar([x + 0.2 for x in xs], [r.anchor_perf or 0 for r in group], 0.4, label="anchor")
        name, roof = roofs[unit]
        if roof:
            ax.axhline(roof, color="black", linestyle="--", linewidth=1, label=f"{name} {roof:.0f}")
        ax.set_xticks(list(xs), [f"{r.label}\nvs {r.anchor}" for r in group], rotation=75, fontsize=6,
                      ha="right")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
        ax.set_title(f"achieved {unit}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _first_anchor(rows: list[Row]) -> list[Row]:
    """One row per case (its first measured anchor): tilekit's bar would repeat otherwise."""
    seen, out = set(), []
    for r in rows:
        key = (r.suite, r.name, r.label)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def write_all(rows: list[Row], meta: dict, out_dir: Path) -> list[Path]:
    made = [ratio_chart(rows, out_dir / "ratio.png"), roofline_chart(rows, meta, out_dir / "roofline.png")]
    return [p for p in made if p is not None]
