"""Which configs of an op the compiler builds wrong: every config of the op's whole grid (its space's constraint
left out, one config per distinct set of launches), run on the tuner's bench case against the op's default config
(the tuner's agreement check, several runs each), for each problem named. How docs/results/wrong-configs.txt was
measured; run it after a kernel change that may take a config class in or out of the space.

    python -m benchmarks.studies.wrong_configs --kernel decode_attention \
        --shape B=1,H=32,Hkv=8,nq=1,capacity=2048,D=128,new_kv=1,fp8=0 [--shape ...] [--dtype bfloat16] [--runs 4]
"""

from __future__ import annotations

import argparse
import json
import sys


def distinct_configs(op, problem: dict) -> list[dict]:
    """One config of op's whole grid per distinct (kernel constants, grid, hints) of its launches, in grid order;
    configs whose launches cannot be formed for the problem are left out."""
    from tilekit.autotune.space import split_hints
    seen, kept = set(), []
    for config in op.space:
        try:
            key = (tuple((tuple(launch.constants(problem, config)), tuple(launch.grid(problem, config)))
                         for launch in op.launches), tuple(sorted(split_hints(config)[1].items())))
        except (ValueError, ZeroDivisionError, KeyError):
            continue
        if key not in seen:
            seen.add(key)
            kept.append(config)
    return kept


def scan(op, problem: dict, runs: int) -> tuple[list, list, list]:
    """(configs that agree, [(config, reason)] that do not, [(config, error)] that do not compile) on one problem."""
    from tilekit.autotune.compile import precompile
    from tilekit.autotune.tuner import agreeing
    from tilekit.device import device_info
    p = op.tuning_problem(problem)
    default = op.default(p)
    configs = distinct_configs(op, p)
    if default not in configs:
        configs.insert(0, default)
    ok, errors = precompile([(op, p, c) for c in configs], device_info().arch)
    failed = [(configs[i], why) for i, why in sorted(errors.items())]
    compiled = [c for i, c in enumerate(configs) if i in ok]
    kept, wrong = agreeing(op.bench_case(p), compiled, default, runs=runs)
    return kept, [(c, why) for c, _, why in wrong], failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.wrong_configs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--shape", action="append", required=True, help="problem fields, as for tilekit tune")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--out", help="folder for wrong-configs.json")
    args = parser.parse_args(argv)
    import tilekit.kernels  # noqa: F401  (declares the ops)
    from tilekit.autotune.registry import registered_ops
    from tilekit.cli.common import UsageError, _parse_shape
    ops = registered_ops()
    if args.kernel not in ops:
        parser.error(f"--kernel must be one of {', '.join(sorted(ops))}, got {args.kernel!r}")
    op = ops[args.kernel]
    try:
        problems = [_parse_shape(op, shape, args.dtype) for shape in args.shape]
    except UsageError as e:
        parser.error(str(e))
    report = []
    for problem in problems:
        kept, wrong, failed = scan(op, problem, args.runs)
        in_space = sum(op.space.admits(c, op.tuning_problem(problem)) for c, _ in wrong)
        shape = ",".join(f"{k}={v}" for k, v in problem.items())
        print(f"{args.kernel} {shape}: {len(kept)} agree, {len(wrong)} wrong ({in_space} of them in the space), "
              f"{len(failed)} do not compile", flush=True)
        for config, why in wrong:
            mark = "IN SPACE" if op.space.admits(config, op.tuning_problem(problem)) else "outside"
            print(f"    wrong {mark:8} {config}: {why}", flush=True)
        report.append(dict(problem=problem, agree=kept, wrong=[dict(config=c, why=w) for c, w in wrong],
                           failed=[dict(config=c, error=e) for c, e in failed]))
    if args.out:
        from pathlib import Path
        Path(args.out, "wrong-configs.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
