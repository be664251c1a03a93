"""Decode-step variants of tilekit's GPT-2 compared inside one process: the replayed greedy decode graph
(bf16, a 128-token prompt and 128 new tokens, dependent launch as configured) of copies of the model
sharing its weights, replays interleaved, so that no process-level effect separates them.

    python -m benchmarks.studies.decode_ab --model gpt2 --model gpt2-xl --batch 1 --batch 8 [--out DIR]

Variants: `fixed` (this tree: the fixed-point residual stream, both output projections split over K
by residual_linear) and `model-dtype` (fixed_point_rows = 0: the residual stream in bf16 and every
projection a `linear`, the path before the fixed-point residual).
Each variant's first greedy tokens are compared with the model-dtype variant's.
"""

from __future__ import annotations

import copy
import json
import sys

from benchmarks.studies.breakdown import (NEW_TOKENS, PROMPT, _decode_generation, decode_model, interleaved_replays,
                                          model_batch_parser)


VARIANTS = {"model-dtype": dict(fixed_point_rows=0), "fixed": {}}    # name -> the GPT attributes it sets


def run(preset: str, weights, batch: int, copy_gbs: float, rounds: int = 5, reps: int = 200, log=print) -> dict:
    """The variants of `weights` (a GPT of `preset`) at `batch`, replays interleaved over `rounds`."""
    import numpy as np

    from benchmarks.suites.model import model_config
    from benchmarks.harness.report import decode_floor_ms
    gens, tokens = {}, {}
    for name, attrs in VARIANTS.items():
        model = copy.copy(weights)          # the same weight arrays, a runtime (graphs, buffers) of its own
        model._init_runtime()
        for attr, value in attrs.items():
            setattr(model, attr, value)
        gens[name] = _decode_generation(model, batch)
        tokens[name] = np.asarray(gens[name].state.history.get())
    times = interleaved_replays(gens, rounds, reps)
    floor = decode_floor_ms(model_config(preset), batch, PROMPT, NEW_TOKENS, copy_gbs)
    base = float(np.median(times["model-dtype"]))
    rows = []
    for name, ts in times.items():
        ms = float(np.median(ts))
        same = tokens[name][:, PROMPT:PROMPT + NEW_TOKENS] == tokens["model-dtype"][:, PROMPT:PROMPT + NEW_TOKENS]
        leading = [int(np.argmin(s)) if not s.all() else NEW_TOKENS for s in same]
        rows.append(dict(preset=preset, batch=batch, variant=name, step_ms=ms, rounds_ms=ts, speedup=base / ms,
                         floor_ms=floor, pct_floor=100 * floor / ms, leading_tokens_agree=leading))
        log(f"{preset:8s} B{batch:<2d} {name:12s} {ms:7.3f} ms/step  {base / ms:5.2f}x  {100 * floor / ms:4.0f}% "
            f"of the {floor:.3f} ms floor  (rounds {' '.join(f'{t:.3f}' for t in ts)}; tokens agreeing with "
            f"model-dtype: min {min(leading)} of {NEW_TOKENS})")
    for gen in gens.values():
        gen.model.forget_graphs()
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = model_batch_parser("decode_ab", __doc__).parse_args(argv)
    from benchmarks.harness.timing import copy_bandwidth
    copy_gbs = copy_bandwidth()["gbs"]
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    results = []
    for preset in args.model or ["gpt2", "gpt2-xl"]:
        weights = decode_model(preset)
        results += [run(preset, weights, batch, copy_gbs) for batch in args.batch or [1, 8]]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_ab.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
