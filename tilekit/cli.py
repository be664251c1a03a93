"""The `tilekit` command: tune kernels, inspect and move tuning databases, generate text, chat.

The benchmark suite lives in the source checkout: `python -m benchmarks` from its root."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tilekit.untrusted import shown

DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "fp32": "float32", "float32": "float32"}


class UsageError(Exception):
    """Misuse of a command: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with misuse reported as one `tilekit: ...` line (exit 2), like UsageError, and no
    abbreviated options (a `tune --dev all` would otherwise reach its workers as --devices)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"tilekit: {self.prog.removeprefix('tilekit ')}: {message} (see `{self.prog} --help`)\n"
                  if self.prog != "tilekit" else f"tilekit: {message} (see `tilekit --help`)\n")


# -- small helpers ---------------------------------------------------------------------------

MAX_BATCH, MAX_TOKENS = 4096, 1 << 20      # a workload's batch size and its prompt or generated tokens


def _int_list(text: str, most: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()] if len(text) <= 1000 else None
    except ValueError:
        values = None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text[:100]!r}")
    if min(values) < 1 or max(values) > most:
        raise argparse.ArgumentTypeError(f"expected integers in [1, {most}], got {text!r}")
    return values


def _batch_sizes(text: str) -> list[int]:
    return _int_list(text, MAX_BATCH)


def _token_counts(text: str) -> list[int]:
    return _int_list(text, MAX_TOKENS)


def _token_count(text: str) -> int:
    values = _int_list(text, MAX_TOKENS)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one integer in [1, {MAX_TOKENS}], got {text!r}")
    return values[0]


def _dtype(text: str) -> str:
    try:
        return DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPE_ALIASES)}") from None


def _config_for(model: str):
    """A preset name (of any family) or a checkpoint / config.json -> the config of its family."""
    from tilekit.models import families
    if model in families.preset_names():
        return families.preset_config(model)
    try:
        return families.config_from_path(model)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--model {model!r} is neither a preset ({', '.join(families.preset_names())}) nor a "
                         f"usable checkpoint or config.json: {e}")


def _parse_shape(op, text: str, dtype: str) -> dict:
    problem, given = dict(op.field_defaults, dtype=dtype), set()
    if len(text) > 1000:
        raise UsageError(f"--shape is {len(text)} characters long; a problem takes a few dozen")
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep:
            raise UsageError(f"--shape items look like NAME=VALUE, got {_shown(item, 100)}")
        if name in given:
            raise UsageError(f"--shape names {_shown(name, 100)} twice")
        given.add(name)
        problem[name] = int(value) if re.fullmatch(r"-?[0-9]+", value) else value     # ASCII digits only (not '²')
    unknown = set(problem) - set(op.fields)
    missing = [f for f in op.fields if f not in problem]
    if unknown or missing:
        raise UsageError(f"--shape for {op.name} takes {', '.join(op.fields)}"
                         + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else "")
                         + (f"; missing: {', '.join(missing)}" if missing else ""))
    errors = op.problem_errors(problem)
    if errors:
        raise UsageError(f"--shape for {op.name}: {_shown('; '.join(errors), 400)}")
    return {f: problem[f] for f in op.fields}


class Progress:
    """One status line on a terminal (rewritten in place), plain lines otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0

    def line(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + text[:120])
            self.stream.flush()
        elif force or now - self.last > 5:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.last = now

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _shown(text: str, limit: int = 160) -> str:
    """Text read from a file as one short printable line."""
    if text.isprintable() and len(text) <= limit:
        return text
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


# -- tune ------------------------------------------------------------------------------------

def _check_quantize_head(args) -> None:
    if args.quantize_head and args.quantize is None:
        raise UsageError("--quantize-head goes with --quantize int8 | fp8")


def _model_problems(args) -> list:
    """The workload of --model with its --dtype, sizes, --quantize[-head] and --tp (tune, db explain); a quantized
    checkpoint's own scheme (FP8 block scales, its LM head as stored)."""
    from tilekit.models import families
    from tilekit.engine.workload import model_problems
    config = _config_for(args.model)
    if args.model in families.preset_names():
        quantize, head = args.quantize, args.quantize_head
    else:
        quantize, head = families.quantization_of(args.model, args.quantize, args.quantize_head), False
    return model_problems(config, args.dtype, args.batch_sizes, args.seq_lens, args.new_tokens, quantize, args.tp,
                          head)


