"""The `tilekit` command on CPU: help, misuse, the db subcommands, concurrent imports, db explain."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.autotune.test_shipped_db import H100_FILE, RETUNE_PENDING
from tests._autotune_fakes import H100, H200, admitted_config, entry, run_together
from tilekit import cli
from tilekit.autotune import jobs
from tilekit.autotune import store
from tilekit.autotune.db import TuningDB, TuningDBWarning
from tilekit.device import DeviceInfo, gpu_unavailable_reason
from tilekit.kernels.layer_norm import LAYER_NORM
from tilekit.kernels.linear import LINEAR
from tilekit.models.gpt2.config import GPTConfig
from tilekit.engine.workload import model_problems

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = gpu_unavailable_reason() is None


@pytest.fixture(autouse=True)
def empty_shipped(tmp_path, monkeypatch):
    """An empty shipped layer (tests that want the real tuning_db/ point at it themselves)."""
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "no-shipped"))
    (tmp_path / "no-shipped").mkdir()
    monkeypatch.delenv("TILEKIT_AUTOTUNE", raising=False)
    store.reset()


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:   # argparse: --help and its own errors
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return rc, out, err


def misuse(argv, capsys) -> str:
    rc, out, err = run(argv, capsys)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tilekit: "), err
    return lines[0]


def linear_problem(M=8192, N=2304, K=768, **kw) -> dict:
    return dict(dict(dtype="bfloat16", M=M, N=N, K=K, wt="kn", bias=1, act="none", res=0, tf32=0), **kw)


def linear_config(**problem) -> dict:
    """A config the linear space admits for linear_problem(**problem)."""
    return admitted_config(LINEAR, linear_problem(**problem))


def linear_entry(device=H100, **problem) -> tuple[str, dict]:
    """(key, a usable entry on `device`) of linear_problem(**problem)."""
    return LINEAR.problem_key(linear_problem(**problem))[1], entry(LINEAR, linear_config(**problem), device)


def seed_user_db() -> dict[str, set[str]]:
    """Real-op entries in the user db for two GPUs; returns {file stem: keys}."""
    h100 = {LINEAR.problem_key(linear_problem(M=m))[1]: entry(LINEAR, linear_config(M=m), H100, time_us=m / 100)
            for m in (8, 128, 8192)}
    ln_problem = dict(dtype="bfloat16", M=1024, N=768, gather=0, fixed=0)
    h100[LAYER_NORM.problem_key(ln_problem)[1]] = entry(LAYER_NORM, admitted_config(LAYER_NORM, ln_problem), H100)
    h200 = dict([linear_entry(H200, M=1024, N=768, res=1)])
    store.user_db().store(H100, h100)
    store.user_db().store(H200, h200)
    store.reset()
    return {"NVIDIA_H100_80GB_HBM3": set(h100), "NVIDIA_H200": set(h200)}


def user_files() -> dict:
    """Every file under the user cache, with its bytes."""
    return {p: p.read_bytes() for p in Path(os.environ["TILEKIT_CACHE_DIR"]).rglob("*") if p.is_file()}


def user_entries() -> dict:
    store.reset()
    return {(dfile.path.name, key): e for dfile, key, e in store.user_db().items()}


def listed_keys(out: str) -> set[str]:
    return {line.split()[-1] for line in out.splitlines()[1:-1]}


# -- help and misuse -------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [[], ["tune"], ["db"], ["db", "list"], ["db", "show"], ["db", "explain"],
                                  ["db", "export"], ["db", "import"], ["db", "verify"], ["db", "check"],
                                  ["db", "clear"], ["generate"]])
def test_help_exits_0(argv, capsys):
    rc, out, err = run(argv + ["--help"], capsys)
    assert rc == 0, err
    assert "usage:" in out


@pytest.mark.parametrize("argv, says", [
    (["tune"], "exactly one of --model, --kernel, --stale or --like"),
    (["tune", "--model", "gpt2", "--kernel", "linear"], "exactly one of --model, --kernel, --stale or --like"),
    (["tune", "--model", "gpt2", "--like", "NVIDIA H200"], "exactly one of --model, --kernel, --stale or --like"),
    (["tune", "--like", "NVIDIA H200", "--kernel", "linear", "--shape", "M=1"], "--shape goes with --kernel alone"),
    (["tune", "--like", "NVIDIA H200", "--kernel", "nosuch"], "--kernel must be one of"),
    (["tune", "--kernel", "nosuch"], "--kernel must be one of"),
    (["tune", "--kernel", "linear"], "needs --shape"),
    (["tune", "--kernel", "linear", "--shape", "M=8,N=8"], "missing: K"),
    (["tune", "--kernel", "linear", "--shape", "M=8,N=8,K=8,Q=1"], "unknown: Q"),
    (["tune", "--kernel", "linear", "--shape", "M8"], "NAME=VALUE"),
    (["tune", "--model", "gpt2", "--dtype", "int8"], "dtype must be one of"),
    (["tune", "--model", "gpt2", "--batch-sizes", "0"], "argument --batch-sizes: expected integers in [1, 4096]"),
    (["tune", "--kernel", "linear", "--shape", "M=1,M=2,N=8,K=8"], "--shape names M twice"),
    (["tune", "--kernel", "linear", "--shape", "M=" + "9" * 5000 + ",N=8,K=8"], "--shape is 5010 characters long"),
    (["tune", "--kernel", "linear", "--shape", "M=99999999999,N=8,K=8"],
     "M must be an integer in [1, 2147483648], got 99999999999"),
    (["tune", "--model", "gpt2", "--batch-sizes", "1000000000"], "argument --batch-sizes: expected integers in"),
    (["tune", "--model", "gpt2", "--batch-sizes", "9" * 30], "argument --batch-sizes: expected integers in"),
    (["tune", "--model", "gpt2", "--seq-lens", "1000000000000"], "argument --seq-lens: expected integers in"),
    (["tune", "--model", "gpt2", "--new-tokens", "1,2"], "argument --new-tokens: expected one integer"),
    (["db", "explain", "--gpu", "NVIDIA H200", "--batch-sizes", "100000000"], "argument --batch-sizes"),
    (["tune", "--model", "gpt2", "--seq-lens", "x"], "comma-separated integers"),
    (["tune", "--model", "no-such-model"], "neither a preset"),
    (["db", "show", "nosuchkey"], "no entry with key 'nosuchkey'"),
    (["db", "frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_misuse_exits_2_with_one_line(argv, says, capsys):
    assert says in misuse(argv, capsys)


def test_a_rank_error_is_one_line_and_the_peer_lost_status(monkeypatch, capsys):
    """Tensor parallelism's RankError (a rank missing, dead, or with another WORLD_SIZE) ends a command as the other
    errors do, with the status of a lost peer, its text escaped."""
    from tilekit import parallel

    def rendezvous_fails(args):
        raise parallel.RankError("rank 1: rank 0: rank 1 has WORLD_SIZE=3\x1b[2J but rank 0 has WORLD_SIZE=2\n")
    monkeypatch.setattr(cli.generate, "run", rendezvous_fails)
    assert cli.main(["generate", "--model", "gpt2"]) == parallel.EXIT_PEER_LOST
    err = capsys.readouterr().err
    assert err == ("tilekit: rank 1: rank 0: rank 1 has WORLD_SIZE=3\\x1b[2J but rank 0 has WORLD_SIZE=2\\n\n")


def test_import_of_a_non_export_file(tmp_path, capsys):
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello\n")
    assert "cannot read" in misuse(["db", "import", str(not_json)], capsys)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": 1, "device": H100.as_dict(), "entries": {}}))  # a device file
    assert "is not a tilekit export" in misuse(["db", "import", str(other)], capsys)
    assert "cannot read" in misuse(["db", "import", str(tmp_path / "missing.json")], capsys)
    assert user_entries() == {}


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("argv", [["tune", "--model", "gpt2"],
                                  ["tune", "--kernel", "linear", "--shape", "M=8,N=8,K=8"]])
def test_tune_without_gpu_says_so(argv, capsys):
    assert "tuning needs a GPU" in misuse(argv, capsys)


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_db_check_without_gpu_says_so(capsys):
    assert "db check needs a GPU" in misuse(["db", "check"], capsys)


def test_db_check_refuses_an_unknown_kernel_before_looking_for_a_gpu(capsys):
    assert "--kernel must be one of" in misuse(["db", "check", "--kernel", "no_such_op"], capsys)


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_explain_without_gpu_needs_gpu_name(capsys):
    assert "--gpu NAME" in misuse(["db", "explain", "--model", "gpt2"], capsys)


def _actions(parser, prog="tilekit"):
    """(command, action) for every argument of the parser and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield prog, action
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield prog, action


