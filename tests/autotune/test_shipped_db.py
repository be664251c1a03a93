"""The shipped tuning_db/ against the current kernels: parseable, sound, in-space, fresh, covering the models.

A stale entry (tuned for another kernel source or search space) fails: a change to a kernel ships
with its re-tuned entries (`tilekit tune --stale shipped` on each GPU), or without the file.
"""

import warnings
from pathlib import Path

import pytest

import tilekit.kernels  # noqa: F401  (declares every op the files name; run alone, nothing else imports them)
from tilekit.autotune.db import SCHEMA_VERSION, TuningDB, _parse, device_file_name, entry_problem
from tilekit.autotune.keys import bucket_problem, key_string, parse_key
from tilekit.autotune.registry import registered_ops
from tilekit.device import DeviceInfo
from tilekit.models.gpt2.config import GPTConfig
from tilekit.models import LLAMA_PRESETS
from tilekit.engine.workload import model_problems

SHIPPED = Path(__file__).resolve().parents[2] / "tuning_db"
FILES = sorted(p for p in SHIPPED.rglob("*") if p.is_file())
H100_FILE = SHIPPED / "sm_90" / "NVIDIA_H100_80GB_HBM3.json"
H200_FILE = SHIPPED / "sm_90" / "NVIDIA_H200.json"
# Ops a kernel change made stale whose entries were re-tuned on one GPU only (that GPU is not lent): the other's file
# dropped them and answers their shapes through the same-arch rule, from the re-tuned file, until
# `tilekit tune --stale shipped` runs there. next_token's one-id-at-a-time eos ban, re-tuned on the H200 (no H100 lent).
RETUNE_PENDING = {H100_FILE: ("next_token", H200_FILE)}
# sm_90 GPUs without a file of their own
OTHER_SM90 = [DeviceInfo("NVIDIA H800", "sm_90", 132), DeviceInfo("NVIDIA H20", "sm_90", 78)]


def _rel(path: Path) -> str:
    return str(path.relative_to(SHIPPED))


def _entries(path: Path) -> dict:
    data, problem = _parse(path)
    assert problem is None and data, f"{_rel(path)}: {problem or 'missing'}"
    return data["entries"]


def test_shipped_files_exist():
    assert H100_FILE in FILES and H200_FILE in FILES


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_file_parses_and_header_matches_path(path):
    assert path.suffix == ".json" and len(path.relative_to(SHIPPED).parts) == 2, \
        f"{_rel(path)}: tuning_db/ holds only <arch>/<GPU>.json"
    data, problem = _parse(path)
    assert problem is None, f"{_rel(path)}: {problem}"
    assert data["schema"] == SCHEMA_VERSION
    device = DeviceInfo.from_dict(data["device"])
    assert device.arch == path.parent.name
    assert device_file_name(device.name) == path.name
    assert device.sm_count > 0
    assert data["entries"], f"{_rel(path)} has no entries"
    # the loader sees every entry (nothing ignored with a warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = {key for dfile, key, _ in TuningDB(SHIPPED, "shipped", writable=False).items()
                  if dfile.path == path}
    assert loaded == set(data["entries"])


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_entries_are_sound_and_in_space(path):
    ops = registered_ops()
    header = _parse(path)[0]["device"]
    problems, stale = [], []
    for key, entry in _entries(path).items():
        where = f"{_rel(path)} {key}"
        why = entry_problem(key, entry)
        if why:
            problems.append(f"{where}: {why}")
            continue
        name, fields = parse_key(key)
        op = ops.get(name)
        if op is None:
            problems.append(f"{where}: no registered op {name!r}")
            continue
        if set(fields) != set(op.fields):
            problems.append(f"{where}: fields {sorted(fields)} are not {op.name}'s {sorted(op.fields)}")
        elif key_string(name, fields) != key or bucket_problem(fields, op.buckets) != fields:
            problems.append(f"{where}: not a canonical, bucketed key (no lookup would ask for it)")
        if not op.space.contains(entry["config"]):
            problems.append(f"{where}: config {entry['config']} is outside the current {name} search space")
        if "device" in entry and entry["device"] != header:
            problems.append(f"{where}: entry device {entry['device']} is not the file's {header}")
        if entry["kernel_hash"] != op.kernel_hash():
            stale.append(f"{where}: kernel_hash {entry['kernel_hash']} != current {op.kernel_hash()}")
        elif entry["space_hash"] != op.space_hash():
            stale.append(f"{where}: space_hash {entry['space_hash']} != current {op.space_hash()}")
    assert not problems, "\n".join(problems)
    assert not stale, f"{len(stale)} stale entries (re-tune on that GPU):\n" + "\n".join(stale[:10])


def _config(model: str):
    return LLAMA_PRESETS[model] if model in LLAMA_PRESETS else GPTConfig.preset(model)


def _missing(path: Path, model: str, dtype: str = "bfloat16") -> list[str]:
    have = set(_entries(path))
    want = {op.problem_key(p)[1] for op, p in
            model_problems(_config(model), dtype, (1, 8), (128, 1024))}
    assert want
    return sorted(want - have)


@pytest.mark.parametrize("path", [H100_FILE, H200_FILE], ids=_rel)
@pytest.mark.parametrize("model, dtype", [("gpt2", "bfloat16"), ("gpt2-medium", "bfloat16"),
                                          ("gpt2-large", "bfloat16"), ("gpt2-xl", "bfloat16"), ("gpt2", "float16"),
                                          ("llama-3.2-1b", "bfloat16"), ("llama-3.1-8b", "bfloat16")])
def test_each_shipped_gpu_covers_every_model_shape(path, model, dtype):
    missing = _missing(path, model, dtype)
    if path in RETUNE_PENDING:       # only the pending op's shapes, each held by the file re-tuned for it
        op, other = RETUNE_PENDING[path]
        pending = [key for key in missing if parse_key(key)[0] == op]
        assert not set(pending) - set(_entries(other)), f"{op} shapes in neither {_rel(path)} nor {_rel(other)}"
        missing = sorted(set(missing) - set(pending))
    assert not missing, f"{len(missing)} {model} {dtype} shapes missing from {_rel(path)}: {missing}"


@pytest.mark.parametrize("device", OTHER_SM90, ids=lambda d: d.name)
@pytest.mark.parametrize("model", ["gpt2", "gpt2-xl", "llama-3.2-1b"])
def test_another_sm90_gpu_uses_a_shipped_sm90_file(model, device, monkeypatch):
    """A GPU without a file of its own: every shape resolves through the same-arch rule, exact bucket."""
    from tilekit.autotune import store
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(SHIPPED))
    store.reset()
    for op, problem in model_problems(_config(model), "bfloat16", (1, 8), (128, 1024)):
        found = op.resolve(problem, device, "cached")
        assert found.source == "shipped" and found.match.exact, (op.name, problem)
        assert found.match.device_rule.startswith("same-arch (NVIDIA_H"), found.describe()
