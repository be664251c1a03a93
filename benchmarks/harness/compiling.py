"""Compiling a study's kernels up front, in parallel worker processes (cuTile's disk cache keeps them), so its
timed loop does not compile one kernel at a time."""

from __future__ import annotations

import json
import threading
import time


def distinct_tasks(calls, config_of=None) -> list[tuple]:
    """(op, problem, config) of each distinct (op, problem) call, with config_of(op, problem) (default: the
    config this GPU's databases give it, else the default)."""
    if config_of is None:
        from tilekit.device import device_info
        device = device_info()

        def config_of(op, problem):
            return op.resolve(problem, device).config
    tasks = {}
    for op, problem in calls:
        config = config_of(op, problem)
        key = (op.name, json.dumps(problem, sort_keys=True, default=str), json.dumps(config, sort_keys=True))
        tasks.setdefault(key, (op, problem, config))
    return list(tasks.values())


class Precompile(threading.Thread):
    """tilekit.autotune.compile.precompile of the tasks in worker processes, in the background."""

    def __init__(self, tasks: list[tuple], arch: str):
        super().__init__(daemon=True)
        self.tasks, self.arch, self.ok, self.errors, self.seconds = tasks, arch, set(), {}, 0.0

    def run(self) -> None:
        from tilekit.autotune.compile import precompile
        start = time.perf_counter()
        self.ok, self.errors = precompile(self.tasks, self.arch)
        self.seconds = time.perf_counter() - start

    def summary(self) -> str:
        """One line, after join(): how many compiled, in how long, and one error if any failed."""
        return (f"precompiled {len(self.ok)}/{len(self.tasks)} kernels in {self.seconds:.0f} s"
                + (f"; {len(self.errors)} failed, e.g. {next(iter(self.errors.values()))}" if self.errors else ""))