def test_every_argument_has_help():
    actions = list(_actions(cli.build_parser()))
    assert len(actions) > 30
    missing = [f"{prog} {action.dest}" for prog, action in actions
               if action.help != argparse.SUPPRESS and not (action.help or "").strip()]
    assert not missing, missing


@pytest.mark.skipif(HAS_GPU, reason="checks the message on a machine without a GPU")
def test_generate_without_gpu_says_so_before_loading(monkeypatch, capsys):
    import tilekit.models
    monkeypatch.setattr(tilekit.models.GPT, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded weights without a GPU"))
    line = misuse(["generate", "--model", str(ROOT / "tests" / "data" / "tiny-gpt2"), "--prompt", "Hi"], capsys)
    assert line == (f"tilekit: generate needs a GPU: {gpu_unavailable_reason()} (--device cpu runs the NumPy "
                    "reference, slowly)")


def test_the_installed_cli_has_no_bench_and_never_imports_the_benchmarks(capsys):
    """The suite lives in the source checkout (`python -m benchmarks`); the installed command neither
    offers it nor imports code from the current directory."""
    line = misuse(["bench"], capsys)
    assert "invalid choice: 'bench'" in line
    assert "python -m benchmarks" in cli.__doc__
    assert "benchmarks" not in open(cli.__file__).read().replace("python -m benchmarks", "")


def _module(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "tilekit", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)


def test_module_entry_point():
    p = _module("--help")
    assert p.returncode == 0 and "usage: tilekit" in p.stdout
    for sub in ("tune", "db", "generate"):
        assert sub in p.stdout
    assert not any(line.split()[:1] == ["bench"] for line in p.stdout.splitlines())
    p = _module("tune", "--kernel", "nosuch")
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("tilekit: --kernel must be one of")


def test_module_entry_point_reads_the_db(isolated_cache):
    keys = seed_user_db()
    p = _module("db", "list", "--device", "H200",
                env_extra={"TILEKIT_CACHE_DIR": os.environ["TILEKIT_CACHE_DIR"],
                           "TILEKIT_SHIPPED_DB": os.environ["TILEKIT_SHIPPED_DB"]})
    assert p.returncode == 0, p.stderr
    assert listed_keys(p.stdout) == keys["NVIDIA_H200"]


# -- db list / show / export / clear / import ------------------------------------------------

def test_db_list_and_filters(capsys):
    rc, out, _ = run(["db", "list"], capsys)
    assert (rc, out.strip()) == (0, "no tuning entries")
    keys = seed_user_db()
    everything = keys["NVIDIA_H100_80GB_HBM3"] | keys["NVIDIA_H200"]

    rc, out, _ = run(["db", "list"], capsys)
    assert rc == 0 and listed_keys(out) == everything
    assert out.splitlines()[-1] == f"{len(everything)} entries"
    assert all(line.startswith("user ") for line in out.splitlines()[1:-1])

    rc, out, _ = run(["db", "list", "--kernel", "layer_norm"], capsys)
    assert listed_keys(out) == {k for k in everything if k.startswith("layer_norm/")} != set()
    for device in ("H100", "h100", "NVIDIA H100 80GB", "H100 80GB HBM3"):
        rc, out, _ = run(["db", "list", "--device", device], capsys)
        assert listed_keys(out) == keys["NVIDIA_H100_80GB_HBM3"], device
    rc, out, _ = run(["db", "list", "--device", "NVIDIA H200", "--kernel", "linear"], capsys)
    assert listed_keys(out) == keys["NVIDIA_H200"]
    rc, out, _ = run(["db", "list", "--device", "B200"], capsys)
    assert (rc, out.strip()) == (0, "no tuning entries match")


def test_db_show_prints_json(capsys):
    seed_user_db()
    key = LINEAR.problem_key(linear_problem(M=128))[1]
    rc, out, _ = run(["db", "show", key], capsys)
    assert rc == 0
    header, *body = out.splitlines()
    assert header.startswith("# user db: ") and header.endswith("NVIDIA_H100_80GB_HBM3.json")
    shown = json.loads("\n".join(body))
    assert shown == user_entries()[("NVIDIA_H100_80GB_HBM3.json", key)]
    assert shown["config"] == linear_config(M=128) and shown["kernel_hash"] == LINEAR.kernel_hash()


def test_db_export_clear_import_round_trip(tmp_path, capsys):
    seed_user_db()
    before = user_entries()
    assert len(before) == 5
    export = tmp_path / "export.json"
    rc, out, _ = run(["db", "export", str(export)], capsys)
    assert rc == 0 and out.startswith("exported 5 entries")
    payload = json.loads(export.read_text())
    assert payload["kind"] == "tilekit-tuning-export"
    assert sorted(f["device"]["name"] for f in payload["files"]) == [H100.name, H200.name]

    rc, out, _ = run(["db", "clear", "--yes"], capsys)
    assert rc == 0 and out.startswith("removed 5 entries")
    assert user_entries() == {}
    rc, out, _ = run(["db", "list"], capsys)
    assert out.strip() == "no tuning entries"

    rc, out, _ = run(["db", "import", str(export)], capsys)
    assert rc == 0 and out.startswith("imported 5 entries")
    assert user_entries() == before
    for device in (H100, H200):   # the device header survives the trip
        data = json.loads(store.user_db().file_for(device).path.read_text())
        assert data["device"] == device.as_dict()
    r = LINEAR.resolve(linear_problem(M=8000), H100, mode="cached")   # and dispatch uses the entries
    assert (r.source, r.config, r.match.rule) == ("user", linear_config(M=8192), "exact")

    rc, out, _ = run(["db", "import", str(export)], capsys)   # importing twice changes nothing
    assert rc == 0 and user_entries() == before


@pytest.mark.parametrize("layer, expected", [("user", "user"), ("shipped", "shipped"), ("all", "both")])
def test_db_export_layers(layer, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    keys = seed_user_db()
    shipped = {key for _, key, _ in store.shipped_db().items()}
    export = tmp_path / "export.json"
    rc, out, _ = run(["db", "export", str(export), "--layer", layer], capsys)
    got = {key for f in json.loads(export.read_text())["files"] for key in f["entries"]}
    user = keys["NVIDIA_H100_80GB_HBM3"] | keys["NVIDIA_H200"]
    assert rc == 0 and got == {"user": user, "shipped": shipped, "both": user | shipped}[expected]
    assert out.startswith(f"exported {sum(len(f['entries']) for f in json.loads(export.read_text())['files'])}")


def test_db_export_all_prefers_the_user_entry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    key, shipped_entry = next((k, e) for d, k, e in store.shipped_db().items() if d.path.stem == "NVIDIA_H100_80GB_HBM3")
    mine = dict(shipped_entry, time_us=1.0)
    store.user_db().store(H100, {key: mine})
    export = tmp_path / "export.json"
    assert run(["db", "export", str(export), "--layer", "all"], capsys)[0] == 0
    (h100,) = [f for f in json.loads(export.read_text())["files"] if f["device"]["name"] == H100.name]
    assert h100["entries"][key] == mine


def test_db_export_to_a_bad_place(tmp_path, capsys):
    seed_user_db()
    before = user_files()
    (tmp_path / "adir").mkdir()
    shipped = Path(os.environ["TILEKIT_SHIPPED_DB"])
    for target, says in [(tmp_path / "missing" / "x.json", f"directory {tmp_path / 'missing'} does not exist"),
                         (tmp_path / "adir", "it is a directory"),
                         (store.user_db().root / "sm_90" / "x.json", "it is inside the user tuning database"),
                         (shipped / "x.json", "it is inside the shipped tuning database")]:
        assert misuse(["db", "export", str(target)], capsys) == f"tilekit: cannot export to {target}: {says}"
    assert user_files() == before and not (tmp_path / "missing").exists() and not list((tmp_path / "adir").iterdir())


def test_db_import_drops_what_lookup_rejects_and_says_why(tmp_path, capsys):
    good = dict(linear_entry(M=m) for m in (8, 16))
    k1, k2, k3, k4, k5, k6 = (LINEAR.problem_key(linear_problem(M=2 ** m))[1] for m in range(6, 12))
    first = next(iter(LINEAR.space.params))
    refused = next(iter(LINEAR.space))        # in the space, but no candidate of k6's problem (M=2048)
    assert not LINEAR.space.admits(refused, LINEAR.tuning_problem(linear_problem(M=2048)))
    bad = {k1: entry(LINEAR, dict(linear_config(M=64), **{first: -1}), H100),
           k2: entry(LINEAR, dict(linear_config(M=128), **{first: 1e30}), H100),
           k3: entry(LINEAR, linear_config(M=256), H100, time_us=-5.0),
           k4: entry(LINEAR, linear_config(M=512), H100, toolchain={"cuda_tile": "0.1", "tileiras": "0.1"}),
           k5: entry(LINEAR, linear_config(M=1024), H100, kernel_hash="0" * 16),
           k6: entry(LINEAR, refused, H100),
           "nosuch/M=8,dtype=bfloat16": entry(LINEAR, linear_config(M=8), H100),
           "linear/not a key": entry(LINEAR, linear_config(), H100)}
    export = tmp_path / "export.json"
    export.write_text(json.dumps({"schema": 1, "kind": "tilekit-tuning-export",
                                  "files": [{"device": H100.as_dict(), "entries": {**good, **bad}}]}))
    rc, out, err = run(["db", "import", str(export)], capsys)
    assert rc == 0 and err == "", err
    imported, dropped = out.splitlines()
    assert imported == f"imported 2 entries into {store.user_db().root}"
    assert dropped.startswith("dropped 8: 2 config outside the linear search space, ")
    for reason in ("1 config the linear search space's rule refuses for its key", "1 time_us is negative",
                   "1 stale: tuned with {'cuda_tile': '0.1'",
                   "1 stale: tuned for another version of the kernel source", "1 unknown kernel 'nosuch'",
                   "1 malformed tuning key 'linear/not a key'"):
        assert ", " + reason in dropped, dropped
    assert set(user_entries()) == {("NVIDIA_H100_80GB_HBM3.json", k) for k in good}


def test_db_clear_asks_first(monkeypatch, capsys):
    seed_user_db()
    before = user_files()
    assert "confirm with --yes" in misuse(["db", "clear"], capsys)   # stdin is not a terminal here
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    for answer in ("", "n", "no thanks"):
        monkeypatch.setattr("builtins.input", lambda prompt: answer)
        rc, out, _ = run(["db", "clear"], capsys)
        assert (rc, out) == (1, "nothing deleted\n") and user_files() == before
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    rc, out, _ = run(["db", "clear"], capsys)
    assert rc == 0 and out.startswith("removed 5 entries") and user_entries() == {}


@pytest.mark.parametrize("argv", [["db", "list"], ["db", "show", "x"], ["db", "export", "{tmp}/e.json"],
                                  ["db", "import", "{tmp}/e.json"], ["db", "verify"], ["db", "clear", "--yes"],
                                  ["db", "explain", "--gpu", "NVIDIA H200"]])
def test_db_commands_when_the_cache_dir_is_a_file(argv, tmp_path, monkeypatch, capsys):
    (tmp_path / "e.json").write_text(json.dumps({"schema": 1, "kind": "tilekit-tuning-export", "files": [
        {"device": H100.as_dict(), "entries": dict([linear_entry()])}]}))
    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "cachefile"))
    store.reset()
    line = misuse([a.format(tmp=tmp_path) for a in argv], capsys)
    assert line == (f"tilekit: the user tuning database {tmp_path / 'cachefile' / 'tuning'} cannot be used: "
                    f"{tmp_path / 'cachefile'} is not a directory (see TILEKIT_CACHE_DIR)")
    assert (tmp_path / "cachefile").read_text() == "x"


