"""The tuning database: JSON files, one per device, layered user cache over shipped results.

Layout: ``<root>/<arch>/<GPU name>.json`` holding ``{"schema", "device", "entries"}``, each entry
keyed by ``keys.key_string``. Writes merge under a file lock and land with tmp + fsync + rename,
so concurrent writers lose nothing and a crash never leaves a half-written file. A file that cannot
be parsed, or has another schema version, is ignored with one warning and moved aside (never
silently overwritten) the next time someone writes.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from filelock import FileLock

from tilekit.autotune.keys import Buckets, bucket_distance, parse_key
from tilekit.device import DeviceInfo

SCHEMA_VERSION = 1
ENTRY_FIELDS = {"config": dict, "time_us": (int, float), "kernel_hash": str, "space_hash": str,
                "toolchain": dict}


class TuningDBWarning(UserWarning):
    """A tuning file or entry was ignored (corrupt, other schema, stale, outside its space)."""


_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, TuningDBWarning, stacklevel=3)


def device_file_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name).strip("_") + ".json"


@dataclass(frozen=True)
class Match:
    """A stored entry that answers a lookup, and how it was found."""

    key: str
    entry: dict
    layer: str           # "user" or "shipped"
    device_rule: str     # "exact-gpu" or "same-arch (<other GPU>)"
    bucket_rule: str     # "exact" or "nearest (<key>)"

    def describe(self) -> str:
        return f"{self.layer} db, {self.device_rule}, {self.bucket_rule} bucket"


class DeviceFile:
    """One JSON file of results for one GPU."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._cache: tuple[tuple[int, int], dict] | None = None

    def read(self) -> dict:
        """Parsed entries (empty when missing, unreadable or of another schema: never raises)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return {}
        except OSError as e:  # e.g. the arch "directory" is a file
            warn_once(f"tilekit: ignoring tuning file {self.path}: unreadable ({e})")
            return {}
        # st_ino too: every write lands as a new file (rename), while size and a coarse mtime may not change
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        data, problem = _parse(self.path)
        if problem:
            warn_once(f"tilekit: ignoring tuning file {self.path}: {problem}")
        entries = data.get("entries", {}) if data else {}
        self._cache = (stamp, entries)
        return entries

    def header_device(self) -> dict | None:
        data, _ = _parse(self.path)
        return data.get("device") if data else None

    def merge(self, device: DeviceInfo, updates: Mapping[str, dict]) -> None:
        """Add or replace entries atomically, under a lock shared by all processes."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):
            entries = {}
            if self.path.exists():
                data, problem = _parse(self.path)
                if problem:
                    aside = self.path.with_name(f"{self.path.name}.{time.time_ns()}.bad")
                    os.replace(self.path, aside)
                    warnings.warn(f"tilekit: tuning file {self.path} was unusable ({problem}); "
                                  f"moved it to {aside.name} and started a new one", TuningDBWarning,
                                  stacklevel=2)
                else:
                    entries = dict(data["entries"])
            entries.update(updates)
            _atomic_write_json(self.path, {"schema": SCHEMA_VERSION, "device": device.as_dict(),
                                           "entries": entries})

    def remove(self, keys: set[str] | None = None) -> int:
        """Delete some entries (or the whole file when keys is None); returns how many went."""
        with FileLock(str(self.path) + ".lock"):
            data, problem = _parse(self.path)
            if not self.path.exists() or problem:
                if keys is None and self.path.exists():
                    self.path.unlink()
                return 0
            if keys is None:
                self.path.unlink()
                return len(data["entries"])
            kept = {k: v for k, v in data["entries"].items() if k not in keys}
            removed = len(data["entries"]) - len(kept)
            _atomic_write_json(self.path, {**data, "entries": kept})
            return removed


def _parse(path: Path) -> tuple[dict | None, str | None]:
    """(data, None) for a valid file, (None, reason) otherwise, ({}, None) when missing."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return None, f"unreadable ({e})"
    except UnicodeDecodeError as e:
        return None, f"not valid JSON (not UTF-8: {e.reason} at byte {e.start})"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at line {e.lineno})"
    if not isinstance(data, dict) or "schema" not in data:
        return None, "not a tilekit tuning file (no schema field)"
    if data["schema"] != SCHEMA_VERSION:
        return None, f"schema version {data['schema']!r}, this tilekit reads {SCHEMA_VERSION}"
    if not isinstance(data.get("entries"), dict) or not isinstance(data.get("device"), dict):
        return None, "missing 'device' or 'entries'"
    return data, None


def _atomic_write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def entry_problem(key: str, entry: dict) -> str | None:
    """None when an entry is structurally sound, else what is wrong with it."""
    if not isinstance(entry, dict):
        return "entry is not an object"
    for name, kind in ENTRY_FIELDS.items():
        if not isinstance(entry.get(name), kind):
            return f"field {name!r} missing or of the wrong type"
    try:
        parse_key(key)
    except ValueError as e:
        return str(e)
    return None


class TuningDB:
    """One layer of results (a directory of per-device files)."""

    def __init__(self, root: str | os.PathLike, layer: str, writable: bool):
        self.root = Path(root)
        self.layer = layer
        self.writable = writable
        self._files: dict[Path, DeviceFile] = {}

    def file_for(self, device: DeviceInfo) -> DeviceFile:
        return self._file(self.root / device.arch / device_file_name(device.name))

    def _file(self, path: Path) -> DeviceFile:
        if path not in self._files:
            self._files[path] = DeviceFile(path)
        return self._files[path]

    def device_files(self, arch: str | None = None) -> list[DeviceFile]:
        pattern = f"{arch}/*.json" if arch else "*/*.json"
        return [self._file(p) for p in sorted(self.root.glob(pattern))] if self.root.is_dir() else []

    def lookup(self, op: str, problem: Mapping, device: DeviceInfo, buckets: Buckets,
               usable: Callable[[str, dict], str | None]) -> Match | None:
        """Best usable entry: exact GPU then same arch; exact bucket then nearest bucket.

        `usable(key, entry)` returns None for an entry this kernel may use, else why not.
        """
        own = self.file_for(device)
        tiers = [(own, "exact-gpu")] + [
            (f, f"same-arch ({f.path.stem})") for f in self.device_files(device.arch) if f.path != own.path]
        for dfile, device_rule in tiers:
            entries = dfile.read()
            best: tuple[float, str] | None = None
            for key, entry in entries.items():
                if not key.startswith(op + "/"):
                    continue
                shape_problem = entry_problem(key, entry)
                if shape_problem:
                    warn_once(f"tilekit: ignoring entry {key} in {dfile.path}: {shape_problem}")
                    continue
                distance = bucket_distance(problem, parse_key(key)[1], buckets)
                if distance is None or (best is not None and (distance, key) >= best):
                    continue
                why_not = usable(key, entry)
                if why_not:
                    warn_once(f"tilekit: not using {self.layer} entry {key} ({dfile.path.name}): {why_not}")
                    continue
                best = (distance, key)
            if best is not None:
                distance, key = best
                rule = "exact" if distance == 0 else f"nearest ({key.partition('/')[2]})"
                return Match(key, entries[key], self.layer, device_rule, rule)
        return None

    def store(self, device: DeviceInfo, updates: Mapping[str, dict]) -> None:
        if not self.writable:
            raise PermissionError(f"the {self.layer} tuning database at {self.root} is read-only")
        self.file_for(device).merge(device, updates)

    def items(self) -> Iterator[tuple[DeviceFile, str, dict]]:
        for dfile in self.device_files():
            for key, entry in sorted(dfile.read().items()):
                yield dfile, key, entry
