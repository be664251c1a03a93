"""Loading a Llama checkpoint (issue #31): tilekit's streaming loader against Hugging Face from_pretrained.

    python -m benchmarks.studies.load --preset llama-3.2-1b [--dir DIR] [--reps 3] [--today]

Writes a random-weight bfloat16 checkpoint of the preset with safetensors, sharded as the hub shards it (5 GB
files), unless DIR already holds it. Then, with the page cache warmed, each load runs in a fresh subprocess,
the two alternating, `--reps` times: HF AutoModelForCausalLM.from_pretrained(dtype=bfloat16, device_map="cuda"),
the anchor, and tilekit's hf.load_tensors of every tensor into new bfloat16 CuPy arrays (phase B: the model's
from_pretrained). Each child times its load after imports and CUDA start-up, and measures peak resident memory
above that point (VmHWM after resetting it through /proc/self/clear_refs). Rows: the median time and peak of
each, and whether tilekit meets #31 (time <= 1.2x HF; peak <= the largest tensor + 1 GB).
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

CHILDREN = ("HF from_pretrained", "tilekit load_tensors")
TODAY = "tilekit Llama.from_pretrained today"
SHARD_BYTES = 5 * 10 ** 9


def llama(preset: str):
    """The preset's config and its tensors' shapes."""
    from tilekit.models import families
    config = families.preset_config(preset)
    return config, families.family_of_config(config).weights.state_dict_shapes(config)


def write(preset: str, directory: Path) -> None:
    """A random checkpoint: every tensor a view of one N(0, 0.02) bfloat16 pool as large as the largest tensor, so
    writing it costs that much memory, not the checkpoint's."""
    import ml_dtypes
    import numpy as np

    from tilekit.models import hf
    marker = directory / "tilekit-bench-preset"
    if marker.is_file() and marker.read_text() == preset:
        return
    config, shapes = llama(preset)
    largest = max(math.prod(s) for s in shapes.values())
    pool = (np.random.default_rng(0).standard_normal(largest, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    tensors = {name: pool[:math.prod(shape)].reshape(shape) for name, shape in shapes.items()}
    hf.write_checkpoint(directory, dict(config.to_hf_dict(), torch_dtype="bfloat16"), tensors, dtype="bfloat16",
                        shard_bytes=SHARD_BYTES)
    marker.write_text(preset)


def warm(directory: Path) -> None:
    """Read every file once so that both loaders find the checkpoint in the page cache."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(which: str, preset: str, directory: str) -> None:
    """One load in this fresh process; prints {"seconds", "peak_gb", "baseline_gb"} as JSON."""
    if which == CHILDREN[0]:
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

        from tilekit.models import hf
        cupy.zeros(1)
        hf.CupyDevice().staging(1)

        def run():
            if which == TODAY:
                from tilekit.models import load_model
                load_model(directory)
            else:
                checkpoint = hf.find_checkpoint(directory)
                _, shapes = llama(preset)
                with checkpoint.tensor_files() as files:
                    hf.load_tensors(files, {n: hf.Target(s, "bfloat16") for n, s in shapes.items()})
            cupy.cuda.runtime.deviceSynchronize()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                          # VmHWM := VmRSS, so the peak is the load's
    except OSError:
        pass
    baseline = _status_kb("VmRSS")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_gb": (_status_kb("VmHWM") - baseline) / 2 ** 20,
                      "baseline_gb": baseline / 2 ** 20}))


def measure(which: str, preset: str, directory: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "benchmarks.studies.load", "--child", which, preset, str(directory)],
                       capture_output=True, text=True, timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{which} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--dir", type=Path, help="where the checkpoint is written (default: /tmp/tilekit-load-PRESET)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--today", action="store_true", help="also time today's Llama.from_pretrained (slow)")
    parser.add_argument("--child", nargs=3, metavar=("WHICH", "PRESET", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    directory = args.dir or Path(f"/tmp/tilekit-load-{args.preset}")
    write(args.preset, directory)
    warm(directory)
    _, shapes = llama(args.preset)
    largest_gb = max(math.prod(s) for s in shapes.values()) * 2 / 2 ** 30
    names = CHILDREN + ((TODAY,) if args.today else ())
    runs = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names if rep % 2 == 0 else reversed(names):
            runs[name].append(measure(name, args.preset, directory))
    hf_s = statistics.median(r["seconds"] for r in runs[CHILDREN[0]])
    for name in names:
        s = statistics.median(r["seconds"] for r in runs[name])
        peak = statistics.median(r["peak_gb"] for r in runs[name])
        verdict = "" if name == CHILDREN[0] else (
            "  meets #31" if s <= 1.2 * hf_s and peak <= largest_gb + 1 else "  misses #31")
        print(f"load {args.preset:<14} {name:<36} {s:7.2f} s {s / hf_s:6.2f}x HF  peak RSS +{peak:5.2f} GB "
              f"(baseline {statistics.median(r['baseline_gb'] for r in runs[name]):.2f} GB){verdict}")
    print(f"  #31 bounds: time <= {1.2 * hf_s:.2f} s, peak RSS <= {largest_gb + 1:.2f} GB (largest tensor "
          f"{largest_gb:.2f} GB + 1 GB); median of {args.reps}, alternating order, page cache warm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
