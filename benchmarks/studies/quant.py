"""Quantized weights (issue #34): decode steps of a Llama shape in bf16, int8 and fp8, FP8 prefill, and each
quantized linear against PyTorch's FP8 / INT8 GEMMs on the same shapes.

    python -m benchmarks.studies.quant [--model llama-3.1-8b] [--batch 1 --batch 8 --batch 32] [--part prefill]
        [--out DIR]

Decode rows: the replayed greedy decode step (128-token prompt + 128 new tokens) of random weights, each
quantized model (int8, fp8; "+head": its LM head quantized too) against the bf16 step as its anchor, with % of its
own weight-streaming floor (quantized linears at one byte a weight plus their scales, the rest in bf16, the
embedding table's batch rows only, and the mean step's KV cache, at the copy bandwidth) and the share of next
tokens each model picks as bf16's greedy run did, fed that run's tokens (teacher-forced).
Prefill row: B8 x T1024 full-logits forward, fp8 (W8A8) against bf16, and its logits' distance from bf16's.
Linear rows: quant_linear per Llama linear shape (int8, fp8 per channel, fp8 with 128 x 128 block scales) against
torch._scaled_mm (FP8, fast accumulation; blockwise where this PyTorch takes it) and torch._int_mm (INT8, M > 16),
each output checked against float64 (a failing row is FAILED, without a time), % of the bandwidth floor (few rows)
or the tensor-core rate.
"""

from __future__ import annotations

import json
import math
import sys

from benchmarks.studies.breakdown import NEW_TOKENS, PROMPT, _decode_generation, decode_model, model_batch_parser, replay_ms

KINDS = (None, "int8", "fp8", "int8+head", "fp8+head")     # +head: the LM head quantized too (quantize_head)


def scheme(kind: str | None):
    """The quantization a decode row's model holds: None (bf16), or a load-time Scheme of its weights (+head: the
    untied LM head too)."""
    from tilekit.models.quantization import Scheme
    return None if kind is None else Scheme(kind.removesuffix("+head"), head=kind.endswith("+head"))


def next_token_agreement(model, sequences, prompt: int) -> float:
    """Share of the generated positions of `sequences` (B, prompt + n: a reference model's greedy output) where
    `model`, fed the reference's tokens so far (one forward, teacher-forced), picks the reference's next token.
    Free-running generations of random weights part for good at their first different token, so comparing them
    says little; this compares every step on the same history."""
    import numpy as np
    logits = np.asarray(_host(model(sequences[:, :-1])[:, prompt - 1:]), np.float32)    # sliced before the copy
    return float(np.mean(logits.argmax(-1) == sequences[:, prompt:]))


def _host(a):
    """A model's output on the host (CuPy arrays copied, NumPy ones as they are)."""
    return a.get() if hasattr(a, "get") else a


def timed(fn) -> float:
    """Median ms of fn (L2 flushed), NaN where the anchor does not run here (a PyTorch build without it)."""
    from benchmarks.harness.timing import measure
    try:
        return measure(fn, flush_l2=True, reps=30)["median_ms"]
    except (RuntimeError, TypeError, NotImplementedError) as e:
        print(f"  anchor failed: {type(e).__name__}: {e}")
        return math.nan


