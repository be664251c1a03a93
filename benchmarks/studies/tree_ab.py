"""Two source trees of tilekit on the same checkpoints, in fresh processes that alternate: greedy tokens compared
and decode / prefill timed the same way (the public API: generate() and forward(), host cost included).

    python -m benchmarks.studies.tree_ab --before DIR [--after DIR] [--warm] [--preset gpt2 ...] [--out DIR]

`--before` and `--after` (default: this checkout) are checkouts' roots (their tilekit/ packages; the shipped
tuning_db/ of this tree serves both, so only code differs). Checkpoints are random weights at the presets' shapes
written by this tree's save_pretrained. `--warm` runs every child once first, side by side, so that cold kernel
compiles are not paid one process after another (those runs are not counted); `--layers N` shortens every preset to
N layers (DeepSeek-V2-Lite's 27 would take minutes to write and load).
Per preset and tree: the first 64 greedy tokens after a 128-token prompt, decode ms/token at batch 1
((time of 129 new tokens - time of 1) / 128, median of 5) and a full-logits forward of 1 x 512 tokens (median of
10), each after a warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import json, sys, time
import numpy as np, cupy
from tilekit.models import load_model

def sync():
    cupy.cuda.runtime.deviceSynchronize()

def median_s(fn, n):
    times = []
    for _ in range(n):
        sync(); t = time.perf_counter(); fn(); sync(); times.append(time.perf_counter() - t)
    return float(np.median(times))

model = load_model(sys.argv[1], dtype="bfloat16")
V = model.config.vocab_size
prompt = [int(t) for t in np.random.default_rng(0).integers(0, V, 128)]
long = np.random.default_rng(1).integers(0, V, (1, 512)).astype(np.int32)
gen = lambda n: model.generate([prompt], n, temperature=0, eos_token_id=[])
tokens = [int(t) for t in gen(64)[0][128:]]
gen(129); gen(1); model(long)
decode = (median_s(lambda: gen(129), 5) - median_s(lambda: gen(1), 5)) / 128
prefill = median_s(lambda: model(long), 10)
print("RESULT " + json.dumps(dict(tokens=tokens, decode_ms=1e3 * decode, prefill_ms=1e3 * prefill)))
'''


def write_checkpoint(preset: str, layers: int | None, directory: Path) -> None:
    import dataclasses

    from tilekit.models.families import family_of_config, preset_config
    config = preset_config(preset)
    if layers is not None and layers < config.n_layer:
        config = dataclasses.replace(config, n_layer=layers)
    family_of_config(config).model_class(config, dtype="bfloat16", seed=0).save_pretrained(directory)


def run_child(tree: Path, checkpoint: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
               TILEKIT_SHIPPED_DB=str(ROOT / "tuning_db"))
    done = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint)], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    # a tree from before the clean-exit fix (3779ce9) dies at exit (SIGSEGV) after its result: kept, its status noted
    return dict(json.loads(line[len("RESULT "):]), exit=done.returncode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.tree_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--after", type=Path, default=ROOT, help="the checkout compared with it (default: this one)")
    parser.add_argument("--preset", action="append", dest="presets")
    parser.add_argument("--layers", type=int, help="shorten every preset to this many layers")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each tree per preset (0 with --warm: "
                                                              "write the checkpoints and fill the caches only)")
    parser.add_argument("--warm", action="store_true",
                        help="first run every child once, all at once, to fill cuTile's cache (not counted)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tilekit-tree-ab"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    for flag, tree in (("--before", args.before), ("--after", args.after)):
        if not (tree / "tilekit" / "__init__.py").is_file():
            parser.error(f"{flag} {tree} holds no tilekit/ package")
    if args.rounds < 0 or (args.rounds == 0 and not args.warm):
        parser.error(f"--rounds {args.rounds}: give 1 or more (0 only with --warm)")
    import numpy as np
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rows, presets = [], args.presets or ["gpt2", "llama-3.2-1b", "deepseek-v2-lite"]
    for preset in presets:
        if not (args.work / preset / "config.json").is_file():
            write_checkpoint(preset, args.layers, args.work / preset)
    if args.warm:                  # cold compiles run side by side; the timed rounds below find them cached
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(len(trees) * len(presets)) as pool:
            list(pool.map(lambda job: run_child(*job), [(t, args.work / p) for t in trees.values() for p in presets]))
    if args.rounds == 0:
        return 0
    for preset in presets:
        checkpoint = args.work / preset
        runs = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(run_child(tree, checkpoint))
        same = all(r["tokens"] == runs["before"][0]["tokens"] for rs in runs.values() for r in rs)
        row = dict(preset=preset, layers=args.layers, tokens_identical=same,
                   exits={name: sorted({r["exit"] for r in rs}) for name, rs in runs.items()})
        for name, rs in runs.items():
            row[f"{name}_decode_ms"] = float(np.median([r["decode_ms"] for r in rs]))
            row[f"{name}_prefill_ms"] = float(np.median([r["prefill_ms"] for r in rs]))
            row[f"{name}_all"] = rs
        rows.append(row)
        print(f"{preset:18s} greedy tokens {'identical' if same else 'DIFFER'}  decode B1 {row['before_decode_ms']:.3f}"
              f" -> {row['after_decode_ms']:.3f} ms/token ({row['after_decode_ms'] / row['before_decode_ms']:.3f}x)"
              f"  prefill 1x512 {row['before_prefill_ms']:.2f} -> {row['after_prefill_ms']:.2f} ms "
              f"({row['after_prefill_ms'] / row['before_prefill_ms']:.3f}x)  exit status {row['exits']}", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "tree-ab.json").write_text(json.dumps(dict(argv=sys.argv, rows=rows), indent=1))
    return 0 if all(r["tokens_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