def test_a_tuning_write_into_a_cache_path_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    """What `tune` meets when it stores a result (measured here without a GPU)."""
    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "cachefile"))
    store.reset()
    key = LINEAR.problem_key(linear_problem())[1]
    monkeypatch.setattr(cli.tune, "run",
                        lambda args: store.user_db().store(H100, {key: entry(LINEAR, linear_config())}))
    path = tmp_path / "cachefile" / "tuning" / "sm_90" / "NVIDIA_H100_80GB_HBM3.json"
    assert misuse(["tune", "--model", "gpt2"], capsys) == \
        f"tilekit: cannot write {path}: {tmp_path / 'cachefile'} is not a directory"


# -- db verify -------------------------------------------------------------------------------

def test_db_verify_good_entries(capsys):
    seed_user_db()
    for argv in (["db", "verify"], ["db", "verify", "--strict"]):
        rc, out, _ = run(argv, capsys)
        assert rc == 0 and out.strip() == "5 usable, 0 stale, 0 invalid", out


def verify_with_one_more(capsys, config, label, **entry_fields):
    """Seed the user db plus one linear entry; run `db verify`; return (rc, output, key, the `label` line)."""
    seed_user_db()
    key = LINEAR.problem_key(linear_problem(M=4096))[1]
    store.user_db().store(H100, {key: entry(LINEAR, config, H100, **entry_fields)})
    store.reset()
    rc, out, _ = run(["db", "verify"], capsys)
    (line,) = [line for line in out.splitlines() if line.startswith(label)]
    return rc, out, key, line


