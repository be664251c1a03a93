"""Where a decode step's or a prefill's time goes: every kernel of one graph-replayed greedy decode
step, with its GPU time (CUPTI, through torch.profiler), the bytes it must move and its share of the
measured copy bandwidth; or, with --prefill T, every kernel of one full-logits forward() of batch x T
tokens, grouped by problem, with its matrix FLOPs and share of the measured dense bf16 peak.

    python -m benchmarks.studies.breakdown --model gpt2-xl --batch 1 [--out DIR]
    python -m benchmarks.studies.breakdown --model gpt2-xl --batch 8 --prefill 1024 [--out DIR]

The kernels come from the profiler in launch order; the problem each one ran comes from recording
the same step's op calls (tilekit.autotune.op.recording), so every row names its op and shape.
Under programmatic dependent launch a kernel starts before the previous one ends and its span
includes the wait, so kernel times come from a step captured without it. What each op adds to the
step is its critical path: the sum over its kernels of (its end - the previous kernel's end), given
for the step without and with dependent launch, whose step times are both reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

PROMPT, NEW_TOKENS = 128, 128


def min_bytes(op_name: str, p: dict, context: int) -> float:
    """The fewest DRAM bytes one call must move: each input read once, each output written once."""
    item = {"float32": 4}.get(p.get("dtype"), 2)     # ops without a dtype key (MoE routing) count 2 bytes
    if op_name == "linear":
        return item * (p["M"] * p["K"] + p["K"] * p["N"] + p["bias"] * p["N"] + (1 + p["res"]) * p["M"] * p["N"])
    if op_name == "residual_linear":            # the fixed-point residual read and written, 8 bytes each
        return item * (p["M"] * p["K"] + p["K"] * p["N"] + p["bias"] * p["N"]) + 16 * p["M"] * p["N"]
    if op_name == "swiglu_linear":
        return item * (p["M"] * p["K"] + 2 * p["K"] * p["N"] + p["M"] * p["N"])
    if op_name == "layer_norm":                 # a fixed-point input row is 8 bytes per element
        return (8 if p.get("fixed") else item) * p["M"] * p["N"] + item * (p["M"] * p["N"] + 2 * p["N"])
    if op_name == "rms_norm":                   # a fixed-point input row is 8 bytes per element
        return ((8 if p.get("fixed") else item) + item * (1 + 2 * p["res"])) * p["M"] * p["N"] + item * p["N"]
    if op_name == "apply_rope":                       # the rotated heads read and written, a table row per token
        return item * 2 * p["B"] * p["H"] * p["T"] * p["D"] + 4 * p["B"] * p["T"] * p["D"]
    if op_name == "embedding":
        return (item * (2 if p["P"] else 1) + (8 if p.get("fixed") else item)) * p["M"] * p["C"]
    if op_name == "write_kv":                   # an FP8 cache: a byte a code
        return (item + (1 if p["fp8"] else item)) * 2 * p["B"] * p["H"] * p["T"] * p["D"]
    if op_name == "decode_attention":           # the context's keys and values once, and the new ones written
        return (1 if p["fp8"] else item) * 2 * p["B"] * p["Hkv"] * (context + p["new_kv"] * p["nq"]) * p["D"]
    if op_name == "next_token":                 # the logits read, and with penalties both token counts
        return (item + 8 * p["pen"]) * p["B"] * p["V"]
    if op_name == "quant_linear":               # 8-bit weights and their fp32 scales; FP8 activations a byte each
        halves, M, N, K = 2 if p["act"] == "swiglu" else 1, p["M"], p["N"], p["K"]
        scales = N if p["scale"] == "channel" else math.ceil(N / 128) * math.ceil(K / 128)
        return ((1 if p["xq"] == "fp8" else item) * M * K + halves * (N * K + 4 * scales)
                + item * (p["bias"] * N + (1 + p["res"]) * M * N))
    if op_name in ("moe_gate_up", "moe_down_combine"):
        # the weights of the fewest experts a call can touch: each token's `slots` (all of them at one token;
        # tokens sharing experts at more), the token rows in and out; the combine adds into the int64 residual
        experts, M, I, C = min(p["E"], p["slots"]), p["M"], p["I"], p["C"]
        if op_name == "moe_gate_up":
            return item * (experts * 2 * I * C + M * C + M * p["slots"] * I)
        return item * (experts * C * I + M * p["slots"] * I) + 4 * M * p["slots"] + 16 * M * C
    if op_name == "moe_router":                 # the gate and the rows read, ids and weights written
        return item * (p["E"] + p["M"]) * p["C"] + 8 * p["M"] * (p["K"] + p["shared"])
    if op_name == "moe_permute":                # the ids read, offsets and the sorted pairs written
        return 8 * p["P"] + 4 * (p["E"] + 1)
    if op_name == "mla_decode_attention":      # the latent cache once, the queries, the latent outputs, new entries
        B, H, nq, R, P = p["B"], p["H"], p["nq"], p["R"], p["P"]
        return item * (B * (context + p["new_kv"] * nq) * (R + P) + B * H * nq * (2 * R + P))
    if op_name == "head_linear":                # every head's weights, its rows in and out
        return item * p["H"] * (p["K"] * p["N"] + p["M"] * (p["K"] + p["N"]))
    if op_name == "fixed_cast":                 # int64 in, the dtype out
        return (8 + item) * p["M"] * p["N"]
    if op_name == "quantize_fp8":               # x read, its FP8 bits and fp32 scales written
        return (item + 1) * p["M"] * p["K"] + 4 * p["M"] * (math.ceil(p["K"] / 128) if p["group"] else 1)
    return float("nan")


def min_flops(op_name: str, p: dict) -> float:
    """Matrix-multiply FLOPs of one call (2 per multiply-add); causal attention counts the visible half,
    as benchmarks.harness.report.prefill_flops does."""
    if op_name in ("linear", "residual_linear"):
        return 2.0 * p["M"] * p["N"] * p["K"]
    if op_name == "quant_linear":
        return (4.0 if p["act"] == "swiglu" else 2.0) * p["M"] * p["N"] * p["K"]
    if op_name == "swiglu_linear":
        return 4.0 * p["M"] * p["N"] * p["K"]
    if op_name == "attention":
        return 4.0 * p["B"] * p["H"] * p["Tq"] * p["Tk"] * p["D"] / (2 if p["causal"] else 1)
    return 0.0


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
                     "us": us, "bytes": nbytes, "flops": min_flops(op.name, p) if launch.hinted else 0.0,
                     "path_us": end - kernels[j - 1][2] if j else us,
                     "pct_bandwidth": 100.0 * nbytes / (us * 1e-6) / (bandwidth_gbs * 1e9) if nbytes else None})
    return rows


def summarize(rows: list[dict], by: str = "op") -> list[dict]:
    """Per op (by="op") or per problem key (by="key"): kernels, total and mean microseconds, share of
    the step, bytes, FLOPs, critical path."""
    total = sum(r["us"] for r in rows)
    groups = defaultdict(list)
    for r in rows:
        groups[r[by]].append(r)
    out = []
    for name, rs in sorted(groups.items(), key=lambda kv: -sum(r["us"] for r in kv[1])):
        us, nbytes = sum(r["us"] for r in rs), sum(r["bytes"] for r in rs)
        out.append({"op": name, "kernels": len(rs), "us": us, "mean_us": us / len(rs),
                    "share": us / total, "bytes": nbytes, "flops": sum(r["flops"] for r in rs),
                    "path_us": sum(r["path_us"] for r in rs)})
    return out


def format_table(summary: list[dict], bandwidth_gbs: float, step_ms: float, sequential_ms: float,
                 by: str = "op") -> str:
    """The summary's rows (by op, or by="key": by problem, keys shortened) and the step's totals."""
    width = 18 if by == "op" else 62
    lines = [f"{'op' if by == 'op' else 'problem':<{width}}{'kernels':>8}{'total us':>10}{'mean us':>9}{'share':>7}"
             f"{'MB':>8}{'% of BW':>9}{'path us':>9}{'path dep':>9}"]
    for s in summary:
        pct = 100.0 * s["bytes"] / (s["us"] * 1e-6) / (bandwidth_gbs * 1e9) if s["bytes"] else 0.0
        dependent = f"{s['path_us_dependent']:>9.1f}" if s.get("path_us_dependent") is not None else f"{'-':>9}"
        name = s["op"] if by == "op" else short_key(s["op"])
        lines.append(f"{name:<{width}}{s['kernels']:>8}{s['us']:>10.1f}{s['mean_us']:>9.2f}{100 * s['share']:>6.0f}%"
                     f"{s['bytes'] / 1e6:>8.1f}{pct:>8.0f}%{s['path_us']:>9.1f}" + dependent)
    kernel_us = sum(s["us"] for s in summary)
    lines.append(f"kernels {kernel_us / 1e3:.3f} ms of a {sequential_ms:.3f} ms step without dependent launch; "
                 f"{step_ms:.3f} ms with it (replayed graphs, wall); copy bandwidth {bandwidth_gbs:.0f} GB/s")
    return "\n".join(lines)


def graph_ms(graph, stream, reps: int) -> float:
    """Mean wall time of one replay of a captured graph on `stream` (after one unmeasured replay)."""
    import cupy
    graph.launch(stream)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        graph.launch(stream)
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def replay_ms(gen, reps: int = 20) -> float:
    """Mean wall time of one replay of gen's decode graph."""
    return graph_ms(gen.decode_graph, gen.stream, reps)


