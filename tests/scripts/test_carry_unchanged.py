"""scripts/carry_unchanged.py on CPU (tileiras compiles without a GPU), in a scratch copy of the tree: an edit
to the exact GELU's code (with lines added above the kernels, which moves their line numbers in the cubins'
debug sections) leaves the approximate GELU's code sections identical, so only that entry is carried to the new
kernel hash; a space rule that drops configs of the exact GELU only carries the approximate GELU's entry to the
new space hash; a constant added to the kernel (which renames it) carries the entry whose code it leaves alone."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tilekit.kernels  # noqa: F401  (declares the ops)
from tilekit.autotune.registry import registered_ops
from tilekit.device import toolchain

ROOT = Path(__file__).resolve().parents[2]
DEVICE = {"arch": "sm_90", "name": "NVIDIA H200", "sm_count": 132}

pytest.importorskip("cuda.tile.compilation")
if shutil.which("git") is None:
    pytest.skip("needs git", allow_module_level=True)


def _entry(op, exact: int, hashes: dict | None = None) -> tuple[str, dict]:
    """gelu's entry for the exact or approximate form, tuned for `hashes` (default: this checkout's)."""
    problem = dict(dtype="bfloat16", n=1 << 20, exact=exact)
    config = dict(BLOCK=1024, occupancy=2)
    hashes = hashes or dict(kernel=op.kernel_hash(), space=op.space_hash())
    return op.problem_key(problem)[1], {
        "config": config, "time_us": 10.0, "default_config": config, "default_time_us": 10.0,
        "kernel_hash": hashes["kernel"], "space_hash": hashes["space"], "toolchain": toolchain(), "device": DEVICE,
        "candidates": 1, "measured": 1, "tuned_at": "2026-11-25T00:00:00+00:00"}


def _hashes(tree: Path) -> dict:
    """gelu's kernel and space hashes under the tilekit of `tree`."""
    return json.loads(subprocess.run(
        [sys.executable, "-c", "import json, tilekit.kernels; from tilekit.autotune.registry import registered_ops; "
         "op = registered_ops()['gelu']; print(json.dumps(dict(kernel=op.kernel_hash(), space=op.space_hash())))"],
        env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True, check=True).stdout)


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


def _carry_after(tmp_path, edit, old_digest=None) -> tuple[dict, dict, dict]:
    """(entries after carry_unchanged, the two entries before, gelu's (kernel, space) hashes after) in a scratch
    tree whose gelu.py `edit` (text -> text) changed after the entries were committed as tuned; with `old_digest`
    (text -> text), the entries were tuned under that edit of digest.py, and this checkout's digest.py came since."""
    gelu = registered_ops()["gelu"]
    tree = tmp_path / "tree"
    for part in ("tilekit", "scripts"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    digest = tree / "tilekit" / "autotune" / "digest.py"
    if old_digest:
        digest.write_text(old_digest(digest.read_text()))
    tuned = _hashes(tree)
    approximate, exact = _entry(gelu, 0, tuned), _entry(gelu, 1, tuned)
    db_file = tree / "tuning_db" / "sm_90" / "NVIDIA_H200.json"
    db_file.parent.mkdir(parents=True)
    schema = json.loads((ROOT / "tuning_db" / "sm_90" / "NVIDIA_H200.json").read_text())["schema"]
    db_file.write_text(json.dumps({"schema": schema, "device": DEVICE, "entries": dict([approximate, exact])}))
    _git(tree, "init", "-q")
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tuned")
    old = _git(tree, "rev-parse", "HEAD")
    shutil.copy2(ROOT / "tilekit" / "autotune" / "digest.py", digest)
    source = tree / "tilekit" / "kernels" / "gelu.py"
    source.write_text(edit(source.read_text()))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(tree / "scripts" / "carry_unchanged.py"), old], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 entries stale for their kernel source or search space" in done.stdout
    return json.loads(db_file.read_text())["entries"], dict([approximate, exact]), _hashes(tree)


