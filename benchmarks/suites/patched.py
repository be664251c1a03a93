"""Hugging Face generate on tilekit.patch: the same HF model with random weights, unpatched (sdpa) and patched.

    python -m benchmarks.suites.patched [--model llama-3.2-1b] [--model gpt2] [--out DIR]

Per model (bf16, batch 1, a 128-token random prompt, 128 greedy new tokens, dynamic cache): the first
generated position's logits of both sides must agree within benchmarks.harness.checks.MODEL_TOLERANCE (else
the exit status is 1); how many leading greedy tokens agree is reported (random bf16 weights may flip
near-ties); each side's generate is timed as benchmarks.harness.timing.wall_time does (one warm-up, median of 3).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import numpy as np

from benchmarks.harness import checks, timing
from benchmarks.suites.model import NEW_TOKENS, PROMPT, Anchors, build_hf, model_config

DTYPE = "bfloat16"


def run(preset: str, log=print) -> dict:
    """Unpatched and patched generate of one preset: timings, first-step logits error, greedy agreement."""
    import torch

    import tilekit
    config = model_config(preset)
    with torch.no_grad():               # not inference_mode: its tensors would become the parameters
        model = build_hf(config, "sdpa", dtype=DTYPE, seed=0)
    generate = Anchors(model, config, DTYPE).decode("HF sdpa", 1, NEW_TOKENS)
    prompt = torch.from_numpy(np.random.default_rng(0).integers(0, config.vocab_size, (1, PROMPT))).cuda()
    sides = {}
    with torch.inference_mode():
        for side in ("HF", "tilekit"):
            if side == "tilekit":
                tilekit.patch(model)
            tokens, logits = generate(prompt, check=True)
            times = timing.wall_time(lambda: generate(prompt), warmup=1, runs=3)
            sides[side] = tokens[0, PROMPT:].cpu().numpy(), logits, times["median_ms"] / NEW_TOKENS, times
            log(f"[patched {preset}] {side}: {sides[side][2]:.3f} ms/token")
    tilekit.unpatch(model)
    (hf_tokens, hf_logits, hf_ms, hf_times), (tk_tokens, tk_logits, tk_ms, tk_times) = sides["HF"], sides["tilekit"]
    result = {"model": preset, "dtype": DTYPE, "batch": 1, "prompt": PROMPT, "new_tokens": NEW_TOKENS,
              "hf_ms_per_token": hf_ms, "tilekit_ms_per_token": tk_ms, "speedup": hf_ms / tk_ms,
              "logits_rel_error": checks.rel_error(tk_logits, hf_logits), "logits_tolerance": checks.MODEL_TOLERANCE,
              "greedy_agreement": checks.leading_agreement(tk_tokens, hf_tokens),
              "hf_generate": hf_times, "tilekit_generate": tk_times}
    return result


def table(results: list[dict]) -> str:
    lines = [(f"{'model':<14} {'HF ms/token':>12} {'tilekit ms/token':>17} {'speedup':>8} {'logits err':>11} "
              f"{'greedy agreement':>17}")]
    for r in results:
        lines.append(f"{r['model']:<14} {r['hf_ms_per_token']:>12.3f} {r['tilekit_ms_per_token']:>17.3f} "
                     f"{r['speedup']:>7.2f}x {r['logits_rel_error']:>11.2e} "
                     f"{r['greedy_agreement']:>13}/{r['new_tokens']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.suites.patched", description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="GPT-2 or Llama preset (repeatable; default llama-3.2-1b "
                                                     "and gpt2)")
    ap.add_argument("--out", type=Path, help="write patched.json here")
    args = ap.parse_args(argv)
    import transformers
    transformers.logging.set_verbosity_error()
    results, failed = [], 0
    for preset in args.model or ["llama-3.2-1b", "gpt2"]:
        try:
            results.append(run(preset))
        except Exception:  # noqa: BLE001 - the other models still run
            failed += 1
            traceback.print_exc()
        timing.free_memory()          # the model of the last run is gone
    print(f"HF generate, unpatched (sdpa) vs tilekit.patch: {DTYPE}, batch 1, {PROMPT}+{NEW_TOKENS} greedy, "
          "dynamic cache\n" + table(results))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "patched.json").write_text(json.dumps(results, indent=1) + "\n")
    return 1 if failed or not all(r["logits_rel_error"] < r["logits_tolerance"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