def test_db_verify_reports_stale(capsys):
    rc, out, key, stale = verify_with_one_more(capsys, linear_config(M=4096), "STALE", kernel_hash="0" * 16)
    assert rc == 0
    assert key in stale and "another version of the kernel source" in stale
    assert out.splitlines()[-1] == "5 usable, 1 stale, 0 invalid"
    rc, out, _ = run(["db", "verify", "--strict"], capsys)
    assert rc == 1


def test_db_verify_reports_invalid(capsys):
    outside = dict(linear_config(M=4096), **{next(iter(LINEAR.space.params)): 3})   # 3 is in no tile-size list
    assert not LINEAR.space.contains(outside)
    rc, out, key, invalid = verify_with_one_more(capsys, outside, "INVALID")
    assert rc == 1
    assert key in invalid and "outside the linear search space" in invalid
    assert out.splitlines()[-1] == "5 usable, 0 stale, 1 invalid"


def test_db_verify_reports_a_config_the_rule_refuses_for_its_key_and_dispatch_passes_it_by(capsys):
    """A config of the space's values that its rule refuses for the entry's own key (e.g. tiles larger than the
    problem, too much shared memory) is invalid, and a lookup of that very key does not use it."""
    problem = linear_problem(M=4096)
    refused = next(iter(LINEAR.space))
    assert not LINEAR.space.admits(refused, LINEAR.tuning_problem(problem)) and refused != linear_config(M=4096)
    rc, out, key, invalid = verify_with_one_more(capsys, refused, "INVALID")
    assert rc == 1 and key in invalid and "config the linear search space's rule refuses for its key" in invalid
    assert out.splitlines()[-1] == "5 usable, 0 stale, 1 invalid"
    with pytest.warns(TuningDBWarning, match="rule refuses for its key"):
        r = LINEAR.resolve(problem, H100, mode="cached")
    assert (r.source, r.match.key, r.config) == ("user", LINEAR.problem_key(linear_problem())[1], linear_config())