def cmd_tune(args) -> int:
    from tilekit.autotune.registry import registered_ops
    from tilekit.device import gpu_unavailable_reason
    kernel_alone = args.kernel if args.like is None else None          # with --like, --kernel only filters
    if sum(x is not None and x is not False for x in (args.model, kernel_alone, args.stale, args.like)) != 1:
        raise UsageError("tune needs exactly one of --model, --kernel, --stale or --like")
    if args.quantize is not None and args.model is None:
        raise UsageError("--quantize goes with --model")
    _check_quantize_head(args)
    if args.tp != 1 and args.model is None:
        raise UsageError("--tp goes with --model")
    if args.kernel is not None and args.kernel not in registered_ops():
        raise UsageError(f"--kernel must be one of {', '.join(sorted(registered_ops()))}")
    if args.like is not None:
        if args.shape is not None:
            raise UsageError("--shape goes with --kernel alone, not with --like")
        items = _like_items(args.like, args.kernel)
    elif args.kernel is not None:
        if not args.shape:
            raise UsageError("--kernel needs --shape, e.g. --shape M=8192,N=2304,K=768")
        op = registered_ops()[args.kernel]
        items = [(op, _parse_shape(op, args.shape, args.dtype))]
    elif args.model is not None:
        items = _model_problems(args)
    reason = gpu_unavailable_reason()
    if reason:
        raise UsageError(f"tuning needs a GPU: {reason}")
    if args.stale:
        items = _stale_items(args.stale)
        args.force = True                       # the stale entries are what gets replaced
    if args.devices is not None and args.shard is None:     # a worker never spawns workers
        return _tune_on_devices(args, items)
    return _tune_here(args, items, shard=args.shard)


def _like_items(gpu: str, kernel: str | None) -> list:
    """(op, problem) of every well-formed entry (of `kernel` only, when given) of the shipped file of the GPU named
    `gpu`: the shapes tuned there, to tune here (those this GPU holds exactly are skipped later)."""
    from tilekit.autotune import store
    files = {f.device().name: f for f in store.shipped_db().device_files() if f.device() is not None}
    if gpu not in files:
        raise UsageError(f"--like must name a GPU of the shipped database ({', '.join(sorted(files)) or 'none'}), "
                         f"got {gpu!r}")
    return [(op, problem) for op, problem, _, _ in _entries_of(files[gpu], "shipped") if kernel in (None, op.name)]


def _stale_items(layer: str) -> list:
    """(op, problem) of every entry of this GPU's file in `layer` that is stale: tuned for another
    kernel, search space or (user layer) toolchain; malformed entries are left to `db verify`."""
    return [(op, problem) for op, problem, entry, stale in _entries_here(layer) if stale]


def _entries_here(layer: str) -> list:
    """(op, problem, entry, stale) of every well-formed entry of this GPU's file in `layer`."""
    from tilekit.autotune import store
    from tilekit.device import device_info
    db = store.user_db() if layer == "user" else store.shipped_db()
    return _entries_of(db.file_for(device_info()), layer)


def _entries_of(dfile, layer: str) -> list:
    """(op, problem, entry, stale) of every well-formed entry of a device file of `layer`."""
    from tilekit.autotune.entries import entry_defect
    from tilekit.autotune.keys import parse_key
    from tilekit.autotune.registry import registered_ops
    items = []
    for key, entry in sorted(dfile.read().items()):
        if entry_defect(key, entry) is None:
            name, problem = parse_key(key)
            op = registered_ops()[name]
            items.append((op, problem, entry, bool(op.why_unusable(entry, layer))))
    return items


