"""Many processes writing device files of one directory at once lose nothing and leave valid JSON."""

import json
import multiprocessing

from tests._autotune_fakes import run_together
from tilekit.autotune.db import SCHEMA_VERSION, TuningDB
from tilekit.device import DeviceInfo

PROCS = 8
KEYS = 25
DEVICE = DeviceInfo("NVIDIA H100 80GB HBM3", "sm_90", 132)
OTHER = DeviceInfo("NVIDIA H200", "sm_90", 132)   # another file in the same directory


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
            # odd writers write another file of the directory: cleaning up after killed writers of
            # one file must never touch the temporary files of a live writer of another
            db.store(OTHER if writer % 2 and not same_key else DEVICE, {key: _entry(writer, i)})
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


def _entries(root, device=DEVICE) -> dict:
    data = json.loads(TuningDB(root, "user", False).file_for(device).path.read_text())   # no torn write
    assert data["schema"] == SCHEMA_VERSION and data["device"] == device.as_dict()
    leftovers = [p.name for p in (root / "sm_90").iterdir() if p.suffix not in (".json", ".lock")]
    assert not leftovers, leftovers   # no temporary or moved-aside files
    return data["entries"]


def test_concurrent_writers_lose_nothing(tmp_path):
    root = tmp_path / "db"
    _run(root, same_key=False)
    for device, writers in ((DEVICE, range(0, PROCS, 2)), (OTHER, range(1, PROCS, 2))):
        expected = {f"stress/M={i},N={w},dtype=x": _entry(w, i) for w in writers for i in range(KEYS)}
        assert _entries(root, device) == expected
        assert len(TuningDB(root, "user", writable=False).file_for(device).read()) == len(expected)


def test_concurrent_writers_of_one_key_leave_one_entry(tmp_path):
    root = tmp_path / "db"
    _run(root, same_key=True)
    (key, value), = _entries(root).items()
    assert key == "stress/M=1,N=1,dtype=x"
    assert value == _entry(value["writer"], KEYS - 1)   # whole, and some writer's last word
