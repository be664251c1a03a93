"""Which value of a search-space axis wins, case by case: the kernel suite's matmul and attention cases
are tuned over their op's whole space (winners go to the user database, so a kernel suite run after
this one measures tuned kernels), and for each named axis the best time the tuner measured with each
of its values is printed side by side (the tuner's timer: L2 flushed, cuTile's exhaustive_search).

    python -m benchmarks.studies.space_ab [--axis attention:LONGEST_FIRST] [--axis linear:PERSISTENT] [--full]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.suites.kernels import Case, describe, plan

DEFAULT_AXES = ("attention:LONGEST_FIRST",)


def op_problem(case: Case) -> tuple[str, dict] | None:
    """(op name, problem) that tilekit's side of a kernel-suite case runs, or None for other kinds."""
    p = case.params
    if case.kind in ("linear", "linear_nk", "epilogue"):
        _, _, M, K, N = p
        fused, nk = case.kind == "epilogue", case.kind == "linear_nk" or p[1] == "lm_head"
        return "linear", dict(dtype="bfloat16", M=M, N=N, K=K, wt="nk" if nk else "kn", bias=int(fused),
                              act="gelu" if fused else "none", res=int(fused), tf32=0)
    if case.kind == "attention":
        B, H, T, D = p
        return "attention", dict(dtype="bfloat16", B=B, H=H, Hkv=H, Tq=T, Tk=T, D=D, causal=1)
    return None


def best_by_value(timings: dict, axis: str) -> dict:
    """{axis value: (best us, its config)} over a tuner's measured configs."""
    best: dict = {}
    for frozen, us in timings.items():
        config = dict(frozen)
        value = config.get(axis)
        if value is not None and (value not in best or us < best[value][0]):
            best[value] = (us, config)
    return best


def parse_axes(values, ops: dict) -> dict:
    """{op name: axis} from 'op:AXIS' strings; ValueError naming --axis for an unknown op or axis (only
    ops the kernel suite runs: linear, attention)."""
    axes = {}
    for value in values:
        name, sep, axis = value.partition(":")
        if not sep or name not in ("linear", "attention"):
            raise ValueError(f"--axis must be linear:AXIS or attention:AXIS, got {value!r}")
        if axis not in ops[name].space.params:
            raise ValueError(f"--axis {value!r}: {name}'s search space has no axis {axis!r} "
                             f"(it has {', '.join(ops[name].space.params)})")
        axes[name] = axis
    return axes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--axis", action="append", help="op:AXIS (default: %s)" % " ".join(DEFAULT_AXES))
    parser.add_argument("--full", action="store_true", help="the full kernel suite's cases")
    args = parser.parse_args(argv)

    import tilekit.kernels  # noqa: F401  (declares the ops)
    from tilekit.autotune.registry import registered_ops
    from tilekit.autotune.tuner import tune_many
    ops = registered_ops()
    try:
        axes = parse_axes(args.axis or DEFAULT_AXES, ops)
    except ValueError as e:
        parser.error(str(e))
    cases = [(c, found) for c in plan("full" if args.full else "quick") if (found := op_problem(c))]
    cases = [(c, (name, p)) for c, (name, p) in cases if name in axes]
    results = tune_many([(ops[name], p) for _, (name, p) in cases],
                        progress=lambda event, **k: print(event, k.get("key", ""), file=sys.stderr)
                        if event in ("measure", "skipped") else None)
    by_key = {r.key: r for r in results}
    print(f"{'case':<38} {'axis':<14} {'best us per value':<34} ratio (best at the first value / best at any "
          "other)  winner")
    for case, (name, p) in cases:
        r = by_key.get(ops[name].problem_key(p)[1])
        if r is None:
            print(f"{describe(case)[0]:<38} not tuned")
            continue
        best = best_by_value(r.timings, axes[name])
        values = "  ".join(f"{v}: {us:8.2f}" for v, (us, _) in sorted(best.items()))
        first, *others = sorted(best)
        ratio = best[first][0] / min(best[v][0] for v in others) if others else float("nan")
        print(f"{describe(case)[0]:<38} {axes[name]:<14} {values:<34} {ratio:5.3f}  {r.config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