@pytest.mark.parametrize("damage, says", [
    (lambda p: p.write_text("{ truncated"), "not valid JSON"),
    (lambda p: p.write_text(p.read_text().replace('"schema": 1', '"schema": 2')), "schema version 2"),
    (lambda p: p.write_text(p.read_text().replace('"time_us":0.08', '"time_us":NaN')), "not strict JSON"),
    (lambda p: (p.unlink(), p.mkdir()), "is a directory"),
    (lambda p: (p.unlink(), os.mkfifo(p)), "is not a regular file"),
])
def test_db_verify_fails_on_an_unusable_file(damage, says, capsys):
    seed_user_db()
    path = store.user_db().file_for(H100).path
    damage(path)
    store.reset()
    rc, out, _ = run(["db", "verify"], capsys)
    assert rc == 1
    assert f"BAD     user {path}: " in out and says in out, out
    assert out.splitlines()[-1] == "1 usable, 0 stale, 0 invalid, 1 unusable files"


def test_db_verify_counts_unparseable_keys_as_invalid(capsys):
    seed_user_db()
    good = entry(LINEAR, linear_config(), H100)
    store.user_db().store(H100, {"linear/garbage": good, "linear": good, "linear/M=x,dtype=bfloat16": good})
    store.reset()
    rc, out, _ = run(["db", "verify"], capsys)
    assert rc == 1 and out.splitlines()[-1] == "5 usable, 0 stale, 3 invalid"
    assert "INVALID user NVIDIA_H100_80GB_HBM3.json linear/garbage: malformed tuning key" in out
    assert "INVALID user NVIDIA_H100_80GB_HBM3.json linear/M=x,dtype=bfloat16: key is not a linear problem key" in out


