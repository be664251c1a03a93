"""TunableOp: a kernel's search space, default and keys, and the dispatch that picks its config.

Dispatch order for a problem: in-process dict -> user db -> shipped db -> heuristic default,
steered by ``TILEKIT_AUTOTUNE`` (off | cached | auto). After the first call with a given key the
answer is one dict lookup.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tilekit.autotune import store
from tilekit.autotune.db import Match
from tilekit.autotune.keys import Buckets, bucket_problem, key_string
from tilekit.autotune.space import Config, Problem, SearchSpace, split_hints
from tilekit.device import DeviceInfo, device_info, toolchain

MODES = ("off", "cached", "auto")


def autotune_mode() -> str:
    mode = os.environ.get("TILEKIT_AUTOTUNE", "cached").strip().lower() or "cached"
    if mode not in MODES:
        raise ValueError(f"TILEKIT_AUTOTUNE={mode!r} is not one of {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class Resolution:
    """The config chosen for a problem and where it came from."""

    config: Config
    source: str               # "user", "shipped", "tuned", or "default"
    match: Match | None = None

    def describe(self) -> str:
        return self.match.describe() if self.match else {
            "default": "heuristic default", "tuned": "tuned just now (auto mode)"}[self.source]


@dataclass(frozen=True)
class Plan:
    """What a launcher needs: the kernel constants and the kernel compiled with the config's hints."""

    config: Config
    constants: dict
    kernel: Any


@dataclass(frozen=True)
class BenchCase:
    """One problem instantiated on the GPU for timing: fresh random inputs and a launch recipe."""

    grid: Callable[[Config], tuple]
    args: Callable[[Config], tuple]


class TunableOp:
    """Everything the autotuner and the dispatcher know about one op.

    fields: the problem's field names, in the order the launcher builds its key tuple.
    buckets: which fields are bucketed and how (others must match exactly).
    default: heuristic config for a problem, used when nothing is tuned.
    bench: builds a BenchCase for a (bucketed) problem on the current GPU.
    signature: (problem, config) -> [(kernel, argument specs)], for ahead-of-time compiles.
    field_defaults: values the command line fills in for fields a user leaves out.
    """

    def __init__(self, name: str, *, kernel, fields: tuple[str, ...], space: SearchSpace,
                 default: Callable[[Problem], Config], buckets: Buckets,
                 bench: Callable[[Problem], BenchCase],
                 signature: Callable[[Problem, Config], tuple],
                 source_of: tuple = (), field_defaults: Mapping | None = None):
        self.name = name
        self.field_defaults = dict(field_defaults or {})
        self.kernel = kernel
        self.fields = fields
        self.space = space
        self.default = default
        self.buckets = buckets
        self.bench = bench
        self.signature = signature
        self._source_of = (kernel,) + tuple(source_of)
        self._hot: dict[tuple, Plan] = {}
        self._hinted: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self._saved_by_pins: list[dict] = []
        _REGISTRY[name] = self

    # -- identity -------------------------------------------------------------------------
    def kernel_hash(self) -> str:
        """Hash of the kernel source (and its tile helpers): a changed kernel invalidates results."""
        if not hasattr(self, "_kernel_hash"):
            text = "".join(inspect.getsource(getattr(f, "_pyfunc", f)) for f in self._source_of)
            self._kernel_hash = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._kernel_hash

    def space_hash(self) -> str:
        if not hasattr(self, "_space_hash"):
            self._space_hash = self.space.digest()
        return self._space_hash

    # -- dispatch -------------------------------------------------------------------------
    def plan(self, key: tuple) -> Plan:
        """Hot path: key = (device index, *field values in `fields` order)."""
        plan = self._hot.get(key)
        if plan is None:
            plan = self._plan_slow(key)
        return plan

    def _plan_slow(self, key: tuple) -> Plan:
        with self._lock:
            if key in self._hot:
                return self._hot[key]
            problem = dict(zip(self.fields, key[1:]))
            resolution = self.resolve(problem, device_info(key[0]))
            plan = self.make_plan(resolution.config)
            self._hot[key] = plan
            return plan

    def make_plan(self, config: Config) -> Plan:
        constants, hints = split_hints(config)
        hint_key = tuple(sorted(hints.items()))
        kernel = self._hinted.get(hint_key)
        if kernel is None:
            kernel = self.kernel.replace_hints(**hints) if hints else self.kernel
            self._hinted[hint_key] = kernel
        return Plan(config=dict(config), constants=constants, kernel=kernel)

    def problem_key(self, problem: Problem) -> tuple[dict, str]:
        bucketed = bucket_problem(problem, self.buckets)
        return bucketed, key_string(self.name, bucketed)

    def resolve(self, problem: Problem, device: DeviceInfo, mode: str | None = None) -> Resolution:
        """Choose the config for `problem` on `device` (slow path; no in-process caching)."""
        mode = mode or autotune_mode()
        if mode == "off":
            return Resolution(self.default(problem), "default")
        bucketed, _ = self.problem_key(problem)
        found = [m for db in store.layers()
                 if (m := db.lookup(self.name, bucketed, device, self.buckets,
                                    lambda k, e, layer=db.layer: self.why_unusable(e, layer)))]
        if found:   # the closest match wins; the user layer only breaks ties
            best = min(found, key=lambda m: (m.device_rule != "exact-gpu", m.bucket_rule != "exact"))
            exact = best.device_rule == "exact-gpu" and best.bucket_rule == "exact"
            if exact or mode != "auto":
                return Resolution(dict(best.entry["config"]), best.layer, best)
        if mode == "auto":   # tune what this GPU and bucket lack, even where a fallback exists
            from tilekit.autotune.tuner import tune
            result = tune(self, problem)
            return Resolution(result.config, "tuned")
        return Resolution(self.default(problem), "default")

    def why_unusable(self, entry: Mapping, layer: str) -> str | None:
        """None when a stored entry may be used by this kernel now, else the reason."""
        if not self.space.contains(entry["config"]):
            return f"config {entry['config']} is not in the current search space"
        if entry["kernel_hash"] != self.kernel_hash():
            return "stale: tuned for another version of the kernel source"
        if entry["space_hash"] != self.space_hash():
            return "stale: tuned over another search space"
        if layer == "user" and entry["toolchain"] != toolchain():
            return f"stale: tuned with {entry['toolchain']}, running {toolchain()}"
        return None

    @contextlib.contextmanager
    def pinned(self, config: Config):
        """Within the block every call of this op runs `config` (testing every config of a space)."""
        if not self.space.contains(config):
            raise ValueError(f"{config} is not in the {self.name} search space")
        saved, self._hot = self._hot, _Always(self.make_plan(config))
        self._saved_by_pins.append(saved)
        try:
            yield
        finally:
            self._saved_by_pins.pop()
            self._hot = saved

    def forget(self) -> None:
        """Drop in-process answers (after the databases changed)."""
        with self._lock:
            self._hot.clear()
            for saved in self._saved_by_pins:   # what pinned() will restore must forget too
                saved.clear()


class _Always(dict):
    """A plan table that answers every key with one plan."""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan

    def get(self, key, default=None):
        return self.plan


_REGISTRY: dict[str, TunableOp] = {}


def registered_ops() -> dict[str, TunableOp]:
    """All ops, by name (imports the kernel modules so that they register)."""
    import tilekit.kernels  # noqa: F401  (registration side effect)
    return dict(_REGISTRY)
