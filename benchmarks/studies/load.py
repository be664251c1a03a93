"""Loading a checkpoint (issue #31): tilekit's from_pretrained against Hugging Face's, same files, same run.

    python -m benchmarks.studies.load [--preset llama-3.2-1b] [--preset llama-3.1-8b] [--dir DIR] [--reps 3]
                                      [--out DIR]

For each preset (default: both above), a random-weight bfloat16 checkpoint sharded as the hub shards (5 GB files) is
written once under DIR/PRESET (default /tmp/tilekit-load). With the page cache warmed (every file read once), each
load runs in a fresh process, the two alternating, --reps times: Hugging Face's
AutoModelForCausalLM.from_pretrained(dtype=bfloat16, device_map="cuda"), the anchor, and tilekit's from_pretrained
(the preset's family: Llama.from_pretrained) in bfloat16. Each process times its load after its imports and CUDA
start-up and measures peak resident memory above that point (VmHWM after resetting it through
/proc/self/clear_refs). Progress goes to stderr; the table, one row "load PRESET WHO" per loader with the median time
and peak and whether tilekit meets #31 (time <= 1.2x HF; peak <= the largest tensor + 1 GiB), is printed last;
--out DIR gets load.json (every run, the medians, the bounds, the GPU and versions).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import system

HF, TILEKIT = "HF from_pretrained", "tilekit from_pretrained"
DEFAULT_PRESETS = ("llama-3.2-1b", "llama-3.1-8b")
SHARD_BYTES = 5 * 10 ** 9
GiB = 2 ** 30


def model(preset: str):
    """The preset's family, config and tensor shapes."""
    from tilekit.models import families
    config = families.preset_config(preset)
    family = families.family_of_config(config)
    return family, config, family.weights.state_dict_shapes(config)


def write(preset: str, directory: Path) -> None:
    """A random checkpoint, unless `directory` holds this preset's already: every tensor a view of one N(0, 0.02)
    bfloat16 pool as large as the largest tensor, so that writing it costs that much memory, not the checkpoint's."""
    import ml_dtypes
    import numpy as np
    marker = directory / "tilekit-bench-preset"
    if marker.is_file() and marker.read_text() == preset:
        return
    family, config, shapes = model(preset)
    pool = (np.random.default_rng(0).standard_normal(max(map(math.prod, shapes.values())), np.float32) * 0.02
            ).astype(ml_dtypes.bfloat16)
    family.weights.save_state_dict(directory, config, {n: pool[:math.prod(s)].reshape(s) for n, s in shapes.items()},
                                   dtype="bfloat16", shard_bytes=SHARD_BYTES)
    marker.write_text(preset)


def warm(directory: Path) -> None:
    """Read every file once, so that both loaders find the checkpoint in the page cache."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(who: str, directory: str) -> None:
    """One load in this fresh process; prints {"seconds", "peak_gib", "baseline_gib"} as JSON."""
    if who == HF:
        import torch
        import transformers
        torch.zeros(1, device="cuda")
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
        dtype_arg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"   # older versions ignore `dtype`

        def run():
            transformers.AutoModelForCausalLM.from_pretrained(directory, device_map="cuda",
                                                              **{dtype_arg: torch.bfloat16})
            torch.cuda.synchronize()
    else:
        import cupy

        from tilekit.models import families
        from tilekit import checkpoints
        cls = families.family_of_fields(checkpoints.find_checkpoint(directory).config()).model_class   # imported now
        cupy.zeros(1)

        def run():
            cls.from_pretrained(directory, dtype="bfloat16")
            cupy.cuda.runtime.deviceSynchronize()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                          # VmHWM := VmRSS, so that the peak is the load's
    except OSError:
        pass
    baseline = _status_kb("VmRSS")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_gib": (_status_kb("VmHWM") - baseline) / 2 ** 20,
                      "baseline_gib": baseline / 2 ** 20}))


def measure(who: str, directory: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "benchmarks.studies.load", "--child", who, str(directory)],
                       capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{who} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_preset(preset: str, directory: Path, reps: int, log) -> dict:
    """Every run of both loaders on the preset's checkpoint, alternating; the medians and #31's verdict."""
    log(f"[load {preset}] writing / checking {directory}")
    write(preset, directory)
    warm(directory)
    shapes = model(preset)[2]
    largest = max(map(math.prod, shapes.values())) * 2 / GiB
    runs = {HF: [], TILEKIT: []}
    for rep in range(reps):
        for who in (HF, TILEKIT) if rep % 2 == 0 else (TILEKIT, HF):
            runs[who].append(measure(who, directory))
            log(f"[load {preset}] {who}: {runs[who][-1]['seconds']:.2f} s, peak RSS +{runs[who][-1]['peak_gib']:.2f}"
                " GiB")
    median = {who: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_gib", "baseline_gib")}
              for who, rs in runs.items()}
    bounds = {"seconds": 1.2 * median[HF]["seconds"], "peak_gib": largest + 1}
    meets = median[TILEKIT]["seconds"] <= bounds["seconds"] and median[TILEKIT]["peak_gib"] <= bounds["peak_gib"]
    return {"preset": preset, "directory": str(directory), "largest_tensor_gib": largest, "runs": runs,
            "median": median, "bounds_31": bounds, "meets_31": meets}


def table(results: list[dict], reps: int) -> str:
    lines = []
    for r in results:
        hf_s = r["median"][HF]["seconds"]
        for who, m in r["median"].items():
            verdict = "" if who == HF else ("  meets #31" if r["meets_31"] else "  misses #31")
            lines.append(f"load {r['preset']:<14} {who:<24} {m['seconds']:7.2f} s {m['seconds'] / hf_s:6.2f}x HF  "
                         f"peak RSS +{m['peak_gib']:5.2f} GiB (baseline {m['baseline_gib']:.2f} GiB){verdict}")
        b = r["bounds_31"]
        lines.append(f"  #31 bounds: time <= {b['seconds']:.2f} s, peak RSS <= {b['peak_gib']:.2f} GiB (largest tensor "
                     f"{r['largest_tensor_gib']:.2f} GiB + 1 GiB)")
    lines.append(f"median of {reps}, alternating order, fresh processes, page cache warm")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.load", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append",
                        help=f"a model preset (repeatable; default {', '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tilekit-load"),
                        help="where the checkpoints are written, one folder per preset (default /tmp/tilekit-load)")
    parser.add_argument("--reps", type=int, default=3, help="loads of each loader (default 3)")
    parser.add_argument("--out", type=Path, help="write load.json here")
    parser.add_argument("--child", nargs=2, metavar=("WHO", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    presets = args.preset or list(DEFAULT_PRESETS)
    from tilekit.models import families
    unknown = [p for p in presets if p not in families.preset_names()]
    if unknown or args.reps < 1:
        parser.error(f"--preset {', '.join(unknown)}: not a preset" if unknown else "--reps must be >= 1")
    meta = system.environment("load", list(sys.argv[1:] if argv is None else argv))

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
    results = [run_preset(p, args.dir / p, args.reps, log) for p in presets]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load.json").write_text(json.dumps({**meta, "reps": args.reps, "results": results}, indent=1)
                                            + "\n")
    print(table(results, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