def decode_rows(preset: str, batch: int, copy_gbs: float, log=print) -> list[dict]:
    import numpy as np

    from benchmarks.harness.report import mean_kv_bytes, streamed_bytes
    from benchmarks.harness.timing import free_memory
    rows, base, tokens = [], None, None
    for kind in KINDS:
        model = decode_model(preset, quantize=scheme(kind))
        gen = _decode_generation(model, batch)
        ms = float(np.median([replay_ms(gen, 50) for _ in range(5)]))
        kv = mean_kv_bytes(model.config, batch, PROMPT, NEW_TOKENS)
        floor = (streamed_bytes(model, batch) + kv) / (copy_gbs * 1e9) * 1e3
        if kind is None:
            base, tokens = ms, np.asarray(gen.state.history.get())[:, :PROMPT + NEW_TOKENS]
        row = dict(preset=preset, batch=batch, weights=kind or "bf16", step_ms=ms, vs_bf16=base / ms, floor_ms=floor,
                   pct_floor=100 * floor / ms, next_token_agree=next_token_agreement(model, tokens, PROMPT))
        log(f"{preset} {row['weights']:9s} B{batch:<3d} {ms:7.3f} ms/step  {row['vs_bf16']:5.2f}x bf16  "
            f"{row['pct_floor']:4.0f}% of the {floor:.3f} ms floor  "
            f"next tokens as bf16's: {row['next_token_agree']:.1%}")
        rows.append(row)
        model.forget_graphs()
        del model, gen
        free_memory()
    return rows


def prefill_rows(preset: str, batch: int = 8, seq: int = 1024, log=print) -> list[dict]:
    """The full-logits forward of bf16 and W8A8 fp8 models on the same random weights and ids, and the fp8 logits'
    distance from bf16's (norm-relative) and their argmax agreement. No bound: at 32 random layers any perturbation
    grows (session 25, H100: weight-only fp8 0.45 from bf16's, W8A8 0.60 with its FP8 GEMMs promoted or not, two W8A8
    runs differing only in their GEMMs' tiles 0.39 apart); a row whose logits are not all finite fails."""
    import cupy
    import numpy as np

    from benchmarks.harness.timing import free_memory, measure
    rows, anchor = [], None
    for kind in (None, "fp8"):
        model = decode_model(preset, quantize=scheme(kind))
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, seq))
        logits = model(ids).astype(cupy.float32)
        finite = bool(cupy.isfinite(logits).all())
        if anchor is None:
            anchor, error, agree = logits, 0.0, 1.0
        else:
            error = float(cupy.linalg.norm(logits - anchor) / cupy.linalg.norm(anchor))
            agree = float(cupy.mean(cupy.argmax(logits, -1) == cupy.argmax(anchor, -1)))
        del logits
        ms = measure(lambda: model(ids), flush_l2=False, warmup=2, reps=10)["median_ms"] if finite else None
        anchor_ms = rows[0]["forward_ms"] if rows else ms
        vs = None if ms is None or anchor_ms is None else anchor_ms / ms
        rows.append(dict(preset=preset, batch=batch, seq=seq, weights=kind or "bf16", forward_ms=ms, vs_bf16=vs,
                         logits_vs_bf16=error, argmax_as_bf16=agree))
        timing = "FAILED: non-finite logits" if ms is None else f"{ms:8.2f} ms" + (f"  {vs:.2f}x bf16" if vs else "")
        log(f"{preset} prefill B{batch} T{seq} {rows[-1]['weights']:5s} {timing}  logits {error:.3g} from bf16's, "
            f"argmax as bf16's {agree:.1%}")
        model.forget_graphs()
        del model
        free_memory()
    return rows


def expanded(scale, shape):
    """A scale tensor (per row [R] or [R, 1], per block [ceil(R/128), ceil(C/128)], per row group
    [R, ceil(C/128)]) as a float64 (R, C) tensor of each element's scale."""
    from tilekit.models.quantization import QBLOCK
    s = scale.double().reshape(scale.shape[0], -1)
    for axis, full in enumerate(shape):
        if s.shape[axis] == 1:
            s = s.expand(*(full if a == axis else n for a, n in enumerate(s.shape)))
        elif s.shape[axis] != full:
            s = s.repeat_interleave(QBLOCK, axis).narrow(axis, 0, full)
    return s


def dequantized(codes, scale, kind: str):
    """float64 codes x scale (torch, on the GPU) of int8 or FP8 (uint8 bits or float8_e4m3fn) codes."""
    import torch
    values = codes.double() if kind == "int8" else codes.view(torch.float8_e4m3fn).double()
    return values * expanded(scale, tuple(codes.shape))