def test_only_entries_whose_cubins_did_not_change_are_carried(tmp_path):
    gelu = registered_ops()["gelu"]

    def edit(text):          # the exact form's code (not in the approximate cubin), and every kernel's lines moved
        assert text.count("1.00002368") == 1
        return "# a comment\n" * 3 + text.replace("1.00002368", "1.00012368")   # another float32 (not 1.00002369)
    entries, before, hashes = _carry_after(tmp_path, edit)
    (approximate, _), (exact, _) = _entry(gelu, 0), _entry(gelu, 1)
    assert hashes["kernel"] != gelu.kernel_hash() and hashes["space"] == gelu.space_hash()
    assert entries[approximate]["kernel_hash"] == hashes["kernel"]          # carried: identical code sections
    assert entries[exact]["kernel_hash"] == gelu.kernel_hash()              # left stale: its code changed
    assert {k: v for k, v in entries[approximate].items() if k != "kernel_hash"} == \
        {k: v for k, v in before[approximate].items() if k != "kernel_hash"}


def test_a_space_change_carries_only_the_problems_whose_candidates_it_leaves_alone(tmp_path):
    gelu = registered_ops()["gelu"]

    def edit(text):          # the exact form loses its 256-wide blocks; the approximate one keeps every config
        rule = 'return c["BLOCK"] <= max(256, pow2_ceil(p["n"]))'
        assert text.count(rule) == 1
        return text.replace(rule, rule + ' and (p["exact"] == 0 or c["BLOCK"] >= 512)')
    entries, before, hashes = _carry_after(tmp_path, edit)
    (approximate, _), (exact, _) = _entry(gelu, 0), _entry(gelu, 1)
    assert hashes["kernel"] == gelu.kernel_hash() and hashes["space"] != gelu.space_hash()
    assert entries[approximate]["space_hash"] == hashes["space"]            # carried: the same candidates
    assert entries[exact] == before[exact]                                  # left stale: candidates changed
    assert {k: v for k, v in entries[approximate].items() if k != "space_hash"} == \
        {k: v for k, v in before[approximate].items() if k != "space_hash"}


def test_a_constant_added_carries_the_problems_whose_code_it_leaves_alone(tmp_path):
    gelu = registered_ops()["gelu"]

    def edit(text):          # NEGATE, on for the exact form only: every kernel's mangled name spells it out
        sig, body, constants = ("EXACT: ct.Constant[bool]):", "    ct.store(Y, (pid,), y.astype(Y.dtype))",
                                'return (c["BLOCK"], bool(p["exact"]))')
        assert text.count(sig) == text.count(body) == text.count(constants) == 1
        return (text.replace(sig, "EXACT: ct.Constant[bool], NEGATE: ct.Constant[bool]):")
                .replace(body, "    if NEGATE:\n        y = -y\n" + body)
                .replace(constants, 'return (c["BLOCK"], bool(p["exact"]), bool(p["exact"]))'))
    entries, before, hashes = _carry_after(tmp_path, edit)
    (approximate, _), (exact, _) = _entry(gelu, 0), _entry(gelu, 1)
    assert hashes["kernel"] != gelu.kernel_hash()
    assert entries[approximate]["kernel_hash"] == hashes["kernel"]          # carried: NEGATE off, same code
    assert entries[exact] == before[exact]                                  # left stale: its code negates


def test_a_digest_change_alone_carries_entries_whose_code_it_hashes_alike(tmp_path):
    """Entries tuned when the digest still hashed where a kernel lets the next one launch (PDL_CONTROL empty), and
    gelu's kernel since letting it launch at its end too: its cubins differ, but this digest hashes the old code
    and the new alike, so both entries are carried."""
    def old_digest(text):
        assert "PDL_CONTROL = frozenset({" in text
        return text + "\nPDL_CONTROL = frozenset()\n"          # read at each digest: none left out

    def edit(text):
        body = "    ct.store(Y, (pid,), y.astype(Y.dtype))"
        assert text.count(body) == 1
        return text.replace(body, body + "\n    ct.grid_dependency_control_launch_dependents()")
    entries, before, hashes = _carry_after(tmp_path, edit, old_digest)
    gelu = registered_ops()["gelu"]
    assert hashes["kernel"] == gelu.kernel_hash() != before[_entry(gelu, 0)[0]]["kernel_hash"]
    for exact in (0, 1):
        key = _entry(gelu, exact)[0]
        assert entries[key]["kernel_hash"] == hashes["kernel"], exact
        assert {k: v for k, v in entries[key].items() if k != "kernel_hash"} == \
            {k: v for k, v in before[key].items() if k != "kernel_hash"}
