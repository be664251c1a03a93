"""Markdown for the README from a results.json: `python -m benchmarks.harness.markdown RESULTS_JSON [--suite S]`.

The run's header line (GPU, date, command, versions, rooflines), then one table per suite, each
case's rows strongest anchor first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness.report import SUITES, strongest_first

SOURCES_PREFIX = "tuned side's configs: "     # how a tuning row's note starts (benchmarks.suites.tuning)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def command(meta: dict) -> str:
    """The command line of the run, without --out DIR."""
    argv, kept = list(meta.get("argv", [])), []
    while argv:
        arg = argv.pop(0)
        if arg == "--out":
            argv[:1] = []
        elif not arg.startswith("--out="):
            kept.append(arg)
    prog = "python -m benchmarks.suites.overhead" if meta.get("mode") == "overhead" else "python -m benchmarks"
    return " ".join([prog] + kept)


def header(meta: dict) -> str:
    gpu, versions = meta["gpu"], meta.get("versions", {})
    text = (f"{gpu['name']} ({gpu['sm_count']} SMs, driver {gpu.get('driver', '?')}), {meta['date'][:10]}, "
            f"`{command(meta)}`; " + ", ".join(f"{name} {versions.get(key, '?')}" for name, key in (
                ("cuda-tile", "cuda_tile"), ("tileiras", "tileiras"), ("torch", "torch"),
                ("transformers", "transformers"))) + ".")
    if source := meta.get("tilekit"):
        text += f" tilekit from {source['path']} at {(source.get('commit') or 'unknown')[:12]}."
    if calib := meta.get("calibration"):
        text += (f" Rooflines measured in the same run: copy {calib['copy_bandwidth_gbs']:.0f} GB/s (read + "
                 f"write), bf16 matmul {calib['matmul_peak_tflops']:.0f} TFLOP/s.")
    return text


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


def check(row: dict) -> str:
    """What the row's check measured: the relative error, and for decode rows the greedy agreement."""
    error = row.get("error")              # a number, None, or "inf" / "nan" (JSON has no infinities)
    text = "-" if error is None else f"err {error:.1e}" if isinstance(error, (int, float)) else f"err {error}"
    params = row.get("params", {})
    if params.get("greedy_agreement") is not None:
        n = params.get("new_tokens")
        text += f", {params['greedy_agreement']}{'' if n is None else f'/{n}'} tokens agree"
        if len(each := params.get("greedy_agreement_per_sequence") or []) > 1:
            text += f" (least of {len(each)}; median {sorted(each)[len(each) // 2]})"
    return text


def _anchor_rows(rows: list) -> list[str]:
    columns = [("case", "---"), ("anchor", "---"), ("tilekit ms", "---:"), ("anchor ms", "---:"),
               ("anchor/tilekit", "---:"), ("tilekit perf", "---:"), ("tilekit % of floor", "---:"),
               ("anchor % of floor", "---:"), ("check", "---")]
    return _table(columns, rows, lambda r: [
        r["label"], r["anchor"], _fmt(r["tilekit_ms"], ".3f"), _fmt(r["anchor_ms"], ".3f"),
        f"{_fmt(r['ratio'], '.2f')}x", f"{_fmt(r['tilekit_perf'], '.1f')} {r['unit']}",
        f"{_fmt(r['pct_roofline'], '.0f')}%", f"{_fmt(r.get('anchor_pct_roofline'), '.0f')}%", check(r)], keep=2)


def _tuning_rows(rows: list) -> list[str]:
    columns = [("case", "---"), ("untuned ms (TILEKIT_AUTOTUNE=off)", "---:"), ("tuned ms", "---:"),
               ("untuned/tuned", "---:"), ("where the tuned configs came from", "---")]
    return _table(columns, rows, lambda r: [
        r["label"], _fmt(r["anchor_ms"], ".3f"), _fmt(r["tilekit_ms"], ".3f"), f"{_fmt(r['ratio'], '.2f')}x",
        r["note"].removeprefix(SOURCES_PREFIX)], keep=1)


def _overhead_rows(rows: list) -> list[str]:
    def us(ms):
        return _fmt(None if ms is None else ms * 1e3, ".1f")
    columns = [("call", "---"), ("tilekit us (median)", "---:"), ("p10 / p90 us", "---:"), ("torch op", "---"),
               ("torch us", "---:")]
    return _table(columns, rows, lambda r: [
        r["label"], us(r["tilekit_ms"]), f"{us(r['tilekit_p10_ms'])} / {us(r['tilekit_p90_ms'])}", r["anchor"],
        us(r["anchor_ms"])], keep=1)


TABLES = {"tuning": _tuning_rows, "overhead": _overhead_rows}


def render(results: dict, suite: str | None = None) -> str:
    """The run's header line and one table per suite of its rows (of `suite` only, when given)."""
    rows = strongest_first([r for r in results["rows"] if suite is None or r["suite"] == suite],
                           lambda r, k: r.get(k))
    present = list(dict.fromkeys(r["suite"] for r in rows))
    lines = [header(results["meta"])]
    for s in present or [suite]:
        block = [r for r in rows if r["suite"] == s]
        lines += [""] + ([f"**{s}**", ""] if len(present) > 1 else []) + TABLES.get(s, _anchor_rows)(block)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness.markdown",
                                 description="a README table from a benchmark results.json")
    ap.add_argument("results", type=Path)
    ap.add_argument("--suite", choices=SUITES, help="only this suite's rows")
    args = ap.parse_args(argv)
    print(render(json.loads(args.results.read_text()), args.suite))
    return 0


if __name__ == "__main__":
    sys.exit(main())