def _pending(items, force: bool):
    """Split items into (to tune, already tuned exactly for this GPU)."""
    from tilekit.device import device_info
    todo, cached = [], []
    dev = device_info()
    for op, problem in items:
        r = op.resolve(problem, dev, mode="cached")
        exact = r.match is not None and r.match.device_rule == "exact-gpu" and r.match.exact
        (cached if exact and not force else todo).append((op, problem))
    return todo, cached


def _shard_items(items: list, shard: str) -> list:
    """The 'i/n' share of items: every n-th from the i-th."""
    index, count = (int(v) for v in shard.split("/"))
    return items[index::count]


def _tune_here(args, items, shard: str | None) -> int:
    from tilekit.autotune.tuner import tune_many
    from tilekit.device import device_info
    if shard:
        items = _shard_items(items, shard)
    todo, cached = _pending(items, args.force)
    out = sys.stdout
    print(f"tilekit tune on {device_info().name}: {len(items)} kernel shapes, {len(cached)} already tuned, "
          f"{len(todo)} to tune", file=out, flush=True)
    if not todo:
        return 0
    progress = Progress()
    start = time.monotonic()
    budget_s = None if args.budget is None else args.budget * 60
    results = []

    def notify(event, **info):
        elapsed = time.monotonic() - start
        left = "" if budget_s is None else f", {max(0, budget_s - elapsed) / 60:.1f} min left"
        if event == "compile":
            progress.line(f"compile {_bar(info['done'], info['total'])} {info['op']}{left}")
        elif event == "measure":
            progress.line(f"measure {_bar(info['index'], info['count'])} {info['key']} "
                          f"({info['n']} configs){left}")
        elif event == "tuned":
            r = info["result"]
            results.append(r)
            cut = "" if r.complete else f" (budget spent: the best of {r.measured} of {r.candidates} configs)"
            progress.line(f"tuned {r.key}: {r.time_us:.1f} us{cut}", force=True)
            for config, reason, why in r.failures:
                if reason == "WrongOutput":
                    progress.line(f"  rejected {config}: {why}", force=True)
        elif event in ("skipped", "budget-exhausted"):
            progress.line(f"{event}: {info.get('key', '')} {info.get('reason', '')}", force=True)

    try:
        tune_many(todo, budget_s=budget_s, workers=args.workers, progress=notify)
    except KeyboardInterrupt:
        progress.done()
        print(f"interrupted: {len(results)} results were stored; run the command again to continue",
              file=sys.stderr)
        _print_results(results, out)
        return 130
    progress.done()
    _print_results(results, out)
    print(f"tuned {len(results)} of {len(todo)} shapes in {time.monotonic() - start:.0f} s", file=out)
    return 0 if len(results) == len(todo) else 1


def _print_results(results, out) -> None:
    if not results:
        return
    width = max(len(r.key) for r in results)
    width = min(width, 78)
    print(f"{'kernel shape':<{width}}  {'default us':>10}  {'tuned us':>9}  {'speedup':>7}", file=out)
    for r in results:
        default = f"{r.default_time_us:10.1f}" if r.default_time_us else f"{'-':>10}"
        speed = f"{r.speedup:6.2f}x" if r.speedup else f"{'-':>7}"
        print(f"{r.key[:width]:<{width}}  {default}  {r.time_us:9.1f}  {speed}", file=out)


def _parse_devices(text: str, count: int) -> list[int]:
    """--devices 'all' or '0,2' -> sorted GPU indices, all below `count`."""
    if text == "all":
        return list(range(count))
    try:
        devices = sorted(set(int(d) for d in text.split(",")))
    except ValueError:
        devices = []
    if not devices or any(not 0 <= d < count for d in devices):
        raise UsageError(f"--devices must be 'all' or GPU indices below {count}, got {text!r}")
    return devices


