"""Long-context attention (issue #35): decode attention against SDPA and the copy bandwidth, FP8-cache rows beside
bf16, causal prefill attention against SDPA, and decode ms/token of the Llama-3.1-8B shape at long contexts.

    python -m benchmarks.studies.long_context [--out DIR] [--layers 4]

Decode rows: decode_attention (one new token, its key and value written by the same launch) for B 1/8/32, head
dim 64/128, 32 query heads in GQA groups of 1/4/8, contexts 4K-128K (shapes whose bf16 cache exceeds 16 GiB are
left out), against F.scaled_dot_product_attention (enable_gqa) under each of the flash / efficient / cuDNN
backends (the fastest that runs; outputs checked against tilekit's), L2 flushed. % copy: the cache bytes read
per second against a device-to-device copy moving the same bytes (half of them read, half written), timed
beside it. Each row is timed twice on both sides: one call with its host cost (tilekit's Python dispatch, SDPA's
C++ one), and a CUDA-graph replay of the call (GPU work alone, as a model's replayed decode step runs it). fp8
rows: the same shapes over an FP8 (e4m3) cache, half the bytes, against the same SDPA time.
Prefill rows: causal attention() against the fastest SDPA backend, TFLOP/s of the visible half.
Model rows: the replayed decode step (greedy, bf16 weights, random) of the Llama-3.1-8B shape with --layers of
its 32 layers (the whole model's step is about 32 / layers times the non-head part), bf16 and FP8 caches, at
8K / 32K / 128K contexts, against the gpt-fast-style torch.compile(mode="reduce-overhead") step
(benchmarks.suites.gptfast) where its (capacity x capacity) causal mask fits in 4 GiB (8K, 32K).
The last thing printed is the summary table; --out gets long_context.json with every row.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

HEADS = 32
DECODE_BATCHES, HEAD_DIMS, GROUPS = (1, 8, 32), (64, 128), (1, 4, 8)
CONTEXTS = (4096, 16384, 32768, 131072)
MAX_CACHE_BYTES = 16 << 30
PREFILL = ((4, 16, 2048, 128), (4, 16, 4096, 128), (4, 16, 8192, 128), (4, 16, 4096, 64), (4, 16, 8192, 64))
MODEL_CONTEXTS = (8192, 32768, 131072)
MAX_MASK_BYTES = 4 << 30
BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
REPS = 10


def timed(fn) -> float:
    """Median ms of fn, L2 flushed before each rep."""
    from benchmarks.harness.timing import measure
    return measure(fn, flush_l2=True, warmup=2, reps=REPS)["median_ms"]


def timed_graph(fn) -> float:
    """Median ms of a CUDA-graph replay of fn (its GPU work alone, no launch cost), L2 flushed before each rep; nan
    when fn cannot be captured."""
    from benchmarks.harness.timing import measure_graph
    found = measure_graph(fn, flush_l2=True, warmup=2, reps=REPS)
    return math.nan if "eager" in found else found["median_ms"]


def sdpa_call(q, k, v, backend: str, **kw):
    """F.scaled_dot_product_attention(q, k, v, **kw) under one backend (a BACKENDS name)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return run


def best_sdpa(q, k, v, reference, **kw) -> tuple:
    """(ms, backend, call) of the fastest SDPA backend that runs on these inputs and agrees with `reference`
    (tilekit's output on the device; relative error <= 2e-2; call: sdpa_call's, to time again); (nan, reasons,
    None) when none does."""
    from benchmarks.harness.checks import rel_error
    best, why = (math.nan, "", None), []
    for name in BACKENDS:
        run = sdpa_call(q, k, v, name, **kw)
        try:
            err = rel_error(run(), reference)
        except Exception as e:  # noqa: BLE001 - a backend that does not take this shape or build
            why.append(f"{name}: {type(e).__name__}")
            continue
        if not err <= 2e-2:
            why.append(f"{name}: differs ({err:.1e})")
            continue
        ms = timed(run)
        if not ms >= best[0]:
            best = (ms, name.removesuffix("_ATTENTION").lower(), run)
    return best if best[2] else (math.nan, "; ".join(why), None)


