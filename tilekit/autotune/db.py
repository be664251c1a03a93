"""The tuning database: JSON files, one per device, layered user cache over shipped results.

Layout: ``<root>/<arch>/<GPU name>.json`` holding ``{"schema", "device", "entries"}``, each entry
keyed by ``keys.key_string``. Writes merge under a file lock and land with tmp + fsync + rename,
so concurrent writers lose nothing and a crash never leaves a half-written file. A file that cannot
be parsed, or has another schema version, is ignored with one warning and, in the writable user
layer, moved aside (never silently overwritten) the next time someone writes.

Every file is untrusted input: nothing read from one names a path (arch is ``sm_<digits>``, GPU
names are sanitised, and a path that resolves outside its root is refused), files are strict JSON
(no NaN or Infinity), and the read-only shipped layer is never written, renamed or deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import reprlib
import secrets
import stat
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

from filelock import FileLock

from tilekit.autotune.keys import EXACT, RULES, Buckets, key_distance, parse_key, search_tier
from tilekit.device import DeviceInfo
from tilekit.untrusted import parse_json, shown

SCHEMA_VERSION = 1
ENTRY_FIELDS = {"config": dict, "time_us": (int, float), "kernel_hash": str, "space_hash": str,
                "toolchain": dict}
MAX_FILE_BYTES = 64 << 20      # a tuning file holds ~650 bytes per entry; anything larger is refused unread
MAX_NAME = 128                 # characters of a GPU's file name
ARCH = re.compile(r"sm_[0-9]{1,5}")
_TMP = r"\.[0-9a-z_]{8,16}\.tmp"   # what follows '.<file name>' in a writer's temporary file


class TuningDBWarning(UserWarning):
    """A tuning file or entry was ignored (corrupt, other schema, stale, outside its space)."""


class TuningDBError(Exception):
    """A tuning file could not be written; the message names the file and the reason."""


_warned: set[str] = set()
MAX_WARNINGS = 100       # distinct warnings a process shows (a file of a million bad entries made a million lines)


def warn_once(message: str) -> None:
    """A TuningDBWarning, once per message and at most MAX_WARNINGS in all; the message's control characters (a
    key or path read from a file) escaped."""
    if message in _warned or len(_warned) > MAX_WARNINGS:
        return
    _warned.add(message)
    if len(_warned) > MAX_WARNINGS:
        message = f"more than {MAX_WARNINGS} tuning database warnings: the rest are not shown"
    warnings.warn(shown(message, 2000), TuningDBWarning, stacklevel=3)


def sanitise(text: str) -> str:
    """Runs of characters other than letters, digits, '.' and '-' become '_'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", text).strip("_")


def device_file_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'; ValueError when no safe name results."""
    stem = sanitise(device_name)
    if not stem or stem.startswith(".") or len(stem) > MAX_NAME:
        raise ValueError(f"GPU name {reprlib.repr(device_name)} makes no usable file name")
    return stem + ".json"


def json_kind(value) -> str:
    """How a JSON value is described in an error message."""
    for kind, name in ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
                       (list, "a list"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def device_from_record(record) -> DeviceInfo:
    """The device an untrusted {"name", "arch", "sm_count"} record describes; ValueError saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"device is {json_kind(record)}, expected an object with name, arch and sm_count")
    name, arch, sm_count = record.get("name"), record.get("arch"), record.get("sm_count")
    if not isinstance(name, str):
        raise ValueError(f"device name is {json_kind(name)}, expected a string")
    device_file_name(name)
    if not isinstance(arch, str) or not ARCH.fullmatch(arch):
        raise ValueError(f"device arch {reprlib.repr(arch)} is not sm_<digits>")
    if type(sm_count) is not int or not 0 <= sm_count < 1 << 20:
        raise ValueError(f"device sm_count {reprlib.repr(sm_count)} is not a small non-negative integer")
    return DeviceInfo(name, arch, sm_count)


def read_json(path: Path):
    """Parse one JSON file strictly; OSError when it cannot be read, ValueError saying why it is not JSON.

    Refused unread: directories, FIFOs and devices (which could block), files over MAX_FILE_BYTES.
    Refused as malformed (tilekit.untrusted.parse_json): NaN and Infinity literals, numbers that overflow a float,
    repeated keys.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is a directory" if stat.S_ISDIR(st.st_mode) else "is not a regular file")
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_FILE_BYTES + 1) if st.st_size <= MAX_FILE_BYTES else b""
    finally:
        os.close(fd)
    if max(st.st_size, len(raw)) > MAX_FILE_BYTES:
        raise ValueError(f"is larger than {MAX_FILE_BYTES >> 20} MiB")
    return parse_json(raw)