def kernel_events(prof) -> list:
    """The GPU kernels a torch profiler recorded (no copies or fills), in start order."""
    import torch
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset", "[memory]"))), key=lambda e: e.time_range.start)


def interleaved_replays(gens: dict, rounds: int, reps: int) -> dict[str, list[float]]:
    """Name -> replay_ms of each generation's decode graph in each of `rounds` rounds, the generations taking
    turns within a round, so that drifts of clock or temperature hit every one of them."""
    times = {name: [] for name in gens}
    for _ in range(rounds):
        for name, gen in gens.items():
            times[name].append(replay_ms(gen, reps))
    return times


def profile_step(gen, bandwidth_gbs: float, reps: int = 5, step_reps: int = 200) -> dict:
    """Profile `reps` replays of gen's decode graph; return rows of the median replay, and the step time as the
    mean of `step_reps` more (on the H100, 5 replays read 1.5-3.4% above 200 replays
    in another process of the same tree; repeated means of 100 agreed within 0.2%)."""
    from torch.profiler import ProfilerActivity, profile

    from tilekit.autotune.op import recording
    state, stream = gen.state, gen.stream
    with stream, recording() as calls:           # the problems of one step, launched eagerly
        state.step()
    context = int(state.positions.get().max()) + 1
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            gen.decode_graph.launch(stream)
        stream.synchronize()
    step_ms = replay_ms(gen, step_reps)
    rows = median_run_rows(prof, reps, calls, context, bandwidth_gbs)
    return {"step_ms": step_ms, "context": context, "kernels": rows, "summary": summarize(rows)}


