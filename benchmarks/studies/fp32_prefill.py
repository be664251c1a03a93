"""GPT-2 in fp32 (anchored by bf16) against eager PyTorch in the same dtype, one process, same random weights:
prefill (full-logits forward of B1 x T128: tilekit's forward against the Hugging Face module, sdpa, TF32 off) and
greedy decode ms per token at batch 1 (the difference of two generate() lengths, so the prompt's prefill cancels:
tilekit's graphed step against the gpt-fast-style eager PyTorch step over the same module).

    python -m benchmarks.studies.fp32_prefill [--batch 1] [--seq 128] [--dtype float32 --dtype bfloat16] [--tiles]

Untuned fp32 shapes run the heuristic defaults (fp32 products run on tensor cores as three tf32 products,
tiles.tensor_mma); --tiles adds fp32 prefill with every linear pinned to each of a few fixed tiles, to check the
default's choice.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

PLAIN = dict(GROUP_M=8, SPLIT_K=1, PERSISTENT=0, occupancy=1, num_ctas=1, num_worker_warps=0)
TILES = [dict(PLAIN, TM=128, TN=128, TK=32, num_worker_warps=8), dict(PLAIN, TM=128, TN=64, TK=32),
         dict(PLAIN, TM=64, TN=64, TK=64), dict(PLAIN, TM=64, TN=64, TK=32),
         dict(PLAIN, TM=64, TN=64, TK=32, num_worker_warps=8), dict(PLAIN, TM=64, TN=32, TK=32),
         dict(PLAIN, TM=32, TN=32, TK=32)]
SHORT, LONG = 1, 65       # new tokens of the two generate() calls whose difference is the decode time


def _decode_ms(generate, prompt, runs: int = 3) -> float:
    """ms per decode step: (wall time of generate(prompt, LONG) - of generate(prompt, SHORT)) / (LONG - SHORT)."""
    from benchmarks.harness.timing import wall_time
    short = wall_time(lambda: generate(prompt, SHORT), warmup=1, runs=runs)["median_ms"]
    long = wall_time(lambda: generate(prompt, LONG), warmup=1, runs=runs)["median_ms"]
    return (long - short) / (LONG - SHORT)


def run(dtype: str, batch: int, seq: int, tiles: bool) -> list[tuple]:
    """(what, tilekit ms, eager PyTorch ms, relative error of tilekit's logits) rows of one dtype."""
    import cupy
    import numpy as np
    import torch

    from benchmarks.harness.timing import measure, shared_stream
    from benchmarks.suites.gptfast import decoder_for
    from benchmarks.suites.model import build_hf, tilekit_state
    from tilekit.kernels.linear import LINEAR
    from tilekit.models.families import family_of_config, preset_config

    torch.backends.cuda.matmul.allow_tf32 = False
    config = preset_config("gpt2")
    hf = build_hf(config, "sdpa", dtype=dtype, seed=0)
    model = family_of_config(config).model_class(config, dtype=dtype, state=tilekit_state(hf, config))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq))
    ids_t = torch.from_numpy(ids).cuda()
    rows = []
    with shared_stream(), torch.no_grad():
        ref = hf(ids_t, use_cache=False).logits.float().cpu().numpy()
        eager = measure(lambda: hf(ids_t, use_cache=False), flush_l2=False, warmup=2, reps=10)["median_ms"]
        for name, pin in [("default", None)] + [(f"{c['TM']}x{c['TN']}x{c['TK']}"
                                                  f"{' w8' if c['num_worker_warps'] else ''}", c)
                                                 for c in (TILES if tiles else [])]:
            with LINEAR.pinned(pin) if pin else contextlib.nullcontext():
                model.forget_graphs()
                got = cupy.asnumpy(model(ids)).astype(np.float64)
                ms = measure(lambda: model(ids), flush_l2=False, warmup=2, reps=10)["median_ms"]
            rows.append((f"prefill B{batch} T{seq} {name}", ms, eager, np.linalg.norm(got - ref) / np.linalg.norm(ref)))
        decoder = decoder_for(hf, batch, seq + LONG, compile=False)
        eager = _decode_ms(lambda p, n: decoder.generate(p, n), ids_t)
        model.forget_graphs()
        ms = _decode_ms(lambda p, n: model.generate(p, n, temperature=0, eos_token_id=[]), ids)
        rows.append((f"decode B{batch} ms/token", ms, eager, float("nan")))
    del model, hf
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.fp32_prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", action="append", choices=("float32", "float16", "bfloat16"),
                    help="repeatable (default float32 and bfloat16)")
    ap.add_argument("--tiles", action="store_true", help="fp32 prefill with the linears pinned to fixed tiles too")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.seq < 1:
        ap.error(f"--batch and --seq must be at least 1, got {args.batch} and {args.seq}")
    print("gpt2, random weights; eager = the same module in eager PyTorch (TF32 off); ratio = eager ms / tilekit ms")
    print(f"{'dtype':<10}{'case':<34}{'tilekit ms':>11}{'eager ms':>10}{'ratio':>8}  rel err")
    for dtype in args.dtype or ["float32", "bfloat16"]:
        for what, ms, eager, err in run(dtype, args.batch, args.seq, args.tiles and dtype == "float32"):
            print(f"{dtype:<10}{what:<34}{ms:>11.3f}{eager:>10.3f}{eager / ms:>7.2f}x  {err:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
