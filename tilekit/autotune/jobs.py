"""What a tune run tunes, and a run spread over several GPUs: the shapes of a GPU's entries (stale ones, or those
another GPU's shipped file holds), those already tuned exactly here, and one worker process per GPU (`python -m
tilekit tune ... --shard i/n`), GPUs of one model splitting its shapes, all writing into the one user database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

def like_items(gpu: str, kernel: str | None) -> list:
    """(op, problem) of every well-formed entry (of `kernel` only, when given) of the shipped file of the GPU named
    `gpu`: the shapes tuned there, to tune here (those this GPU holds exactly are skipped later)."""
    from tilekit.autotune import store
    files = {f.device().name: f for f in store.shipped_db().device_files() if f.device() is not None}
    if gpu not in files:
        raise ValueError(f"--like must name a GPU of the shipped database ({', '.join(sorted(files)) or 'none'}), "
                         f"got {gpu!r}")
    return [(op, problem) for op, problem, _, _ in entries_of(files[gpu], "shipped") if kernel in (None, op.name)]


def stale_items(layer: str) -> list:
    """(op, problem) of every entry of this GPU's file in `layer` that is stale: tuned for another
    kernel, search space or (user layer) toolchain; malformed entries are left to `db verify`."""
    return [(op, problem) for op, problem, entry, stale in entries_here(layer) if stale]


def entries_here(layer: str) -> list:
    """(op, problem, entry, stale) of every well-formed entry of this GPU's file in `layer`."""
    from tilekit.autotune import store
    from tilekit.device import device_info
    db = store.user_db() if layer == "user" else store.shipped_db()
    return entries_of(db.file_for(device_info()), layer)


def entries_of(dfile, layer: str) -> list:
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


def pending(items, force: bool):
    """Split items into (to tune, already tuned exactly for this GPU)."""
    from tilekit.device import device_info
    todo, cached = [], []
    dev = device_info()
    for op, problem in items:
        r = op.resolve(problem, dev, mode="cached")
        exact = r.match is not None and r.match.device_rule == "exact-gpu" and r.match.exact
        (cached if exact and not force else todo).append((op, problem))
    return todo, cached


def shard_items(items: list, shard: str) -> list:
    """The 'i/n' share of items: every n-th from the i-th."""
    index, count = (int(v) for v in shard.split("/"))
    return items[index::count]


def parse_devices(text: str, count: int) -> list[int]:
    """--devices 'all' or '0,2' -> sorted GPU indices, all below `count`."""
    if text == "all":
        return list(range(count))
    try:
        devices = sorted(set(int(d) for d in text.split(",")))
    except ValueError:
        devices = []
    if not devices or any(not 0 <= d < count for d in devices):
        raise ValueError(f"--devices must be 'all' or GPU indices below {count}, got {text!r}")
    return devices


def shard_jobs(names: dict[int, str]) -> list[tuple[int, str]]:
    """(device, 'i/n') per GPU: GPUs of one model split that model's shapes; each model gets all of them."""
    jobs = []
    for name in sorted(set(names.values())):
        group = [d for d in sorted(names) if names[d] == name]
        jobs += [(d, f"{i}/{len(group)}") for i, d in enumerate(group)]
    return jobs


def child_argv(argv: list[str], shard: str, workers: int) -> list[str]:
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


def tune_on_devices(devices: str, argv: list[str], items) -> int:
    """One worker process per GPU, writing into the one user database; output prefixed by GPU."""
    import threading

    import cupy
    devices = parse_devices(devices, cupy.cuda.runtime.getDeviceCount())
    names = {d: cupy.cuda.runtime.getDeviceProperties(d)["name"].decode() for d in devices}
    jobs = shard_jobs(names)
    workers = max(1, (os.cpu_count() or 2) // len(jobs))
    print(f"tilekit tune: {len(items)} kernel shapes on {len(jobs)} GPUs "
          f"({', '.join(f'{d}: {names[d]}' for d in devices)})", flush=True)
    start, procs, pumps = time.monotonic(), [], []
    for dev, shard in jobs:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible_device(dev, os.environ.get("CUDA_VISIBLE_DEVICES")))
        p = subprocess.Popen([sys.executable, "-m", "tilekit", *child_argv(argv, shard, workers)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             errors="replace")
        procs.append(p)
        pumps.append(threading.Thread(target=prefix_lines, args=(p.stdout, f"[gpu {dev}] "), daemon=True))
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
    return exit_status(codes)


def visible_device(index: int, parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the worker of GPU `index` as this process numbers it."""
    if parent:
        return parent.split(",")[index].strip()
    return str(index)


def exit_status(codes: list[int]) -> int:
    """One exit status for all workers: the worst, a worker killed by signal N counting as 128 + N."""
    return max((128 - c if c < 0 else c) for c in codes)


def prefix_lines(pipe, prefix: str) -> None:
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