def _shard_jobs(names: dict[int, str]) -> list[tuple[int, str]]:
    """(device, 'i/n') per GPU: GPUs of one model split that model's shapes; each model gets all of them."""
    jobs = []
    for name in sorted(set(names.values())):
        group = [d for d in sorted(names) if names[d] == name]
        jobs += [(d, f"{i}/{len(group)}") for i, d in enumerate(group)]
    return jobs


def _child_argv(argv: list[str], shard: str, workers: int) -> list[str]:
    """The tune command line for one worker: --devices dropped, --shard and --workers set."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--devices":
            skip = True
        elif not a.startswith("--devices="):
            out.append(a)
    if "--workers" not in out and not any(a.startswith("--workers=") for a in out):
        out += ["--workers", str(workers)]
    return out + ["--shard", shard]


def _tune_on_devices(args, items) -> int:
    """One worker process per GPU, writing into the one user database; output prefixed by GPU."""
    import threading

    import cupy
    devices = _parse_devices(args.devices, cupy.cuda.runtime.getDeviceCount())
    names = {d: cupy.cuda.runtime.getDeviceProperties(d)["name"].decode() for d in devices}
    jobs = _shard_jobs(names)
    workers = max(1, (os.cpu_count() or 2) // len(jobs))
    print(f"tilekit tune: {len(items)} kernel shapes on {len(jobs)} GPUs "
          f"({', '.join(f'{d}: {names[d]}' for d in devices)})", flush=True)
    start, procs, pumps = time.monotonic(), [], []
    for dev, shard in jobs:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=_visible_device(dev, os.environ.get("CUDA_VISIBLE_DEVICES")))
        p = subprocess.Popen([sys.executable, "-m", "tilekit", *_child_argv(args.argv, shard, workers)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")
        procs.append(p)
        pumps.append(threading.Thread(target=_prefix_lines, args=(p.stdout, f"[gpu {dev}] "), daemon=True))
        pumps[-1].start()
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:      # workers store what they finished; pass the signal on if it missed them
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        print("interrupted: finished results were stored; run the command again to continue", file=sys.stderr)
        return 130
    finally:
        for t in pumps:
            t.join(timeout=5)
    print(f"tilekit tune: {len(jobs)} workers done in {time.monotonic() - start:.0f} s, exit codes {codes}")
    return _exit_status(codes)


def _visible_device(index: int, parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the worker of GPU `index` as this process numbers it."""
    if parent:
        return parent.split(",")[index].strip()
    return str(index)


def _exit_status(codes: list[int]) -> int:
    """One exit status for all workers: the worst, a worker killed by signal N counting as 128 + N."""
    return max((128 - c if c < 0 else c) for c in codes)


def _prefix_lines(pipe, prefix: str) -> None:
    """Copy a worker's output lines with a prefix; keep draining if our stdout goes away, so the
    worker never blocks on a full pipe."""
    out_ok = True
    for line in pipe:
        if out_ok:
            try:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
            except (OSError, ValueError):
                out_ok = False


# -- db --------------------------------------------------------------------------------------

def cmd_db(args) -> int:
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
    items = [(op, problem, entry["config"]) for op, problem, entry, stale in _entries_here(args.layer)
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
        return _tune_here(retune, [(op, problem) for op, problem, _, _ in wrong], shard=None)
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


# -- generate -------------------------------------------------------------------------

MAX_PROMPTS_BYTES = 16 << 20      # a prompts file of more is refused unread


def _generation_options(args) -> dict:
    """generate()'s options from the command line, each checked (ValueError naming it) before any model loads."""
    from tilekit.engine.sampling import GenerationSettings, SamplingParams
    sampling = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                              "presence_penalty", "frequency_penalty")}
    settings = dict(min_new_tokens=args.min_new_tokens, stop_strings=args.stop or None, seed=args.seed)
    options = dict(sampling, **settings)
    if args.kv_cache_dtype != "auto":
        if args.device != "cuda":
            raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} needs --device cuda (the NumPy reference keeps "
                             "its cache in float64)")
        options["kv_cache_dtype"] = args.kv_cache_dtype
    checked = {k: v for k, v in options.items() if v is not None}
    SamplingParams(**{k: checked[k] for k in sampling if k in checked})
    GenerationSettings(max_new_tokens=args.max_new_tokens, **{k: checked[k] for k in settings if k in checked})
    return options