def median_run_rows(prof, reps: int, calls: list, context: int, bandwidth_gbs: float) -> list[dict]:
    """kernel_rows of the median of the `reps` equal runs a torch profiler recorded (kernels only, no
    copies or fills), with the configs this GPU's databases give the calls."""
    from tilekit.device import device_info
    events = kernel_events(prof)
    per_run = len(events) // reps
    runs = [[(e.name, e.time_range.end - e.time_range.start, e.time_range.end)
             for e in events[i * per_run:(i + 1) * per_run]] for i in range(reps)]
    median = sorted(runs, key=lambda r: r[-1][2] - r[0][2] + r[0][1])[reps // 2]
    device = device_info()
    return kernel_rows(calls, median, context, bandwidth_gbs, lambda op, p: op.resolve(p, device).config)


@contextlib.contextmanager
def ordinary_launch():
    """Every kernel launched in the block waits for the one before it (programmatic dependent launch off)."""
    from tilekit.autotune import op
    saved, op.DEPENDENT_LAUNCH = op.DEPENDENT_LAUNCH, False
    try:
        yield
    finally:
        op.DEPENDENT_LAUNCH = saved


def _decode_generation(model, batch: int):
    """Greedy-generate PROMPT + NEW_TOKENS once (graphs captured); the model's generation state."""
    import numpy as np
    model.forget_graphs()
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, PROMPT))
    model.generate(prompt, NEW_TOKENS, temperature=0, eos_token_id=[])
    (gen,) = model.runner._generations.values()
    return gen


