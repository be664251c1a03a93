"""Tensor parallelism on one multi-GPU host: a Llama-3.1-8B-shape model (or another preset's: --preset
deepseek-v2-lite, llama-3.1-70b; random bf16 weights, written once as a Hugging Face checkpoint under /tmp) at each
TP size of --tp in the same run (default 1,2), each a fresh set of rank processes (tilekit.parallel.launch) reading
the same checkpoint. --quantize fp8 | int8 (Llama): the random weights are quantized per channel on one GPU as they
are drawn and written as a compressed-tensors checkpoint, which every rank then reads its slices of (a 70B model's
bf16 weights fit no single 80 GB GPU, its fp8 ones do: about 72 GB with the bf16 embedding and LM head, on disk too).
A run that fails (out of memory) is reported and the other sizes' rows are kept; the smallest size that ran is the
anchor.

    source .gpu/setup.sh && python -m benchmarks.studies.tp --out $OUT [--tp 1,2,4] [--layers 32] [--preset NAME]
        [--quantize fp8]

Rows: decode B1 and B8 (the replayed decode graph, all-reduces included, after a 128-token prompt: ms/token),
prefill B8 T1024 (generate()'s replayed prompt-prefill graph: every block over 8 x 1024 tokens and the last tokens'
logits), each with its ratio to the anchor and its strong-scaling efficiency (anchor ms x anchor size / (ms x
size)); each size above 1 runs twice, with messages up to 1 MiB through peer memory ("tp=N", the default:
tilekit.kernels.peer_all_reduce, the RMSNorm after it fused) and through NCCL alone ("tp=N nccl",
TILEKIT_PEER_ALL_REDUCE_BYTES=0); at each, one all-reduce of the decode step's residual stream (B x n_embd as the
model keeps it: bf16 for Llama, int64 fixed point for DeepSeek-V2; two per layer) timed as 64 of them captured in a
graph, plus the bus bandwidth of a 256 MiB all-reduce against the NVLink's (H100 / H200 SXM: 450 GB/s per
direction). The profile: rank 0's kernels of five replays of the decode B1 graph (CUPTI through torch.profiler)
split into all-reduce time (NCCL's or the peer kernel's, waiting for the slowest rank included), the other kernels'
time and the idle gaps between kernels, beside the rank's floor (its weight and KV bytes at the measured copy
bandwidth). The greedy tokens of each size are compared with the anchor's (bf16: the all-reduced sums round
differently, so a near tie may flip late tokens). Prints a table (rows labelled "tp=N ...") and writes
tp-PRESET[-QUANTIZE].json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.studies.breakdown import graph_ms, kernel_events, replay_ms
from tilekit.env import PEER_ALL_REDUCE_DEFAULT

PRESET = "llama-3.1-8b"
PROMPT, NEW = 128, 128
NVLINK_GBS = {"H100": 450.0, "H200": 450.0}     # NVLink 4, per direction per GPU (SXM)


def model_config(preset: str, layers: int | None):
    """The preset's config with `layers` decoder layers (None: all of them)."""
    from tilekit.models.families import preset_config
    config = preset_config(preset)
    return config if layers in (None, config.n_layer) else config.replace(n_layer=layers)


def checkpoint_path(preset: str, quantize: str | None = None) -> Path:
    return Path(tempfile.gettempdir()) / f"tilekit-tp-{preset}{'-' + quantize if quantize else ''}"


