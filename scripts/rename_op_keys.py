"""Carry tuning entries across an op's rename: every key "OLD/<problem>" of the given device files becomes
"NEW/<problem>", the entry itself unchanged (an entry names no op; its kernel digest covers the kernels' code,
not the op's name or module). The files stay in the database's own format (sorted keys, atomic write).

    python scripts/rename_op_keys.py OLD=NEW [OLD=NEW ...] [FILE ...]     (default: every file in tuning_db/)

Used for issue #30's renames: kv_write=write_kv rope=apply_rope greedy=greedy_step. A key that would land on
one the file already holds is an error, and nothing is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tilekit.autotune.db import atomic_write_text, dumps, read_json

SHIPPED = Path(__file__).resolve().parents[1] / "tuning_db"


def rename_keys(path: Path, renames: dict[str, str]) -> int:
    """Rename the keys of one device file; returns how many changed."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{path} is not a tilekit device file (an object with device and entries)")
    entries, changed = {}, 0
    for key, entry in data["entries"].items():
        op, sep, problem = key.partition("/")
        if sep and op in renames:
            key, changed = f"{renames[op]}/{problem}", changed + 1
        if key in entries:
            raise ValueError(f"{path}: renaming would give two entries the key {key!r}")
        entries[key] = entry
    if changed:
        atomic_write_text(path, dumps(dict(data, entries=entries)))
    return changed


def main(argv: list[str]) -> int:
    pairs = [a.partition("=") for a in argv if "=" in a]
    files = [Path(a) for a in argv if "=" not in a] or sorted(SHIPPED.glob("sm_*/*.json"))
    if not pairs or any(not old or not new for old, _, new in pairs):
        sys.exit(__doc__)
    renames = {old: new for old, _, new in pairs}
    for path in files:
        print(f"{path}: {rename_keys(path, renames)} keys renamed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
