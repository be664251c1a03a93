"""Offline throughput of continuous batching (tilekit.engine.LLMEngine over the paged KV cache) against tilekit's
own static batching (model.generate over batches of requests in arrival order, each batch running to its longest
request), same random weights, same requests, same process, greedy with eos ignored.

    python -m benchmarks.studies.continuous --preset llama-3.2-1b [--requests 256] [--input 256 2048]
        [--output 64 512] [--shared-prefix 1024] [--no-prefix-cache] [--static-batch 64] [--max-running 64]
        [--compile-timeout S] [--compile-log] [--out DIR]
    python -m benchmarks.studies.continuous --input 256 1024 --output 128 128 --transformers

With --transformers, transformers' own continuous batching (generate_batch with paged attention, greedy, eos off)
runs the same requests on the same weights (tilekit's model is built from its state dict) after the engine: it
takes one output length, so --output must give one.

Rows: output tokens/s and total (prompt + output) tokens/s of each side, the engine's start-up (buffers, warm-up,
graph captures), its first request's time to first token after start-up against a static generate of a new
prompt length, prefix-cache hit rate, preemptions and a roofline estimate. Check: of the first 16 requests, at least
12 whose first 4 engine tokens equal their static-batch (or transformers') tokens (bf16 kernels of different batch shapes round differently and a
random-weight model's logits are close, so later tokens may part; each one's leading agreement is recorded); a row
whose check fails is marked failed. Results as JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def workload(n: int, inputs: tuple[int, int], outputs: tuple[int, int], shared: int, vocab: int, seed: int = 0):
    """n requests: (prompt token ids, output length), lengths uniform in the ranges; `shared` leading tokens common
    to every prompt (a system prompt), counted within its input length."""
    import numpy as np
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, vocab, shared)]
    reqs = []
    for _ in range(n):
        length = int(rng.integers(inputs[0], inputs[1] + 1))
        own = [int(t) for t in rng.integers(0, vocab, max(1, length - shared))]
        reqs.append((system + own, int(rng.integers(outputs[0], outputs[1] + 1))))
    return reqs


def synchronize():
    import cupy
    cupy.cuda.runtime.deviceSynchronize()


def run_static(model, reqs, batch: int) -> tuple[float, list[list[int]]]:
    """Seconds for every request through generate() in batches of `batch` (each to its batch's longest output)."""
    outs = []
    synchronize()
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i:i + batch]
        seqs = model.generate([p for p, _ in chunk], max(n for _, n in chunk), temperature=0, eos_token_id=[])
        outs += [[int(t) for t in s[len(p):len(p) + n]] for s, (p, n) in zip(seqs, chunk)]
    synchronize()
    return time.perf_counter() - start, outs


def run_engine(engine, reqs) -> tuple[float, list[list[int]]]:
    synchronize()
    start = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], None, sampling=[dict(max_new_tokens=n) for _, n in reqs],
                           temperature=0, ignore_eos=True)
    synchronize()
    return time.perf_counter() - start, [o["token_ids"] for o in outs]


def roofline_seconds(config, reqs, max_running: int, copy_gbs: float, peak_tflops: float, itemsize: int = 2) -> float:
    """A floor for the engine's run of `reqs`: every prompt's prefill (its matrix FLOPs, of a mixture-of-experts
    layer's experts only those a token is routed to, and its causal attention) at the measured bf16 matmul rate,
    plus, at the measured copy bandwidth, the weights read once per decode step (at the least output tokens /
    max_running steps; of the experts, the share max_running tokens are routed to) and every decode token's KV
    cache entries once."""
    from benchmarks.harness.report import attention_flops_per_pair, decode_params, kv_values_per_token
    from benchmarks.harness.report import token_matmul_params
    L, matrices, pair = config.n_layer, token_matmul_params(config), attention_flops_per_pair(config)
    flops = sum(2.0 * len(p) * matrices + L * pair * len(p) * (len(p) + 1) / 2 for p, _ in reqs)
    steps = -(-sum(n for _, n in reqs) // max_running)
    kv_token = L * kv_values_per_token(config) * itemsize
    kv = sum(kv_token * (n * len(p) + n * (n - 1) / 2) for p, n in reqs)
    weights = steps * decode_params(config, max_running) * itemsize
    return flops / (peak_tflops * 1e12) + (weights + kv) / (copy_gbs * 1e9)


HF_ATTENTION = ("paged|sdpa", "sdpa_paged", "sdpa")     # the first one this transformers builds is used


def with_paged_attention(build):
    """(build(impl), impl) for the first of HF_ATTENTION that this transformers builds a model with."""
    errors = []
    for impl in HF_ATTENTION:
        try:
            return build(impl), impl
        except Exception as e:  # noqa: BLE001 - the next implementation name
            errors.append(f"{impl}: {type(e).__name__}: {e}")
    raise RuntimeError("transformers built none of " + "; ".join(errors))


def transformers_model(config, dtype: str):
    """transformers' model of `config` with random weights (seed 0) and paged attention, and the name of its
    attention implementation."""
    from benchmarks.suites.model import build_hf
    return with_paged_attention(lambda impl: build_hf(config, impl, dtype=dtype, seed=0))


def run_transformers(hf, reqs) -> tuple[float, list[list[int]]]:
    """Seconds for transformers' continuous batching (generate_batch, greedy, eos off) of every request; its one
    generation config takes one output length, so the requests must share theirs."""
    from transformers.generation import GenerationConfig
    new = reqs[0][1]
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=hf.generation_config.pad_token_id)
    hf.generate_batch(inputs=[p for p, _ in reqs[:4]], generation_config=config, progress_bar=False)  # warm-up
    synchronize()
    start = time.perf_counter()
    out = hf.generate_batch(inputs=[p for p, _ in reqs], generation_config=config, progress_bar=False)
    synchronize()
    seconds = time.perf_counter() - start
    by_prompt = {}
    for result in out.values():
        by_prompt.setdefault(tuple(result.prompt_ids), []).append([int(t) for t in result.generated_tokens])
    return seconds, [by_prompt[tuple(p)].pop() for p, _ in reqs]