def copy_ms(nbytes: int) -> float:
    """A device-to-device copy of nbytes / 2 bytes: nbytes moved."""
    import cupy
    src = cupy.empty(nbytes // 2, cupy.uint8)
    dst = cupy.empty_like(src)
    return timed(lambda: cupy.copyto(dst, src))


def cache_bytes(B: int, Hkv: int, D: int, context: int) -> int:
    """Bytes of a bf16 key and value cache (what one decode call reads)."""
    return 2 * B * Hkv * context * D * 2


def decode_shapes():
    """(B, Hkv, D, context) of each decode row."""
    for D in HEAD_DIMS:
        for G in GROUPS:
            for B in DECODE_BATCHES:
                for ctx in CONTEXTS:
                    if cache_bytes(B, HEADS // G, D, ctx) <= MAX_CACHE_BYTES:
                        yield B, HEADS // G, D, ctx


def kernel_calls(parts) -> list[tuple]:
    """(op, problem) of every decode_attention and attention call of the decode and prefill parts."""
    from tilekit.kernels.attention import ATTENTION
    from tilekit.kernels.decode_attention import DECODE_ATTENTION
    calls = []
    if "decode" in parts:
        calls += [(DECODE_ATTENTION, dict(dtype="bfloat16", B=B, H=HEADS, Hkv=Hkv, nq=1, capacity=ctx, D=D, new_kv=1,
                                          fp8=fp8)) for B, Hkv, D, ctx in decode_shapes() for fp8 in (0, 1)]
    if "prefill" in parts:
        calls += [(ATTENTION, dict(dtype="bfloat16", B=B, H=H, Hkv=H, Tq=T, Tk=T, D=D, causal=1))
                  for B, H, T, D in PREFILL]
    return calls


def decode_rows(log=print) -> list[dict]:
    import cupy
    import torch

    from benchmarks.harness.timing import free_memory
    from tilekit.kernels import decode_attention
    rows = []
    for B, Hkv, D, ctx in decode_shapes():
        G, nbytes = HEADS // Hkv, cache_bytes(B, Hkv, D, ctx)
        q = torch.randn(B, HEADS, 1, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(B, Hkv, ctx, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn(B, Hkv, ctx, D, dtype=torch.bfloat16, device="cuda")
        new_k, new_v = k[:, :, -1:].clone(), v[:, :, -1:].clone()    # rewritten as they are
        lengths = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)

        def ours():
            decode_attention(q, k, v, lengths, new_k=new_k, new_v=new_v, out=out)
        ours()
        sdpa_ms, backend, sdpa = best_sdpa(q, k, v, out.clone(), enable_gqa=True)
        sdpa_graph_ms = timed_graph(sdpa) if sdpa else math.nan
        ms, graph_ms, base = timed(ours), timed_graph(ours), copy_ms(nbytes)
        row = dict(B=B, H=HEADS, Hkv=Hkv, D=D, context=ctx, cache="bf16", ms=ms, sdpa_ms=sdpa_ms,
                   sdpa_backend=backend, vs_sdpa=sdpa_ms / ms, copy_ms=base, pct_copy=100 * base / ms,
                   graph_ms=graph_ms, sdpa_graph_ms=sdpa_graph_ms, vs_sdpa_graph=sdpa_graph_ms / graph_ms,
                   pct_copy_graph=100 * base / graph_ms)
        rows.append(row)
        del k, v
        free_memory()
        # the FP8 cache: codes of N(0, 1) values at scale 1/64 (no saturation), half the bytes
        scales = torch.full((Hkv,), 1 / 64, dtype=torch.float32, device="cuda")
        codes = [(torch.randn(B, Hkv, ctx, D, device="cuda", dtype=torch.bfloat16) * 64)
                 .to(torch.float8_e4m3fn).view(torch.uint8) for _ in range(2)]

        def fp8():
            decode_attention(q, *codes, lengths, new_k=new_k, new_v=new_v, k_scale=scales,
                             v_scale=scales, out=out)
        fp8()
        ms8, graph8, base8 = timed(fp8), timed_graph(fp8), copy_ms(nbytes // 2)
        rows.append(dict(row, cache="fp8", ms=ms8, vs_sdpa=sdpa_ms / ms8, copy_ms=base8,
                         pct_copy=100 * base8 / ms8, vs_bf16=ms / ms8, graph_ms=graph8,
                         vs_sdpa_graph=sdpa_graph_ms / graph8, pct_copy_graph=100 * base8 / graph8))
        log(f"decode B{B:<2d} D{D:<3d} G{G} ctx {ctx:>6d}: bf16 {ms * 1e3:8.1f} us "
            f"{row['pct_copy']:4.0f}% copy {row['vs_sdpa']:5.2f}x sdpa ({backend}); fp8 {ms8 * 1e3:8.1f} us "
            f"{rows[-1]['pct_copy']:4.0f}% copy {rows[-1]['vs_sdpa']:5.2f}x sdpa | graphed: bf16 {graph_ms * 1e3:8.1f} us "
            f"{row['pct_copy_graph']:4.0f}% copy {row['vs_sdpa_graph']:5.2f}x sdpa; fp8 {graph8 * 1e3:8.1f} us "
            f"{rows[-1]['pct_copy_graph']:4.0f}% copy {rows[-1]['vs_sdpa_graph']:5.2f}x sdpa")
        del codes, q, out
        free_memory()
    cupy.cuda.runtime.deviceSynchronize()
    return rows


def prefill_rows(log=print) -> list[dict]:
    import torch

    from benchmarks.harness.timing import free_memory, tflops
    from tilekit.kernels import attention
    rows = []
    for B, H, T, D in PREFILL:
        q, k, v = (torch.randn(B, H, T, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        out = torch.empty_like(q)
        attention(q, k, v, causal=True, out=out)
        sdpa_ms, backend, _ = best_sdpa(q, k, v, out.clone(), is_causal=True)
        ms = timed(lambda: attention(q, k, v, causal=True, out=out))
        flops = 4.0 * B * H * T * T * D / 2
        rows.append(dict(B=B, H=H, T=T, D=D, ms=ms, tflops=tflops(flops, ms), sdpa_ms=sdpa_ms, sdpa_backend=backend,
                         sdpa_tflops=tflops(flops, sdpa_ms), vs_sdpa=sdpa_ms / ms))
        log(f"prefill B{B} H{H} T{T} D{D}: {ms:7.3f} ms {rows[-1]['tflops']:5.0f} TFLOP/s, sdpa ({backend}) "
            f"{sdpa_ms:7.3f} ms: {rows[-1]['vs_sdpa']:.2f}x")
        del q, k, v, out
        free_memory()
    return rows


def llama_config(layers: int):
    import dataclasses

    from tilekit.models.families import preset_config
    return dataclasses.replace(preset_config("llama-3.1-8b"), n_layer=layers)


def tilekit_step_ms(model, context: int, kv_cache_dtype: str) -> float:
    """The replayed greedy decode step of one sequence at about `context` positions (the cache holds zeros:
    attention reads it all the same); the newest position leaves room for the 64 steps the timing replays."""
    import numpy as np

    from benchmarks.studies.breakdown import replay_ms
    from tilekit.engine.graphs import Generation
    from tilekit.engine.picker import GREEDY
    from tilekit.engine.steps import capacity_for
    capacity = capacity_for(model, context, 64)[0]
    gen = Generation(model, 1, capacity, GREEDY, kv_cache_dtype)
    try:
        with gen.stream:
            gen.state.positions.set(np.full(1, min(context, capacity - 64) - 1, np.int32))
            gen.decode(use_graph=True)
        return float(np.median([replay_ms(gen, 10) for _ in range(3)]))
    finally:
        gen.release()


def anchor_step_ms(hf, context: int) -> float:
    """gpt-fast's compiled greedy step (benchmarks.suites.gptfast) at the same position."""
    import numpy as np
    import torch

    from benchmarks.suites.gptfast import decoder_for
    decoder = decoder_for(hf, 1, context + 64)
    decoder.pos.fill_(context - 1)
    for _ in range(3):                 # compile, record, replay
        decoder.decode_step()
    ms = []
    for _ in range(3):
        decoder.pos.fill_(context - 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            decoder.decode_step()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end) / 10)
    return float(np.median(ms))


def model_rows(layers: int, log=print) -> list[dict]:
    import torch

    from benchmarks.harness.timing import free_memory
    from benchmarks.suites.model import build_hf
    from tilekit.models.families import family_of_config
    config = llama_config(layers)
    hf = build_hf(config, "sdpa", seed=0)
    model = family_of_config(config).model_class(config, dtype="bfloat16", seed=0)
    rows = []
    for ctx in MODEL_CONTEXTS:
        row = dict(model=f"llama-3.1-8b shape, {layers} of 32 layers", context=ctx)
        for kv in ("auto", "fp8"):
            row[f"{'bf16' if kv == 'auto' else kv}_ms"] = tilekit_step_ms(model, ctx, kv)
            free_memory()
        if (ctx + 64) ** 2 <= MAX_MASK_BYTES:
            row["compiled_ms"] = anchor_step_ms(hf, ctx)
            torch._dynamo.reset()
        else:
            row["compiled_ms"], row["note"] = math.nan, f"compiled step not run: its causal mask takes {(ctx + 64) ** 2 >> 30} GiB"
        row.update(vs_compiled=row["compiled_ms"] / row["bf16_ms"], fp8_vs_bf16=row["bf16_ms"] / row["fp8_ms"])
        log(f"model ctx {ctx:>6d}: bf16 cache {row['bf16_ms']:.3f} ms/token, fp8 cache {row['fp8_ms']:.3f}, "
            f"compiled step {row['compiled_ms']:.3f} ({row['vs_compiled']:.2f}x)")
        rows.append(row)
        free_memory()
    return rows


def geomean(values) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def lowest(values) -> float:
    values = [v for v in values if math.isfinite(v)]
    return min(values) if values else math.nan


def summary_table(results: dict) -> str:
    """The short table printed last: decode by (cache, batch), timed with host cost and as graph replays (GPU work
    alone, both sides), prefill and model rows."""
    lines = ["| part | rows | vs SDPA / compiled (geomean) | worst | % copy (min) | graphed: vs SDPA | % copy (min) |",
             "|---|---|---|---|---|---|---|"]
    for cache in ("bf16", "fp8"):
        for B in DECODE_BATCHES:
            part = [r for r in results["decode"] if r["cache"] == cache and r["B"] == B]
            if part:
                worst = min(part, key=lambda r: r["vs_sdpa"] if math.isfinite(r["vs_sdpa"]) else math.inf)
                lines.append(f"| decode {cache} B{B} | {len(part)} | {geomean(r['vs_sdpa'] for r in part):.2f}x | "
                             f"{worst['vs_sdpa']:.2f}x (D{worst['D']} G{HEADS // worst['Hkv']} ctx {worst['context']}) | "
                             f"{min(r['pct_copy'] for r in part):.0f}% | "
                             f"{geomean(r.get('vs_sdpa_graph', math.nan) for r in part):.2f}x | "
                             f"{lowest(r.get('pct_copy_graph', math.nan) for r in part):.0f}% |")
    for r in results["prefill"]:
        lines.append(f"| prefill B{r['B']} H{r['H']} T{r['T']} D{r['D']} | 1 | {r['vs_sdpa']:.2f}x | "
                     f"{r['tflops']:.0f} TFLOP/s | - | - | - |")
    for r in results["model"]:
        lines.append(f"| {r['model']} ctx {r['context']} | 1 | {r['vs_compiled']:.2f}x ({r['bf16_ms']:.3f} ms/token; "
                     f"fp8 cache {r['fp8_ms']:.3f}) | - | - | - | - |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.long_context", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write long_context.json here")
    ap.add_argument("--layers", type=int, default=4, help="layers of the Llama-3.1-8B shape in the model rows "
                                                          "(1..32; default 4)")
    ap.add_argument("--parts", default="decode,prefill,model", help="comma-separated: decode, prefill, model")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    parts = args.parts.split(",")
    if not 1 <= args.layers <= 32 or not set(parts) <= {"decode", "prefill", "model"}:
        parser().error("--layers must lie in 1..32 and --parts name decode, prefill or model")
    from benchmarks.harness.compiling import Precompile, distinct_tasks
    from benchmarks.harness.timing import shared_stream
    from tilekit.device import device_info
    compiling = Precompile(distinct_tasks(kernel_calls(parts)), device_info().arch)
    compiling.run()                     # in this thread: every row then runs on compiled kernels
    print(compiling.summary(), flush=True)
    results = {"decode": [], "prefill": [], "model": []}
    rows = dict(decode=decode_rows, prefill=prefill_rows, model=lambda: model_rows(args.layers))
    with shared_stream():
        for part in ("decode", "prefill", "model"):
            if part in parts:
                results[part] = rows[part]()
                if args.out:            # after each part: a run cut short keeps the parts it finished
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "long_context.json").write_text(json.dumps(results, indent=1) + "\n")
    print(summary_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