def write_checkpoint(path: Path, config, log=print, quantize: str | None = None) -> None:
    """Random weights of `config` (drawn on the GPU) saved as a bf16 checkpoint, or `quantize`d per channel as they
    are drawn and saved as a compressed-tensors one, unless already there (a run stopped while writing leaves no
    weights file, and the next one writes it again). A quantized model of a family whose files keep its own tensors
    (drawn_as_stored: Llama) is drawn a tensor at a time (drawn_tensors): a 70B model's
    fp8 weights fit an 80 GB GPU, with the whole model's draw buffers they did not. Any other model is drawn whole
    (seed 0) and saved by save_pretrained, which writes its family's layout."""
    from tilekit.models import quantization
    from tilekit import checkpoints
    from tilekit.models.families import family_of_config
    if (path / "model.safetensors").exists() and json.loads((path / "config.json").read_text()).get(
            "num_hidden_layers") == config.n_layer:     # the weights file is renamed into place once whole
        log(f"checkpoint {path} (kept from an earlier run)")
        return
    start = time.perf_counter()
    model_class = family_of_config(config).model_class
    weights = model_class.weights
    if quantize and drawn_as_stored(weights):
        tensors, raw = drawn_tensors(weights, config, quantize)
        hf_config = dict(config.to_hf_dict(), torch_dtype="bfloat16", quantization_config=quantization.
                         compressed_tensors_config(quantization.Scheme(quantize)))
        checkpoints.write_checkpoint(path, hf_config, tensors, dtype="bfloat16", raw=raw)
    else:
        model = model_class(config, dtype="bfloat16", seed=0, **({"quantize": quantize} if quantize else {}))
        model.save_pretrained(path)
        del model
    import cupy
    cupy.get_default_memory_pool().free_all_blocks()     # the ranks start on these GPUs next
    log(f"checkpoint {path} written in {time.perf_counter() - start:.0f} s")


def drawn_as_stored(weights) -> bool:
    """Whether a family's checkpoints hold its tensors as the model does (no LAYOUT.to_file) with every linear of
    weights.QUANTIZED quantized (no DEQUANTIZED ones): then drawn_tensors writes a checkpoint it loads."""
    return weights.LAYOUT.to_file is None and not weights.QUANTIZATION.dequantized


class Drawn:
    """A checkpoint tensor drawn on the GPU only when checkpoints.write_checkpoint reaches it (its shape and dtype known
    before): a float weight, or the codes or the scales of a linear quantized per channel (`part`), the linear's
    draw shared by the two and dropped once both were taken."""

    def __init__(self, draw, shape, dtype, part: str | None = None):
        self.draw, self.shape, self.dtype, self.part = draw, tuple(shape), dtype, part

    def value(self):
        return self.draw() if self.part is None else self.draw(self.part)

    def astype(self, dtype, copy=False):
        return self.value().astype(dtype, copy=copy)

    def get(self):
        import cupy
        return cupy.asnumpy(self.value())


def _sampler(shape, mean: float, std: float, seed: int, quantize: str, code_dtype):
    """draw(): the float tensor ~ N(mean, std) from `seed` (fp32, on the GPU); draw(part): "codes" (code_dtype) or
    "scale" of it quantized per channel, one draw serving both."""
    import cupy
    import numpy as np

    from tilekit.models import quantization
    kept = {}

    def draw(part=None):
        if part is None or not kept:
            w = cupy.random.default_rng(seed).standard_normal(shape, dtype=cupy.float32) * std + mean
            if part is None:
                return w
            codes = cupy.empty(shape, code_dtype)
            scale = cupy.empty(shape[0], np.float32)
            quantization.quantize_into(w, codes, scale, quantize)
            kept.update(codes=codes, scale=scale.reshape(-1, 1))
        return kept.pop(part)
    return draw


def drawn_tensors(weights, config, quantize: str, seed: int = 0) -> tuple[dict, dict]:
    """(name -> Drawn, name -> safetensors dtype of the codes and scales) of a random checkpoint of `config` whose
    linears (weights.QUANTIZED) are quantized per channel (`quantize`: int8 | fp8), in the file's order (each
    linear's codes, then its fp32 scales [out, 1]); tensor i drawn from seed + i, ~ weights.weight_stats."""
    import numpy as np

    from tilekit.kernels.quant_linear import WEIGHT_DTYPES
    from tilekit.models import quantization
    shapes = weights.state_dict_shapes(config)
    linears = set(quantization.linear_names(shapes, weights.QUANTIZED))
    code_dtype = np.dtype(WEIGHT_DTYPES[quantize])
    tensors, raw = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        draw = _sampler(shape, *weights.weight_stats(config, name), seed + i, quantize, code_dtype)
        if name in linears:
            tensors[name] = Drawn(draw, shape, code_dtype, "codes")
            tensors[quantization.scale_key(name)] = Drawn(draw, (shape[0], 1), np.dtype(np.float32), "scale")
            raw[name], raw[quantization.scale_key(name)] = quantization.FILE_DTYPES[quantize], "F32"
        else:
            tensors[name] = Drawn(draw, shape, np.dtype(np.float32))
    return tensors, raw


