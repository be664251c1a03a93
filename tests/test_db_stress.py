"""Many processes writing one device file at once lose nothing and leave valid JSON."""

import json
import multiprocessing

from tests._autotune_fakes import run_together
from tilekit.autotune.db import SCHEMA_VERSION, TuningDB
from tilekit.device import DeviceInfo

PROCS = 8
KEYS = 25
DEVICE = DeviceInfo("NVIDIA H100 80GB HBM3", "sm_90", 132)


def _entry(writer: int, i: int) -> dict:
    return {"config": {"A": 1 + i % 3, "occupancy": 1}, "time_us": float(writer * 1000 + i),
            "kernel_hash": "k" * 16, "space_hash": "s" * 16,
            "toolchain": {"cuda_tile": "1", "tileiras": "1"}, "device": DEVICE.as_dict(), "writer": writer}


def _writer(root: str, writer: int, same_key: bool, errors, start) -> None:
    try:
        db = TuningDB(root, "user", writable=True)   # each process its own instance, one shared root
        start.wait(60)
        for i in range(KEYS):
            key = "stress/M=1,N=1,dtype=x" if same_key else f"stress/M={i},N={writer},dtype=x"
            db.store(DEVICE, {key: _entry(writer, i)})
            if same_key:   # a reader in between writes always sees a whole file
                assert key in db.file_for(DEVICE).read()
    except BaseException as e:  # reported to the parent: an assert here would only kill the child
        errors.put(f"writer {writer}: {type(e).__name__}: {e}")


def _run(root, same_key: bool) -> None:
    errors = multiprocessing.get_context("spawn").Queue()
    codes = run_together(_writer, [(str(root), w, same_key, errors) for w in range(PROCS)], timeout=60)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures
    assert codes == [0] * PROCS


def _file(root):
    (path,) = (root / "sm_90").glob("*.json")
    data = json.loads(path.read_text())   # valid JSON: no torn or interleaved write
    assert data["schema"] == SCHEMA_VERSION and data["device"] == DEVICE.as_dict()
    leftovers = [p.name for p in (root / "sm_90").iterdir() if p.suffix not in (".json", ".lock")]
    assert not leftovers, leftovers   # no temporary or moved-aside files
    return data


def test_concurrent_writers_lose_nothing(tmp_path):
    root = tmp_path / "db"
    _run(root, same_key=False)
    entries = _file(root)["entries"]
    expected = {f"stress/M={i},N={w},dtype=x": _entry(w, i) for w in range(PROCS) for i in range(KEYS)}
    assert len(entries) == PROCS * KEYS
    assert entries == expected
    fresh = TuningDB(root, "user", writable=False)
    assert len(fresh.file_for(DEVICE).read()) == PROCS * KEYS


def test_concurrent_writers_of_one_key_leave_one_entry(tmp_path):
    root = tmp_path / "db"
    _run(root, same_key=True)
    entries = _file(root)["entries"]
    (key, value), = entries.items()
    assert key == "stress/M=1,N=1,dtype=x"
    assert value == _entry(value["writer"], KEYS - 1)   # whole, and some writer's last word