def decode_model(preset: str, dtype: str = "bfloat16", quantize=None):
    """tilekit's model of a preset (of any family) in `dtype`, random weights from seed 0 (`quantize`: its linears
    quantized per channel to "int8" or "fp8", or a quantization.Scheme)."""
    from tilekit.models.families import family_of_config, preset_config
    config = preset_config(preset)
    options = {} if quantize is None else {"quantize": quantize}
    return family_of_config(config).model_class(config, dtype=dtype, seed=0, **options)


def run(preset: str, batch: int, bandwidth_gbs: float, log=print, dtype: str = "bfloat16",
        quantize: str | None = None, by_problem: bool = False) -> dict:
    """The decode step profiled as it runs (dependent launch), then captured and profiled without it; by_problem:
    a second table per problem key (which shape of an op falls short)."""
    from tilekit.autotune import op
    model = decode_model(preset, dtype, quantize)
    dependent = profile_step(_decode_generation(model, batch), bandwidth_gbs) if op.DEPENDENT_LAUNCH else None
    with ordinary_launch():
        result = profile_step(_decode_generation(model, batch), bandwidth_gbs)
    result["step_ms_sequential"] = result["step_ms"]
    if dependent is not None:
        result["step_ms"] = dependent["step_ms"]
        paths = {s["op"]: s["path_us"] for s in dependent["summary"]}
        for s in result["summary"]:
            s["path_us_dependent"] = paths[s["op"]]
    result.update(preset=preset, batch=batch, bandwidth_gbs=bandwidth_gbs, dependent_launch=dependent is not None,
                  quantize=quantize)
    log(f"[breakdown {preset} {quantize or dtype} B{batch}]\n" + format_table(result["summary"], bandwidth_gbs, result["step_ms"],
                                                          result["step_ms_sequential"]))
    if by_problem:
        log(format_table(summarize(result["kernels"], by="key"), bandwidth_gbs, result["step_ms"],
                         result["step_ms_sequential"], by="key"))
    return result


def short_key(key: str) -> str:
    """A problem key without its dtype and its zero or 'none' fields: 'linear M=8192,N=6400,K=1600,act=gelu,bias=1'."""
    op, _, fields = key.partition("/")
    kept = [f for f in fields.split(",") if not f.startswith("dtype=") and f.split("=")[-1] not in ("0", "none")]
    return f"{op} {','.join(kept)}"


def format_prefill_table(summary: list[dict], peak_tflops: float, bandwidth_gbs: float, forward_ms: dict) -> str:
    """Per problem: kernels, total and mean us, share, TFLOP/s and % of the dense peak (matrix work) or
    % of copy bandwidth (the rest); then the forward's wall times against the kernels' sum."""
    lines = [f"{'problem':<62}{'kernels':>8}{'total ms':>10}{'mean us':>9}{'share':>7}{'TFLOP/s':>9}{'% peak':>8}"
             f"{'% of BW':>9}"]
    for s in summary:
        secs = s["us"] * 1e-6
        rate = f"{s['flops'] / secs / 1e12:>9.0f}{100 * s['flops'] / secs / 1e12 / peak_tflops:>7.0f}%" \
            if s["flops"] else f"{'-':>9}{'-':>8}"
        bw = f"{100 * s['bytes'] / secs / (bandwidth_gbs * 1e9):>8.0f}%" if s["bytes"] and not s["flops"] else f"{'-':>9}"
        lines.append(f"{short_key(s['op']):<62}{s['kernels']:>8}{s['us'] / 1e3:>10.3f}{s['mean_us']:>9.1f}"
                     f"{100 * s['share']:>6.0f}%" + rate + bw)
    kernel_ms = sum(s["us"] for s in summary) / 1e3
    flops = sum(s["flops"] for s in summary)
    lines.append(f"kernels {kernel_ms:.3f} ms ({flops / kernel_ms / 1e9:.0f} TFLOP/s); forward() wall, median: "
                 + ", ".join(f"{name} {ms:.3f} ms" for name, ms in forward_ms.items())
                 + f"; dense peak {peak_tflops:.0f} TFLOP/s, copy bandwidth {bandwidth_gbs:.0f} GB/s")
    return "\n".join(lines)


