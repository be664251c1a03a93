"""Where a decode step's time goes: every kernel of one graph-replayed greedy decode step, with its
GPU time (CUPTI, through torch.profiler), the bytes it must move and its share of the measured copy
bandwidth.

    python -m benchmarks.breakdown --model gpt2-xl --batch 1 [--out DIR]

The kernels come from the profiler in launch order; the problem each one ran comes from recording
the same step's op calls (tilekit.autotune.op.recording), so every row names its op and shape.
Under programmatic dependent launch a kernel starts before the previous one ends and its span
includes the wait, so kernel times come from a step captured without it. What each op adds to the
step is its critical path: the sum over its kernels of (its end - the previous kernel's end), given
for the step without and with dependent launch, whose step times are both reported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

PROMPT, NEW_TOKENS = 128, 128


def min_bytes(op_name: str, p: dict, context: int) -> float:
    """The fewest DRAM bytes one call must move: each input read once, each output written once."""
    item = {"float32": 4}.get(p["dtype"], 2)
    if op_name == "linear":
        return item * (p["M"] * p["K"] + p["K"] * p["N"] + p["bias"] * p["N"] + (1 + p["res"]) * p["M"] * p["N"])
    if op_name == "residual_linear":            # the fixed-point residual read and written, 8 bytes each
        return item * (p["M"] * p["K"] + p["K"] * p["N"] + p["bias"] * p["N"]) + 16 * p["M"] * p["N"]
    if op_name == "swiglu_linear":
        return item * (p["M"] * p["K"] + 2 * p["K"] * p["N"] + p["M"] * p["N"])
    if op_name == "layer_norm":                 # a fixed-point input row is 8 bytes per element
        return (8 if p.get("fixed") else item) * p["M"] * p["N"] + item * (p["M"] * p["N"] + 2 * p["N"])
    if op_name == "rms_norm":
        return item * ((2 + 2 * p["res"]) * p["M"] * p["N"] + p["N"])
    if op_name == "rope":                       # the rotated heads read and written, a table row per token
        return item * 2 * p["B"] * p["H"] * p["T"] * p["D"] + 4 * p["B"] * p["T"] * p["D"]
    if op_name == "embedding":
        return (item * (2 if p["P"] else 1) + (8 if p.get("fixed") else item)) * p["M"] * p["C"]
    if op_name == "kv_write":
        return item * 4 * p["B"] * p["H"] * p["T"] * p["D"]
    if op_name == "decode_attention":           # the context's keys and values once, and the new ones written
        return item * 2 * p["B"] * p["Hkv"] * (context + p["new_kv"] * p["nq"]) * p["D"]
    if op_name == "greedy":
        return item * p["B"] * p["V"]
    return float("nan")


def kernel_rows(calls: list, kernels: list, context: int, bandwidth_gbs: float, config_of=None) -> list[dict]:
    """One row per kernel: calls (op, problem) expand to their launches, zipped with the profiled
    kernels (name, microseconds, end time in microseconds) in launch order; an op's bytes go to its
    first (tuned) kernel; path_us is the kernel's end minus the previous kernel's end. A launch whose
    grid is empty under config_of(op, problem) (default: the op's default config) did not run."""
    config_of = config_of or (lambda op, p: op.default(p))
    matched = [(op, p, i) for op, p in calls for i, launch in enumerate(op.launches)
               if 0 not in launch.grid(p, config_of(op, p))]
    if len(matched) != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernels profiled, {len(matched)} launches recorded")
    rows = []
    for j, ((op, p, i), (name, us, end)) in enumerate(zip(matched, kernels)):
        launch = op.launches[i]
        if launch.kernel._pyfunc.__name__ not in name:
            raise RuntimeError(f"kernel {name!r} profiled where {launch.kernel._pyfunc.__name__} was launched")
        nbytes = min_bytes(op.name, p, context) if launch.hinted else 0.0
        rows.append({"op": op.name, "kernel": launch.kernel._pyfunc.__name__, "key": op.problem_key(p)[1],
                     "us": us, "bytes": nbytes, "path_us": end - kernels[j - 1][2] if j else us,
                     "pct_bandwidth": 100.0 * nbytes / (us * 1e-6) / (bandwidth_gbs * 1e9) if nbytes else None})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per op: kernels, total and mean microseconds, share of the step, bytes, % of bandwidth."""
    total = sum(r["us"] for r in rows)
    groups = defaultdict(list)
    for r in rows:
        groups[r["op"]].append(r)
    out = []
    for op, rs in sorted(groups.items(), key=lambda kv: -sum(r["us"] for r in kv[1])):
        us, nbytes = sum(r["us"] for r in rs), sum(r["bytes"] for r in rs)
        out.append({"op": op, "kernels": len(rs), "us": us, "mean_us": us / len(rs),
                    "share": us / total, "bytes": nbytes, "path_us": sum(r["path_us"] for r in rs)})
    return out


def format_table(summary: list[dict], bandwidth_gbs: float, step_ms: float, sequential_ms: float) -> str:
    lines = [f"{'op':<18}{'kernels':>8}{'total us':>10}{'mean us':>9}{'share':>7}{'MB':>8}{'% of BW':>9}"
             f"{'path us':>9}{'path dep':>9}"]
    for s in summary:
        pct = 100.0 * s["bytes"] / (s["us"] * 1e-6) / (bandwidth_gbs * 1e9) if s["bytes"] else 0.0
        dependent = f"{s['path_us_dependent']:>9.1f}" if s.get("path_us_dependent") is not None else f"{'-':>9}"
        lines.append(f"{s['op']:<18}{s['kernels']:>8}{s['us']:>10.1f}{s['mean_us']:>9.2f}{100 * s['share']:>6.0f}%"
                     f"{s['bytes'] / 1e6:>8.1f}{pct:>8.0f}%{s['path_us']:>9.1f}" + dependent)
    kernel_us = sum(s["us"] for s in summary)
    lines.append(f"kernels {kernel_us / 1e3:.3f} ms of a {sequential_ms:.3f} ms step without dependent launch; "
                 f"{step_ms:.3f} ms with it (replayed graphs, wall); copy bandwidth {bandwidth_gbs:.0f} GB/s")
    return "\n".join(lines)


def replay_ms(gen, reps: int = 20) -> float:
    """Mean wall time of one replay of gen's decode graph."""
    import cupy
    stream = gen.stream
    gen.decode_graph.launch(stream)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        gen.decode_graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def profile_step(gen, bandwidth_gbs: float, reps: int = 5, step_reps: int = 200) -> dict:
    """Profile `reps` replays of gen's decode graph; return rows of the median replay, and the step time as the
    mean of `step_reps` more (on the H100, 5 replays read 1.5-3.4% above 200 replays
    in another process of the same tree; repeated means of 100 agreed within 0.2%)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tilekit.autotune.op import recording
    from tilekit.device import device_info
    state, stream = gen.state, gen.stream
    with stream, recording() as calls:           # the problems of one step, launched eagerly
        state.step(gen.greedy, gen.eos)
    context = int(state.positions.get().max()) + 1
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            gen.decode_graph.launch(stream)
        stream.synchronize()
    step_ms = replay_ms(gen, step_reps)
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per_step = len(events) // reps
    replays = [[(e.name, e.time_range.end - e.time_range.start, e.time_range.end)
                for e in events[i * per_step:(i + 1) * per_step]] for i in range(reps)]
    median = sorted(replays, key=lambda r: r[-1][2] - r[0][2] + r[0][1])[reps // 2]
    device = device_info()
    rows = kernel_rows(calls, median, context, bandwidth_gbs, lambda op, p: op.resolve(p, device).config)
    return {"step_ms": step_ms, "context": context, "kernels": rows, "summary": summarize(rows)}


def _decode_generation(model, batch: int):
    """Greedy-generate PROMPT + NEW_TOKENS once (graphs captured); the model's generation state."""
    import numpy as np
    model.forget_graphs()
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, PROMPT))
    model.generate(prompt, NEW_TOKENS, temperature=0)
    (gen,) = model._generations.values()
    return gen


