"""Decode-step variants of tilekit's GPT-2 compared inside one process: the replayed greedy decode graph
(bf16, a 128-token prompt and 128 new tokens, dependent launch as configured) of copies of the model
sharing its weights, replays interleaved, so that no process-level effect separates them.

    python -m benchmarks.decode_ab --model gpt2 --model gpt2-xl --batch 1 --batch 8 [--out DIR]

Variants: `fixed` (this tree: the fixed-point residual stream, both output projections split over K
by residual_linear), `model-dtype` (fixed_point_rows = 0: the residual stream in bf16 and every
projection a `linear`, the path before the fixed-point residual) and, for each --block-config (a
JSON decode_block config; "{}" for the one the op resolves), `block`: every block of the step in one
decode_block launch with that config (compiled in parallel first).
Each variant's first greedy tokens are compared with the model-dtype variant's.
"""

from __future__ import annotations

import copy
import json
import sys

from benchmarks.breakdown import NEW_TOKENS, PROMPT, _decode_generation, decode_model, model_batch_args, replay_ms


VARIANTS = {"model-dtype": dict(fixed_point_rows=0), "fixed": {}}    # name -> the GPT attributes it sets


def block_variants(overrides: list[dict]) -> dict:
    """name -> (GPT attributes, decode_block config overrides or None: the resolved config) of the variants."""
    variants = {name: (attrs, None) for name, attrs in VARIANTS.items()}
    for override in overrides:
        name = "block " + (",".join(f"{k}={v}" for k, v in sorted(override.items())) or "resolved")
        variants[name] = (dict(decode_block_launches=True), override or None)
    return variants


def block_configs(weights, batch: int, variants: dict, log=print) -> dict:
    """name -> the full decode_block config of each block variant with overrides (the default config
    with them applied); every block variant's kernel compiled in parallel processes first."""
    from benchmarks.breakdown import NEW_TOKENS, PROMPT
    from tilekit.autotune.compile import precompile
    from tilekit.device import device_info
    from tilekit.kernels.decode_block import DECODE_BLOCK
    from tilekit.models.runtime import capacity_for
    c = weights.config
    problem = DECODE_BLOCK.tuning_problem(dict(dtype=weights.dtype, B=batch, C=c.n_embd, H=c.n_head,
                                               capacity=capacity_for(weights, PROMPT, NEW_TOKENS)[0]))
    default = DECODE_BLOCK.default(problem)
    configs = {name: {**default, **(override or {})} for name, (attrs, override) in variants.items()
               if attrs.get("decode_block_launches")}
    names = list(configs)
    _, errors = precompile([(DECODE_BLOCK, problem, configs[n]) for n in names], device_info(0).arch)
    for i, e in errors.items():
        log(f"decode_block {configs[names[i]]} did not compile: {e}")
    return {name: config for name, config in configs.items() if variants[name][1]}


def run(preset: str, weights, batch: int, copy_gbs: float, variants: dict, rounds: int = 5, reps: int = 200,
        log=print) -> dict:
    """The variants of `weights` (a GPT of `preset`) at `batch`, replays interleaved over `rounds`."""
    import contextlib

    import numpy as np

    from benchmarks.model import model_config
    from benchmarks.report import decode_floor_ms
    from tilekit.kernels.decode_block import DECODE_BLOCK
    pinned = block_configs(weights, batch, variants, log)
    gens, tokens = {}, {}
    for name, (attrs, _) in variants.items():
        model = copy.copy(weights)          # the same weight arrays, a runtime (graphs, buffers) of its own
        model._init_runtime()
        for attr, value in attrs.items():
            setattr(model, attr, value)
        with DECODE_BLOCK.pinned(pinned[name]) if name in pinned else contextlib.nullcontext():
            gens[name] = _decode_generation(model, batch)      # the graph keeps the config it captured
        tokens[name] = np.asarray(gens[name].state.history.get())
    times = {name: [] for name in gens}
    for _ in range(rounds):                 # interleaved, so drifts of clock or temperature hit every variant
        for name, gen in gens.items():
            times[name].append(replay_ms(gen, reps))
    floor = decode_floor_ms(model_config(preset), batch, PROMPT, NEW_TOKENS, copy_gbs)
    base = float(np.median(times["model-dtype"]))
    rows = []
    for name, ts in times.items():
        ms = float(np.median(ts))
        same = tokens[name][:, PROMPT:PROMPT + NEW_TOKENS] == tokens["model-dtype"][:, PROMPT:PROMPT + NEW_TOKENS]
        leading = [int(np.argmin(s)) if not s.all() else NEW_TOKENS for s in same]
        rows.append(dict(preset=preset, batch=batch, variant=name, step_ms=ms, rounds_ms=ts, speedup=base / ms,
                         floor_ms=floor, pct_floor=100 * floor / ms, leading_tokens_agree=leading))
        log(f"{preset:8s} B{batch:<2d} {name:24s} {ms:7.3f} ms/step  {base / ms:5.2f}x  {100 * floor / ms:4.0f}% "
            f"of the {floor:.3f} ms floor  (rounds {' '.join(f'{t:.3f}' for t in ts)}; tokens agreeing with "
            f"model-dtype: min {min(leading)} of {NEW_TOKENS})")
    for gen in gens.values():
        gen.model.forget_graphs()
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = model_batch_args("decode_ab", __doc__, argv, extra=lambda ap: ap.add_argument(
        "--block-config", type=json.loads, action="append", default=[],
        help='a decode_block variant\'s config as JSON (repeatable; "{}": the resolved one)'))
    variants = block_variants(args.block_config)
    from benchmarks.timing import copy_bandwidth
    copy_gbs = copy_bandwidth()["gbs"]
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    results = []
    for preset in args.model or ["gpt2", "gpt2-xl"]:
        weights = decode_model(preset)
        results += [run(preset, weights, batch, copy_gbs, variants) for batch in args.batch or [1, 8]]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_ab.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
