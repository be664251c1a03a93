"""Each tilekit kernel against its anchors (cuBLAS through torch and CuPy, SDPA flash and cuDNN,
torch ops, torch.compile of the fused epilogue) with the same timer and L2 policy.

`plan(mode)` lists the cases as plain data (no GPU needed); `build(case)` makes fresh random
inputs on the GPU and the callables to time; `run_case` checks every output against the anchor
before timing, then times each side as a CUDA-graph replay (GPU work only), and turns the result
into report rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from benchmarks.harness import checks, timing
from benchmarks.harness.report import Row, fill_times, mark_error, short_error
from tilekit.autotune.op import autotune_mode, recording

M_TOKENS = 8192
HEAD_DIM = 64
PRESET_WIDTH = {"gpt2": 768, "gpt2-xl": 1600}
FULL_WIDTH = {"gpt2": 768, "gpt2-medium": 1024, "gpt2-large": 1280, "gpt2-xl": 1600}
FULL_ROWS = (128, 1024, M_TOKENS)       # prefill rows: B1 T128, B8 T128 / B1 T1024, B8 T1024
VOCAB = 50257
LABEL_WIDTH = 36                        # the summary table's case column
DECODE_HEADS = 12                       # gpt2
COMPILE_BUDGET_S = 120.0                # for the torch.compile epilogue anchors of one run
COMPILE_MODE = {"quick": "default", "full": "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class Case:
    kind: str          # linear | linear_nk | epilogue | attention | layer_norm | gelu | decode_attention
    params: tuple      # kind-specific, see build()


def linear_layers(C: int) -> list[tuple[str, int, int]]:
    """(layer, K, N) of GPT-2's four matmuls for width C (weights are [K, N] = [in, out])."""
    return [("attn.c_attn", C, 3 * C), ("attn.c_proj", C, C), ("mlp.c_fc", C, 4 * C), ("mlp.c_proj", 4 * C, C)]


def lm_head(C: int) -> tuple[str, int, int]:
    """(layer, K, N) of the tied LM head, x @ wte^T: its weight is wte as stored, [N, K] = [out, in]."""
    return ("lm_head", C, VOCAB)


def plan(mode: str) -> list[Case]:
    """The cases of a run; quick is a subset of full."""
    if mode not in ("quick", "full"):
        raise ValueError(f"mode must be 'quick' or 'full', got {mode!r}")
    full = mode == "full"
    cases = []
    for preset, C in (FULL_WIDTH if full else PRESET_WIDTH).items():
        for M in (FULL_ROWS if full else (M_TOKENS,)):
            cases += [Case("linear", (preset, layer, M, K, N)) for layer, K, N in linear_layers(C) + [lm_head(C)]]
    for preset, C in PRESET_WIDTH.items():
        cases.append(Case("epilogue", (preset, "mlp.c_fc", M_TOKENS, C, 4 * C)))
    attn = [(8, 12, 1024, HEAD_DIM), (1, 25, 1024, HEAD_DIM), (4, 16, 4096, HEAD_DIM), (4, 16, 2048, 128)]
    cases += [Case("attention", shape) for shape in attn]
    ln = [(8192, 768), (8192, 1600), (32768, 1600)] + ([(16384, 4096)] if full else [])
    cases += [Case("layer_norm", s) for s in ln]
    cases.append(Case("gelu", (16384, 4096)))
    decode = [(b, t) for b in (1, 8, 32) for t in (1024, 8192)] if full else [(1, 1024), (8, 8192), (32, 8192)]
    cases += [Case("decode_attention", (B, DECODE_HEADS, ctx, HEAD_DIM)) for B, ctx in decode]
    return cases


@dataclass
class Built:
    tilekit: Callable
    anchors: list[tuple[str, Callable]]
    compiled: tuple = ()                       # names of anchors whose first call compiles