def leading_agreement(ours: list[list[int]], theirs: list[list[int]], count: int = 16) -> tuple[list[int], str]:
    """The first tokens on which each of the first `count` requests agree, and "ok" when at least 3 in 4 agree on
    their first 4 tokens (random weights in bf16 tie often enough that a few requests part early)."""
    leading = [next((j for j, (a, b) in enumerate(zip(ours[i], theirs[i])) if a != b), len(theirs[i]))
               for i in range(min(count, len(ours)))]
    same = [n >= min(4, len(theirs[i])) for i, n in enumerate(leading)]
    return leading, ("ok" if sum(same) >= 0.75 * len(same) else
                     f"FAILED: {sum(same)} of {len(same)} requests' first 4 tokens agree")


def first_token_seconds(engine, prompt) -> float:
    """Time to the first token of one request on an idle engine."""
    start = time.perf_counter()
    request = engine.add_request(prompt, 1, temperature=0, ignore_eos=True)
    while engine.has_unfinished:
        engine.step()
    assert len(request.output) == 1
    return time.perf_counter() - start


def print_row(r: dict) -> None:
    if r["side"] == "engine":
        phases = r["startup_phases"]
        extra = (f"start-up {r['startup_s']:.1f} s ({phases['launches']} launches precompiled in "
                 f"{phases['precompile_s']:.1f} s), first token "
                 f"{1e3 * r['ttft_first_s']:.1f} ms, prefix hits {100 * r['prefix_hit_rate']:.0f}%, preemptions "
                 f"{r['preemptions']}, {r['pct_roofline']:.0f}% of roofline")
    else:
        extra = f"first generate of a new length {r['first_new_length_s']:.2f} s"
    print(f"  {r['side']:7s} {r['seconds']:7.2f} s  {r['output_tps']:9.0f} output tok/s  {r['total_tps']:9.0f} "
          f"total tok/s  {extra}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.continuous", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input", type=int, nargs=2, default=(256, 2048), metavar=("MIN", "MAX"))
    parser.add_argument("--output", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--shared-prefix", type=int, default=0)
    parser.add_argument("--static-batch", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--no-static", action="store_true", help="skip the static-batching side")
    parser.add_argument("--no-prefix-cache", action="store_true", help="the engine without prefix caching")
    parser.add_argument("--transformers", action="store_true",
                        help="also run transformers' generate_batch on the same weights (needs one output length)")
    parser.add_argument("--compile-timeout", type=float, default=300.0, metavar="S",
                        help="seconds the start-up's parallel compile may take (the engine's compile_timeout_s)")
    parser.add_argument("--compile-log", action="store_true",
                        help="print each start-up kernel as its compile ends (where a slow start-up spends its time)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.transformers and args.output[0] != args.output[1]:
        parser.error("--transformers needs one output length (--output N N): generate_batch takes one")

    from tilekit.engine.llm import LLMEngine
    from tilekit.models.families import family_of_config, preset_config
    config = preset_config(args.preset)
    hf, anchor_failure = None, None
    if args.transformers:             # tilekit's model from transformers' weights: the same model on both sides
        from benchmarks.suites.model import tilekit_state
        try:
            hf, impl = transformers_model(config, args.dtype)
        except Exception as e:  # noqa: BLE001 - reported as the anchor's failed row; the engine still runs
            anchor_failure = f"FAILED: {type(e).__name__}: {e}"
    if hf is not None:
        model = family_of_config(config).model_class(config, dtype=args.dtype, state=tilekit_state(hf, config))
    else:
        model = family_of_config(config).model_class(config, dtype=args.dtype, seed=0)
    reqs = workload(args.requests, tuple(args.input), tuple(args.output), args.shared_prefix, config.vocab_size)
    max_len = min(model.context_length, args.input[1] + args.output[1])
    print(f"starting the engine ({args.preset}, max_running {args.max_running}, token budget {args.token_budget}, "
          f"max_len {max_len})", flush=True)
    t0 = time.perf_counter()

    def compiled(done, total, name, error):
        print(f"  {time.perf_counter() - t0:6.1f} s  compiled {done}/{total}  {name}{'  ' + error if error else ''}",
              flush=True)
    engine = LLMEngine(model, max_running=args.max_running, token_budget=args.token_budget, max_len=max_len,
                       gpu_memory_utilization=0.5, prefix_caching=not args.no_prefix_cache,
                       compile_timeout_s=args.compile_timeout,
                       compile_progress=compiled if args.compile_log else None)
    startup = time.perf_counter() - t0
    phases = engine.executor.startup
    print(f"engine started in {startup:.1f} s: collect {phases['collect_s']:.1f} s, precompile {phases['precompile_s']:.1f} s "
          f"({phases['launches']} launches), run and capture {phases['run_s']:.1f} s; not precompiled: "
          f"{phases['precompile_errors'] or 'none'}", flush=True)
    ttft = first_token_seconds(engine, reqs[0][0])
    engine.pool.queried_tokens = engine.pool.hit_tokens = 0
    engine_s, engine_out = run_engine(engine, reqs)
    stats = engine.stats()
    prompt_tokens = sum(len(p) for p, _ in reqs)
    output_tokens = sum(n for _, n in reqs)
    from benchmarks.harness.timing import copy_bandwidth, matmul_peak_tflops
    copy_gbs, peak = copy_bandwidth()["gbs"], matmul_peak_tflops()
    floor = roofline_seconds(config, reqs, args.max_running, copy_gbs, peak)
    rows = [dict(side="engine", seconds=engine_s, output_tps=output_tokens / engine_s,
                 total_tps=(prompt_tokens + output_tokens) / engine_s, startup_s=startup, ttft_first_s=ttft,
                 prefix_hit_rate=stats["prefix_hit_rate"], preemptions=stats["preemptions"],
                 blocks=stats["blocks_total"], roofline_s=floor, pct_roofline=100 * floor / engine_s,
                 copy_gbs=copy_gbs, matmul_tflops=peak, startup_phases=engine.executor.startup)]
    print(f"{args.preset} {args.dtype}: {args.requests} requests, input {args.input[0]}-{args.input[1]}, output "
          f"{args.output[0]}-{args.output[1]}, shared prefix {args.shared_prefix}; {prompt_tokens} prompt + "
          f"{output_tokens} output tokens; roofline {floor:.2f} s (copy {copy_gbs:.0f} GB/s, matmul {peak:.0f} "
          f"TFLOP/s)")
    print_row(rows[0])

    def save():
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            cache = "-nocache" if args.no_prefix_cache else ""
            name = f"continuous-{args.preset}-{args.requests}-prefix{args.shared_prefix}{cache}.json"
            (args.out / name).write_text(json.dumps(dict(argv=sys.argv, rows=rows,
                                                         args={k: str(v) for k, v in vars(args).items()}), indent=1))
    save()                    # the engine's row stands even if the static side runs out of time
    if not args.no_static:
        t0 = time.perf_counter()
        model.generate([reqs[1][0][:len(reqs[1][0]) // 2]], 1, temperature=0)     # a new prompt length, cold
        static_cold = time.perf_counter() - t0
        static_s, static_out = run_static(model, reqs, args.static_batch)
        rows.append(dict(side="static", seconds=static_s, output_tps=output_tokens / static_s,
                         total_tps=(prompt_tokens + output_tokens) / static_s, first_new_length_s=static_cold))
        rows[0]["leading_tokens_agreeing"], rows[0]["check"] = leading_agreement(engine_out, static_out)
        rows[0]["speedup_vs_static"] = static_s / engine_s
        print_row(rows[1])
        print(f"  engine {rows[0]['check']}, {rows[0]['speedup_vs_static']:.2f}x static")
    engine.close()
    save()
    if anchor_failure:
        rows.append(dict(side="transformers generate_batch", check=anchor_failure))
        print(f"  transformers {anchor_failure}", flush=True)
        save()
    if hf is not None:
        try:
            hf_s, hf_out = run_transformers(hf, reqs)
            leading, check = leading_agreement(engine_out, hf_out)
            rows.append(dict(side=f"transformers generate_batch ({impl})", seconds=hf_s,
                             output_tps=output_tokens / hf_s, total_tps=(prompt_tokens + output_tokens) / hf_s,
                             leading_tokens_agreeing=leading, check=check, engine_speedup=hf_s / engine_s))
            print(f"  transformers {hf_s:7.2f} s  {output_tokens / hf_s:9.0f} output tok/s  "
                  f"({impl}); engine {hf_s / engine_s:.1f}x; engine against it: {check}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed anchor is a failed row, not a number
            rows.append(dict(side="transformers generate_batch", check=f"FAILED: {type(e).__name__}: {e}"))
            print(f"  transformers FAILED: {type(e).__name__}: {e}", flush=True)
        save()
    return 0 if all(r.get("check", "ok") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
