"""`tilekit db`: inspect, move and check tuning databases."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tilekit.autotune.jobs import entries_here
from tilekit.cli.common import (Progress, UsageError, _arch, _bar, _check_quantize_head, _model_args, _model_problems,
                                _positive, _shown)
from tilekit.cli.tune import tune_here


def add_parser(sub) -> None:
    db = sub.add_parser("db", help="inspect, move and check tuning databases")
    dbs = db.add_subparsers(dest="db_command", required=True, metavar="SUBCOMMAND", help="what to do")
    p = dbs.add_parser("list", help="list tuned entries (user and shipped)")
    p.add_argument("--kernel", help="only this kernel's entries, e.g. linear")
    p.add_argument("--device", help="only GPUs whose name contains this, e.g. H100")
    p = dbs.add_parser("show", help="print one entry")
    p.add_argument("key", help="the entry's key as `db list` prints it")
    p = dbs.add_parser("explain", help="which layer and rule (exact, nearest bucket, nearest shape, "
                                      "default) answers each shape a model uses")
    _model_args(p, "gpt2")
    p.add_argument("--gpu", help="explain for this GPU name instead of the local one")
    p.add_argument("--arch", type=_arch, default="sm_90", help="compute capability with --gpu (default sm_90)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: per shape its key, rule (exact, nearest bucket, nearest shape or "
                        "default), layer, device rule, the entry it borrowed from and the config")
    p = dbs.add_parser("export", help="write tuning entries to one portable JSON file")
    p.add_argument("file", help="the file to write (replaced atomically; its directory must exist)")
    p.add_argument("--layer", choices=("user", "shipped", "all"), default="user",
                   help="which database to export (default user; with all, user entries win)")
    p = dbs.add_parser("import", help="merge an exported file into the user database",
                       description="Merge an exported file into the user database. Every entry is checked "
                                   "as dispatch checks it (known kernel, config in its search space, finite "
                                   "times, current kernel, space and toolchain); the others are dropped and "
                                   "counted per reason. A malformed file changes nothing (exit 2).")
    p.add_argument("file", help="a file written by `tilekit db export`")
    p = dbs.add_parser("verify", help="check files and entries; non-zero exit when any is invalid or unusable")
    p.add_argument("--strict", action="store_true", help="treat stale entries as invalid too")
    p = dbs.add_parser("check", help="run this GPU's entries against their kernel's default config",
                       description="Run the config of every usable entry of this GPU's file three times, and the "
                                   "kernel's default config, from the same random inputs: an entry whose outputs "
                                   "differ from the default's (a config the compiler built wrong) is listed, and "
                                   "the exit is non-zero. --retune tunes those shapes again into the user database "
                                   "(the tuner drops configs that disagree). Needs a GPU.")
    p.add_argument("--layer", choices=("user", "shipped"), default="shipped", help="which database (default shipped)")
    p.add_argument("--retune", action="store_true", help="tune the disagreeing shapes again")
    p.add_argument("--kernel", help="check only this kernel's entries")
    p.add_argument("--workers", type=_positive, help="compile processes (default: CPU cores - 1)")
    p = dbs.add_parser("clear", help="delete the user database",
                       description="Delete the user database: its device files and the temporary files of "
                                   "killed writers. Lock files stay (deleting one a writer waits on would let "
                                   "two writers in); moved-aside corrupt files (*.bad) stay unless "
                                   "--moved-aside. Asks first on a terminal; elsewhere needs --yes.")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--moved-aside", action="store_true",
                   help="also delete corrupt files that were moved aside (*.bad)")


def run(args) -> int:
    from tilekit.autotune import store
    problem = store.user_db().root_problem()
    if problem:
        raise UsageError(f"the user tuning database {store.user_db().root} cannot be used: {problem} "
                         f"(see TILEKIT_CACHE_DIR)")
    handler = {"list": _db_list, "show": _db_show, "explain": _db_explain, "export": _db_export,
               "import": _db_import, "verify": _db_verify, "check": _db_check, "clear": _db_clear}[args.db_command]
    result = handler(args)
    store.reset()
    return result


def _all_entries(layers=("user", "shipped")):
    from tilekit.autotune import store
    for db in store.layers():
        if db.layer in layers:
            for dfile, key, entry in db.items():
                yield db, dfile, key, entry


def _db_list(args) -> int:
    from tilekit.autotune.db import sanitise
    from tilekit.autotune.entries import bad_time
    rows = []
    for db, dfile, key, entry in _all_entries():
        op = key.partition("/")[0]
        if args.kernel and op != args.kernel:
            continue
        if args.device and sanitise(args.device).lower() not in dfile.path.stem.lower():
            continue
        time_us = entry.get("time_us") if isinstance(entry, dict) else None
        shown_time = f"{time_us:.1f}" if bad_time(time_us) is None else "?"
        rows.append((db.layer, dfile.path.stem, _shown(key), shown_time))
    if not rows:
        print("no tuning entries" + (" match" if args.kernel or args.device else ""))
        return 0
    print(f"{'layer':<8} {'device':<24} {'time us':>9}  key")
    for layer, device, key, t in rows:
        print(f"{layer:<8} {device[:24]:<24} {t:>9}  {key}")
    print(f"{len(rows)} entries")
    return 0


def _db_show(args) -> int:
    found = [(db, dfile, entry) for db, dfile, key, entry in _all_entries() if key == args.key]
    if not found:
        raise UsageError(f"no entry with key {args.key!r} (see `tilekit db list`)")
    for db, dfile, entry in found:
        print(f"# {db.layer} db: {dfile.path}")
        print(json.dumps(entry, indent=2, sort_keys=True))
    return 0


def _db_explain(args) -> int:
    from tilekit.device import DeviceInfo, device_info, gpu_unavailable_reason
    _check_quantize_head(args)
    items = _model_problems(args)
    if args.gpu:
        device = DeviceInfo(args.gpu, args.arch, 0)
    elif gpu_unavailable_reason() is None:
        device = device_info()
    else:
        raise UsageError("no GPU here: name one with --gpu NAME --arch sm_XX")
    from tilekit.env import autotune_mode
    mode = autotune_mode()            # what a model would do here; a bogus value is refused, naming it
    shapes = []
    for op, problem in items:
        r = op.resolve(problem, device, mode="off" if mode == "off" else "cached")
        m = r.match
        shapes.append({"key": op.problem_key(problem)[1], "rule": m.rule if m else r.source,
                       "layer": m and m.layer, "device_rule": m and m.device_rule, "entry": m and m.key,
                       "config": r.config, "how": r.describe()})
    if args.json:
        print(json.dumps({"device": device.as_dict(), "autotune": mode, "shapes": shapes}, indent=1))
        return 0
    print(f"{device.name} ({device.arch}), TILEKIT_AUTOTUNE={mode}"
          + (" (a missing key would be tuned on first use)" if mode == "auto" else ""))
    for shape in shapes:
        print(f"{shape['key']:<90} {shape['how']}")
    return 0


def _db_export(args) -> int:
    """One portable file of the chosen layers; with `all`, the user layer wins for a key both hold."""
    from tilekit.autotune import store
    from tilekit.autotune.db import SCHEMA_VERSION, atomic_write_text, dumps
    out = Path(args.file)
    if out.is_dir():
        raise UsageError(f"cannot export to {out}: it is a directory")
    if out.is_symlink() or (out.exists() and not out.is_file()):      # the export replaces the file it writes
        raise UsageError(f"cannot export to {out}: it is a link or a special file, not a regular file")
    if not out.parent.is_dir():
        raise UsageError(f"cannot export to {out}: directory {out.parent} does not exist")
    for db in store.layers():
        if out.resolve().is_relative_to(db.root.resolve()):
            raise UsageError(f"cannot export to {out}: it is inside the {db.layer} tuning database")
    files: dict[tuple[str, str], dict] = {}
    for layer in {"user": ["user"], "shipped": ["shipped"], "all": ["shipped", "user"]}[args.layer]:
        db = next(db for db in store.layers() if db.layer == layer)
        for dfile in db.device_files():
            data, problem = dfile.load()
            if problem:
                print(f"tilekit: skipped {dfile.path}: {problem}", file=sys.stderr)
            elif data["entries"]:
                device = dfile.device()
                record = files.setdefault((device.arch, device.name), {"device": device.as_dict(), "entries": {}})
                record["entries"].update(data["entries"])
    payload = {"schema": SCHEMA_VERSION, "kind": "tilekit-tuning-export", "files": list(files.values())}
    try:
        atomic_write_text(out, dumps(payload))
    except OSError as e:
        raise UsageError(f"cannot export to {out}: {e.strerror or e}")
    print(f"exported {sum(len(f['entries']) for f in files.values())} entries ({args.layer} layer) to {out}")
    return 0


def _read_export(name: str) -> list:
    """[(DeviceInfo, entries)] of an export file, every record checked before anything is written."""
    from tilekit.autotune.db import SCHEMA_VERSION, device_from_record, json_kind, read_json
    try:
        payload = read_json(Path(name))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {name}: {e.strerror if isinstance(e, OSError) else e}")
    if not isinstance(payload, dict) or payload.get("kind") != "tilekit-tuning-export":
        raise UsageError(f"{name} is not a tilekit export (made by `tilekit db export`)")
    if type(payload.get("schema")) is not int or payload["schema"] != SCHEMA_VERSION:
        raise UsageError(f"{name} has schema {payload.get('schema')!r:.40}; this tilekit reads {SCHEMA_VERSION}")
    files = payload.get("files")
    if not isinstance(files, list):
        raise UsageError(f"cannot import {name}: 'files' is {json_kind(files)}, expected a list")
    out = []
    for i, record in enumerate(files):
        try:
            if not isinstance(record, dict):
                raise ValueError(f"is {json_kind(record)}, expected an object with device and entries")
            device = device_from_record(record.get("device"))
            if not isinstance(record.get("entries"), dict):
                raise ValueError(f"entries is {json_kind(record.get('entries'))}, expected an object")
        except ValueError as e:
            raise UsageError(f"cannot import {name}: files[{i}]: {e}")
        out.append((device, record["entries"]))
    return out


def _db_import(args) -> int:
    """Merge the entries that lookup would use; report the rest per reason."""
    from collections import Counter

    from tilekit.autotune import store
    from tilekit.autotune.db import TuningDBError
    from tilekit.autotune.entries import entry_reason
    imported, dropped = 0, Counter()
    for device, entries in _read_export(args.file):
        good = {}
        for key, entry in entries.items():
            why = entry_reason(key, entry, "user")
            if why:
                dropped[why] += 1
            else:
                good[key] = entry
        if good:
            try:
                store.user_db().store(device, good)
            except TuningDBError as e:
                raise UsageError(f"cannot import {args.file}: {e}")
            imported += len(good)
    print(f"imported {imported} entries into {store.user_db().root}")
    if dropped:
        shown = dropped.most_common(8)
        rest = sum(dropped.values()) - sum(n for _, n in shown)
        print(f"dropped {sum(dropped.values())}: " + ", ".join(f"{n} {_shown(why)}" for why, n in shown)
              + (f", {rest} for {len(dropped) - len(shown)} other reasons" if rest else ""))
    return 0


def _db_verify(args) -> int:
    from tilekit.autotune import store
    from tilekit.autotune.entries import entry_defect, staleness
    invalid = stale = ok = bad = 0
    for db in store.layers():
        for dfile in db.device_files():
            data, problem = dfile.load()
            if problem:
                bad += 1
                print(f"BAD     {db.layer} {_shown(str(dfile.path), 400)}: {problem}")
            for key, entry in sorted(data.get("entries", {}).items()):
                where = f"{db.layer} {dfile.path.name} {_shown(key)}"
                defect = entry_defect(key, entry)
                why = defect or staleness(key, entry, db.layer)
                if defect:
                    invalid += 1
                    print(f"INVALID {where}: {_shown(defect)}")
                elif why:
                    stale += 1
                    print(f"STALE   {where}: {_shown(why)}")
                else:
                    ok += 1
    print(f"{ok} usable, {stale} stale, {invalid} invalid" + (f", {bad} unusable files" if bad else ""))
    return 1 if invalid or bad or (stale and args.strict) else 0


def _db_check(args) -> int:
    from tilekit.autotune.tuner import disagreeing_entries
    from tilekit.device import device_info, gpu_unavailable_reason
    from tilekit.autotune.registry import registered_ops
    if args.kernel is not None and args.kernel not in registered_ops():
        raise UsageError(f"--kernel must be one of {', '.join(sorted(registered_ops()))}")
    reason = gpu_unavailable_reason()
    if reason:
        raise UsageError(f"db check needs a GPU: {reason}")
    items = [(op, problem, entry["config"]) for op, problem, entry, stale in entries_here(args.layer)
             if not stale and args.kernel in (None, op.name)]
    print(f"checking {len(items)} {args.layer} entries for {device_info().name}", flush=True)
    progress = Progress()
    wrong = disagreeing_entries(items, workers=args.workers, progress=lambda done, total: progress.line(
        f"run {_bar(done, total)}"))
    progress.done()
    for op, problem, config, why in wrong:
        print(f"WRONG   {op.problem_key(problem)[1]}: {config}: {why}")
    print(f"{len(items) - len(wrong)} of {len(items)} entries agree with their kernel's default config")
    if wrong and args.retune:
        retune = argparse.Namespace(force=True, budget=None, workers=args.workers)
        return tune_here(retune, [(op, problem) for op, problem, _, _ in wrong], shard=None)
    return 1 if wrong else 0


def _db_clear(args) -> int:
    from tilekit.autotune import store
    db = store.user_db()
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError(f"db clear deletes the user tuning database {db.root}: confirm with --yes")
        try:
            answer = input(f"delete the user tuning database {db.root}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    print(f"removed {db.clear(moved_aside=args.moved_aside)} entries from {db.root}")
    return 0