# -- concurrent imports ----------------------------------------------------------------------

PROCS = 8
KEYS = 12


def _import_worker(path: str, start) -> None:
    start.wait(60)
    sys.exit(cli.main(["db", "import", path]))


def test_concurrent_imports_lose_nothing(tmp_path, monkeypatch, capsys):
    files, expected = [], {}
    for i in range(PROCS):   # distinct exports, made by `db export` from separate caches
        monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / f"src{i}"))
        store.reset()
        for device in (H100, H200):
            batch = {LINEAR.problem_key(linear_problem(M=2 ** j, N=64 * (i + 1)))[1]:
                     entry(LINEAR, linear_config(M=2 ** j, N=64 * (i + 1)), device, time_us=float(i * 100 + j))
                     for j in range(KEYS)}
            store.user_db().store(device, batch)
            expected.update({(device.name, k): v for k, v in batch.items()})
        files.append(tmp_path / f"export{i}.json")
        assert run(["db", "export", str(files[-1])], capsys)[0] == 0

    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path / "shared"))
    store.reset()
    assert run_together(_import_worker, [(str(f),) for f in files]) == [0] * PROCS

    got = {(dfile.device().name, key): e for dfile, key, e in store.user_db().items()}
    assert len(got) == PROCS * KEYS * 2 and got == expected
    leftovers = [p.name for p in (tmp_path / "shared" / "tuning" / "sm_90").iterdir()
                 if p.suffix not in (".json", ".lock")]
    assert not leftovers


# -- db explain ------------------------------------------------------------------------------

GPT2_SHAPES = model_problems(GPTConfig.preset("gpt2"), "bfloat16", (1, 8), (128, 1024))


def explain(gpu: str, capsys) -> list[str]:
    rc, out, err = run(["db", "explain", "--model", "gpt2", "--gpu", gpu, "--arch", "sm_90"], capsys)
    assert rc == 0, err
    header, *lines = out.splitlines()
    assert header == f"{gpu} (sm_90), TILEKIT_AUTOTUNE=cached"
    assert len(lines) == len(GPT2_SHAPES)
    assert [line.split()[0] for line in lines] == [op.problem_key(p)[1] for op, p in GPT2_SHAPES]
    return lines


def test_explain_without_any_db(capsys):
    assert all(line.endswith("heuristic default") for line in explain("NVIDIA H200", capsys))


def test_explain_with_shipped_db_exact_gpu(monkeypatch, capsys):
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    lines = explain("NVIDIA H100 80GB HBM3", capsys)
    pending = RETUNE_PENDING[H100_FILE][0]   # dropped from the H100 file until re-tuned there: the H200's answer
    assert all(line.endswith("shipped db, same-arch (NVIDIA_H200), exact bucket") if line.startswith(pending + "/")
               else line.endswith("shipped db, exact-gpu, exact bucket") for line in lines), lines


def test_explain_with_shipped_db_same_arch(monkeypatch, capsys):
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    lines = explain("NVIDIA H800", capsys)
    assert all("shipped db, same-arch (NVIDIA_H" in line and line.endswith("exact bucket")
               for line in lines), lines


def test_explain_prefers_the_user_db_for_its_gpu(monkeypatch, capsys):
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(ROOT / "tuning_db"))
    store.reset()
    op, problem = next((op, p) for op, p in GPT2_SHAPES if op is LINEAR)
    h800 = DeviceInfo("NVIDIA H800", "sm_90", 132)
    store.user_db().store(h800, {op.problem_key(problem)[1]: entry(op, admitted_config(op, problem), h800)})
    store.reset()
    lines = explain("NVIDIA H800", capsys)
    assert sum(line.endswith("user db, exact-gpu, exact bucket") for line in lines) == 1


