"""The tuner: compile candidates in parallel, measure them with cuTile's exhaustive_search, store the winner.

Compilation dominates tuning time (about a second of tileiras per config), so every candidate of
every requested problem is compiled first in a pool of worker processes; their cubins land in
cuTile's disk cache and the measuring process then only pays the Python front end. Measurement
is `cuda.tile.tune.exhaustive_search` (L2 flushed before each run, sampled until its 95%
confidence interval is within 1%). Each winner is stored as soon as it is measured, so an
interrupted run keeps what it finished. A candidate whose kernel never finishes ends the process with a line
naming it (hang_watch) instead of leaving the tuner waiting forever.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from tilekit.autotune import store
from tilekit.autotune.arrays import ITEMSIZE
from tilekit.autotune.compile import precompile
from tilekit.autotune.space import Config, split_hints
from tilekit.device import device_info, toolchain


HANG_S = 120.0          # seconds one candidate's agreement runs may take before the GPU is taken for hung
HANG_PER_TIMED_S = 10.0  # ... and a chunk of timed candidates, this much more per config
HUNG_EXIT = 3


@contextlib.contextmanager
def hang_watch(what: str, seconds: float):
    """Within the block, GPU work still running after `seconds` ends the process (exit status HUNG_EXIT) with a line
    on stderr naming `what`: a kernel that never finishes cannot be stopped from its own process (its context has
    to go), and a tuner waiting on it waits forever (a 1 x 128 quantize_fp8 tile at occupancy 2 did, H100). Shapes
    tuned before it are already stored."""
    timer = threading.Timer(seconds, _hung, (what, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _hung(what: str, seconds: float) -> None:
    sys.stderr.write(f"tilekit tune: {what} has not finished in {seconds:g} s, so the GPU looks hung; the shapes "
                     f"tuned before it are stored. Leave that config out of the op's search space (and report it), "
                     f"then run the command again.\n")
    sys.stderr.flush()
    os._exit(HUNG_EXIT)


@dataclass
class TuneResult:
    op: str
    key: str
    config: Config
    time_us: float
    default_config: Config
    default_time_us: float | None
    candidates: int
    measured: int
    failures: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)      # every measured config (sorted item tuple) -> us
    complete: bool = True          # False: the budget ran out before every compiled config was checked and timed

    @property
    def speedup(self) -> float | None:
        return self.default_time_us / self.time_us if self.default_time_us else None


def tune(op, problem: dict, **kwargs) -> TuneResult:
    """Tune one problem of one op on the current GPU and store the result in the user database."""
    results = tune_many([(op, problem)], **kwargs)
    if not results:
        raise RuntimeError(f"tuning {op.name} {problem} produced no result (budget too small?)")
    return results[0]


def problem_bytes(op, problem: dict) -> int:
    """Bytes of the arrays a problem declares: what its kernels move, roughly what timing each config costs."""
    p = op.complete(op.tuning_problem(problem))
    return sum(ITEMSIZE[s.dtype] * math.prod(s.shape) for s in op.arrays(p).values())


def smallest_first(items: Sequence[tuple]) -> list[tuple]:
    """(op, problem) items, the problems with the fewest bytes first (ties keep their order): a budget that runs
    out leaves the large prefill shapes untuned rather than the decode ones, and tunes more shapes."""
    return sorted(items, key=lambda item: problem_bytes(*item))


def tune_many(items: Sequence[tuple], *, budget_s: float | None = None, workers: int | None = None,
              save: bool = True, progress: Callable[..., None] | None = None) -> list[TuneResult]:
    """Tune each (op, problem), smallest first; compile everything in parallel first, then measure one by one."""
    import cupy

    start = time.monotonic()
    notify = progress or (lambda *a, **k: None)
    dev = device_info()
    plans = []
    for op, problem in smallest_first(items):
        bucketed, key = op.tuning_problem(problem), op.problem_key(problem)[1]
        candidates = op.space.candidates(bucketed)
        default = op.default(bucketed)
        if op.space.contains(default):
            candidates = [default] + [c for c in candidates if c != default]
        plans.append((op, bucketed, key, candidates, default))

    # Phase 1: compile every candidate of every problem in parallel (fills cuTile's disk cache).
    tasks, owner = [], []
    for i, (op, bucketed, key, candidates, _) in enumerate(plans):
        for config in candidates:
            tasks.append((op, bucketed, config))
            owner.append(i)
    deadline = None if budget_s is None else start + 0.6 * budget_s
    finished = 0

    def tick(index):
        nonlocal finished
        finished += 1
        notify("compile", done=finished, total=len(tasks), op=tasks[index][0].name)

    notify("compile-start", total=len(tasks))
    ok, _errors = precompile(tasks, dev.arch, workers=workers, deadline=deadline, progress=tick)
    compiled: dict[int, list] = {i: [] for i in range(len(plans))}
    for index in sorted(ok):
        compiled[owner[index]].append(tasks[index][2])

    # Phase 2: measure, store as we go.
    results = []
    stream = cupy.cuda.get_current_stream()
    end = None if budget_s is None else start + budget_s
    for i, (op, bucketed, key, candidates, default) in enumerate(plans):
        if end is not None and time.monotonic() > end:
            notify("budget-exhausted", key=key)
            break
        configs = compiled[i]
        if not configs:
            notify("skipped", key=key, reason="no candidate compiled")
            continue
        notify("measure", op=op.name, key=key, n=len(configs), index=i, count=len(plans))
        case = op.bench_case(bucketed)
        checked, wrong = agreeing(case, configs, default, deadline=end, name=key)
        if not checked:
            notify("skipped", key=key, reason=f"every candidate's output differs from the default's: {wrong[0][2]}")
            continue
        found = measure(op, case, checked, stream, deadline=end, name=key)
        stream.synchronize()
        timings = {_freeze(m.config): m.mean_us for m in found.successes}
        best = dict(found.best.config)
        result = TuneResult(op=op.name, key=key, config=best, time_us=found.best.mean_us,
                            default_config=default, default_time_us=timings.get(_freeze(default)),
                            candidates=len(candidates), measured=len(found.successes),
                            failures=wrong + [(c, e.__name__, m.splitlines()[0] if m else "")
                                              for c, e, m in found.failures], timings=timings,
                            complete=len(found.successes) + len(found.failures) + len(wrong) == len(configs))
        if save:
            store.user_db().store(dev, {key: _entry(op, result, dev)})
            op.forget()
        notify("tuned", result=result)
        results.append(result)
    return results


def agreeing(case, configs: Sequence[Config], reference: Config, runs: int = 3,
             deadline: float | None = None, name: str = "a shape") -> tuple[list, list]:
    """(configs whose outputs agree with the reference config's, [(config, reason, why)] of the rest).

    Each config runs `runs` times on the case's arrays, from the same contents each time; every array it leaves
    behind (outputs, caches written in place) must lie within the dtype's agreement tolerance of the
    reference's first run, every time. tileiras 13.4 builds some configs of correct kernels that race on sm_90
    (decode attention: wrong in some runs only; docs/results/wrong-configs.txt), so a timing alone cannot pick a
    winner. The reference is the op's default config (each op's tests check it against a float64 reference);
    when it does not agree with itself nothing is kept, and without it among the compiled configs every config
    is kept. Past `deadline` (time.monotonic()) the configs not yet checked are left out, the reference first
    checked. Each config's runs are under hang_watch (`name`: the shape, for its message)."""
    from tilekit.autotune.arrays import agreement_tolerance, relative_difference
    if reference not in configs:
        return list(configs), []
    with hang_watch(f"config {reference} (the default) of {name}", HANG_S):
        want = case.outputs(reference)
    kept, wrong = [], []

    def disagreement(got: dict) -> str | None:
        ratio, name = max((relative_difference(got[n], a) / agreement_tolerance(a.dtype), n) for n, a in want.items())
        if ratio <= 1:
            return None
        return f"{name} differs from the default config's by {ratio * agreement_tolerance(want[name].dtype):.3g} (relative)"

    for config in [reference] + [c for c in configs if c != reference]:
        if config != reference and deadline is not None and time.monotonic() > deadline:
            break
        why = None
        try:
            with hang_watch(f"config {config} of {name}", HANG_S):
                for _ in range(runs - 1 if config == reference else runs):
                    why = disagreement(case.outputs(config))
                    if why:
                        break
        except Exception as e:  # noqa: BLE001  (a candidate that cannot run fails, as in measuring)
            wrong.append((config, type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
            continue
        if why:
            wrong.append((config, "WrongOutput", why))
        else:
            kept.append(config)
    if reference not in kept:
        return [], wrong + [(c, "WrongOutput", "the default config does not agree with itself") for c in kept]
    return kept, wrong


def disagreeing_entries(items: Sequence[tuple], *, workers: int | None = None,
                        progress: Callable[[int, int], None] | None = None) -> list[tuple]:
    """[(op, problem, config, why)] of the (op, problem, config) items whose config does not agree with the op's
    default config (`agreeing`, on the problem's bench case); every config is compiled in parallel first."""
    checks = []
    for op, problem, config in items:
        bucketed = op.tuning_problem(problem)
        checks.append((op, problem, config, bucketed, op.default(bucketed)))
    precompile([task for op, _, config, bucketed, default in checks
                for task in ((op, bucketed, config), (op, bucketed, default))], device_info().arch, workers=workers)
    wrong = []
    for i, (op, problem, config, bucketed, default) in enumerate(checks):
        if config != default:
            kept, rejected = agreeing(op.bench_case(bucketed), [default, config], default)
            if config not in kept:
                wrong.append((op, problem, config, rejected[-1][2]))
        if progress:
            progress(i + 1, len(items))
    return wrong


MEASURE_CHUNK = 32       # configs timed by one search; a budget is checked between searches


def measure(op, case, configs: Sequence[Config], stream, deadline: float | None = None, name: str = "a shape"):
    """The configs timed as exhaustive_search times them (measure_launches for ops tuned whole), MEASURE_CHUNK at a
    time: past `deadline` (time.monotonic()) no further chunk starts, so a shape of hundreds of configs (each paying
    cuTile's front end on first launch) stops within a chunk of a --budget, having timed the first chunk (the
    default config leads it). Each chunk is under hang_watch. Returns exhaustive_search's TuningResult over every
    chunk timed."""
    import cuda.tile as ct
    from cuda.tile.tune import TuningResult
    successes, failures = [], []
    for first in range(0, len(configs), MEASURE_CHUNK):
        if first and deadline is not None and time.monotonic() > deadline:
            break
        chunk = configs[first:first + MEASURE_CHUNK]
        what = f"timing {len(chunk)} configs of {name} (from {chunk[0]})"
        try:
            with hang_watch(what, HANG_S + HANG_PER_TIMED_S * len(chunk)):
                if case.launches is not None:
                    found = measure_launches(chunk, stream, case.launches)
                else:
                    found = ct.tune.exhaustive_search(chunk, stream, case.grid, op.kernel, case.args,
                                                      lambda c: split_hints(c)[1], quiet=True)
        except ValueError as e:         # no config of the chunk ran: each is a failure
            failures += [(c, ValueError, str(e)) for c in chunk]
            continue
        successes += found.successes
        failures += found.failures
    if not successes:
        config, kind, message = failures[0]
        raise ValueError(f"no config ran: {config}: {kind.__name__}: {message}")
    return TuningResult(best=min(successes, key=lambda m: m.mean_us), successes=tuple(successes),
                        failures=tuple(failures))


def measure_launches(configs: Sequence[Config], stream, launches: Callable, samples: int = 30, warmup: int = 3):
    """exhaustive_search's result for ops tuned whole (Op.tune_whole): each config's launches(config), a list of
    (kernel, grid, args), run in order and timed together between two events, L2 flushed before each sample;
    the mean of `samples` after `warmup` runs. A config that fails to launch is a failure, as there."""
    import cupy
    import cuda.tile as ct
    from cuda.tile.tune import Measurement, TuningResult

    flush = cupy.empty(64 << 20, cupy.int32)        # 256 MiB: more than any L2
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    successes, failures = [], []
    for config in configs:
        try:
            recipe = launches(config)
            times = []
            for i in range(warmup + samples):
                flush.fill(i)
                start.record(stream)
                for kernel, grid, args in recipe:
                    ct.launch(stream, grid, kernel, args)
                end.record(stream)
                end.synchronize()
                if i >= warmup:
                    times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
        except Exception as e:  # noqa: BLE001  (a candidate that cannot run is reported, as exhaustive_search does)
            failures.append((config, type(e), str(e)))
            continue
        mean = sum(times) / len(times)
        spread = math.sqrt(sum((t - mean) ** 2 for t in times) / (len(times) - 1) / len(times))
        successes.append(Measurement(config=config, mean_us=mean, error_margin_us=1.96 * spread,
                                     num_samples=len(times)))
    if not successes:
        config, kind, message = failures[0]
        raise ValueError(f"no config ran: {config}: {kind.__name__}: {message}")
    return TuningResult(best=min(successes, key=lambda m: m.mean_us), successes=tuple(successes),
                        failures=tuple(failures))


def _freeze(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def _entry(op, r: TuneResult, dev) -> dict:
    return {"config": r.config, "time_us": round(r.time_us, 3),
            "default_config": r.default_config,
            "default_time_us": None if r.default_time_us is None else round(r.default_time_us, 3),
            "kernel_hash": op.kernel_hash(), "space_hash": op.space_hash(), "toolchain": toolchain(),
            "device": dev.as_dict(), "candidates": r.candidates, "measured": r.measured,
            "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
