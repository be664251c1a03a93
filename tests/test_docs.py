"""The documentation stays true (CPU only): every relative link in README.md and docs/*.md resolves to a file of the
checkout; docs/results.md is exactly what scripts/results_page.py generates from docs/results/*.json now (and the
script copes with JSON of any shape); every `tilekit ...` command the pages show parses with the real parser; every
Python snippet is valid Python whose `from tilekit... import` names exist; the README's install and test commands
are the ones CI runs (.ci/run)."""

import ast
import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path) -> list[tuple[str, list[str]]]:
    """(info string, lines) of every fenced code block of a Markdown page."""
    found, fence, info, lines = [], None, "", []
    for line in page.read_text(encoding="utf-8").splitlines():
        stripped = line.lstrip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})(.*)", stripped)
            if m:
                fence, info, lines = m.group(1), m.group(2).strip(), []
        elif stripped.startswith(fence) and not stripped[len(fence):].strip():
            found.append((info, lines))
            fence = None
        else:
            lines.append(line)
    assert fence is None, f"{_id(page)}: a code block is never closed"
    return found


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks, inline code spans removed."""
    out, fence = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        stripped = line.lstrip()
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if stripped.startswith(fence) and not stripped[len(fence):].strip():
                fence = None
            continue
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return out


def links(page: Path) -> list[str]:
    targets = []
    for line in prose(page):
        targets += LINK.findall(line)
        m = REFERENCE.match(line)
        if m:
            targets.append(m.group(1))
    return targets


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_resolves(page):
    targets = links(page)
    assert page != README or len(targets) >= 10, "the link finder found (almost) nothing in README.md"
    broken = []
    for target in targets:
        if SCHEME.match(target) or target.startswith("#"):
            continue                             # a web address, or an anchor on the same page
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (page.parent / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            broken.append(target)
    assert not broken, f"{_id(page)}: links to nothing in the checkout: {broken}"


def test_the_link_finder_sees_links_but_not_code(tmp_path):
    page = tmp_path / "probe.md"
    page.write_text("[a](x.md) and ![b](img/y.png#top) `[c](not-a-link.md)`\n[ref]: z.md\n"
                    "```\n[d](in-code.md)\n```\n[e](https://example.com) [f](#here)\n", encoding="utf-8")
    assert links(page) == ["x.md", "img/y.png#top", "z.md", "https://example.com", "#here"]


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_is_what_the_script_generates_now():
    page = _results_page()
    current = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert current == page.render(), "docs/results.md is stale: run `python scripts/results_page.py`"
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        assert f"(results/{path.name})" in current, f"docs/results.md leaves out {path.name}"


def test_results_page_copes_with_any_json(tmp_path):
    files = {
        "bench.json": {"meta": {"date": "2026-01-02T03:04:05", "gpu": {"name": "GPU X"}, "argv": ["--quick", "--out",
                                                                                                 "/x"],
                                "tilekit": {"commit": "0123456789abcdef"}},
                       "rows": [{"label": "case a", "anchor": "cuBLAS", "tilekit_ms": 1.0, "anchor_ms": 2.0,
                                 "ratio": 2.0, "pct_roofline": 50.0, "status": "ok"},
                                {"label": "case | b", "status": "failed"}]},
        "study.json": [{"rows": [{"preset": "p", "ms": 0.5, "runs": [1, 2]}]}, {"rows": [{"preset": "q"}]}],
        "records.json": [{"a": 1, "b": {"c": float("nan")}}],
        "nested.json": {"date": "2026-02-03", "gpu": {"name": "GPU Y"}, "results": [{"x": {"y": {"z": 3}}}]},
        "number.json": 3,
        "empty.json": [],
        "ints.json": [1, 2, 3],
        "odd.json": {"rows": "not a list"},
    }
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "bench.txt").write_text("the log\n", encoding="utf-8")
    text = _results_page().render(tmp_path)
    for name in [*files, "broken.json"]:
        assert f"](results/{name})" in text, name
        assert f"## {Path(name).stem}\n" in text, name
    assert "date 2026-01-02; GPU GPU X; commit 0123456789ab; arguments `--quick`." in text
    assert "| case a | cuBLAS | 1 | 2 | 2.00x | 50% | ok |" in text and "case \\| b" in text
    assert "(log: [bench.txt](results/bench.txt))" in text
    assert "| p | 0.5 |" in text and "| q | - |" in text and "b.c" in text and "x.y.z" in text
    assert "date 2026-02-03; GPU GPU Y" in text
    assert "broken.json](results/broken.json): not readable as JSON" in text
    assert "not tabulated" in text
    assert text == _results_page().render(tmp_path)       # the same files give the same page


def commands(page: Path) -> list[list[str]]:
    """Each `tilekit ...` command in the page's code blocks (also `python -m tilekit ...`, `torchrun ... -m
    tilekit ...`), as its arguments after `tilekit`; environment assignments, comments and a trailing `&` dropped."""
    found = []
    for info, lines in blocks(page):
        if info not in ("", "bash", "sh", "shell", "console"):
            continue
        joined, held = [], ""
        for line in lines:
            if line.rstrip().endswith("\\"):
                held += line.rstrip()[:-1] + " "
                continue
            joined.append(held + line)
            held = ""
        for line in joined:
            try:
                words = shlex.split(line.strip().removeprefix("$ "), comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                words = words[1:]
            while words and words[-1] in ("&", "&&", ";"):
                words = words[:-1]
            if words[:1] == ["tilekit"]:
                found.append(words[1:])
            elif "-m" in words and words[words.index("-m") + 1:words.index("-m") + 2] == ["tilekit"]:
                found.append(words[words.index("-m") + 2:])
    return found


def test_the_readme_quickstart_shows_every_command():
    shown = {argv[0] for argv in commands(README) if argv}
    assert {"generate", "chat", "serve", "tune", "db"} <= shown, shown


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_command_shown_parses(page, capsys):
    from tilekit.cli import build_parser
    for argv in commands(page):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{_id(page)}: `tilekit {shlex.join(argv)}` does not parse: {capsys.readouterr().err.strip()}")
        assert args.command == argv[0]


def test_the_command_finder_reads_shell_lines(tmp_path):
    page = tmp_path / "probe.md"
    page.write_text("```bash\nTILEKIT_API_KEY=k tilekit serve --model M &   # note\ntilekit tune \\\n"
                    "    --model gpt2\ntorchrun --nproc-per-node 2 -m tilekit generate --model M --prompt 'a b'\n"
                    "python -m benchmarks\n```\n```python\ntilekit = 1\n```\n", encoding="utf-8")
    assert commands(page) == [["serve", "--model", "M"], ["tune", "--model", "gpt2"],
                              ["generate", "--model", "M", "--prompt", "a b"]]


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_python_snippet_is_python_and_its_tilekit_names_exist(page):
    for info, lines in blocks(page):
        if info != "python":
            continue
        tree = ast.parse("\n".join(lines))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tilekit":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"{_id(page)}: from {node.module} import {alias.name}: no such name"


def test_the_readme_installs_and_tests_as_ci_does():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    wanted = [line.replace("python -m pip install -e", "pip install -e") for line in ci
              if line.startswith(("python -m pip install -e", "python -m pytest"))]
    assert any(w.startswith("pip install") for w in wanted) and any(w.startswith("python -m pytest") for w in wanted), ci
    shown = [line.strip() for _, lines in blocks(README) for line in lines]
    for command in wanted:
        assert command in shown, f"README.md does not show CI's `{command}`"
    assert 'pip install -e ".[serve]"' in README.read_text(encoding="utf-8")