def output_problem(y, ref, dtype: str) -> str | None:
    """None where y (M, N) matches the float64 reference as tilekit.kernels.checks.assert_close asks (the whole
    output and every row within `dtype`'s tolerance), else its message."""
    from tilekit.kernels.checks import TOL, assert_close
    try:
        assert_close(y.double().cpu().numpy(), ref.cpu().numpy(), TOL[dtype], f"output ({dtype} tolerance)")
    except AssertionError as e:
        return str(e)
    return None


def block_scaled_mm(xf8, wf8, w_scale, ref):
    """torch._scaled_mm of x (M, K) FP8 with 1 x 128 scales of one and w (N, K) FP8 with 128 x 128 block scales, in
    the first scale layout this PyTorch takes whose output matches `ref`; None where none does."""
    import torch
    M, K = xf8.shape
    ones = torch.ones(-(-K // 128), M, device="cuda").t()             # 1 x 128 scales: outer-dimension-major
    for scale_b in (w_scale.t(), w_scale.t().contiguous(), w_scale):
        def call(scale_b=scale_b):
            return torch._scaled_mm(xf8, wf8.t(), scale_a=ones, scale_b=scale_b, out_dtype=torch.bfloat16)
        try:
            if output_problem(call(), ref, "bfloat16") is None:
                return call
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            continue
    return None


def linear_rows(preset: str, copy_gbs: float, peak: float, rows_list=(1, 8, 32, 8192), log=print) -> list[dict]:
    """quant_linear (weight-only int8 / fp8 with per-channel scales, fp8 with 128 x 128 block scales; W8A8 fp8 from
    128 rows, the activations quantized per row, or per 128-column group with block scales) against
    torch._scaled_mm (fp8: per-channel scales, fast accumulation; block scales where this PyTorch takes them, else
    the per-channel call, so marked) and torch._int_mm (int8, M > 16). Every output (ours poisoned first) is checked
    against a float64 product of the dequantized operands: a row that fails is FAILED, without a time. `peak`: the
    measured bf16 tensor-core rate (FP8's taken as twice it)."""
    import cupy
    import torch

    from tilekit.kernels import quant_linear, quantize_fp8
    from tilekit.models.families import preset_config
    c = preset_config(preset)
    shapes = {"qkv": ((c.n_head + 2 * c.n_kv_head) * c.head_dim, c.n_embd), "o_proj": (c.n_embd, c.n_head * c.head_dim),
              "gate_up": (2 * c.intermediate_size, c.n_embd), "down": (c.n_embd, c.intermediate_size)}
    out = []
    for name, (N, K) in shapes.items():
        w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        wf8 = (torch.randn(N, K, device="cuda")).to(torch.float8_e4m3fn)
        ws = torch.rand(N, device="cuda") / K
        wsb = torch.rand(-(-N // 128), -(-K // 128), device="cuda") / K
        weights = {"int8": (w8, ws), "fp8": (wf8.view(torch.uint8), ws), "fp8 block": (wf8.view(torch.uint8), wsb)}
        exact = {kind: dequantized(w, scale, kind.split()[0]) for kind, (w, scale) in weights.items()}   # float64
        for M in rows_list:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            xf8 = x.to(torch.float8_e4m3fn)
            x64 = xf8.double()

            def per_channel():
                return torch._scaled_mm(xf8, wf8.t(), scale_a=torch.ones(M, 1, device="cuda"), scale_b=ws.view(1, N),
                                        out_dtype=torch.bfloat16, use_fast_accum=True)
            for kind, (w, scale) in weights.items():
                w8a8 = M >= 128 and kind != "int8"
                group = 128 if kind == "fp8 block" else None
                wdtype = kind.split()[0]
                if w8a8:
                    xq = torch.empty(M, K, dtype=torch.uint8, device="cuda")
                    xs = torch.empty(M, -(-K // 128) if group else 1, device="cuda")

                    def ours(w=w, scale=scale, xq=xq, xs=xs, group=group):
                        quantize_fp8(x, xq, xs, group=group)
                        quant_linear(xq, w, scale, weight_dtype="fp8", x_scale=xs, out=y)
                else:
                    def ours(w=w, scale=scale, wdtype=wdtype):
                        quant_linear(x, w, scale, weight_dtype=wdtype, out=y)
                y.view(torch.int16).fill_(0x7FC0)                               # NaN bits: poisoned
                ours()
                lhs = dequantized(xq, xs, "fp8") if w8a8 else x.double()
                problem = output_problem(y, lhs @ exact[kind].t(), "bfloat16")
                theirs, anchor, wrong = None, None, None
                if kind == "int8" and M > 16:
                    x8 = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
                    theirs, anchor = (lambda x8=x8: torch._int_mm(x8, w8.t())), "torch._int_mm"
                    wrong = output_problem(theirs().double(), x8.double() @ w8.double().t(), "float32")
                elif kind == "fp8":
                    theirs, anchor = per_channel, "torch._scaled_mm"
                elif kind == "fp8 block":
                    theirs, anchor = block_scaled_mm(xf8, wf8, wsb, x64 @ exact[kind].t()), "torch._scaled_mm blockwise"
                    if theirs is None:
                        theirs, anchor = per_channel, "torch._scaled_mm per channel (no blockwise here)"
                if theirs is per_channel:                   # block_scaled_mm checked its own output
                    wrong = output_problem(theirs(), x64 @ exact["fp8"].t(), "bfloat16")
                ms = math.nan if problem else timed(ours)
                ref_ms = math.nan if theirs is None or wrong else timed(theirs)
                floor = (N * K + 2 * M * (K + N)) / (copy_gbs * 1e9) * 1e3
                compute = 2 * M * N * K / (peak * (2 if w8a8 else 1) * 1e12) * 1e3
                row = dict(preset=preset, linear=name, M=M, N=N, K=K, weights=kind, w8a8=w8a8, ms=ms,
                           torch_ms=ref_ms, anchor=anchor, vs_torch=ref_ms / ms,
                           pct_floor=100 * max(floor, compute) / ms, problem=problem, anchor_problem=wrong)
                label = f"{name:8s} M{M:<5d} N{N:<6d} K{K:<6d} {kind:9s}{' w8a8' if w8a8 else '     '}"
                if problem:
                    log(f"{label} FAILED: {problem}")
                else:
                    theirs_text = f"anchor FAILED: {wrong}" if wrong else \
                        f"{anchor or 'no anchor'} {ref_ms * 1e3:9.1f} us ({row['vs_torch']:.2f}x)"
                    log(f"{label} {ms * 1e3:9.1f} us  {theirs_text}  {row['pct_floor']:4.0f}% of floor")
                out.append(row)
    cupy.cuda.runtime.deviceSynchronize()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = model_batch_parser("studies.quant", __doc__)
    parser.add_argument("--part", action="append", choices=("decode", "prefill", "linear"),
                        help="rows to run (repeatable; default all)")
    args = parser.parse_args(argv)
    from benchmarks.harness.timing import copy_bandwidth, matmul_peak_tflops
    copy_gbs, peak = copy_bandwidth()["gbs"], matmul_peak_tflops()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, bf16 matmul {peak:.0f} TFLOP/s")
    results = {"decode": [], "prefill": [], "linear": []}
    parts = args.part or list(results)
    for preset in args.model or ["llama-3.1-8b"]:
        if "decode" in parts:
            for batch in args.batch or [1, 8, 32]:
                results["decode"] += decode_rows(preset, batch, copy_gbs)
        if "prefill" in parts:
            results["prefill"] += prefill_rows(preset)
        if "linear" in parts:
            results["linear"] += linear_rows(preset, copy_gbs, peak)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quant.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