def describe(case: Case) -> tuple[str, str]:
    """(table label, full shape) of a case, without touching the GPU."""
    p = case.params
    if case.kind == "linear_nk":
        preset, layer, M, K, N = p
        return f"lin {preset} {layer} M{M}", f"M={M} K={K} N={N}, W [N, K]"
    if case.kind == "linear":
        preset, layer, M, K, N = p
        label = f"linear {preset} {layer} {K}x{N}"
        if M != M_TOKENS or len(label) > LABEL_WIDTH:            # the full suite's extra rows: short names
            label = f"lin {preset.replace('gpt2-', '')} {layer} M{M}"
        return label, f"M={M} K={K} N={N}"
    if case.kind == "epilogue":
        preset, layer, M, K, N = p
        return f"lin+gelu+res {preset} {K}x{N}", f"{layer} M={M} K={K} N={N}: gelu(x W + b) + r"
    if case.kind == "attention":
        B, H, T, D = p
        return f"attention causal B{B} H{H} T{T}" + (f" D{D}" if D != HEAD_DIM else ""), f"B={B} H={H} T={T} D={D}"
    if case.kind == "layer_norm":
        return f"layer_norm {p[0]}x{p[1]}", f"M={p[0]} N={p[1]}"
    if case.kind == "gelu":
        return f"gelu tanh {p[0]}x{p[1]}", f"{p[0]}x{p[1]}"
    if case.kind == "decode_attention":
        B, H, ctx, D = p
        return f"decode_attn B{B} H{H} ctx{ctx}", f"B={B} H={H} nq=1 ctx={ctx} D={D}"
    raise ValueError(f"unknown case kind {case.kind!r}")


def work_of(case: Case, itemsize: int = 2) -> tuple[str, float, str]:
    """(unit, flops or bytes of one call, roofline key) of a case."""
    p = case.params
    if case.kind in ("linear", "linear_nk", "epilogue"):
        _, _, M, K, N = p
        return "TFLOP/s", 2.0 * M * N * K, "matmul_peak_tflops"
    if case.kind == "attention":
        B, H, T, D = p
        return "TFLOP/s", 2.0 * B * H * T * T * D, "matmul_peak_tflops"
    if case.kind == "layer_norm":
        M, N = p
        return "GB/s", float(2 * M * N * itemsize + 2 * N * itemsize), "copy_bandwidth_gbs"
    if case.kind == "gelu":
        return "GB/s", float(2 * math.prod(p) * itemsize), "copy_bandwidth_gbs"
    if case.kind == "decode_attention":
        B, H, ctx, D = p
        return "GB/s", float(2 * B * H * ctx * D * itemsize), "copy_bandwidth_gbs"
    raise ValueError(f"unknown case kind {case.kind!r}")


class Unavailable(Exception):
    """An anchor this installation cannot run: its rows are skipped, with the reason."""


def _raiser(exc: Exception) -> Callable:
    def fail():
        raise exc
    return fail


def _probed(fn: Callable, what: str) -> Callable:
    """fn, after one call that succeeded, or a callable raising Unavailable with the reason."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - e.g. bf16 in an older CuPy, a backend torch lacks here
        return _raiser(Unavailable(f"{what}: {short_error(e)}"))
    return fn


def _cupy_matmul(x, w) -> Callable:
    """cupy.matmul on zero-copy views of x and w (probed: bf16 support differs by CuPy version)."""
    try:
        import cupy
        xc, wc = cupy.from_dlpack(x), cupy.from_dlpack(w)
    except Exception as e:  # noqa: BLE001
        return _raiser(Unavailable(f"cupy.matmul on {x.dtype}: {short_error(e)}"))
    return _probed(lambda: cupy.matmul(xc, wc), f"cupy.matmul on {x.dtype}")


def _sdpa(backend: str, q, k, v, **kw) -> Callable:
    """F.scaled_dot_product_attention restricted to one SDPBackend (probed: skipped where torch lacks it)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return _probed(run, f"SDPBackend.{backend}")


