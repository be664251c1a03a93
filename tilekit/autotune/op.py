"""Ops: each kernel family declared once, and the one launch path every public op function shares.

An `Op` declares what a problem is (key fields and their buckets), which configs may run it (search
space, heuristic default), which arrays its kernels take (`arrays`, `scratch`), and how each
launch's grid and arguments follow from (problem, config). From that one declaration come:

* the launch path: `op(arrays, flags, scalars)` looks up a launch plan keyed by what validation
  depends on (dtype, shape, strides and device of every array, the flags). A hit goes straight to
  `ct.launch` with the prebuilt grid and constants. A miss validates (the op's `bind`), resolves the
  config (user db -> shipped db: exact key, nearest bucket, nearest shape -> default, steered by
  TILEKIT_AUTOTUNE) and builds the plan;
* the tuner's benchmark case and the ahead-of-time compile signatures, from the declared arrays;
* the workload: under `recording()` every call records its problem, and calls with MetaArrays
  (a dry run of a model's step code) record without launching.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cuda.tile import launch as ct_launch

from tilekit.autotune import arrays as arr
from tilekit.autotune import store
from tilekit.autotune.db import Match, warn_once
from tilekit.autotune.digest import code_digest
from tilekit.autotune.entries import entry_reason
from tilekit.autotune.keys import bucket_problem, key_string
from tilekit.autotune.registry import register
from tilekit.autotune.space import Config, Problem, SearchSpace, split_hints
from tilekit.device import DeviceInfo, device_info, toolchain
from tilekit.env import autotune_mode, dependent_launch

# Kernels launch with programmatic dependent launch (each starts while the previous one finishes; see
# tilekit.kernels.tiles) unless TILEKIT_DEPENDENT_LAUNCH=0.
DEPENDENT_LAUNCH = dependent_launch()

MAX_SIZE_FIELD = 1 << 31    # a problem's size field (kernels index in int32), from the command line or a database key
STALE_KERNEL = "stale: tuned for another version of the kernel source or its launch"    # why_unusable's reasons
STALE_SPACE = "stale: tuned over another search space"


@dataclass(frozen=True)
class Resolution:
    """The config chosen for a problem and where it came from."""

    config: Config
    source: str               # "user", "shipped", "tuned", "default" or "pinned"
    match: Match | None = None

    def describe(self) -> str:
        return self.match.describe() if self.match else {
            "default": "heuristic default", "tuned": "tuned just now (auto mode)",
            "pinned": "pinned config"}[self.source]


@dataclass(frozen=True)
class Launch:
    """One kernel launch of an op. `args` names its runtime arguments (declared arrays, scratch and
    scalars) in the kernel's order; `constants(problem, config)` gives the compile-time arguments
    that follow them. The config's hints (occupancy, num_ctas) apply to the `hinted` launch, the
    one the tuner measures. `dependent`: launched with programmatic dependent launch (when
    DEPENDENT_LAUNCH is on), or a function of (problem, config) saying when; a launch without it
    waits for the kernel before it as usual."""

    kernel: Any
    grid: Callable[[Problem, Config], tuple]
    args: tuple[str, ...]
    constants: Callable[[Problem, Config], tuple]
    hinted: bool = True
    dependent: bool | Callable[[Problem, Config], bool] = True


@dataclass(frozen=True)
class Binding:
    """What an op's validation makes of one call: the problem, and where each kernel array comes from.

    arrays: kernel array name -> (index of the call's array, shape to view it as, or None).
    output: (index, allocator) of the array allocated when the caller passes None there.
    returns: index of the call's array the op returns (None: returns nothing).
    scalars: kernel scalar name -> (index into the call's scalars, value used when that is None).
    fixed: kernel array name -> an array made for this signature (e.g. default positions).
    """

    problem: dict
    arrays: Mapping[str, tuple[int, tuple | None]]
    output: tuple[int, Callable] | None = None
    returns: int | None = None
    scalars: Mapping[str, tuple[int, Any]] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchCase:
    """One problem instantiated on the GPU for timing: fresh random inputs and a launch recipe."""

    grid: Callable[[Config], tuple]
    args: Callable[[Config], tuple]
    launches: Callable[[Config], list] | None = None   # tune_whole ops: [(kernel, grid, args)] of every launch
    outputs: Callable[[Config], dict] | None = None    # config -> {name: array} after one run from the same start


_ARRAY, _VIEW, _FIXED, _WORK, _SCALAR = range(5)
_recording = threading.local()         # .calls: the list of the innermost recording() of this thread
_collecting = threading.local()        # .launches: the list of the innermost collecting_launches() of this thread


@contextlib.contextmanager
def recording():
    """Collect (op, problem) of every op call this thread makes in the block (calls with MetaArrays
    launch nothing)."""
    calls: list[tuple[Op, dict]] = []
    outer, _recording.calls = getattr(_recording, "calls", None), calls
    try:
        yield calls
    finally:
        _recording.calls = outer


@contextlib.contextmanager
def collecting_launches():
    """Plans called by this thread in the block launch nothing: each launch is collected instead, as (op, config,
    kernel, arguments), for tilekit.autotune.compile.precompile_launches (a start-up compiles all its kernels in
    parallel, then runs them)."""
    launches: list[tuple] = []
    outer, _collecting.launches = getattr(_collecting, "launches", None), launches
    try:
        yield launches
    finally:
        _collecting.launches = outer


class _Tuning:
    """Auto-mode tuning of one key at a time per process: the first caller tunes, later callers wait
    for it (no op lock is held, so nothing else waits), and a key whose tuning failed is not retried."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: dict[str, threading.Event] = {}
        self.failed: set[str] = set()

    def tune(self, op: "Op", problem: Problem, key: str, device: DeviceInfo) -> Config | None:
        """The tuned config, or None when tuning failed (now or before in this process)."""
        with self.lock:
            if key in self.failed:
                return None
            done = self.running.get(key)
            mine = done is None
            if mine:
                done = self.running[key] = threading.Event()
        if not mine:
            done.wait()
            return None if key in self.failed else _stored_config(op, problem, device)
        from tilekit.autotune.tuner import tune
        try:
            # another thread may have stored it between this caller's miss and now (its tuning has ended)
            return _stored_config(op, problem, device) or tune(op, problem).config
        except Exception:
            self.failed.add(key)
            raise
        finally:
            with self.lock:
                del self.running[key]
            done.set()


_tuning = _Tuning()


def _stored_config(op: "Op", problem: Problem, device: DeviceInfo) -> Config | None:
    """The config another thread's tuning just stored for `problem` on `device`, if any."""
    found = op.resolve(problem, device, mode="cached")
    return found.config if found.match is not None and found.match.exact else None


class Plan:
    """A validated call signature with its config: the grid, constants and argument sources of each
    launch, the output allocator and the stream getter. Calling it launches."""

    __slots__ = ("op", "problem", "config", "launches", "alloc", "out_index", "returns", "stream", "work")

    def __call__(self, arrays: tuple, scalars: tuple):
        if self.alloc is not None and arrays[self.out_index] is None:
            arrays = (*arrays[:self.out_index], self.alloc(), *arrays[self.out_index + 1:])
        if self.launches:
            collected = getattr(_collecting, "launches", None)
            handle = self.stream()
            work = arr.scratch(self.work, handle) if self.work is not None else ()
            for kernel, grid, sources, constants, dependent in self.launches:
                args = []
                for kind, a, b in sources:
                    if kind == _ARRAY:
                        args.append(arrays[a])
                    elif kind == _VIEW:
                        args.append(arrays[a].reshape(b))
                    elif kind == _FIXED:
                        args.append(a)
                    elif kind == _WORK:
                        args.append(work[a])
                    else:
                        value = scalars[a]
                        args.append(b if value is None else value)
                if collected is not None:
                    collected.append((self.op, self.config, kernel, (*args, *constants)))
                    continue
                ct_launch(handle, grid, kernel, (*args, *constants),
                          programmatic_dependent_launch=DEPENDENT_LAUNCH and dependent)
        return None if self.returns is None else arrays[self.returns]


class Op:
    """One op, declared once.

    args: the public function's array arguments, in call order (names used in error messages).
    key: problem field -> bucket function (None: must match exactly); the tuning database's key.
    extras: launch-only problem fields (not in the key) -> a value for a key problem that lacks them.
    arrays(problem): every array the launches take except scratch -> ArraySpec (role in/out/absent).
    scratch(problem, config): work arrays -> ArraySpec (role scratch or zeros), per stream and thread.
    scalars(problem): a representative value of each runtime scalar (benchmarks, compile signatures).
    optional: the public function's array arguments that may be None (the others must be arrays).
    bind(infos, flags): validates one call (raising errors that name the argument) -> Binding.
    choices: key fields that are not sizes -> the values a problem may give them (a tuple, or a range of ints;
    dtype: the float dtypes unless given); every other key field is a size, a positive int, which an untuned
    problem may borrow a config across (the nearest-shape rule; choices must be equal). cli_defaults: values the
    command line fills in for fields it was not given.
    tune_whole: the tuner times every launch of a config in order (the op's whole cost), not the hinted one
    alone; for ops whose later launches' work depends on the config.
    borrowable(config): whether a config tuned (and checked) for another problem may serve an untuned one, beyond
    the space admitting it (default: every config may).
    """

    def __init__(self, name: str, *, args: tuple[str, ...], optional: tuple[str, ...] = (),
                 key: Mapping[str, Callable | None],
                 space: SearchSpace, default: Callable[[Problem], Config],
                 arrays: Callable[[Problem], dict], launches: tuple[Launch, ...],
                 bind: Callable[[list, tuple], Binding], scratch: Callable | None = None,
                 scalars: Callable[[Problem], dict] | None = None,
                 extras: Mapping[str, Callable[[Problem], Any]] | None = None,
                 choices: Mapping[str, tuple] | None = None, cli_defaults: Mapping | None = None,
                 tune_whole: bool = False, borrowable: Callable[[Config], bool] | None = None):
        self.name, self.args, self.bind = name, tuple(args), bind
        self.required = tuple(a not in optional for a in args)
        self.fields = tuple(key)
        self.buckets = {f: b for f, b in key.items() if b is not None}
        self.extras = dict(extras or {})
        self.space, self.default = space, default
        self.arrays, self.scratch, self.scalars = arrays, scratch, scalars
        self.launches = tuple(launches)
        self.tune_whole, self.borrowable = tune_whole, borrowable
        (self.tuned_launch,) = [launch for launch in self.launches if launch.hinted]
        self.kernel = self.tuned_launch.kernel
        self.field_defaults = dict(cli_defaults or {})
        self.choices = {"dtype": arr.FLOAT_DTYPES, **(choices or {})}
        self.sizes = frozenset(f for f in self.fields if f not in self.choices)   # what a nearest shape may change
        self._plans: dict[tuple, Plan] = {}
        self._generation = 0                  # bumped by forget(): a plan built before it is not kept
        self._hinted: dict[tuple, Any] = {}
        self._pins: list[tuple[Config, dict]] = []
        register(self)

    # -- identity ---------------------------------------------------------------------------------
    def kernel_hash(self) -> str:
        """Digest of what compiles and launches: kernels, their tile helpers and constants, grids,
        constant arguments and array layouts. Comments and docstrings do not count."""
        if not hasattr(self, "_kernel_hash"):
            parts = [f for launch in self.launches for f in (launch.kernel, launch.grid, launch.constants)]
            self._kernel_hash = code_digest(*parts, self.arrays, *([self.scratch] if self.scratch else []))
        return self._kernel_hash

    def space_hash(self) -> str:
        if not hasattr(self, "_space_hash"):
            self._space_hash = self.space.digest()
        return self._space_hash

    def problem_key(self, problem: Problem) -> tuple[dict, str]:
        """(key fields bucketed, the key string)."""
        bucketed = bucket_problem({f: problem[f] for f in self.fields}, self.buckets)
        return bucketed, key_string(self.name, bucketed)

    def problem_errors(self, problem: Problem) -> list[str]:
        """What is wrong with a problem named by hand (the command line) or read from a database key: each key
        field must be one of its choices, or an int in [1, MAX_SIZE_FIELD]."""
        errors = []
        for f in self.fields:
            value, allowed = problem.get(f), self.choices.get(f)
            if isinstance(allowed, range) and (type(value) is not int or value not in allowed):
                errors.append(f"{f} must be an integer from {allowed.start}, got {value!r}")
            elif allowed is not None and not isinstance(allowed, range) and (value not in allowed or type(value) is bool):
                errors.append(f"{f} must be one of {', '.join(map(str, allowed))}, got {value!r}")
            elif allowed is None and (type(value) is not int or not 1 <= value <= MAX_SIZE_FIELD):
                errors.append(f"{f} must be an integer in [1, {MAX_SIZE_FIELD}], got {value!r}")
        return errors

    def tuning_problem(self, problem: Problem) -> dict:
        """What the tuner measures for `problem`: its key fields bucketed, its launch-only fields kept
        (or filled in where it lacks them)."""
        return self.complete({**problem, **self.problem_key(problem)[0]})

    def complete(self, problem: Problem) -> dict:
        """The problem with every launch-only field it lacks filled in."""
        full = dict(problem)
        for name, value_for in self.extras.items():
            if name not in full:
                full[name] = value_for(full)
        return full

    def hinted(self, config: Config):
        """The tuned kernel compiled with `config`'s hints."""
        hints = tuple(sorted(split_hints(config)[1].items()))
        kernel = self._hinted.get(hints)
        if kernel is None:
            kernel = self._hinted[hints] = self.kernel.replace_hints(**dict(hints)) if hints else self.kernel
        return kernel

    # -- the launch path --------------------------------------------------------------------------
    def __call__(self, arrays: tuple, flags: tuple = (), scalars: tuple = ()):
        """Launch on the caller's arrays (None where an optional one is absent); returns the output."""
        plan, arrays = self.plan_for(arrays, flags)
        return plan(arrays, scalars)

    def plan_for(self, arrays: tuple, flags: tuple = ()) -> tuple[Plan, tuple]:
        """The plan a call with these arrays and flags runs (built on first use), and the arrays as
        the plan takes them (anything that is not a CuPy array, torch tensor or MetaArray is viewed
        through CuPy)."""
        try:
            key = (flags, *map(arr.signature, arrays))
        except arr.NotADeviceArray:
            arrays = tuple(None if a is None else arr.as_device_array(a, n) for a, n in zip(arrays, self.args))
            key = (flags, *map(arr.signature, arrays))
        try:
            plan = self._plans.get(key)
        except TypeError:               # an unhashable flag: validation names it
            plan = None
        if plan is None:
            plan = self._new_plan(key, arrays, flags)
        calls = getattr(_recording, "calls", None)
        if calls is not None:
            calls.append((self, plan.problem))
        return plan, arrays

    def _new_plan(self, key: tuple, arrays: tuple, flags: tuple) -> Plan:
        """The slow path: validate, choose the config, build the plan. Holds no op lock (tuning in
        auto mode may take minutes); a plan built across a forget() is used once, not kept."""
        for a, name, required in zip(arrays, self.args, self.required):
            if a is None and required:
                raise TypeError(f"{name} must be a CUDA device array (CuPy array or torch CUDA tensor), got None")
        generation = self._generation
        infos = [None if a is None else arr.info(arr.as_device_array(a, n), n) for a, n in zip(arrays, self.args)]
        binding = self.bind(infos, flags)
        problem = self.complete(binding.problem)
        first = next(i for i in infos if i is not None)
        if first.device < 0:                   # a dry run: MetaArrays on no device
            config = self.default(problem)
        else:
            config = self._choose(problem, first.device).config
        plan = self.plan(problem, config, binding, first.kind, first.device)
        try:
            if generation == self._generation:
                self._plans[key] = plan
        except TypeError as e:
            raise TypeError(f"{self.name}: options must be hashable ({e})") from None
        return plan

    def plan(self, problem: dict, config: Config, binding: Binding, kind: str, device: int) -> Plan:
        plan = Plan()
        plan.op, plan.problem, plan.config = self, problem, dict(config)
        plan.stream = arr.stream_getter(kind, device)
        plan.out_index, plan.alloc = binding.output if binding.output else (None, None)
        plan.returns = binding.returns
        specs = {**self.arrays(problem), **(self.scratch(problem, config) if self.scratch else {})}
        work = [n for n, spec in specs.items() if spec.role in ("scratch", "zeros")]
        plan.work = arr.scratch_slot(self.name, device, tuple(specs[n] for n in work)) if work else None
        plan.launches = []
        if kind == "meta":
            return plan
        grids = [tuple(launch.grid(problem, config)) for launch in self.launches]
        if 0 in grids[self.launches.index(self.tuned_launch)]:   # an empty problem: nothing to launch
            return plan
        for launch, grid in zip(self.launches, grids):
            if 0 in grid:                       # a launch this config does without (decode's merge of one split)
                continue
            sources = []
            for name in launch.args:
                spec = specs.get(name)
                if name in binding.arrays:
                    index, view = binding.arrays[name]
                    sources.append((_ARRAY, index, None) if view is None else (_VIEW, index, view))
                elif name in binding.scalars:
                    sources.append((_SCALAR, *binding.scalars[name]))
                elif name in binding.fixed:
                    sources.append((_FIXED, binding.fixed[name], None))
                elif name in work:
                    sources.append((_WORK, work.index(name), None))
                elif spec is not None and spec.role == "absent":
                    sources.append((_FIXED, arr.placeholder(device, spec.dtype, len(spec.shape)), None))
                else:
                    raise RuntimeError(f"{self.name}: kernel argument {name!r} is not bound")
            kernel = self.hinted(config) if launch.hinted else launch.kernel
            dependent = launch.dependent(problem, config) if callable(launch.dependent) else launch.dependent
            plan.launches.append((kernel, grid, tuple(sources), tuple(launch.constants(problem, config)),
                                  bool(dependent)))
        return plan

    # -- choosing the config ----------------------------------------------------------------------
    def _choose(self, problem: Problem, device_index: int) -> Resolution:
        if self._pins:
            return Resolution(dict(self._pins[-1][0]), "pinned")
        return self.resolve(problem, device_info(device_index))

    def resolve(self, problem: Problem, device: DeviceInfo, mode: str | None = None) -> Resolution:
        """Choose the config for `problem` on `device` (no in-process caching). In auto mode a problem
        without an exact entry is tuned now; if tuning fails, one warning and the best other answer."""
        mode = mode or autotune_mode()
        if mode == "off":
            return Resolution(self.default(self.complete(problem)), "default")
        bucketed, key = self.problem_key(problem)
        tuning = self.tuning_problem(problem)
        found = [m for db in store.layers()
                 if (m := db.lookup(self.name, bucketed, device, self.buckets,
                                    lambda k, e, layer=db.layer: entry_reason(k, e, layer), self.sizes,
                                    lambda config: self.space.admits(config, tuning)
                                    and (self.borrowable is None or self.borrowable(config))))]
        best = min(found, key=lambda m: m.rank(), default=None)   # on a tie, the user layer's
        exact = best is not None and best.device_rule == "exact-gpu" and best.exact
        if mode == "auto" and not exact:
            try:
                config = _tuning.tune(self, problem, key, device)
                if config is not None:
                    return Resolution(config, "tuned")
            except Exception as e:  # noqa: BLE001 - a kernel call never fails because tuning did
                fallback = best.describe() if best else "the heuristic default"
                warn_once(f"tilekit: auto-tuning {key} failed ({type(e).__name__}: {e}); using {fallback}")
        if best is not None:      # the closest match wins; the user layer only breaks ties
            return Resolution(dict(best.entry["config"]), best.layer, best)
        return Resolution(self.default(self.complete(problem)), "default")

    def why_unusable(self, entry: Mapping, layer: str) -> str | None:
        """None when a sound stored entry (entry_defect found nothing, so a config outside the space
        was tuned over another one) may be used by this kernel now, else the reason."""
        if entry["kernel_hash"] != self.kernel_hash():
            return STALE_KERNEL
        if entry["space_hash"] != self.space_hash():
            return STALE_SPACE
        if layer == "user" and entry["toolchain"] != toolchain():
            return f"stale: tuned with {entry['toolchain']}, running {toolchain()}"
        return None

    @contextlib.contextmanager
    def pinned(self, config: Config):
        """Within the block every call of this op runs `config` (testing every config of a space)."""
        if not self.space.contains(config):
            raise ValueError(f"{config} is not in the {self.name} search space")
        self._pins.append((dict(config), self._plans))
        self._plans = {}
        try:
            yield
        finally:
            self._plans = self._pins.pop()[1]

    def forget(self) -> None:
        """Drop in-process plans (after the databases changed)."""
        self._generation += 1
        self._plans = {}
        for _, saved in self._pins:           # what pinned() will restore must forget too
            saved.clear()

    # -- tuning and ahead-of-time compilation ------------------------------------------------------
    def bench_case(self, problem: Problem) -> BenchCase:
        """Fresh random arrays in the declared layout on the current GPU, launching the tuned kernel."""
        import cupy
        p = self.complete(problem)
        device, rng, launch = cupy.cuda.runtime.getDevice(), cupy.random.default_rng(), self.tuned_launch
        used = {n for each in self.launches for n in each.args}
        specs = {n: s for n, s in self.arrays(p).items() if n in used}
        values = {n: arr.bench_array(s, device, rng) for n, s in specs.items()}
        values.update(self.scalars(p) if self.scalars else {})
        work: dict[tuple, object] = {}
        start: dict[str, object] = {}

        def args(c: Config, each: Launch = launch) -> tuple:
            for n, s in (self.scratch(p, c) if self.scratch else {}).items():
                if (n, s) not in work:
                    work[n, s] = arr.bench_array(s, device, rng)
                values[n] = work[n, s]
            return tuple(values[n] for n in each.args) + tuple(each.constants(p, c))

        def launches(c: Config) -> list:
            return [(self.hinted(c) if each.hinted else each.kernel, tuple(each.grid(p, c)), args(c, each))
                    for each in self.launches if 0 not in tuple(each.grid(p, c))]

        def outputs(c: Config) -> dict:
            """Every array of the case after one run of `c` from the contents of the first such run (outputs
            poisoned), for comparing configs: what one writes that another does not shows too."""
            if not start:
                for n, s in specs.items():
                    if s.role == "out":
                        arr.poison(values[n])
                start.update({n: values[n].copy() for n, s in specs.items() if s.role != "absent"})
            for n, a in start.items():
                values[n][...] = a
            stream = cupy.cuda.get_current_stream()
            for kernel, grid, a in launches(c):           # every launch: the ones before the tuned one feed it
                ct_launch(stream, grid, kernel, a)
            return {n: values[n].copy() for n in start}

        return BenchCase(grid=lambda c: tuple(launch.grid(p, c)), args=args,
                         launches=launches if self.tune_whole else None, outputs=outputs)

    def compile_args(self, problem: Problem, config: Config) -> list[tuple[Any, tuple]]:
        """(kernel, arguments with ArraySpecs for arrays) of every launch, for export_kernel."""
        p = self.complete(problem)
        values = {**self.arrays(p), **(self.scratch(p, config) if self.scratch else {}),
                  **(self.scalars(p) if self.scalars else {})}
        return [(self.hinted(config) if launch.hinted else launch.kernel,
                 tuple(values[n] for n in launch.args) + tuple(launch.constants(p, config)))
                for launch in self.launches]

