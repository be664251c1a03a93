"""Sampled decode against greedy decode of the same model, in one process: ms per new token of generate()
(a 128-token prompt and 128 new tokens, prefill included, wall time), and of one replayed decode step, the
greedy and the sampled graphs replayed interleaved, and the next_token kernels' microseconds in a profiled
replay of each. Rows "sample <model> B<b> <options>" have the greedy run
of the same model and batch as their anchor (ratio = sampled / greedy: 1.05 means 5% slower).

    python -m benchmarks.studies.sampling --model gpt2 --model llama-3.2-1b --batch 1 --batch 8 [--out DIR]

The default options are the issue's: temperature 0.8, top_k 50, top_p 0.95 (Hugging Face's default sampling
has top_k 50); the first model also runs top-p alone (no top-k: the check pass, and rejections) and top-k +
top-p with repetition and presence penalties. Random weights from seed 0, no eos (every row runs all
128 steps).
"""

from __future__ import annotations

import json
import sys

from benchmarks.studies.breakdown import NEW_TOKENS, PROMPT, decode_model, interleaved_replays, model_batch_parser

TARGET = 1.05          # issue 32: sampled decode costs at most this much of greedy decode, per token
OPTIONS = {"T0.8 k50 p0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
           "T1 p0.9 (no top-k)": dict(temperature=1.0, top_k=0, top_p=0.9),
           "T0.8 k50 p0.95 rep1.2 pres0.5": dict(temperature=0.8, top_k=50, top_p=0.95, repetition_penalty=1.2,
                                                 presence_penalty=0.5)}


def _timed_generation(model, prompt, options: dict, runs: int = 3):
    """(median ms per new token of generate() over `runs` after two warm-ups that capture both graphs, the
    kept Generation, the tokens of the last run)."""
    import time

    import numpy as np
    out = None
    times = []
    for i in range(2 + runs):
        start = time.perf_counter()
        out = model.generate(prompt, NEW_TOKENS, eos_token_id=[], seed=1, **options)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3 / NEW_TOKENS)
    gen = next(reversed(model.runner._generations.values()))      # the one this call used: kept last
    return float(np.median(times)), gen, np.stack(out)


def next_token_kernels(gen) -> dict[str, float]:
    """Microseconds of each next_token kernel in a profiled replay of gen's decode graph (breakdown.profile_step:
    the median of 5 replays)."""
    from benchmarks.studies.breakdown import profile_step
    rows = profile_step(gen, 1.0, step_reps=1)["kernels"]
    return {r["kernel"].removeprefix("next_token_").removesuffix("_kernel"): r["us"] for r in rows
            if r["op"] == "next_token"}


def _us(kernels: dict) -> str:
    return " + ".join(f"{name} {us:.1f}" for name, us in kernels.items()) + " us"


def run(preset: str, batch: int, variants: list[str], rounds: int = 5, reps: int = 100, log=print) -> list[dict]:
    import numpy as np
    model = decode_model(preset)
    model.runner.max_generations = 1 + len(variants)
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, PROMPT))
    greedy_ms, greedy_gen, _ = _timed_generation(model, prompt, dict(temperature=0))
    runs = {name: _timed_generation(model, prompt, OPTIONS[name]) for name in variants}
    steps = interleaved_replays({"greedy": greedy_gen, **{name: runs[name][1] for name in variants}}, rounds, reps)
    greedy_step = float(np.median(steps["greedy"]))
    greedy_pick = next_token_kernels(greedy_gen)
    rows = []
    for name in variants:
        gen_ms, gen, tokens = runs[name]
        step = float(np.median(steps[name]))
        distinct = len(np.unique(tokens[:, PROMPT:]))
        pick = next_token_kernels(gen)
        rows.append(dict(case=f"sample {preset} B{batch} {name}", anchor="greedy", ms_per_token=gen_ms,
                         anchor_ms_per_token=greedy_ms, ratio=gen_ms / greedy_ms, step_ms=step,
                         anchor_step_ms=greedy_step, step_ratio=step / greedy_step, distinct_tokens=distinct,
                         next_token_us=pick, anchor_next_token_us=greedy_pick))
        log(f"sample {preset:13s} B{batch:<2d} {name:30s} generate {gen_ms:7.3f} vs greedy {greedy_ms:7.3f} ms/token "
            f"({gen_ms / greedy_ms:5.3f}x); step {step:7.3f} vs {greedy_step:7.3f} ms ({step / greedy_step:5.3f}x); "
            f"{distinct} distinct tokens; next_token kernels {_us(pick)} vs greedy {_us(greedy_pick)}")
    model.forget_graphs()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = model_batch_parser("studies.sampling", __doc__)
    args = ap.parse_args(argv)
    rows = []
    for i, preset in enumerate(args.model or ["gpt2", "gpt2-xl", "llama-3.2-1b", "llama-3.1-8b"]):
        variants = list(OPTIONS) if i == 0 else list(OPTIONS)[:1]
        for batch in args.batch or [1, 8]:
            rows += run(preset, batch, variants)
    print(f"{'case':<52}{'tk ms/tok':>10}{'greedy':>9}{'ratio':>7}{'step':>8}{'greedy':>8}{'ratio':>7}"
          f"  within {TARGET}x of greedy")
    for r in rows:
        print(f"{r['case']:<52}{r['ms_per_token']:>10.3f}{r['anchor_ms_per_token']:>9.3f}{r['ratio']:>6.3f}x"
              f"{r['step_ms']:>8.3f}{r['anchor_step_ms']:>8.3f}{r['step_ratio']:>6.3f}x"
              f"  {'yes' if r['ratio'] <= TARGET else 'NO'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sampling.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