def _prompts(args) -> list[str]:
    """The prompts of `generate`: --prompt, or --prompts-file (one prompt per line, blank lines skipped)."""
    if (args.prompt is None) == (args.prompts_file is None):
        raise UsageError("generate needs exactly one of --prompt or --prompts-file")
    if args.prompt is not None:
        return [args.prompt]
    lines = [line for line in _read_text(args.prompts_file, "--prompts-file", MAX_PROMPTS_BYTES).splitlines()
             if line.strip()]
    if not lines:
        raise UsageError(f"--prompts-file {_shown(args.prompts_file)} holds no prompt")
    return lines


def _read_text(name: str, what: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes (a FIFO or device is refused unopened)."""
    import stat
    try:
        st = os.stat(name)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what} {_shown(name)} is not a regular file")
        if st.st_size > limit:
            raise UsageError(f"{what} {_shown(name)} is larger than {limit} bytes")
        with open(name, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {_shown(name)}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} {_shown(name)} is not UTF-8 text (byte {e.start})") from None


def _load(args, comm=None):
    """The model of --model on --device: tilekit's on the GPU (`comm`: this tensor-parallel rank's shard), or the
    family's NumPy reference on the CPU."""
    from tilekit.models import families
    if args.device == "cuda":
        from tilekit.device import gpu_unavailable_reason
        reason = gpu_unavailable_reason()
        if reason:   # before loading any weights
            raise UsageError(f"{args.command} needs a GPU: {reason} (--device cpu runs the NumPy reference, slowly)")
        _check_quantize_head(args)
        return families.load_model(args.model, dtype=args.dtype, quantize=args.quantize, comm=comm,
                                   quantize_head=args.quantize_head)
    if args.quantize or args.quantize_head:
        raise UsageError(f"--quantize{'-head' if args.quantize_head and not args.quantize else ''} needs --device "
                         "cuda (the NumPy reference computes in float)")
    return families.load_reference(args.model)


def cmd_generate(args) -> int:
    options = _generation_options(args)
    prompts = _prompts(args)
    from tilekit import parallel
    dist, start_ranks = parallel.placement(args.tp, args.device == "cuda")
    if start_ranks:
        return parallel.launch(args.tp, args.argv)
    if dist is None:
        return _generate(args, _load(args), prompts, options, print)
    comm = parallel.NcclCommunicator(dist)
    try:
        shown = print if dist.rank == 0 else (lambda *a, **k: None)    # rank 0 prints; every rank computes
        status = _generate(args, _load(args, comm), prompts, options, shown)
    except BaseException:
        comm.close(failed=True)
        raise
    comm.close()
    return status


def _generate(args, model, prompts: list[str], options: dict, show) -> int:
    if len(prompts) == 1:
        echoed = args.chat              # the prompt is echoed with the first piece: after every check has passed

        def stream(piece: str) -> None:
            nonlocal echoed
            if not echoed:
                show(prompts[0], end="", flush=True)
                echoed = True
            show(piece, end="", flush=True)
        model.generate_text(prompts[0], args.max_new_tokens, chat=args.chat, stream_to=stream, **options)
        stream("")
        show()
        return 0
    for text in model.generate_text(prompts, args.max_new_tokens, chat=args.chat, **options):
        show(json.dumps(text, ensure_ascii=False))
    return 0


