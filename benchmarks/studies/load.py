"""Loading a checkpoint (issue #63): tilekit's from_pretrained against transformers' at its best, same files, same
run, beside the host-to-device copy floor of the same bytes.

    python -m benchmarks.studies.load [--preset llama-3.2-1b] [--preset llama-3.1-8b] [--writer transformers]
                                      [--single] [--quantize fp8] [--dir DIR] [--reps 3] [--out DIR]
                                      [--staging 8x32 ...] [--profile]

For each preset (default: both above) a random-weight bfloat16 checkpoint is written once under DIR (default
/tmp/tilekit-load) by transformers' own save_pretrained (--writer transformers, the default: hub-style 5 GB shards,
or one file with --single) or by tilekit's (--writer tilekit); --quantize fp8 writes tilekit's FP8 checkpoint of the
preset (compressed-tensors, per-channel scales), which transformers does not load without the compressed-tensors
package (its row is then tilekit's alone, against the floor). With the page cache warm (every file read once), each
load runs in a fresh process, the loaders alternating and both orders taken, --reps times. Every process imports
what its loader runs before the clock and starts CUDA: transformers, torch and the model's own modelling module (its
class resolved from the config, so modeling_llama, modeling_utils, generation and accelerate are imported before
the clock, as tilekit's model class is), then times `from_pretrained(dtype=bfloat16, device_map="cuda")` to a
device synchronize; tilekit times its family's from_pretrained(dtype="bfloat16"). Peak memory above the point the
clock starts is reported twice: VmHWM (resident, file-backed pages of a memory-mapped checkpoint included) and the
peak of RssAnon (anonymous memory only, sampled every 5 ms). A separate process measures the floor: pinned
host-to-device copies of 1 GiB (GB/s; the checkpoint's bytes over it), and the loader's finite check over a 1 GiB
bf16 array. The table is printed last, with #63's verdict per row (time <= 0.5x transformers', >= 12.5 GB/s from
the page cache for checkpoints of 8 GB and more, peak anonymous RSS <= the largest tensor + 1 GiB); --out DIR gets
load.json (every run, the medians, the floor, the GPU and versions). Each tilekit row gives the seconds its stream
spent setting up and running (the pinned staging ring included); --staging BxM adds rows of tilekit with another staging ring
(B buffers of M MiB), and --profile one more tilekit load per checkpoint under cProfile (in load.json and the log).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import pstats
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.harness import system
from tilekit import checkpoints

HF, TILEKIT = "transformers", "tilekit"
DEFAULT_PRESETS = ("llama-3.2-1b", "llama-3.1-8b")
SHARD_BYTES = 5 * 10 ** 9
GiB = 2 ** 30
TARGET_RATIO, TARGET_GBS, LARGE = 0.5, 12.5, 8 * 10 ** 9     # #63: <= 0.5x transformers, >= 12.5 GB/s from 8 GB up


def model(preset: str):
    """The preset's family, config and tensor shapes."""
    from tilekit.models import families
    config = families.preset_config(preset)
    family = families.family_of_config(config)
    return family, config, family.weights.state_dict_shapes(config)


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def write(preset: str, directory: Path, writer: str, single: bool, quantize: str | None) -> None:
    """The preset's random checkpoint in `directory`, unless it holds this one already (a marker names it)."""
    label = f"{preset} {writer} {'single' if single else 'sharded'} {quantize or 'bf16'}"
    marker = directory / "tilekit-bench-checkpoint"
    if marker.is_file() and marker.read_text() == label:
        return
    directory.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "benchmarks.studies.load", "--write-child", preset, str(directory),
                        writer, "single" if single else "sharded", quantize or "bf16"], capture_output=True, text=True,
                       timeout=1800)
    if p.returncode:
        raise RuntimeError(f"writing {label} failed:\n{p.stderr[-4000:]}")
    marker.write_text(label)


