"""Fold tuned device files (a GPU run's user database, from scripts/gpu-tune.sh) into the shipped tuning_db/.

For each file: its device's shipped file keeps the entries this checkout's kernels can still use, takes every
usable entry of the new file (a new entry replaces a shipped one), and drops what went stale; then it reports
the counts. Entries are validated as lookup validates them; the new files are untrusted input.

    python scripts/ship_tuning.py out/NVIDIA_H100_80GB_HBM3.json
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import tilekit.kernels  # noqa: F401  (declares the ops entry_reason checks against)
from tilekit.autotune.db import TuningDB, device_from_record, read_json
from tilekit.autotune.entries import entry_reason

SHIPPED = Path(__file__).resolve().parents[1] / "tuning_db"


def ship(path: Path) -> str:
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path} is not a tilekit device file (an object with device and entries)")
    device = device_from_record(data.get("device"))
    reasons = {key: entry_reason(key, entry, "shipped") for key, entry in data["entries"].items()}
    dropped = Counter(why for why in reasons.values() if why)
    new = {key: data["entries"][key] for key, why in reasons.items() if why is None}
    shipped = TuningDB(SHIPPED, "maintainer", writable=True)    # the repository's copy, not an installed one
    target = shipped.file_for(device)
    stale = {key for key, entry in target.read().items() if entry_reason(key, entry, "shipped")}
    target.remove(stale - new.keys())
    shipped.store(device, new)
    target.path.with_name(target.path.name + ".lock").unlink(missing_ok=True)   # not part of the repository
    note = f"; ignored {sum(dropped.values())} unusable: {dict(dropped)}" if dropped else ""
    return f"{target.path.relative_to(SHIPPED.parent)}: {len(new)} tuned entries in, {len(stale)} stale out{note}"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for name in sys.argv[1:]:
        print(ship(Path(name)))
