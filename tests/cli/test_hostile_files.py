"""Hostile files against `tilekit db import` and the database readers.

Each case states its outcome exactly: exit status, the one-line message, the database's bytes
(unchanged when refused), and that nothing is written outside the user database's root, least of
all into the shipped layer.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._autotune_fakes import H100, admitted_config, entry, run_together
from tilekit import cli
from tilekit.autotune import store
from tilekit.autotune.db import MAX_FILE_BYTES, TuningDB
from tilekit.kernels.linear import LINEAR

ROOT = Path(__file__).resolve().parents[2]


def linear_problem(M: int = 8192, N: int = 2304) -> dict:
    return dict(dtype="bfloat16", M=M, N=N, K=768, wt="kn", bias=1, act="none", res=0, tf32=0)


def linear_key(M: int = 8192, N: int = 2304) -> str:
    return LINEAR.problem_key(linear_problem(M, N))[1]


GOOD_KEY = linear_key()


def good_entry(M: int = 8192, N: int = 2304, **overrides) -> dict:
    """A usable entry for linear_key(M, N)."""
    return entry(LINEAR, admitted_config(LINEAR, linear_problem(M, N)), H100, **overrides)


def export(device=None, entries=None) -> dict:
    return {"schema": 1, "kind": "tilekit-tuning-export",
            "files": [{"device": device or H100.as_dict(), "entries": entries or {GOOD_KEY: good_entry()}}]}


@pytest.fixture(autouse=True)
def layers(tmp_path, monkeypatch):
    """A shipped layer holding one H100 entry, and the (empty) user layer beside it."""
    monkeypatch.setenv("TILEKIT_SHIPPED_DB", str(tmp_path / "shipped"))
    monkeypatch.delenv("TILEKIT_AUTOTUNE", raising=False)
    TuningDB(tmp_path / "shipped", "shipped", writable=True).store(H100, {GOOD_KEY: good_entry(time_us=99.0)})
    store.reset()


def tree(tmp_path) -> dict:
    """Every file and link under tmp_path (the user root, the shipped layer, the hostile files), with bytes."""
    return {p: (os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None)
            for p in sorted(tmp_path.rglob("*"))}


def user_root() -> Path:
    return store.user_db().root


def refused(tmp_path, capsys, content, *says: str, name: str = "hostile.json") -> None:
    """Importing `content` (a payload, text or bytes) fails with one line naming the file; nothing changes."""
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else
                         content.encode() if isinstance(content, str) else json.dumps(content).encode())
    before = tree(tmp_path)
    rc = cli.main(["db", "import", str(path)])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, ""), (rc, out, err)
    assert err.count("\n") == 1 and err.startswith("tilekit: ") and str(path) in err, err
    assert all(part in err for part in says), err
    assert tree(tmp_path) == before


def imported(tmp_path, capsys, payload) -> str:
    path = tmp_path / "import.json"
    path.write_text(json.dumps(payload))
    rc = cli.main(["db", "import", str(path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def with_device(**fields) -> dict:
    device = dict(H100.as_dict(), **fields)
    return export(device={k: v for k, v in device.items() if v is not DROP})


DROP = object()


# -- paths from data -------------------------------------------------------------------------

@pytest.mark.parametrize("device, says", [
    (dict(arch="/abs/sm_90"), "device arch '/abs/sm_90' is not sm_<digits>"),
    (dict(arch="../../shipped/sm_90"), "device arch '../../shipped/sm_90' is not sm_<digits>"),
    (dict(arch="sm_90/../../../shipped/sm_90"), "is not sm_<digits>"),
    (dict(arch="sm_90\n"), "device arch 'sm_90\\n' is not sm_<digits>"),
    (dict(arch="sm_" + "9" * 10000), "is not sm_<digits>"),
    (dict(arch="sm_٩٠"), "is not sm_<digits>"),
    (dict(arch=""), "is not sm_<digits>"),
    (dict(name=".."), "GPU name '..' makes no usable file name"),
    (dict(name="."), "makes no usable file name"),
    (dict(name=""), "makes no usable file name"),
    (dict(name="../../shipped/sm_90/NVIDIA H100 80GB HBM3"), "makes no usable file name"),
    (dict(name="/////"), "makes no usable file name"),
    (dict(name="x" * 100000), "makes no usable file name"),
])
def test_path_tricks_are_refused(device, says, tmp_path, capsys):
    refused(tmp_path, capsys, with_device(**device), ": files[0]: ", says)


def test_slashes_in_a_name_stay_one_file_under_the_root(tmp_path, capsys):
    before = tree(tmp_path / "shipped")
    out = imported(tmp_path, capsys, with_device(name="NVIDIA/../../H100"))
    assert out.startswith("imported 1 entries")
    assert [p.relative_to(user_root()) for p in user_root().rglob("*.json")] == [Path("sm_90/NVIDIA_.._.._H100.json")]
    assert tree(tmp_path / "shipped") == before


def test_an_arch_directory_linked_out_of_the_root(tmp_path, capsys):
    TuningDB(tmp_path / "outside", "user", writable=True).store(H100, {GOOD_KEY: good_entry()})
    user_root().mkdir(parents=True)
    (user_root() / "sm_90").symlink_to(tmp_path / "outside" / "sm_90")
    refused(tmp_path, capsys, export(), "its directory resolves outside the database root")
    with pytest.warns(UserWarning, match="resolves outside the database root"):
        rc = cli.main(["db", "list", "--kernel", "linear"])   # reading through it finds nothing
    assert (rc, capsys.readouterr().out.splitlines()[1:]) == (
        0, [f"{'shipped':<8} {'NVIDIA_H100_80GB_HBM3':<24} {'99.0':>9}  {GOOD_KEY}", "1 entries"])


def test_a_device_file_linked_to_the_shipped_layer(tmp_path, capsys):
    """Reads refuse the link; a write moves the link aside and never touches its target."""
    shipped_file = store.shipped_db().file_for(H100).path
    before = shipped_file.read_bytes()
    user_file = store.user_db().file_for(H100).path
    user_file.parent.mkdir(parents=True)
    user_file.symlink_to(shipped_file)
    rc = cli.main(["db", "verify"])
    out = capsys.readouterr().out
    assert rc == 1 and f"BAD     user {user_file}: resolves outside the database root" in out, out
    with pytest.warns(UserWarning, match="moved it to"):
        out = imported(tmp_path, capsys, export(entries={linear_key(M=64): good_entry(M=64)}))
    assert out.startswith("imported 1 entries")
    assert not user_file.is_symlink() and list(json.loads(user_file.read_text())["entries"]) == [linear_key(M=64)]
    (aside,) = user_file.parent.glob("*.bad")
    assert aside.is_symlink() and shipped_file.read_bytes() == before


def test_a_lock_file_linked_elsewhere_is_never_opened(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    user_file = store.user_db().file_for(H100).path
    user_file.parent.mkdir(parents=True)
    Path(str(user_file) + ".lock").symlink_to(victim)
    refused(tmp_path, capsys, export(), f"cannot write {user_file}")
    assert victim.read_text() == "precious"


# -- wrong types -----------------------------------------------------------------------------

def _files(value):
    return {"schema": 1, "kind": "tilekit-tuning-export", "files": value}


@pytest.mark.parametrize("payload, says", [
    (with_device(name=None), "files[0]: device name is null, expected a string"),
    (with_device(name=7), "files[0]: device name is a number, expected a string"),
    (with_device(name=DROP), "files[0]: device name is null"),
    (with_device(arch=90), "device arch 90 is not sm_<digits>"),
    (with_device(arch=DROP), "device arch None is not sm_<digits>"),
    (with_device(arch=["sm_90"]), "device arch ['sm_90'] is not sm_<digits>"),
    (with_device(sm_count="132"), "device sm_count '132' is not a small non-negative integer"),
    (with_device(sm_count=True), "device sm_count True is not"),
    (with_device(sm_count=132.0), "device sm_count 132.0 is not"),
    (with_device(sm_count=-1), "device sm_count -1 is not"),
    (with_device(sm_count=10 ** 30), "is not a small non-negative integer"),
    (with_device(sm_count=DROP), "device sm_count None is not"),
    (_files([{"device": None, "entries": {}}]), "files[0]: device is null, expected an object"),
    (_files([{"device": [H100.as_dict()], "entries": {}}]), "files[0]: device is a list, expected an object"),
    (_files([{"device": "NVIDIA H100", "entries": {}}]), "files[0]: device is a string, expected an object"),
    (_files([{"entries": {}}]), "files[0]: device is null"),
    (_files([{"device": H100.as_dict(), "entries": []}]), "files[0]: entries is a list, expected an object"),
    (_files([{"device": H100.as_dict()}]), "files[0]: entries is null, expected an object"),
    (_files([{"device": H100.as_dict(), "entries": "x"}]), "files[0]: entries is a string"),
    (_files(["x"]), "files[0]: is a string, expected an object with device and entries"),
    (_files([export()["files"][0], None]), "files[1]: is null"),   # a good record first: still nothing lands
    (_files({"0": export()["files"][0]}), "'files' is an object, expected a list"),
    (_files(None), "'files' is null, expected a list"),
    ({"schema": 1, "kind": "tilekit-tuning-export"}, "'files' is null, expected a list"),
    (dict(export(), schema="1"), "has schema '1'; this tilekit reads 1"),
    (dict(export(), schema=True), "has schema True"),
    (dict(export(), schema=2), "has schema 2"),
    ({"schema": 1, "files": []}, "is not a tilekit export"),
    ([export()], "is not a tilekit export"),
    (json.dumps("just a string"), "is not a tilekit export"),
])
def test_wrong_types_are_one_line_errors(payload, says, tmp_path, capsys):
    refused(tmp_path, capsys, payload, says)


# -- not strict JSON, truncated, not JSON, not a file ---------------------------------------

GOOD_TEXT = json.dumps(export(entries={GOOD_KEY: good_entry(time_us=12.5)}))


@pytest.mark.parametrize("text, says", [
    (GOOD_TEXT.replace('"time_us": 12.5', '"time_us": NaN'), "not strict JSON (NaN is not a JSON number)"),
    (GOOD_TEXT.replace('"time_us": 12.5', '"time_us": Infinity'), "not strict JSON (Infinity is not a JSON"),
    (GOOD_TEXT.replace('"time_us": 12.5', '"time_us": -Infinity'), "not strict JSON (-Infinity is not"),
    (GOOD_TEXT.replace('"time_us": 12.5', '"time_us": 1e400'), "not strict JSON (1e400 is out of range)"),
    (GOOD_TEXT.replace('"sm_count": 132', '"sm_count": 1' + "0" * 5000), "not strict JSON (Exceeds the limit"),
    ("[" * 100000 + "]" * 100000, "not valid JSON (nested too deeply)"),
    ("", "not valid JSON (Expecting value at line 1 column 1)"),
    (GOOD_TEXT[: len(GOOD_TEXT) // 4], "not valid JSON"),
    (GOOD_TEXT[: len(GOOD_TEXT) // 2], "not valid JSON"),
    (GOOD_TEXT[:-1], "not valid JSON"),
    (b"\xff\xfe" + GOOD_TEXT.encode("utf-16-le"), "not valid JSON (not UTF-8"),
    ("\ufeff" + GOOD_TEXT, "not valid JSON (Unexpected UTF-8 BOM"),
])
def test_malformed_json_is_one_line_error(text, says, tmp_path, capsys):
    refused(tmp_path, capsys, text, f"cannot read {tmp_path / 'hostile.json'}: {says}")


def test_a_directory_a_fifo_a_device_and_a_missing_file(tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    refused(tmp_path, capsys, None, f"cannot read {tmp_path / 'missing.json'}: No such file", name="missing.json")
    refused(tmp_path, capsys, None, f"cannot read {tmp_path / 'adir'}: is a directory", name="adir")
    os.mkfifo(tmp_path / "fifo")     # opening one blocks without O_NONBLOCK: must not hang
    refused(tmp_path, capsys, None, f"cannot read {tmp_path / 'fifo'}: is not a regular file", name="fifo")
    rc = cli.main(["db", "import", "/dev/zero"])
    assert rc == 2 and capsys.readouterr().err == "tilekit: cannot read /dev/zero: is not a regular file\n"


def _fifo(path):
    os.mkfifo(path)


def _oversized(path):
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)


def _deep(path):
    path.write_text("[" * 100000)


@pytest.mark.parametrize("make, says", [(_fifo, "is not a regular file"), (_oversized, "is larger than 64 MiB"),
                                        (_deep, "not valid JSON (nested too deeply)")])
def test_hostile_database_files_are_misses_not_hangs(make, says):
    """In the user layer, each is a miss with one warning; the shipped entry answers."""
    user_file = store.user_db().file_for(H100).path
    user_file.parent.mkdir(parents=True)
    make(user_file)
    assert store.user_db().file_for(H100).load() == ({}, says)
    problem = dict(dtype="bfloat16", M=8192, N=2304, K=768, wt="kn", bias=1, act="none", res=0, tf32=0)
    with pytest.warns(UserWarning, match=re.escape(says)):
        assert LINEAR.resolve(problem, H100, mode="cached").source == "shipped"


# -- huge files ------------------------------------------------------------------------------

def _module(*args, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", "tilekit", *args], capture_output=True, text=True, cwd=cwd,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])), timeout=timeout)


def test_a_50_mb_export_is_read_in_seconds(tmp_path):
    junk_entry = good_entry(notes="x" * 100)
    junk = {f"nosuch{i % 3}/M={i},dtype=bfloat16": junk_entry for i in range(90_000)}
    junk[GOOD_KEY] = good_entry()
    path = tmp_path / "big.json"
    path.write_text(json.dumps(export(entries=junk)))
    assert 40e6 < path.stat().st_size < MAX_FILE_BYTES
    p = _module("db", "import", str(path), cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[1] == ("dropped 90000: 30000 unknown kernel 'nosuch0', 30000 unknown kernel "
                                        "'nosuch1', 30000 unknown kernel 'nosuch2'")
    assert [k for _, k, _ in store.user_db().items()] == [GOOD_KEY]


def test_an_export_over_the_size_limit_is_refused_unread(tmp_path, capsys):
    path = tmp_path / "hostile.json"
    with open(path, "wb") as f:
        f.truncate(4 * MAX_FILE_BYTES)   # sparse: costs no disk
    refused(tmp_path, capsys, None, f"cannot read {path}: is larger than 64 MiB")


def test_many_reasons_stay_one_line(tmp_path, capsys):
    entries = {f"k{i}/M=1,dtype=bfloat16": good_entry() for i in range(50)}
    out = imported(tmp_path, capsys, export(entries=entries))
    dropped = out.splitlines()[1]
    assert dropped.startswith("dropped 50: 1 unknown kernel 'k")
    assert dropped.endswith(", 42 for 42 other reasons") and dropped.count(",") == 8


def test_control_characters_from_a_file_are_escaped(tmp_path, capsys):
    key = "\x1b[2Jlinear/M=1\nFAKE LINE"
    store.user_db().store(H100, {key: good_entry()})
    store.reset()
    rc = cli.main(["db", "verify"])
    out = capsys.readouterr().out
    assert rc == 1 and "\x1b" not in out and "\nFAKE" not in out
    assert "INVALID user NVIDIA_H100_80GB_HBM3.json '\\x1b[2Jlinear/M=1\\nFAKE LINE'" in out


# -- concurrent importers and killed writers -------------------------------------------------

def _import(path: str, start) -> None:
    start.wait(60)
    sys.exit(cli.main(["db", "import", path]))


def test_concurrent_good_and_hostile_importers(tmp_path):
    good, hostile = [], []
    for i in range(4):
        good.append(tmp_path / f"good{i}.json")
        shapes = [dict(M=2 ** j, N=64 * (i + 1)) for j in range(10)]
        good[-1].write_text(json.dumps(export(entries={linear_key(**shape): good_entry(**shape) for shape in shapes})))
    for i, bad in enumerate([with_device(arch="../../shipped/sm_90"), with_device(name=".."),
                             GOOD_TEXT.replace("12.5", "NaN"), _files({"x": 1})]):
        hostile.append(tmp_path / f"hostile{i}.json")
        hostile[-1].write_text(bad if isinstance(bad, str) else json.dumps(bad))
    user_root().mkdir(parents=True)
    before = tree(tmp_path)
    codes = run_together(_import, [(str(p),) for p in good + hostile])
    assert codes == [0] * 4 + [2] * 4
    assert len(list(store.user_db().items())) == 40
    after = tree(tmp_path)
    assert {p: after.get(p) for p in before if not p.is_relative_to(user_root())} == \
        {p: v for p, v in before.items() if not p.is_relative_to(user_root())}
    assert all(p.is_relative_to(user_root()) for p in set(after) - set(before))
    leftovers = [p.name for p in (user_root() / "sm_90").iterdir() if p.suffix not in (".json", ".lock")]
    assert not leftovers


KILLED_WRITER = """import os, sys, time
from tilekit.autotune.db import TuningDB
from tilekit.device import DeviceInfo

