"""docs/results.md, generated from the JSON measurement files in docs/results/ (so no number on it is typed by hand).

    python scripts/results_page.py             # rewrite docs/results.md
    python scripts/results_page.py --check     # exit 1 when docs/results.md is not what this script writes now

Each JSON file becomes a section: its date, GPU, commit and command where the file records them, then its rows as a
table. Shapes it knows: a benchmark run (`python -m benchmarks`: {"meta", "rows": [...]}), a study's list of
{"rows": [...]} or list of flat records, and any object holding a list of records under "rows" or "results" (nested
objects are flattened one level deep, lists left out). Anything else, or a file that is not valid JSON, gets a
one-line summary and a link. Needs only the standard library; runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "results.md"
MAX_COLUMNS = 12

# Words, not numbers: what a reader must know before quoting a file's rows (matched by file-name prefix).
CAVEATS = {
    "load-": "These loading rows are known to be wrong: a later fair comparison measured tilekit's load slower than "
             "transformers'. Do not quote them; loading is being reworked (issue #63, see "
             "[finite-check-h200.txt](results/finite-check-h200.txt)).",
}

BENCH_COLUMNS = (("case", "label"), ("anchor", "anchor"), ("tilekit ms", "tilekit_ms"), ("anchor ms", "anchor_ms"),
                 ("anchor / tilekit", "ratio"), ("tilekit % of roofline", "pct_roofline"), ("status", "status"))


def cell(value) -> str:
    """A table cell: numbers to 4 significant digits, text with its pipes and newlines escaped."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return format(value, ".4g") if math.isfinite(value) else str(value)
    if isinstance(value, (list, dict)):
        return f"({len(value)} items)"
    text = str(value).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def facts(meta: dict) -> str:
    """Date, GPU, commit and command of a run, as far as `meta` records them."""
    date = meta.get("date")
    gpu = meta.get("gpu")
    gpu = gpu.get("name") if isinstance(gpu, dict) else gpu
    source = meta.get("tilekit") if isinstance(meta.get("tilekit"), dict) else {}
    commit = meta.get("commit") or meta.get("git_commit") or source.get("commit")
    argv = meta.get("argv")
    parts = [f"date {str(date)[:10] if date else 'not recorded'}", f"GPU {gpu or 'not recorded'}",
             f"commit {str(commit)[:12] if commit else 'not recorded'}"]
    if isinstance(argv, list) and all(isinstance(a, str) for a in argv):
        shown, skip = [], False
        for a in argv:                   # --out DIR says where a machine wrote, not what ran
            if skip:
                skip = False
            elif a == "--out":
                skip = True
            else:
                shown.append(a)
        parts.append("arguments `" + (" ".join(shown) or "(none)").replace("`", "'") + "`")
    return "; ".join(parts) + "."


def flat(record: dict) -> dict:
    """A record's scalar fields, nested objects flattened one level deep ("median.seconds"), lists left out."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                if isinstance(v2, dict):
                    for k3, v3 in v2.items():
                        if not isinstance(v3, (list, dict)):
                            out[f"{k}.{k2}.{k3}"] = v3
                elif not isinstance(v2, list):
                    out[f"{k}.{k2}"] = v2
        elif not isinstance(v, list):
            out[k] = v
    return out


def records_table(records: list[dict]) -> list[str]:
    rows = [flat(r) for r in records]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    dropped = columns[MAX_COLUMNS:]
    columns = columns[:MAX_COLUMNS]
    lines = table(columns, [[r.get(c) for c in columns] for r in rows])
    if dropped:
        lines += ["", f"Columns left out here: {', '.join(dropped)}."]
    return lines


def is_records(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def bench_cell(row: dict, key: str):
    value = row.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if key == "ratio":
            return f"{value:.2f}x"
        if key == "pct_roofline":
            return f"{value:.0f}%"
    return value


def body(data) -> tuple[str | None, list[str], int] | None:
    """(facts line or None, table lines, row count) of a JSON document of a known shape, else None."""
    if isinstance(data, dict) and isinstance(data.get("meta"), dict) and is_records(data.get("rows")) \
            and all("label" in r for r in data["rows"]):
        rows = [[bench_cell(r, key) for _, key in BENCH_COLUMNS] for r in data["rows"]]
        return facts(data["meta"]), table([title for title, _ in BENCH_COLUMNS], rows), len(rows)
    if isinstance(data, dict):
        for key in ("rows", "results"):
            if is_records(data.get(key)):
                meta = data["meta"] if isinstance(data.get("meta"), dict) else data
                return facts(meta), records_table(data[key]), len(data[key])
    if is_records(data):
        if all(set(r) == {"rows"} and is_records(r["rows"]) for r in data):
            rows = [row for r in data for row in r["rows"]]
            return None, records_table(rows), len(rows)
        return None, records_table(data), len(data)
    return None


def summary(data) -> str:
    if isinstance(data, dict):
        return f"a JSON object with keys {', '.join(list(map(str, data))[:10]) or '(none)'}"
    if isinstance(data, list):
        return f"a JSON list of {len(data)} items"
    return f"a JSON {type(data).__name__}"


def section(path: Path) -> list[str]:
    link = f"[{path.name}](results/{path.name})"
    lines = [f"## {path.stem}", ""]
    text_log = path.with_suffix(".txt")
    log_link = f" (log: [{text_log.name}](results/{text_log.name}))" if text_log.exists() else ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return lines + [f"{link}: not readable as JSON ({type(e).__name__}).", ""]
    try:
        found = body(data)
    except (KeyError, TypeError, ValueError, AttributeError):
        found = None
    if found is None:
        return lines + [f"{link}{log_link}: {summary(data)}; not tabulated here.", ""]
    line, rows, _ = found
    lines += [f"Source: {link}{log_link}. " + (line or "Date, GPU and commit: not recorded in the file."), ""]
    for prefix, caveat in CAVEATS.items():
        if path.name.startswith(prefix):
            lines += [f"**Caveat.** {caveat}", ""]
    return lines + rows + [""]


def render(results: Path = RESULTS) -> str:
    files = sorted(results.glob("*.json"))
    lines = ["# Results", "",
             "<!-- Generated by scripts/results_page.py from docs/results/*.json; do not edit by hand. -->", "",
             "Every JSON measurement file in [docs/results/](results/), its rows as recorded. How each benchmark is "
             "run, and what its anchors are: [benchmarks.md](benchmarks.md). The text logs beside these files (and "
             "the many studies that write only text) are in the same folder. Ratios are anchor time / tilekit time: "
             "above 1 means tilekit is faster.", ""]
    lines += ["| file | rows |", "|---|---|"]
    for path in files:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            found = body(data)
            count = "not tabulated" if found is None else str(found[2])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            count = "not readable"
        lines.append(f"| [{path.name}](#{path.stem.lower()}) | {count} |")
    lines.append("")
    for path in files:
        lines += section(path)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/results.md is stale; write nothing")
    args = ap.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != page:
            print("docs/results.md is stale: run python scripts/results_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)} from {len(list(RESULTS.glob('*.json')))} JSON files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