def cmd_chat(args) -> int:
    """An interactive conversation: each line read is a user turn; the reply streams; an empty line or EOF ends."""
    options = _generation_options(args)
    from tilekit import env
    dist = env.distributed()
    if dist is not None and dist.world_size > 1:
        raise UsageError(f"chat does not run tensor-parallel (WORLD_SIZE={dist.world_size}); use generate --chat")
    model = _load(args)
    model.chat_template()       # a checkpoint without one is refused before the first turn
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = model.chat(messages, args.max_new_tokens, stream_to=lambda s: print(s, end="", flush=True), **options)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


# -- parser ----------------------------------------------------------------------------------

def _arch(text: str) -> str:
    from tilekit.autotune.db import ARCH
    if not ARCH.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected sm_<digits> such as sm_90, got {text!r}")
    return text


def _model_args(p, default_model=None):
    p.add_argument("--model", default=default_model,
                   help="a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, llama-3.2-1b, ...), or a checkpoint "
                        "directory / config.json / HF cache name")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 8],
                   help=f"comma-separated, each at most {MAX_BATCH} (default 1,8)")
    p.add_argument("--seq-lens", type=_token_counts, default=[128, 1024],
                   help=f"comma-separated, each at most {MAX_TOKENS} (default 128,1024)")
    p.add_argument("--dtype", type=_dtype, default="bfloat16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--new-tokens", type=_token_count, default=128,
                   help=f"tokens generate() adds after each prompt in the workload (default 128, at most {MAX_TOKENS})")
    p.add_argument("--quantize", choices=("int8", "fp8"),
                   help="the workload of the model with its linears quantized (Llama and DeepSeek-V2 families)")
    p.add_argument("--quantize-head", action="store_true",
                   help="with --quantize: its untied LM head too (Llama and DeepSeek-V2 families)")
    p.add_argument("--tp", type=_positive, default=1,
                   help="the workload of each rank of the model split over this many GPUs (tensor parallelism; "
                        "Llama, GPT-2 and DeepSeek-V2 families)")


def _generation_args(p) -> None:
    """The model, device and generation options that `generate` and `chat` share; sampling options left out
    take the checkpoint's generation_config.json values, as Hugging Face's generate does."""
    p.add_argument("--model", required=True, help="checkpoint directory or HF cache name (any supported family, "
                                                  "chosen by config.json's model_type)")
    p.add_argument("--dtype", type=_dtype, default="bfloat16", help="bf16 (default), fp16 or fp32")
    p.add_argument("--quantize", choices=("int8", "fp8"),
                   help="quantize the linears per channel as the weights load (FP8 / INT8 checkpoints load quantized "
                        "without it)")
    p.add_argument("--quantize-head", action="store_true",
                   help="with --quantize: the untied LM head too (Llama and DeepSeek-V2 families; as gpt-fast's int8 "
                        "does)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): tilekit's kernels; cpu: the family's NumPy float64 reference, slow, for "
                        "checking (same options; its own random draws)")
    p.add_argument("--max-new-tokens", type=_count, help="tokens to generate (default: generation_config.json's)")
    p.add_argument("--min-new-tokens", type=_count, help="ban the end-of-sequence ids until this many were made")
    p.add_argument("--temperature", type=float, help="sampling temperature; 0 is greedy")
    p.add_argument("--top-k", type=_count, help="sample from the k most likely tokens only (0: off)")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with this total probability")
    p.add_argument("--min-p", type=float, help="keep tokens at least this fraction as likely as the likeliest")
    p.add_argument("--repetition-penalty", type=float, help="Hugging Face's repetition penalty (1: off)")
    p.add_argument("--presence-penalty", type=float, help="subtract this from tokens already generated (0: off)")
    p.add_argument("--frequency-penalty", type=float, help="subtract this per time a token was generated (0: off)")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop once the text contains TEXT (repeatable)")
    p.add_argument("--seed", type=_count, help="random seed, for repeatable samples")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="auto (default): keys and values in the model's dtype; fp8: e4m3 codes with per-head scales, "
                        "half the bytes each decode step reads (GPT-2 and Llama families, --device cuda)")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text!r}")
    return value