def profile_forward(model, ids, calls: list, bandwidth_gbs: float, reps: int = 3) -> dict:
    """Profile `reps` graph-replayed forward(ids) calls (blocks as a graph, then the LM head) and
    return the rows of the median one and the forward's median wall time (timing.measure, L2 warm)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.harness.timing import measure
    model.forget_graphs()
    for _ in range(2):                       # capture, then one replay
        model(ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            model(ids)
        torch.cuda.synchronize()
    wall_ms = measure(lambda: model(ids), flush_l2=False, warmup=1, reps=10)["median_ms"]
    rows = median_run_rows(prof, reps, calls, ids.shape[1], bandwidth_gbs)
    return {"wall_ms": wall_ms, "kernels": rows, "summary": summarize(rows, by="key")}


def run_prefill(preset: str, batch: int, seq: int, bandwidth_gbs: float, peak_tflops: float, log=print,
                dtype: str = "bfloat16", quantize: str | None = None) -> dict:
    """forward() on batch x seq random ids, profiled without dependent launch (a kernel's span then is
    its own work); the wall time is also taken with it, when it is on."""
    import numpy as np

    from tilekit.autotune import op
    from tilekit.autotune.op import recording
    model = decode_model(preset, dtype, quantize)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, seq))
    with recording() as calls:               # the problems of one forward, launched eagerly
        model.forward(ids, use_graph=False)
    forward_ms = {}
    if op.DEPENDENT_LAUNCH:
        forward_ms["dependent launch"] = profile_forward(model, ids, calls, bandwidth_gbs)["wall_ms"]
    try:
        with ordinary_launch():
            result = profile_forward(model, ids, calls, bandwidth_gbs)
    finally:
        model.forget_graphs()
    forward_ms["ordinary launch"] = result["wall_ms"]
    result.update(preset=preset, batch=batch, seq=seq, forward_ms=forward_ms, peak_tflops=peak_tflops,
                  bandwidth_gbs=bandwidth_gbs, quantize=quantize)
    log(f"[breakdown prefill {preset} {quantize or dtype} B{batch} T{seq}]\n"
        + format_prefill_table(result["summary"], peak_tflops, bandwidth_gbs, forward_ms))
    return result


def model_batch_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """--model (repeatable), --batch (repeatable) and --out of a decode benchmark module."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc.splitlines()[0])
    ap.add_argument("--model", action="append", help="model preset (repeatable; default gpt2 and gpt2-xl)")
    ap.add_argument("--batch", type=int, action="append", help="batch size (repeatable; default 1 and 8)")
    ap.add_argument("--out", type=Path, help=f"write {module}.json here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = model_batch_parser("breakdown", __doc__)
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--quantize", choices=("int8", "fp8"), help="the model's linears quantized (Llama family)")
    ap.add_argument("--by-problem", action="store_true", help="decode: also a table per problem (kernel shape)")
    ap.add_argument("--prefill", type=int, action="append", metavar="T",
                    help="profile forward() on batch x T tokens instead of a decode step (repeatable)")
    args = ap.parse_args(argv)
    if any(v < 1 for v in args.prefill or ()):
        ap.error(f"--prefill must be at least 1, got {args.prefill}")
    import traceback

    from benchmarks.harness.timing import copy_bandwidth, matmul_peak_tflops
    bandwidth = copy_bandwidth()["gbs"]
    peak = matmul_peak_tflops() if args.prefill else None
    results, failed = [], 0
    for preset in args.model or ["gpt2", "gpt2-xl"]:
        for batch in args.batch or [1, 8]:
            try:
                if args.prefill:
                    results += [run_prefill(preset, batch, seq, bandwidth, peak, dtype=args.dtype,
                                            quantize=args.quantize) for seq in args.prefill]
                else:
                    results.append(run(preset, batch, bandwidth, dtype=args.dtype, quantize=args.quantize,
                                       by_problem=args.by_problem))
            except Exception:  # noqa: BLE001 - the other models still run
                failed += 1
                traceback.print_exc()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "breakdown.json").write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed or not all(math.isfinite(r.get("step_ms", r.get("wall_ms"))) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
