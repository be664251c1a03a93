"""`tilekit tune`: tune the kernels a model (or one kernel shape) uses on this GPU, or on several (one worker process
each: tilekit.autotune.jobs)."""

from __future__ import annotations

import argparse
import sys
import time

from tilekit.autotune.jobs import like_items, pending, shard_items, stale_items, tune_on_devices

from tilekit.cli.common import (Progress, UsageError, _bar, _check_quantize_head, _minutes, _model_args, _model_problems,
                                _parse_shape, _positive)


def add_parser(sub) -> None:
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


def run(args) -> int:
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
        items = like_items(args.like, args.kernel)
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
        items = stale_items(args.stale)
        args.force = True                       # the stale entries are what gets replaced
    if args.devices is not None and args.shard is None:     # a worker never spawns workers
        return tune_on_devices(args.devices, args.argv, items)
    return tune_here(args, items, shard=args.shard)


def tune_here(args, items, shard: str | None) -> int:
    from tilekit.autotune.tuner import tune_many
    from tilekit.device import device_info
    if shard:
        items = shard_items(items, shard)
    todo, cached = pending(items, args.force)
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
