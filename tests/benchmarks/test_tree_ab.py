"""benchmarks.studies.tree_ab without a GPU: its arguments, the warm-only run, the rows and their token check (the
children faked)."""

import json

import pytest

from benchmarks.studies import tree_ab


@pytest.fixture
def trees(tmp_path, monkeypatch):
    for name in ("before", "after"):
        (tmp_path / name / "tilekit").mkdir(parents=True)
        (tmp_path / name / "tilekit" / "__init__.py").write_text("")
    written, children = [], []
    monkeypatch.setattr(tree_ab, "write_checkpoint", lambda preset, layers, d: (
        written.append(preset), d.mkdir(parents=True), (d / "config.json").write_text("{}")))

    def child(tree, checkpoint):
        children.append((tree.name, checkpoint.name))
        tokens = [1, 2, 3] if tree.name == "before" or checkpoint.name != "llama-3.2-1b" else [1, 2, 4]
        return dict(tokens=tokens, decode_ms=2.0 if tree.name == "before" else 1.0, prefill_ms=3.0, exit=0)
    monkeypatch.setattr(tree_ab, "run_child", child)
    return tmp_path, written, children


def test_warm_only_writes_and_warms_without_timing(trees):
    root, written, children = trees
    argv = ["--before", str(root / "before"), "--after", str(root / "after"), "--work", str(root / "work"),
            "--preset", "gpt2", "--rounds", "0", "--warm", "--out", str(root / "out")]
    assert tree_ab.main(argv) == 0
    assert written == ["gpt2"] and sorted(children) == [("after", "gpt2"), ("before", "gpt2")]
    assert not (root / "out").exists()


def test_rows_compare_the_trees_and_fail_on_different_tokens(trees, capsys):
    root, written, children = trees
    argv = ["--before", str(root / "before"), "--after", str(root / "after"), "--work", str(root / "work"),
            "--preset", "gpt2", "--preset", "llama-3.2-1b", "--out", str(root / "out")]
    assert tree_ab.main(argv) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpt2") and "greedy tokens identical" in out[0] and "(0.500x)" in out[0]
    assert "greedy tokens DIFFER" in out[1]
    rows = json.loads((root / "out" / "tree-ab.json").read_text())["rows"]
    assert [r["tokens_identical"] for r in rows] == [True, False] and len(children) == 8


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_rounds_without_timing_are_refused(trees, rounds, capsys):
    root, _, _ = trees
    with pytest.raises(SystemExit):
        tree_ab.main(["--before", str(root / "before"), "--after", str(root / "after"), "--rounds", rounds])
    assert f"--rounds {rounds}" in capsys.readouterr().err