def write_child(preset: str, directory: str, writer: str, layout: str, quantize: str) -> None:
    """Write the checkpoint in this fresh process: transformers' save_pretrained of its model of the preset's config
    (random weights drawn on the GPU), or tilekit's (bf16, or FP8 with --quantize)."""
    family, config, shapes = model(preset)
    shard = None if layout == "single" else SHARD_BYTES
    if writer == "transformers":
        import tempfile

        import torch
        import transformers
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(dict(config.to_hf_dict(), torch_dtype="bfloat16")))
            hf_config = transformers.AutoConfig.from_pretrained(tmp)
        with torch.device("cuda"):
            hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        hf_model.save_pretrained(directory, max_shard_size=f"{shard // 10 ** 9}GB" if shard else "10000GB")
        return
    if quantize == "bf16":
        import ml_dtypes
        import numpy as np
        pool = (np.random.default_rng(0).standard_normal(max(map(math.prod, shapes.values())), np.float32) * 0.02
                ).astype(ml_dtypes.bfloat16)     # every tensor a view of one pool: the largest tensor's memory
        family.weights.save_state_dict(directory, config, {n: pool[:math.prod(s)].reshape(s)
                                                           for n, s in shapes.items()},
                                       dtype="bfloat16", shard_bytes=shard)
        return
    family.model_class(config, dtype="bfloat16", quantize=quantize, seed=0).save_pretrained(directory)