def build(case: Case, compile_mode: str = "default") -> Built:
    """Fresh random bf16 inputs (torch.randn) and the callables: tilekit, then its anchors."""
    import torch
    import torch.nn.functional as F
    import tilekit.kernels as tk
    bf16, dev = torch.bfloat16, "cuda"
    p = case.params

    def randn(*shape, scale=1.0, mean=0.0):
        return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale + mean).to(bf16)

    if case.kind == "linear_nk":      # x @ W^T with W [N, K] = [out, in], as nn.Linear stores it
        _, _, M, K, N = p
        x, w = randn(M, K), randn(N, K, scale=1 / math.sqrt(K))
        return Built(lambda: tk.linear(x, w, weight_layout="out_in"), [("torch.matmul", lambda: torch.matmul(x, w.T))])
    if case.kind in ("linear", "epilogue"):
        _, _, M, K, N = p
        if case.kind == "linear" and p[1] == "lm_head":
            x, wte = randn(M, K), randn(N, K, scale=1 / math.sqrt(K))   # wte [N, K], as the embedding stores it
            # cuBLAS at its best: an output row of 50257 bf16 values is not 16-byte aligned, which keeps cuBLAS
            # off its fast kernels; padding the vocabulary to a multiple of 64 (nanoGPT's 50304) restores them.
            # tilekit writes into padded rows too, as forward()'s logits do (CausalLM.logits).
            padded = torch.zeros(-(-N // 64) * 64, K, device=dev, dtype=bf16)
            padded[:N] = wte
            return Built(lambda: tk.linear(x, wte, weight_layout="out_in",
                                           out=torch.empty(M, padded.shape[0], device=dev, dtype=bf16)[:, :N]),
                         [("torch.matmul", lambda: torch.matmul(x, wte.T)), ("cupy.matmul", _cupy_matmul(x, wte.T)),
                          ("matmul, V padded", lambda: torch.matmul(x, padded.T)[:, :N])])
        x, w = randn(M, K), randn(K, N, scale=1 / math.sqrt(K))
        if case.kind == "linear":
            return Built(lambda: tk.linear(x, w),
                         [("torch.matmul", lambda: torch.matmul(x, w)), ("cupy.matmul", _cupy_matmul(x, w))])
        b, r = randn(N, scale=0.5), randn(M, N)

        def epilogue(x, w, b, r):
            return F.gelu(torch.addmm(b, x, w), approximate="tanh") + r

        compiled = torch.compile(epilogue, mode=compile_mode, dynamic=False)
        return Built(lambda: tk.linear(x, w, b, activation="gelu", residual=r),
                     [("addmm+gelu+res", lambda: epilogue(x, w, b, r)),
                      ("torch.compile", lambda: compiled(x, w, b, r))], compiled=("torch.compile",))
    if case.kind == "attention":
        B, H, T, D = p
        q, k, v = (randn(B, H, T, D) for _ in range(3))
        return Built(lambda: tk.attention(q, k, v, causal=True),
                     [(f"sdpa {name}", _sdpa(backend, q, k, v, is_causal=True))
                      for name, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))])
    if case.kind == "layer_norm":
        M, N = p
        x, w, b = randn(M, N), randn(N, scale=0.1, mean=1.0), randn(N, scale=0.1)
        return Built(lambda: tk.layer_norm(x, w, b, 1e-5), [("F.layer_norm", lambda: F.layer_norm(x, (N,), w, b, 1e-5))])
    if case.kind == "gelu":
        x = randn(*p, scale=2.0)
        return Built(lambda: tk.gelu(x, approximate="tanh"), [("F.gelu", lambda: F.gelu(x, approximate="tanh"))])
    if case.kind == "decode_attention":
        B, H, ctx, D = p
        q, k, v = randn(B, H, 1, D), randn(B, H, ctx, D), randn(B, H, ctx, D)
        lengths = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        return Built(lambda: tk.decode_attention(q, k, v, lengths),
                     [("torch.sdpa", lambda: F.scaled_dot_product_attention(q, k, v))])
    raise ValueError(f"unknown case kind {case.kind!r}")


def _row(case: Case, anchor: str, calib: dict) -> Row:
    label, shape = describe(case)
    unit, work, roof = work_of(case)
    return Row(suite="kernels", name=case.kind, label=label, shape=shape, anchor=anchor, unit=unit,
               work=work, roofline=calib.get(roof), roofline_name=roof,
               tolerance=checks.TOLERANCE["bfloat16"], params={"kind": case.kind, "params": list(case.params)})