# -- one rank ---------------------------------------------------------------------------------------------

def all_reduce_rows(comm, streams: dict, count: int = 64) -> list[dict]:
    """One decode all-reduce (of each batch's residual stream, `streams`: B -> (shape, dtype)) timed as `count` of
    them in a captured graph; and the bus bandwidth of a 256 MiB one (NCCL's busbw: 2 (n - 1) / n x bytes /
    time)."""
    import cupy
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for B, (shape, dtype) in streams.items():
        x = cupy.zeros(shape, dtype)      # the values do not change the time
        with stream:
            comm.all_reduce(x)
            stream.begin_capture()
            for _ in range(count):
                comm.all_reduce(x)
            graph = stream.end_capture()
        ms = min(graph_ms(graph, stream, 10) for _ in range(3)) / count
        rows.append(dict(kind="all_reduce", batch=B, bytes=x.nbytes, us=ms * 1e3))
    big = cupy.zeros((128 << 20,), cupy.float16)
    with stream:
        comm.all_reduce(big)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(5):
            comm.all_reduce(big)
        end.record(stream)
        end.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, end) / 5
    n = comm.world_size
    rows.append(dict(kind="all_reduce", batch=None, bytes=big.nbytes, us=ms * 1e3,
                     busbw_gbs=2 * (n - 1) / n * big.nbytes / (ms * 1e-3) / 1e9))
    return rows