def _version() -> str:
    import tilekit
    return f"tilekit {tilekit.__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tilekit", description=__doc__)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do")

    tune = sub.add_parser("tune", help="tune the kernels a model (or one kernel shape) uses on this GPU")
    _model_args(tune)
    tune.add_argument("--kernel", help="tune one kernel instead of a model (with --shape)")
    tune.add_argument("--shape", help="problem fields, e.g. M=8192,N=2304,K=768")
    tune.add_argument("--budget", type=_minutes,
                      help="time budget in minutes (compiling stops at 60%% of it; a shape being timed when it runs "
                           "out keeps the best of the configs timed so far)")
    tune.add_argument("--stale", choices=("user", "shipped"), nargs="?", const="user",
                      help="re-tune the entries of this GPU's file in that layer (default user) that the "
                           "current kernels made stale; the results go to the user database")
    tune.add_argument("--like", metavar="GPU",
                      help="tune the shapes the shipped database holds for that GPU (its name, as `tilekit db list` "
                           "shows it) that this GPU lacks: a new GPU's bring-up, or re-tuning entries dropped after "
                           "a kernel change; --kernel narrows it to one kernel")
    tune.add_argument("--force", action="store_true", help="re-tune shapes that are already tuned")
    tune.add_argument("--devices", help="'all' or GPU indices '0,1': one worker process per GPU")
    tune.add_argument("--workers", type=_positive, help="compile processes (default: CPU cores - 1)")
    tune.add_argument("--shard", help=argparse.SUPPRESS)
    tune.set_defaults(func=cmd_tune)

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
    db.set_defaults(func=cmd_db)

    gen = sub.add_parser("generate", help="generate text from a checkpoint of any supported family, streaming it")
    _generation_args(gen)
    gen.add_argument("--prompt", help="the text to continue")
    gen.add_argument("--prompts-file", help="a UTF-8 file of prompts, one per line: one batch, each continuation "
                                            "printed as a JSON string on its own line")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the checkpoint's chat template")
    gen.add_argument("--tp", type=_positive,
                     help="split the model over this many GPUs of this host (tensor parallelism; Llama, GPT-2 and "
                          "DeepSeek-V2 families): "
                          "starts one process per GPU; under torchrun (RANK, WORLD_SIZE, ... set) each process is "
                          "one rank and --tp may be left out")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="talk with a checkpoint through its chat template (multi-turn, from stdin)")
    _generation_args(chat)
    chat.add_argument("--system", help="a system message opening the conversation")
    chat.set_defaults(func=cmd_chat)

    return parser


def main(argv: list[str] | None = None) -> int:
    from tilekit.autotune.db import TuningDBError
    from tilekit.parallel import EXIT_PEER_LOST, RankError
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        from tilekit import env
        env.check()          # every TILEKIT_* / HF_* variable, before anything reads one
        if getattr(args, "command", None) in ("tune", "db"):
            import tilekit.kernels  # noqa: F401  (declares the ops that tuning entries name)
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError, TuningDBError) as e:
        print(f"tilekit: {shown(str(e), 1 << 20)}", file=sys.stderr)     # one line: a file's newlines escaped
        return 2
    except RankError as e:    # tensor parallelism: another rank missing, dead or disagreeing (its WORLD_SIZE)
        print(f"tilekit: {shown(str(e), 1 << 20)}", file=sys.stderr)
        return EXIT_PEER_LOST
    except BrokenPipeError:   # output piped into `head` and the like: stop quietly (before OSError, its base)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:     # a permission or disk error on a file the command writes or reads
        print(f"tilekit: {_shown(str(e.filename or ''), 400)}: {shown(str(e.strerror or e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