def hang(fd):
    print("writing", flush=True)
    time.sleep(600)

os.fsync = hang   # killed between writing its temporary file and renaming it
TuningDB(sys.argv[1], "user", writable=True).store(DeviceInfo("NVIDIA H100 80GB HBM3", "sm_90", 132),
                                                   {"linear/M=1": {"half": "x" * 100000}})
"""


def test_killed_writers_leave_nothing_behind_the_next_writer(tmp_path, capsys):
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    writer = subprocess.Popen([sys.executable, str(script), str(user_root())], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    directory = user_root() / "sm_90"
    (tmp,) = directory.glob(".NVIDIA_H100_80GB_HBM3.json.*.tmp")
    assert not (directory / "NVIDIA_H100_80GB_HBM3.json").exists()
    other = directory / ".NVIDIA_H200.json.0123456789abcdef.tmp"   # a live writer of another file
    other.write_text("in progress")

    assert imported(tmp_path, capsys, export()).startswith("imported 1 entries")   # holds the lock: cleans
    assert not tmp.exists() and other.exists()
    assert [k for _, k, _ in store.user_db().items()] == [GOOD_KEY]

    rc = cli.main(["db", "clear", "--yes"])
    assert rc == 0 and capsys.readouterr().out.startswith("removed 1 entries")
    assert sorted(p.name for p in directory.iterdir()) == ["NVIDIA_H100_80GB_HBM3.json.lock",
                                                           "NVIDIA_H200.json.lock"]


def test_a_directory_named_like_a_writers_temporary_file_blocks_nothing(tmp_path, monkeypatch):
    """A killed writer's temporary files are removed before each write; a directory planted under such a name is
    not one of them: it stays, and writes go on (it made every import fail with 'Is a directory')."""
    from tests._autotune_fakes import H100, entry
    from tilekit.autotune import store
    from tilekit.autotune.db import device_file_name
    from tilekit.kernels.linear import LINEAR
    monkeypatch.setenv("TILEKIT_CACHE_DIR", str(tmp_path))
    store.reset()
    folder = tmp_path / "tuning" / H100.arch
    planted = folder / f".{device_file_name(H100.name)}.0123456789abcdef.tmp"
    planted.mkdir(parents=True)
    key = LINEAR.problem_key(dict(dtype="bfloat16", M=8, N=64, K=64, act="none", bias=0, res=0, tf32=0,
                                  wt="nk"))[1]
    store.user_db().store(H100, {key: entry(LINEAR, next(iter(LINEAR.space)), H100)})
    assert planted.is_dir() and key in store.user_db().file_for(H100).read()
    store.reset()