def call_config_sources(calls: list, device=None) -> str:
    """Where the config of each kernel call in `calls` (tilekit.autotune.op.recording) came from on
    `device` (default: the current GPU), e.g. 'linear: shipped db, exact-gpu, exact bucket'; a row on
    a 'heuristic default' ran an untuned tilekit. (In auto mode the calls have tuned what they lacked.)"""
    from tilekit.device import device_info
    if not calls:
        return ""
    device = device or device_info()
    mode = "cached" if autotune_mode() == "auto" else None
    return "; ".join(dict.fromkeys(f"{op.name}: {op.resolve(problem, device, mode).describe()}"
                                   for op, problem in calls))


def run_case(case: Case, calib: dict, *, reps: int, warmup: int = 5, log=print,
             compile_mode: str = "default", budget: timing.CompileBudget | None = None) -> list[Row]:
    """One row per anchor: check tilekit's output against the anchor's, then time both as graph replays.

    A compiled anchor's first call (its compile) is charged to `budget`; once that is spent the
    anchor is skipped with the reason."""
    budget = budget or timing.CompileBudget(COMPILE_BUDGET_S)
    try:
        b = build(case, compile_mode)
    except Exception as e:  # noqa: BLE001
        return mark_error([_row(case, "-", calib)], e, log, "inputs")
    rows = [_row(case, name, calib) for name, _ in b.anchors]
    try:
        with recording() as calls:
            out = b.tilekit()                                # also compiles the kernel
        configs = call_config_sources(calls)
    except Exception as e:  # noqa: BLE001
        return mark_error(rows, e, log, "tilekit")
    for r in rows:
        r.params["tilekit_config"] = configs
        if "heuristic default" in configs:
            r.note = "tilekit untuned (heuristic default config)"
    tk_time = None
    for r, (name, fn) in zip(rows, b.anchors):
        try:
            if name in b.compiled:
                if reason := budget.skip_reason():
                    r.status, r.note = "skipped", reason
                    continue
                ref, seconds = budget.first_call(fn)
                r.params.update(compile_s=round(seconds, 1), compile_mode=compile_mode)
                r.note = "; ".join(filter(None, [r.note, f"{compile_mode} mode, first call (compile) {seconds:.1f} s"]))
            else:
                ref = fn()
            r.error = checks.rel_error(out, ref)
            del ref
            if not r.error < r.tolerance:
                r.status, r.note = "failed", f"relative error {r.error:.3g} >= tolerance {r.tolerance:g}"
                continue
            if tk_time is None:
                tk_time = timing.measure_graph(b.tilekit, flush_l2=True, warmup=warmup, reps=reps)
            an_time = timing.measure_graph(fn, flush_l2=True, warmup=warmup, reps=reps)
            fill_times(r, tk_time, an_time)
            r.note = "; ".join(filter(None, [r.note] + [f"{side} {t['eager']}" for side, t in
                                                         (("tilekit", tk_time), ("anchor", an_time)) if "eager" in t]))
        except Unavailable as e:
            r.status, r.note = "skipped", str(e)
        except Exception as e:  # noqa: BLE001
            mark_error([r], e, log, name)
    return rows


def run(mode: str, calib: dict, log=print) -> list[Row]:
    reps = 30 if mode == "quick" else 100
    budget = timing.CompileBudget(COMPILE_BUDGET_S)
    rows, cases = [], plan(mode)
    for i, case in enumerate(cases):
        label, _ = describe(case)
        log(f"[kernels {i + 1}/{len(cases)}] {label}")
        new = run_case(case, calib, reps=reps, log=log, compile_mode=COMPILE_MODE[mode], budget=budget)
        for r in new:
            log(f"    vs {r.anchor}: " + (f"tilekit {r.tilekit_ms:.4f} ms, anchor {r.anchor_ms:.4f} ms, "
                                          f"ratio {r.ratio:.2f}, err {r.error:.1e}" if r.status == "ok"
                                          else f"{r.status}: {r.note}"))
        rows += new
        timing.free_memory()
    return rows