def decode_model(preset: str):
    """tilekit's bf16 GPT or Llama of a preset, random weights from seed 0."""
    from benchmarks.model import model_config
    from benchmarks.report import is_llama
    from tilekit.models import GPT, Llama
    config = model_config(preset)
    return (Llama if is_llama(config) else GPT)(config, dtype="bfloat16", seed=0)


def run(preset: str, batch: int, bandwidth_gbs: float, log=print) -> dict:
    """The decode step profiled as it runs (dependent launch), then captured and profiled without it."""
    from tilekit.autotune import op
    model = decode_model(preset)
    dependent = profile_step(_decode_generation(model, batch), bandwidth_gbs) if op.DEPENDENT_LAUNCH else None
    saved, op.DEPENDENT_LAUNCH = op.DEPENDENT_LAUNCH, False
    try:
        result = profile_step(_decode_generation(model, batch), bandwidth_gbs)
    finally:
        op.DEPENDENT_LAUNCH = saved
    result["step_ms_sequential"] = result["step_ms"]
    if dependent is not None:
        result["step_ms"] = dependent["step_ms"]
        paths = {s["op"]: s["path_us"] for s in dependent["summary"]}
        for s in result["summary"]:
            s["path_us_dependent"] = paths[s["op"]]
    result.update(preset=preset, batch=batch, bandwidth_gbs=bandwidth_gbs, dependent_launch=dependent is not None)
    log(f"[breakdown {preset} B{batch}]\n" + format_table(result["summary"], bandwidth_gbs, result["step_ms"],
                                                          result["step_ms_sequential"]))
    return result


def model_batch_args(module: str, doc: str, argv: list[str] | None) -> argparse.Namespace:
    """--model (repeatable), --batch (repeatable) and --out of a decode benchmark module."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc.splitlines()[0])
    ap.add_argument("--model", action="append", help="model preset (repeatable; default gpt2 and gpt2-xl)")
    ap.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1 and 8)")
    ap.add_argument("--out", type=Path, help=f"write {module}.json here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = model_batch_args("breakdown", __doc__, argv)
    import traceback

    from benchmarks.timing import copy_bandwidth
    bandwidth = copy_bandwidth()["gbs"]
    results, failed = [], 0
    for preset in args.model or ["gpt2", "gpt2-xl"]:
        for batch in args.batch or [1, 8]:
            try:
                results.append(run(preset, batch, bandwidth))
            except Exception:  # noqa: BLE001 - the other models still run
                failed += 1
                traceback.print_exc()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "breakdown.json").write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed or not all(math.isfinite(r["step_ms"]) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