def warm(directory: Path) -> None:
    """Read every file once, so that every loader finds the checkpoint in the page cache."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class AnonPeak:
    """The peak of RssAnon while the block runs, sampled every 5 ms by a thread."""

    def __enter__(self):
        self.peak, self.running = _status_kb("RssAnon"), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, _status_kb("RssAnon"))
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _status_kb("RssAnon"))


def child(who: str, directory: str, profile: bool = False) -> None:
    """One load in this fresh process; prints {"seconds", "peak_gib", "anon_peak_gib", "baseline_gib"} as JSON, for
    tilekit with its stream's phases (staged) and, with `profile`, cProfile's 30 costliest calls."""
    if who == HF:
        import torch
        import transformers
        config = transformers.AutoConfig.from_pretrained(directory)
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]   # its modelling module imported now
        torch.zeros(1, device="cuda")

        def run():
            cls.from_pretrained(directory, device_map="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
    else:
        import cupy

        from tilekit import checkpoints
        from tilekit.models import families
        cls = families.family_of_fields(checkpoints.find_checkpoint(directory).config()).model_class   # imported now
        cupy.zeros(1)
        phases = staged(who)

        def run():
            cls.from_pretrained(directory, dtype="bfloat16")
            cupy.cuda.runtime.deviceSynchronize()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                          # VmHWM := VmRSS, so that the peak is the load's
    except OSError:
        pass
    baseline, anon = _status_kb("VmRSS"), _status_kb("RssAnon")
    profiler = cProfile.Profile() if profile else None
    with AnonPeak() as peak:
        start = time.perf_counter()
        with profiler or contextlib.nullcontext():
            run()
        seconds = time.perf_counter() - start
    row = {"seconds": seconds, "peak_gib": (_status_kb("VmHWM") - baseline) / 2 ** 20,
           "anon_peak_gib": (peak.peak - anon) / 2 ** 20, "baseline_gib": baseline / 2 ** 20}
    if who != HF:
        row.update(phases)
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        row["profile"] = text.getvalue()
    print(json.dumps(row))


def staged(who: str) -> dict:
    """For a tilekit load: its staging ring as `who` names it ("tilekit BxM": B buffers of M MiB; plain "tilekit":
    load_tensors' defaults), and the returned dict filled, once the load is done, with the seconds its stream spent
    setting up (its list of pieces) and running (the ring pinned by the read workers, reads, copies, conversions,
    checks); the rest of a load is the config, the headers and the model's allocation."""
    from tilekit.checkpoints import load, stream
    if who != TILEKIT:
        buffers, mib = variant(who)
        load.load_tensors.__kwdefaults__.update(buffers=buffers, buffer_bytes=mib << 20)
    phases = {"stream_setup_s": 0.0, "stream_run_s": 0.0}

    def timed(method, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                phases[key] += time.perf_counter() - start
        return wrapper
    stream.LoadStream.__init__ = timed(stream.LoadStream.__init__, "stream_setup_s")
    stream.LoadStream.run = timed(stream.LoadStream.run, "stream_run_s")
    return phases


def variant(who: str) -> tuple[int, int]:
    """("tilekit BxM") -> (B buffers, M MiB each)."""
    buffers, mib = who.removeprefix(TILEKIT + " ").split("x")
    return int(buffers), int(mib)


def floor_child() -> None:
    """Pinned host-to-device copies of 1 GiB, and the loader's finite check over 1 GiB of bf16 (median of 5 each,
    after a warm-up); prints {"h2d_gbs", "finite_check_gbs"} as JSON."""
    import cupy
    import numpy as np

    from tilekit.checkpoints.stream import CupyDevice

    def timed(fn, stream) -> float:
        fn()
        times = []
        for _ in range(5):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return statistics.median(times)
    device = CupyDevice()
    host = device.staging(GiB)
    host[:] = np.random.default_rng(0).integers(0, 255, GiB, dtype=np.uint8)
    raw = device.empty((GiB,), "uint8")
    h2d = timed(lambda: device.upload(host, raw), device.stream)
    values = cupy.random.default_rng(0).standard_normal(GiB // 2, dtype=cupy.float32).astype(cupy.float16)
    flags = device.flags(1)
    check = timed(lambda: device.flag_nonfinite(values, "float16", flags, 0), device.work)
    assert not device.read_flags(flags)[0], "the finite check flagged finite values"
    print(json.dumps({"h2d_gbs": GiB / h2d / 1e9, "finite_check_gbs": GiB / check / 1e9}))


def measure(argv: list[str]) -> dict:
    p = subprocess.run([sys.executable, "-m", "benchmarks.studies.load", *argv], capture_output=True, text=True,
                       timeout=1800)
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_checkpoint(label: str, directory: Path, loaders: tuple[str, ...], reps: int, floor: dict, log,
                   profile: bool = False) -> dict:
    """Every run of the loaders on one checkpoint, alternating (both orders), the medians and #63's verdict (of
    plain tilekit, load_tensors' defaults; other tilekit rows are staging variants); with `profile`, one more
    tilekit load under cProfile, its costliest calls kept."""
    warm(directory)
    nbytes = checkpoint_bytes(directory)
    with checkpoints.find_checkpoint(directory).tensor_files() as files:
        largest = max(t.nbytes for t in files.tensors.values()) / GiB
    runs = {who: [] for who in loaders}
    for rep in range(reps):
        for who in loaders if rep % 2 == 0 else loaders[::-1]:
            runs[who].append(measure(["--child", who, str(directory)]))
            r = runs[who][-1]
            stream = f", stream {r['stream_setup_s']:.2f} + {r['stream_run_s']:.2f} s" if "stream_run_s" in r else ""
            log(f"[load {label}] {who}: {r['seconds']:.2f} s, peak RSS +{r['peak_gib']:.2f} GiB, anonymous "
                f"+{r['anon_peak_gib']:.2f} GiB{stream}")
    median = {who: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for who, rs in runs.items()}
    ours = median[TILEKIT]
    checks = {"anonymous peak <= largest tensor + 1 GiB": ours["anon_peak_gib"] <= largest + 1}
    if HF in median:
        checks[f"<= {TARGET_RATIO}x transformers"] = ours["seconds"] <= TARGET_RATIO * median[HF]["seconds"]
    if nbytes >= LARGE:
        checks[f">= {TARGET_GBS} GB/s"] = nbytes / ours["seconds"] / 1e9 >= TARGET_GBS
    result = {"checkpoint": label, "directory": str(directory), "bytes": nbytes, "largest_tensor_gib": largest,
              "floor_seconds": nbytes / (floor["h2d_gbs"] * 1e9), "runs": runs, "median": median, "checks_63": checks}
    if profile:
        result["profile"] = measure(["--child", TILEKIT, str(directory), "--profile"])["profile"]
        log(f"[load {label}] tilekit under cProfile:\n{result['profile']}")
    return result


def table(results: list[dict], floor: dict, reps: int) -> str:
    lines = [f"load floor: pinned host-to-device copies {floor['h2d_gbs']:.1f} GB/s; the loader's finite check "
             f"{floor['finite_check_gbs']:.0f} GB/s (1 GiB bf16)"]
    for r in results:
        hf_s = r["median"].get(HF, {}).get("seconds")
        for who, m in r["median"].items():
            ratio = f"{m['seconds'] / hf_s:5.2f}x transformers" if hf_s else " " * 18
            rate = r["bytes"] / m["seconds"] / 1e9
            stream = f", stream {m['stream_setup_s']:.2f} + {m['stream_run_s']:.2f} s" if "stream_run_s" in m else ""
            lines.append(f"load {r['checkpoint']:<34} {who:<12} {m['seconds']:6.2f} s {rate:5.1f} GB/s {ratio}  "
                         f"peak RSS +{m['peak_gib']:5.2f} GiB, anonymous +{m['anon_peak_gib']:5.2f} GiB{stream}")
        lines.append(f"load {r['checkpoint']:<34} {'floor':<12} {r['floor_seconds']:6.2f} s (its "
                     f"{r['bytes'] / 1e9:.2f} GB at the copy rate; largest tensor {r['largest_tensor_gib']:.2f} GiB)")
        lines.append("  #63: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["checks_63"].items()))
    lines.append(f"median of {reps}, alternating order, fresh processes, page cache warm")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.load", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append",
                        help=f"a model preset (repeatable; default {', '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--writer", choices=("transformers", "tilekit"), default="transformers",
                        help="whose save_pretrained writes the checkpoints (default transformers)")
    parser.add_argument("--single", action="store_true", help="one model.safetensors instead of 5 GB shards")
    parser.add_argument("--quantize", choices=("fp8", "int8"), help="tilekit's quantized checkpoint of each preset")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tilekit-load"),
                        help="where the checkpoints are written, one folder each (default /tmp/tilekit-load)")
    parser.add_argument("--reps", type=int, default=3, help="loads of each loader (default 3)")
    parser.add_argument("--out", type=Path, help="write load.json here")
    parser.add_argument("--staging", action="append", default=[], metavar="BxM",
                        help="also time tilekit with B staging buffers of M MiB (repeatable; e.g. 8x32)")
    parser.add_argument("--profile", action="store_true", help="one more tilekit load per checkpoint under cProfile")
    parser.add_argument("--child", nargs=2, metavar=("WHO", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--write-child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--floor-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child, profile=args.profile)
        return 0
    if args.write_child:
        write_child(*args.write_child)
        return 0
    if args.floor_child:
        floor_child()
        return 0
    presets = args.preset or list(DEFAULT_PRESETS)
    from tilekit.models import families
    unknown = [p for p in presets if p not in families.preset_names()]
    if unknown or args.reps < 1:
        parser.error(f"--preset {', '.join(unknown)}: not a preset" if unknown else "--reps must be >= 1")
    staging = [f"{TILEKIT} {v}" for v in args.staging]
    for who in staging:
        try:
            buffers, mib = variant(who)
        except ValueError:
            buffers = mib = 0
        if buffers < 1 or mib < 1:
            parser.error(f"--staging {who.removeprefix(TILEKIT + ' ')}: not BxM with positive integers (e.g. 8x32)")
    if args.quantize and args.writer != "tilekit":
        parser.error("--quantize writes tilekit's quantized checkpoints: give --writer tilekit")
    meta = system.environment("load", list(sys.argv[1:] if argv is None else argv))

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)
    floor = measure(["--floor-child"])
    results = []
    for preset in presets:
        label = f"{preset} {args.quantize or 'bf16'} ({args.writer}, {'one file' if args.single else '5 GB shards'})"
        directory = args.dir / f"{preset}-{args.writer}-{'single' if args.single else 'sharded'}-" \
                               f"{args.quantize or 'bf16'}"
        log(f"[load {label}] writing / checking {directory}")
        write(preset, directory, args.writer, args.single, args.quantize)
        loaders = ((TILEKIT,) if args.quantize else (HF, TILEKIT)) + tuple(staging)
        results.append(run_checkpoint(label, directory, loaders, args.reps, floor, log, args.profile))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load.json").write_text(json.dumps({**meta, "reps": args.reps, "floor": floor,
                                                        "results": results}, indent=1) + "\n")
    print(table(results, floor, args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