def test_explain_names_each_rule_and_the_entry_it_borrowed(capsys):
    """Exact, nearest bucket, nearest shape (another N of the same flags) and default, as text and as JSON."""
    h800 = DeviceInfo("NVIDIA H800", "sm_90", 132)
    c_attn = next(p for op, p in GPT2_SHAPES if op is LINEAR and p["N"] == 2304 and p["M"] == 128)
    ln = next(p for op, p in GPT2_SHAPES if op is LAYER_NORM and p["M"] == 128)
    near = {**c_attn, "N": 2048}
    config = next(c for c in LINEAR.space.candidates(LINEAR.tuning_problem(near))
                  if LINEAR.space.admits(c, LINEAR.tuning_problem(c_attn)))
    ln_config = next(c for c in LAYER_NORM.space.candidates(LAYER_NORM.tuning_problem(ln))
                     if LAYER_NORM.space.admits(c, LAYER_NORM.tuning_problem({**ln, "M": 8192})))
    near_key, ln_key = LINEAR.problem_key(near)[1], LAYER_NORM.problem_key(ln)[1]
    store.user_db().store(h800, {near_key: entry(LINEAR, config, h800), ln_key: entry(LAYER_NORM, ln_config, h800)})
    store.reset()
    rc, out, err = run(["db", "explain", "--model", "gpt2", "--gpu", "NVIDIA H800", "--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["device"]["name"] == "NVIDIA H800" and doc["autotune"] == "cached"
    shapes = {s["key"]: s for s in doc["shapes"]}
    assert [s["key"] for s in doc["shapes"]] == [op.problem_key(p)[1] for op, p in GPT2_SHAPES]
    got = shapes[LINEAR.problem_key(c_attn)[1]]
    assert (got["rule"], got["layer"], got["device_rule"], got["entry"], got["config"]) == (
        "nearest shape", "user", "exact-gpu", near_key, config)
    assert shapes[ln_key]["rule"] == "exact" and shapes[ln_key]["entry"] == ln_key
    ln_8192 = LAYER_NORM.problem_key({**ln, "M": 8192})[1]
    assert (shapes[ln_8192]["rule"], shapes[ln_8192]["entry"]) == ("nearest bucket", ln_key)
    others = [s for s in doc["shapes"] if s["key"].split("/")[0] not in ("linear", "layer_norm")]
    assert others and all((s["rule"], s["layer"], s["entry"]) == ("default", None, None) for s in others)
    lines = explain("NVIDIA H800", capsys)
    assert any(line.split()[0] == LINEAR.problem_key(c_attn)[1] and
               line.endswith(f"user db, exact-gpu, nearest shape ({near_key.partition('/')[2]})") for line in lines)


# -- tune --devices: the plan of worker processes (the GPU run itself is in the closing notes) -----

def test_devices_are_parsed_and_checked():
    assert jobs.parse_devices("all", 3) == [0, 1, 2]
    assert jobs.parse_devices("2,0,2", 3) == [0, 2]
    for bad in ("3", "x", "", "-1"):
        with pytest.raises(ValueError, match="--devices"):
            jobs.parse_devices(bad, 3)


def test_same_gpus_split_the_shapes_and_different_gpus_each_tune_all():
    assert jobs.shard_jobs({0: "NVIDIA H200", 1: "NVIDIA H200"}) == [(0, "0/2"), (1, "1/2")]
    mixed = jobs.shard_jobs({0: "NVIDIA H200", 1: "NVIDIA H100", 2: "NVIDIA H200"})
    assert sorted(mixed) == [(0, "0/2"), (1, "0/1"), (2, "1/2")]


def test_worker_command_line():
    argv = ["tune", "--model", "gpt2", "--devices", "all", "--budget", "5"]
    assert jobs.child_argv(argv, "1/2", 7) == ["tune", "--model", "gpt2", "--budget", "5",
                                               "--workers", "7", "--shard", "1/2"]
    assert jobs.child_argv(["tune", "--devices=0,1", "--workers", "3"], "0/2", 7) == [
        "tune", "--workers", "3", "--shard", "0/2"]


def test_shards_cover_every_shape_once():
    items = list(range(57))
    shards = [jobs.shard_items(items, f"{i}/3") for i in range(3)]
    assert sorted(x for s in shards for x in s) == items


def test_worker_exit_status_and_visible_devices():
    assert jobs.exit_status([0, 0]) == 0
    assert jobs.exit_status([0, 1]) == 1
    assert jobs.exit_status([0, -9]) == 137          # a worker killed by SIGKILL is a failure
    assert jobs.visible_device(1, None) == "1"
    assert jobs.visible_device(1, "4, 5") == "5"     # indices are relative to the parent's GPUs


def test_abbreviated_options_are_refused(capsys):
    """`--dev all` must not reach a worker as --devices (workers would spawn workers)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--model", "gpt2", "--dev", "all"])
    assert e.value.code == 2 and "--dev" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["tune", "--model", "gpt2", "--devices", "all"])
    assert args.devices == "all" and args.shard is None


def test_tune_stale_selects_exactly_the_stale_entries(monkeypatch):
    """`tilekit tune --stale [user|shipped]` re-tunes just the entries the current kernels made stale."""
    import tilekit.device
    fresh = LINEAR.problem_key(linear_problem(M=8))[1]
    stale = LINEAR.problem_key(linear_problem(M=128))[1]
    other_gpu = LINEAR.problem_key(linear_problem(M=1024))[1]
    store.user_db().store(H100, {fresh: entry(LINEAR, linear_config(M=8), H100),
                                 stale: entry(LINEAR, linear_config(M=128), H100, kernel_hash="0" * 16)})
    store.user_db().store(H200, {other_gpu: entry(LINEAR, linear_config(M=1024), H200, kernel_hash="0" * 16)})
    monkeypatch.setattr(tilekit.device, "device_info", lambda index=None: H100)
    items = jobs.stale_items("user")
    assert [(op.name, op.problem_key(p)[1]) for op, p in items] == [("linear", stale)]
    assert jobs.stale_items("shipped") == []


def test_tune_like_takes_the_shapes_another_gpus_shipped_file_holds(monkeypatch, tmp_path):
    """`tilekit tune --like GPU [--kernel K]`: the well-formed entries of that GPU's shipped file, one kernel's only
    with --kernel; a name the shipped database lacks is refused, naming the GPUs it holds."""
    shipped = TuningDB(tmp_path / "shipped", "maintainer", writable=True)
    linear = LINEAR.problem_key(linear_problem(M=8))[1]
    norm_problem = dict(dtype="bfloat16", M=8, N=768, gather=0, fixed=0)
    norm, norm_config = LAYER_NORM.problem_key(norm_problem)[1], admitted_config(LAYER_NORM, norm_problem)
    shipped.store(H200, {linear: entry(LINEAR, linear_config(M=8), H200),
                         norm: entry(LAYER_NORM, norm_config, H200, kernel_hash="0" * 16)})
    shipped.store(H100, dict([linear_entry(M=1)]))
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "shipped"))
    store.reset()
    keys = lambda items: sorted(op.problem_key(p)[1] for op, p in items)      # noqa: E731
    assert keys(jobs.like_items(H200.name, None)) == sorted([linear, norm])   # stale there: still a shape to tune
    assert keys(jobs.like_items(H200.name, "layer_norm")) == [norm]
    with pytest.raises(ValueError, match="NVIDIA H100 80GB HBM3, NVIDIA H200.*'NVIDIA H20'"):
        jobs.like_items("NVIDIA H20", None)


def test_db_export_refuses_links_and_special_files(tmp_path, capsys):
    """The export replaces the file it writes: a link or a FIFO given as the target is refused, left as it was."""
    fifo, link, target = tmp_path / "fifo", tmp_path / "link", tmp_path / "target.json"
    os.mkfifo(fifo)
    target.write_text("{}")
    link.symlink_to(target)
    for path in (fifo, link):
        rc, _, err = run(["db", "export", str(path)], capsys)
        assert rc == 2 and "a link or a special file" in err, err
    assert not fifo.is_file() and link.is_symlink() and target.read_text() == "{}"


@pytest.mark.parametrize("field, value, reason", [
    ("time_us", 10 ** 400, "time_us is out of range"), ("default_time_us", -(10 ** 13), "out of range")])
def test_db_verify_names_an_integer_time_no_float_holds(capsys, field, value, reason):
    rc, out, key, invalid = verify_with_one_more(capsys, linear_config(M=4096), "INVALID", **{field: value})
    assert key in invalid and reason in invalid
    rc, out, err = run(["db", "list"], capsys)
    assert rc == 0 and "Traceback" not in err


@pytest.mark.parametrize("problem, reason", [
    (dict(dtype="evil"), "dtype must be one of"), (dict(M=-7), "is not a linear problem key"),
    (dict(K=0), "key field K must be an integer in [1, 2147483648]"),
    (dict(K=1 << 100), "key field K must be an integer in [1, 2147483648]")])
def test_db_verify_refuses_keys_no_problem_has(capsys, problem, reason):
    """Key fields are checked as a problem named on the command line is (choices, positive sizes)."""
    from tilekit.autotune.entries import entry_defect
    key = LINEAR.problem_key(linear_problem(M=8))[1]
    name, fields = key.split("/", 1)
    fields = dict(f.split("=") for f in fields.split(","))
    fields.update({k: str(v) for k, v in problem.items()})
    bad = name + "/" + ",".join(f"{k}={fields[k]}" for k in sorted(fields))
    assert reason in (entry_defect(bad, entry(LINEAR, linear_config(M=8))) or "")


def test_database_warnings_are_escaped_and_capped(monkeypatch):
    """Keys and paths read from a file reach the warning escaped (no raw newline or terminal escape), and a file of
    a million bad entries makes MAX_WARNINGS lines, not a million."""
    import warnings

    from tilekit.autotune import db
    monkeypatch.setattr(db, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db.warn_once("ignoring entry linear/\x1b[2J\nFAKE LINE")
        for i in range(3 * db.MAX_WARNINGS):
            db.warn_once(f"ignoring entry {i}")
    messages = [str(w.message) for w in caught]
    assert messages[0] == "ignoring entry linear/\\x1b[2J\\nFAKE LINE"
    assert len(messages) == db.MAX_WARNINGS + 1 and "the rest are not shown" in messages[-1]


def test_an_error_naming_a_path_with_a_newline_stays_one_line(tmp_path, capsys):
    rc, _, err = run(["db", "import", str(tmp_path / "no\nsuch\x1b[31m" / "x.json")], capsys)
    assert rc == 2 and err.count("\n") == 1 and "\\n" in err and "\x1b" not in err, err


def test_output_piped_into_head_ends_quietly(tmp_path):
    """A closed pipe (`tilekit db list | head -1`) is no error: exit 0, nothing on stderr."""
    env = dict(os.environ, TILEKIT_CACHE_DIR=str(tmp_path))
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m tilekit db list | head -1 > /dev/null; "
                                         "echo ${PIPESTATUS[0]}"], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "0" and "Broken pipe" not in done.stderr, (done.stdout, done.stderr)