def busy_us(spans: list) -> float:
    """Microseconds covered by the union of (start, end) spans."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def cache_bytes(cache) -> float:
    """Bytes of the device arrays a KV (or latent) cache owns on this rank (views not counted twice), per position
    of its capacity."""
    import cupy
    arrays = [a for v in vars(cache).values() for a in (v if isinstance(v, (list, tuple)) else [v])]
    return sum(a.nbytes for a in arrays if isinstance(a, cupy.ndarray) and a.base is None) / cache.capacity


def decode_profile(gen, comm, reps: int = 5) -> dict:
    """Where one replay of gen's decode graph spends its time on this rank: the span from its first kernel's start
    to its last kernel's end, the time all-reduce kernels run (waiting for the slowest rank included), the time only
    other kernels run, and the gaps where none does (the median replay of `reps` by span, in us). The ranks line
    up on an all-reduce inside the profiled window and again before each replay, so that a rank's all-reduces do
    not count the others' profiler start-up as waiting."""
    import cupy
    from torch.profiler import ProfilerActivity, profile
    stream = gen.stream
    gen.decode_graph.launch(stream)
    stream.synchronize()
    flag = cupy.zeros((1,), cupy.float32)

    def line_up():
        if comm is not None:
            with stream:
                comm.all_reduce(flag)
        stream.synchronize()

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            line_up()
            gen.decode_graph.launch(stream)
        stream.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name.startswith("nccl") or "peer_all_reduce" in e.name)
               for e in kernel_events(prof)]
    per = len(kernels) // reps           # each replay's kernels after its line-up all-reduce (none at TP=1)
    replays = [kernels[i * per + (comm is not None):(i + 1) * per] for i in range(reps)]
    if not replays[0]:
        return {}
    stats = []
    for spans in replays:
        every = busy_us([k[:2] for k in spans])
        nccl = busy_us([k[:2] for k in spans if k[2]])
        span = spans[-1][1] - spans[0][0]
        stats.append(dict(kind="profile", batch=1, span_us=span, all_reduce_us=nccl, compute_us=every - nccl,
                          idle_us=span - every, kernels=len(spans)))
    return sorted(stats, key=lambda r: r["span_us"])[reps // 2]


def rank_main(args) -> int:
    """A rank: load the checkpoint's shard, time decode, prefill and the all-reduces; rank 0 writes the JSON."""
    import cupy
    import numpy as np

    from benchmarks.harness.report import streamed_bytes
    from benchmarks.harness.timing import copy_bandwidth
    from tilekit import env, parallel
    from tilekit.models.families import load_model
    dist = env.distributed()
    comm = parallel.NcclCommunicator(dist) if dist.world_size > 1 else None
    cupy.cuda.Device(dist.local_rank).use()
    start = time.perf_counter()
    model = load_model(args.checkpoint, dtype="bfloat16", comm=comm)
    cupy.cuda.runtime.deviceSynchronize()
    rows = [dict(kind="load", seconds=time.perf_counter() - start)]
    copy_gbs = copy_bandwidth()["gbs"]
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    tokens, streams = None, {}
    for B in (1, 8):
        model.forget_graphs()
        prompt = rng.integers(0, V, (B, PROMPT))
        out = model.generate(prompt, NEW, temperature=0, eos_token_id=[])
        tokens = tokens if tokens is not None else np.stack(out)[:, PROMPT:].tolist()
        (gen,) = model.runner._generations.values()
        streams[B] = (gen.state.acts.x.shape, gen.state.acts.x.dtype)    # the residual stream the step all-reduces
        times = [replay_ms(gen, 50) for _ in range(3)]
        kv = cache_bytes(gen.state.cache) * (PROMPT + NEW / 2)           # what the mean step reads
        rows.append(dict(kind="decode", batch=B, ms=float(np.median(times)), rounds=times,
                         floor_ms=(streamed_bytes(model, B) + kv) / (copy_gbs * 1e9) * 1e3, copy_gbs=copy_gbs))
        if B == 1:
            rows.append(decode_profile(gen, comm))
    model.forget_graphs()
    ids = rng.integers(0, V, (8, 1024))
    for _ in range(2):       # a prompt length seen twice: its prefill is captured
        model.generate(ids, 2, temperature=0, eos_token_id=[])
    (gen,) = model.runner._generations.values()
    buf = gen.prompts[1024]
    times = [graph_ms(buf.graph, gen.stream, 3) for _ in range(3)]
    rows.append(dict(kind="prefill", batch=8, tokens=1024, ms=float(np.median(times)), rounds=times))
    model.forget_graphs()
    if comm is not None:
        rows += all_reduce_rows(comm, streams)
    if dist.rank == 0:
        Path(args.result).write_text(json.dumps(dict(tp=dist.world_size, rows=rows, tokens=tokens)))
    if comm is not None:
        comm.close()
    return 0


# -- the study --------------------------------------------------------------------------------------------

def run(sizes: list[int], layers: int | None, out: Path | None, log=print, preset: str = PRESET,
        quantize: str | None = None) -> dict:
    import cupy

    from tilekit import parallel
    from tilekit.device import device_info
    gpus = cupy.cuda.runtime.getDeviceCount()
    if max(sizes) > gpus:
        raise SystemExit(f"tp.py: --tp {max(sizes)} needs {max(sizes)} GPUs, this host shows {gpus}")
    config = model_config(preset, layers)
    checkpoint = checkpoint_path(preset, quantize)
    write_checkpoint(checkpoint, config, log, quantize)
    name = device_info().name
    results = {}
    runs = [(world, nccl) for world in sizes for nccl in ((False, True) if world > 1 else (False,))]
    with tempfile.TemporaryDirectory() as tmp:
        for world, nccl in runs:
            label = f"tp={world}" + (" nccl" if nccl else "")
            result = Path(tmp) / f"tp{world}{nccl}.json"
            start = time.perf_counter()
            status = parallel.launch(world, ["-m", "benchmarks.studies.tp", "--rank", "--checkpoint", str(checkpoint),
                                             "--result", str(result)], program=[sys.executable], quiet_ranks=False,
                                     env={"TILEKIT_PEER_ALL_REDUCE_BYTES": str(0 if nccl else PEER_ALL_REDUCE_DEFAULT)})
            if status:          # e.g. a model that fits only sharded: the other sizes' rows are kept
                log(f"tp.py: the {label} ranks failed (status {status})")
                continue
            results[label] = json.loads(result.read_text())
            log(f"{label}: {time.perf_counter() - start:.0f} s")
    if not results:
        raise SystemExit("tp.py: no TP size ran")
    nvlink = next((v for k, v in NVLINK_GBS.items() if k in name), None)
    table = format_table(results, config, nvlink)
    weights = f"{quantize} weights (per channel, bf16 activations in decode)" if quantize else "bf16"
    log(f"\n{name} x{max(sizes)}, {preset} shape ({config.n_layer} layers), {weights}, random weights\n" + table)
    report = dict(gpu=name, preset=preset, layers=config.n_layer, sizes=sizes, quantize=quantize, results=results,
                  nvlink_gbs=nvlink)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"tp-{preset}{'-' + quantize if quantize else ''}"
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{stem}.md").write_text(table + "\n")
    return report


def format_table(results: dict, config, nvlink) -> str:
    """The rows of every run (results: label -> rank 0's result; "tp=N" small messages through peer memory, "tp=N nccl"
    all through NCCL), against the smallest TP size's as anchor."""
    def row(label, kind, batch):
        return next((r for r in results[label]["rows"] if r["kind"] == kind and r.get("batch") == batch), None)
    anchor = min(results, key=lambda label: (results[label]["tp"], label))
    size = results[anchor]["tp"]
    lines = [f"| run | ms | vs {anchor} | scaling efficiency | % of the rank's floor |", "|---|---:|---:|---:|---:|"]
    for kind, batch, what in (("decode", 1, "decode B1 ms/token"), ("decode", 8, "decode B8 ms/token"),
                              ("prefill", 8, "prefill B8 T1024 ms")):
        base = row(anchor, kind, batch)["ms"]
        for label in results:
            r, world = row(label, kind, batch), results[label]["tp"]
            floor = f"{100 * r['floor_ms'] / r['ms']:.0f}% of {r['floor_ms']:.3f}" if "floor_ms" in r else ""
            lines.append(f"| {label} {what} | {r['ms']:.3f} | {r['ms'] / base:.2f}x | "
                         f"{100 * base * size / (r['ms'] * world):.0f}% | {floor} |")
    L = config.n_layer
    for label in results:
        prof = row(label, "profile", 1)
        if prof:
            lines.append(f"| {label} decode B1 profile (rank 0, us per step): kernels span {prof['span_us']:.0f}, "
                         f"all-reduce {prof['all_reduce_us']:.0f}, other kernels {prof['compute_us']:.0f}, idle "
                         f"{prof['idle_us']:.0f} ({prof['kernels']} kernels) | | | | |")
        if results[label]["tp"] == 1:
            continue
        for B in (1, 8):
            r = row(label, "all_reduce", B)
            step = row(label, "decode", B)["ms"]
            lines.append(f"| {label} all-reduce B{B} ({r['bytes']} B): {r['us']:.1f} us, "
                         f"{2 * r['us']:.1f} us/layer, "
                         f"{2 * L * r['us'] / 1e3:.3f} ms/step ({100 * 2 * L * r['us'] / 1e3 / step:.0f}% of the step) "
                         "| | | | |")
        big = row(label, "all_reduce", None)
        lines.append(f"| {label} all-reduce 256 MiB: bus bandwidth {big['busbw_gbs']:.0f} GB/s"
                     + (f" ({100 * big['busbw_gbs'] / nvlink:.0f}% of NVLink's {nvlink:.0f} GB/s)" if nvlink else "")
                     + " | | | | |")
    one = results[anchor]["tokens"]
    for label in results:
        if label != anchor:
            many = results[label]["tokens"]
            agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(one, many)]
            lines.append(f"| {label} greedy B1 tokens agreeing with {anchor}: {min(agree)} of {len(one[0])} "
                         "| | | | |")
    return "\n".join(lines)


def tp_sizes(text: str) -> list[int]:
    """--tp's comma-separated sizes, each a positive integer, sorted, without repeats."""
    try:
        sizes = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tp takes comma-separated positive integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--tp takes comma-separated positive integers, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=tp_sizes, default=[1, 2],
                   help="comma-separated TP sizes, each run in turn; the smallest is the anchor (default 1,2)")
    p.add_argument("--preset", default=PRESET, help=f"the model shape (default {PRESET}; e.g. deepseek-v2-lite, "
                                                    "llama-3.1-70b)")
    p.add_argument("--quantize", choices=("int8", "fp8"),
                   help="write the checkpoint with the linears quantized per channel (Llama)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="where tp-PRESET.json goes (default $OUT)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        return rank_main(args)
    run(args.tp, args.layers, args.out, preset=args.preset, quantize=args.quantize)
    return 0


if __name__ == "__main__":
    sys.exit(main())