def dumps(data) -> str:
    """Strict JSON text (ValueError on NaN or Infinity), sorted keys, so a diff shows what changed: a database
    file's entries one per line, each compact (the shipped files travel to every GPU host)."""
    if not (isinstance(data, dict) and isinstance(data.get("entries"), dict)):
        return json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n"
    lines, keys = ["{"], sorted(data)
    for i, key in enumerate(keys):
        comma = "," if i < len(keys) - 1 else ""
        if key == "entries":
            items = sorted(data[key].items())
            lines.append(f' "{key}": {{')
            lines += [f"  {_compact(name)}: {_compact(entry)}{',' if j < len(items) - 1 else ''}"
                      for j, (name, entry) in enumerate(items)]
            lines.append(" }" + comma)
        else:
            lines.append(f" {_compact(key)}: {_compact(data[key])}{comma}")
    return "\n".join(lines + ["}"]) + "\n"


def _compact(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same directory, fsync and rename; mode 0o666 minus the umask."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # O_EXCL: never through a planted link
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _parse(path: Path) -> tuple[dict | None, str | None]:
    """(data, None) for a valid file, (None, reason) otherwise, ({}, None) when missing."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    except ValueError as e:
        return None, str(e)
    if not isinstance(data, dict) or "schema" not in data:
        return None, "not a tilekit tuning file (no schema field)"
    if type(data["schema"]) is not int or data["schema"] != SCHEMA_VERSION:
        return None, f"schema version {reprlib.repr(data['schema'])}, this tilekit reads {SCHEMA_VERSION}"
    if not isinstance(data.get("entries"), dict):
        return None, "missing 'entries'"
    try:
        device = device_from_record(data.get("device"))
    except ValueError as e:
        return None, str(e)
    if (device.arch, device_file_name(device.name)) != (path.parent.name, path.name):
        return None, f"its device record ({device.arch}, {device.name}) does not match its path"
    return data, None


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


def _near(sound: list[tuple[str, dict]], problem: Mapping, buckets: Buckets, sizes) -> list[tuple[tuple, str]]:
    """(distance, key) of every (key, key fields) of `sound` that may answer `problem`, closest first
    (keys.key_distance, then the key)."""
    near = []
    for key, fields in sound:
        distance = key_distance(problem, fields, buckets, sizes)
        if distance is not None:
            near.append((distance, key))
    return sorted(near)


class _ByOp:
    """One read of a file's entries by op: the keys grouped on first use, each op's sound entries parsed (the
    unsound ones warned about) the first time a lookup asks for that op."""

    def __init__(self, entries: dict, path: Path):
        self.entries, self.path = entries, path
        self.keys: dict[str, list[str]] | None = None
        self.sound: dict[str, list[tuple[str, dict]]] = {}

    def of(self, op: str) -> list[tuple[str, dict]]:
        """(key, key fields) of every structurally sound entry of `op`, in the file's order."""
        if self.keys is None:
            keys: dict[str, list[str]] = {}
            for key in self.entries:
                name, slash, _ = key.partition("/")
                if slash:
                    keys.setdefault(name, []).append(key)
            self.keys = keys
        if op not in self.sound:
            sound = []
            for key in self.keys.get(op, ()):
                shape_problem = entry_problem(key, self.entries[key])
                if shape_problem:
                    warn_once(f"tilekit: ignoring entry {key} in {self.path}: {shape_problem}")
                else:
                    sound.append((key, parse_key(key)[1]))
            self.sound[op] = sound
        return self.sound[op]


@dataclass(frozen=True)
class Match:
    """A stored entry that answers a lookup, and how it was found."""

    key: str
    entry: dict
    layer: str           # "user" or "shipped"
    device_rule: str     # "exact-gpu" or "same-arch (<other GPU>)"
    rule: str            # keys.RULES: "exact", "nearest bucket" or "nearest shape"
    distance: tuple      # keys.key_distance from the problem: smaller is closer

    @property
    def exact(self) -> bool:
        """The entry was tuned for this very key."""
        return self.rule == EXACT

    def rank(self) -> tuple:
        """Smaller is better: a nearest shape last, a far bucket before it, then the own GPU before others of its
        arch, then the closer key (the order TuningDB.lookup searches in)."""
        return search_tier(self.distance), self.device_rule != "exact-gpu", self.distance

    def describe(self) -> str:
        how = "exact bucket" if self.exact else f"{self.rule} ({self.key.partition('/')[2]})"
        return f"{self.layer} db, {self.device_rule}, {how}"


class DeviceFile:
    """One JSON file of results for one GPU, inside the root of its TuningDB."""

    def __init__(self, path: Path, db: "TuningDB"):
        self.path = Path(path)
        self.db = db
        self._cache: tuple[tuple[int, int, int], tuple[dict, str | None], _ByOp] | None = None

    def _read(self) -> tuple[tuple[dict, str | None], _ByOp]:
        """(load()'s answer, its entries by op), parsed again only when the file changed."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return ({}, None), _ByOp({}, self.path)
        except OSError as e:  # e.g. the arch "directory" is a file
            return ({}, f"unreadable ({e.strerror or e})"), _ByOp({}, self.path)
        # st_ino too: every write lands as a new file (rename), while size and a coarse mtime may not change
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        cache = self._cache
        if cache is None or cache[0] != stamp:
            data, problem = self._parse()
            data = data or {}
            cache = self._cache = (stamp, (data, problem), _ByOp(data.get("entries", {}), self.path))
        return cache[1], cache[2]

    def load(self) -> tuple[dict, str | None]:
        """(file data, None), ({}, None) when missing, or ({}, why it is unusable). Never raises."""
        return self._read()[0]

    def read(self) -> dict:
        """Parsed entries (empty when missing or unusable, with one warning: never raises)."""
        return self._entries()[0]

    def read_op(self, op: str) -> tuple[dict, list[tuple[str, dict]]]:
        """(read(), (key, key fields) of every sound entry of `op` in that same read): a lookup ranks only these."""
        entries, by_op = self._entries()
        return entries, by_op.of(op)

    def _entries(self) -> tuple[dict, _ByOp]:
        """(entries, the same entries by op), with one warning when the file is unusable."""
        (data, problem), by_op = self._read()
        if problem:
            warn_once(f"tilekit: ignoring tuning file {self.path}: {problem}")
        return data.get("entries", {}), by_op

    def device(self) -> DeviceInfo | None:
        data, _ = self.load()
        return device_from_record(data["device"]) if data else None

    def _parse(self) -> tuple[dict | None, str | None]:
        """_parse, refusing a file (a symlink) that resolves outside the database root."""
        if not _inside(self.path, self.db.root):
            return None, f"resolves outside the database root {self.db.root}"
        return _parse(self.path)

    @contextlib.contextmanager
    def _locked(self):
        """Hold the file's lock, after removing temporary files that killed writers left behind."""
        self.db.check_writable()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not _inside(self.path.parent, self.db.root):
                raise TuningDBError(f"refusing to write {self.path}: its directory resolves outside "
                                    f"the database root {self.db.root}")
            with FileLock(str(self.path) + ".lock"):
                # we hold the lock of this file, so every temporary file of it belongs to a dead writer
                pattern = re.compile(re.escape("." + self.path.name) + _TMP)
                for p in self.path.parent.iterdir():   # (a directory so named is someone else's: left, not fatal)
                    if pattern.fullmatch(p.name) and not _is_directory(p):
                        p.unlink(missing_ok=True)
                yield
        except OSError as e:
            raise TuningDBError(f"cannot write {self.path}: {self.db.root_problem() or e.strerror or e}") from e

    def merge(self, device: DeviceInfo, updates: Mapping[str, dict]) -> None:
        """Add or replace entries atomically, under a lock shared by all processes."""
        with self._locked():
            data, problem = self._parse()
            if problem:
                aside = self.path.with_name(f"{self.path.name}.{time.time_ns()}.bad")
                os.replace(self.path, aside)
                warnings.warn(f"tilekit: tuning file {self.path} was unusable ({problem}); "
                              f"moved it to {aside.name} and started a new one", TuningDBWarning,
                              stacklevel=2)
            entries = {**(data or {}).get("entries", {}), **updates}
            atomic_write_text(self.path, dumps({"schema": SCHEMA_VERSION, "device": device.as_dict(),
                                                "entries": entries}))

    def remove(self, keys: set[str] | None = None) -> int:
        """Delete some entries (or the whole file when keys is None); returns how many went."""
        with self._locked():
            data, problem = self._parse()
            entries = {} if problem else (data or {}).get("entries", {})
            if keys is None:
                if os.path.lexists(self.path):
                    self.path.unlink()
                return len(entries)
            kept = {k: v for k, v in entries.items() if k not in keys}
            if len(kept) < len(entries):
                atomic_write_text(self.path, dumps({**data, "entries": kept}))
            return len(entries) - len(kept)


def _is_directory(path: Path) -> bool:
    """Whether `path` itself (not a link's target) is a directory."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _inside(path: Path, root: Path) -> bool:
    """Whether `path`, with every symlink resolved, lies within `root` (resolved too)."""
    try:
        return path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):   # a symlink loop
        return False


class TuningDB:
    """One layer of results (a directory of per-device files)."""

    def __init__(self, root: str | os.PathLike, layer: str, writable: bool):
        self.root = Path(root)
        self.layer = layer
        self.writable = writable
        self._files: dict[Path, DeviceFile] = {}

    def check_writable(self) -> None:
        if not self.writable:
            raise PermissionError(f"the {self.layer} tuning database at {self.root} is read-only")

    def file_for(self, device: DeviceInfo) -> DeviceFile:
        """The file of `device`; ValueError when its arch or name cannot name a file under the root."""
        if not ARCH.fullmatch(device.arch):
            raise ValueError(f"arch {reprlib.repr(device.arch)} is not sm_<digits>")
        return self._file(self.root / device.arch / device_file_name(device.name))

    def _file(self, path: Path) -> DeviceFile:
        if path not in self._files:
            self._files[path] = DeviceFile(path, self)
        return self._files[path]

    def device_files(self, arch: str | None = None) -> list[DeviceFile]:
        """The device files of one arch, or of all: <sm_N>/<name>.json, no hidden files."""
        if arch is not None and not ARCH.fullmatch(arch) or not self.root.is_dir():
            return []
        return [self._file(p) for p in sorted(self.root.glob(f"{arch or '*'}/*.json"))
                if ARCH.fullmatch(p.parent.name) and not p.name.startswith(".")]

    def root_problem(self) -> str | None:
        """Why the root cannot be a directory (a file on its path), or None."""
        for p in (self.root, *self.root.parents):
            try:
                if p.exists():
                    return None if p.is_dir() else f"{p} is not a directory"
            except OSError as e:
                return f"{p}: {e.strerror}"
        return None

    def lookup(self, op: str, problem: Mapping, device: DeviceInfo, buckets: Buckets,
               usable: Callable[[str, dict], str | None], sizes: frozenset | set = frozenset(),
               fits: Callable[[dict], bool] | None = None) -> Match | None:
        """Best usable entry, by keys.key_distance: the exact key or the nearest bucket within
        keys.BUCKET_REACH on the exact GPU, then on another GPU of its arch; then a farther bucket likewise;
        then the nearest shape (other `sizes` fields) likewise. Within one GPU's file the closest key wins,
        the key string breaking ties.

        `usable(key, entry)` returns None for an entry this kernel may use, else why not
        (entries.entry_reason is the rule: it checks a config against the space's rule for the entry's own key).
        `fits(config)` says whether a borrowed config (any rule but exact) is valid for this problem; entries whose
        config does not fit are skipped.
        """
        own = self.file_for(device)
        tiers = [(own, "exact-gpu")] + [
            (f, f"same-arch ({f.path.stem})") for f in self.device_files(device.arch) if f.path != own.path]
        ranked: dict[Path, tuple[dict, list]] = {}     # a file is read only when the search reaches it
        for tier in range(3):
            for dfile, device_rule in tiers:
                if dfile.path not in ranked:
                    entries, sound = dfile.read_op(op)
                    ranked[dfile.path] = entries, _near(sound, problem, buckets, sizes)
                entries, near = ranked[dfile.path]
                for distance, key in near:
                    if search_tier(distance) != tier:
                        continue
                    why_not = usable(key, entries[key])
                    if why_not:
                        warn_once(f"tilekit: not using {self.layer} entries of {dfile.path}: {why_not} "
                                  f"(`tilekit db verify` lists them)")
                        continue
                    if distance[0] and fits is not None and not fits(entries[key]["config"]):
                        continue
                    return Match(key, entries[key], self.layer, device_rule, RULES[distance[0]], distance)
        return None

    def store(self, device: DeviceInfo, updates: Mapping[str, dict]) -> None:
        """Merge entries into the device's file (PermissionError in a read-only layer, TuningDBError
        when the file cannot be written)."""
        self.file_for(device).merge(device, updates)

    def clear(self, moved_aside: bool = False) -> int:
        """Delete every device file with the temporary files of killed writers and, when asked, the
        moved-aside corrupt files (*.bad); returns the number of entries deleted. Lock files stay:
        deleting one that a writer waits on would let two writers in at once."""
        self.check_writable()
        paths, bad = set(), []
        for arch_dir in self.root.glob("sm_*") if self.root.is_dir() else ():
            if ARCH.fullmatch(arch_dir.name) and arch_dir.is_dir() and _inside(arch_dir, self.root):
                for p in arch_dir.iterdir():
                    if m := re.fullmatch(r"([^.].*\.json)|\.([^.].*\.json)" + _TMP, p.name):
                        paths.add(arch_dir / (m[1] or m[2]))
                    elif re.fullmatch(r"[^.].*\.json\.[0-9]+\.bad", p.name):
                        bad.append(p)
        removed = sum(self._file(p).remove() for p in sorted(paths))
        for p in bad if moved_aside else ():
            p.unlink(missing_ok=True)
        return removed

    def items(self) -> Iterator[tuple[DeviceFile, str, dict]]:
        for dfile in self.device_files():
            for key, entry in sorted(dfile.read().items()):
                yield dfile, key, entry
