"""tilekit's GPT against Hugging Face GPT2LMHeadModel on the same random weights: prefill and decode.

The HF model is built from GPT2Config(**config.to_hf_dict()) on the GPU in bf16, its biases and
LayerNorm parameters nudged off 0 / 1 so the check exercises them, and its state dict (float32,
without the "transformer." prefix, the tied lm_head and the mask buffers) builds tilekit's GPT,
so both hold bit-identical bf16 weights.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import numpy as np

from benchmarks import checks, timing
from benchmarks.report import Row, decode_floor_ms, fill_times, param_count, prefill_flops

PROMPT, NEW_TOKENS = 128, 128
COMPILE_BUDGET_S = 180.0        # per preset: shapes whose compile would start later are skipped


@dataclass(frozen=True)
class ModelPlan:
    preset: str
    prefill: tuple = ()                       # (batch, seq) pairs
    decode: tuple = ()                        # batch sizes
    prefill_impls: tuple = ("sdpa", "eager")
    decode_impls: tuple = ("sdpa", "eager")
    compile: bool = False                     # also torch.compile(HF sdpa) for prefill
    prefill_reps: int = 10
    config: object = None                     # a GPTConfig to use instead of the preset's (tests)


def plan(mode: str) -> list[ModelPlan]:
    if mode == "quick":
        return [ModelPlan("gpt2", prefill=((1, 128), (8, 1024)), decode=(1,), decode_impls=("sdpa",)),
                ModelPlan("gpt2-xl", prefill=((8, 1024),), decode=(1,), decode_impls=("sdpa",))]
    if mode == "full":
        grid = tuple((b, t) for b in (1, 8) for t in (128, 512, 1024))
        return [ModelPlan(p, prefill=grid, decode=(1, 8), compile=True, prefill_reps=20)
                for p in ("gpt2", "gpt2-xl")]
    raise ValueError(f"mode must be 'quick' or 'full', got {mode!r}")


# -- building the two models --------------------------------------------------------------------

HF_CORE_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon",
                "activation_function", "tie_word_embeddings")


def hf_config(config, impl: str):
    """GPT2Config(**config.to_hf_dict()) asking for attention `impl`."""
    from transformers import GPT2Config
    d = {k: v for k, v in config.to_hf_dict().items() if k != "model_type"}
    try:
        return GPT2Config(**d, attn_implementation=impl)
    except TypeError:       # a config class that refuses keys it does not declare (n_ctx, ...)
        return GPT2Config(**{k: d[k] for k in HF_CORE_KEYS}, attn_implementation=impl)


def build_hf(config, impl: str, *, seed: int | None = None, like=None):
    """GPT2LMHeadModel in bf16 on the GPU, eval mode, attention `impl`; weights random or `like`'s."""
    import torch
    from transformers import GPT2LMHeadModel
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device("cuda"):
        model = GPT2LMHeadModel(hf_config(config, impl))
    model = model.to(dtype=torch.bfloat16).eval().requires_grad_(False)
    if getattr(model.config, "_attn_implementation", None) != impl and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    actual = getattr(model.config, "_attn_implementation", None)
    if actual != impl:
        raise RuntimeError(f"transformers built attention {actual!r}, not {impl!r}")
    if like is not None:
        model.load_state_dict(like.state_dict())
    elif seed is not None:
        _nudge_affine(model, seed)
    return model


def _nudge_affine(model, seed: int) -> None:
    """Biases and LayerNorm parameters += N(0, 0.02), so they are neither 0 nor 1."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name or ".ln_f." in name:
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
                p.add_((0.02 * noise).to(p.dtype))


def tilekit_state(model, config) -> dict:
    """HF state dict -> tilekit's: float32 numpy under GPT2Model's names, tied head and buffers dropped."""
    from tilekit.models.checkpoint import BUFFER_SUFFIXES, PREFIX, state_dict_shapes
    wanted = state_dict_shapes(config)
    state, unknown = {}, []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" or name.endswith(BUFFER_SUFFIXES):
            continue
        name = name.removeprefix(PREFIX)
        if name in wanted:
            state[name] = t.detach().float().cpu().numpy()
        else:
            unknown.append(name)
    if len(state) != len(wanted):
        raise ValueError(f"HF state dict lacks {len(wanted) - len(state)} of tilekit's tensors; "
                         f"names it has that tilekit does not know: {unknown[:6]}")
    return state


# -- one preset ---------------------------------------------------------------------------------

def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def prefill_label(preset: str, B: int, T: int) -> str:
    return f"prefill {preset} B{B} T{T}"


def decode_label(preset: str, B: int) -> str:
    return f"generate {preset} B{B} {PROMPT}+{NEW_TOKENS}"


def _prefill_row(p: ModelPlan, config, B: int, T: int, anchor: str, calib: dict) -> Row:
    return Row(suite="model", name="prefill", label=prefill_label(p.preset, B, T),
               shape=f"B={B} T={T} V={config.vocab_size}", anchor=anchor, unit="TFLOP/s",
               work=prefill_flops(config, B, T), roofline=calib.get("matmul_peak_tflops"),
               roofline_name="matmul_peak_tflops", tolerance=checks.MODEL_TOLERANCE,
               params={"preset": p.preset, "batch": B, "seq": T})


def run_prefill(p: ModelPlan, config, gpt, hf: dict, calib: dict, log, rng) -> list[Row]:
    """Every (B, T) of the plan against every HF variant in `hf` (name -> callable(ids) -> logits)."""
    import torch
    rows = []
    compile_spent, compile_name = 0.0, next((n for n in hf if "compile" in n), None)
    for B, T in p.prefill:
        ids = rng.integers(0, config.vocab_size, (B, T), dtype=np.int64)
        ids_t = torch.from_numpy(ids).cuda()
        log(f"[model {p.preset}] prefill B={B} T={T}")
        try:
            out = gpt(ids)
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc())
            for name in hf:
                r = _prefill_row(p, config, B, T, name, calib)
                r.status, r.note = "error", f"tilekit: {_short(e)}"
                rows.append(r)
            continue
        tk_time = None
        for name, forward in hf.items():
            r = _prefill_row(p, config, B, T, name, calib)
            rows.append(r)
            if name == compile_name and compile_spent > COMPILE_BUDGET_S:
                r.status, r.note = "skipped", (
                    "torch.compile failed on an earlier shape" if compile_spent == float("inf") else
                    f"torch.compile budget spent ({compile_spent:.0f} s > {COMPILE_BUDGET_S:.0f} s "
                    f"for {p.preset})")
                continue
            try:
                t0 = time.perf_counter()
                ref = forward(ids_t)
                timing.synchronize()
                if name == compile_name:
                    compile_spent += time.perf_counter() - t0
                    r.note = f"first call (compile) {time.perf_counter() - t0:.1f} s"
                r.error = checks.rel_error(out, ref)
                del ref
                if not r.error < r.tolerance:
                    r.status, r.note = "failed", f"logits relative error {r.error:.3g} >= {r.tolerance:g}"
                    continue
                reps, warm = p.prefill_reps, 2
                if tk_time is None:
                    tk_time = timing.measure(lambda: gpt(ids), flush_l2=True, warmup=warm, reps=reps)
                an = timing.measure(lambda: forward(ids_t), flush_l2=True, warmup=warm, reps=reps)
                fill_times(r, tk_time, an)
                log(f"    vs {name}: tilekit {r.tilekit_ms:.2f} ms, {name} {r.anchor_ms:.2f} ms, "
                    f"ratio {r.ratio:.2f}, err {r.error:.1e}")
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                r.status, r.note = "error", f"{name}: {_short(e)}"
                if name == compile_name:         # one failed compile is enough
                    compile_spent = float("inf")
        del out
        timing.free_memory()
    return rows


def _per_token(t: dict, n: int) -> dict:
    return {k: (v / n if k.endswith("_ms") else v) for k, v in t.items()}


def run_decode(p: ModelPlan, config, gpt, hf: dict, calib: dict, log, rng) -> list[Row]:
    """Greedy generation of NEW_TOKENS after a PROMPT-token random prompt, wall-clock, both sides."""
    import torch
    rows = []
    n_params = param_count(config)
    floor = decode_floor_ms(n_params, calib["copy_bandwidth_gbs"]) if calib.get("copy_bandwidth_gbs") else None
    for B in p.decode:
        prompt = rng.integers(0, config.vocab_size, (B, PROMPT), dtype=np.int64)
        prompt_t = torch.from_numpy(prompt).cuda()
        mask = torch.ones_like(prompt_t)
        last = {}

        def tk_generate():
            last["tilekit"] = gpt.generate(prompt, NEW_TOKENS, temperature=0)

        log(f"[model {p.preset}] decode B={B}: {PROMPT} prompt + {NEW_TOKENS} new tokens")
        try:
            tk_time = _per_token(timing.wall_time(tk_generate, warmup=1, runs=3), NEW_TOKENS)
            produced = len(last["tilekit"][0]) - PROMPT
            tk_error = None if produced == NEW_TOKENS else f"tilekit produced {produced} tokens"
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc())
            tk_time, tk_error = None, f"tilekit: {_short(e)}"
        for name, model in hf.items():
            r = Row(suite="model", name="generate", label=decode_label(p.preset, B),
                    shape=f"B={B} prompt={PROMPT} new={NEW_TOKENS}", anchor=name, unit="tok/s",
                    roofline=floor, roofline_name="decode_floor_ms",
                    params={"preset": p.preset, "batch": B, "param_count": n_params})
            rows.append(r)
            if tk_error:
                r.status, r.note = ("failed" if tk_time else "error"), tk_error
                continue

            def hf_generate(model=model):
                last["hf"] = model.generate(prompt_t, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                            min_new_tokens=NEW_TOKENS, do_sample=False,
                                            pad_token_id=config.vocab_size - 1)

            try:
                an = _per_token(timing.wall_time(hf_generate, warmup=1, runs=3), NEW_TOKENS)
                fill_times(r, tk_time, an)
                r.tilekit_perf = B * 1e3 / r.tilekit_ms
                r.anchor_perf = B * 1e3 / r.anchor_ms
                r.pct_roofline = None if floor is None else 100.0 * floor / r.tilekit_ms
                hf_tokens = last["hf"][0, PROMPT:].tolist()
                same = checks.leading_agreement(last["tilekit"][0][PROMPT:], hf_tokens)
                r.params["greedy_agreement"] = same
                r.note = f"greedy tokens equal HF's for the first {same}/{NEW_TOKENS} (sequence 0)"
                log(f"    vs {name}: tilekit {r.tilekit_ms:.3f} ms/token, {name} {r.anchor_ms:.3f} ms/token, "
                    f"ratio {r.ratio:.2f}, floor {floor or 0:.3f} ms; {r.note}")
            except Exception as e:  # noqa: BLE001
                log(traceback.format_exc())
                r.status, r.note = "error", f"{name}: {_short(e)}"
        timing.free_memory()
    return rows


def _forward(model):
    def forward(ids):
        return model(input_ids=ids, use_cache=False).logits
    return forward


def _compiled(model, log):
    import torch
    import torch._dynamo
    for knob in ("recompile_limit", "cache_size_limit"):    # one graph per (B, T): keep them all
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    log("    torch.compile(HF sdpa, dynamic=False): compiles on the first call of each shape")
    return _forward(torch.compile(model, dynamic=False))


def run_preset(p: ModelPlan, calib: dict, log, seed: int = 0) -> list[Row]:
    import torch
    from tilekit.models import GPT, GPTConfig
    config = p.config if p.config is not None else GPTConfig.preset(p.preset)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    impls = sorted(set(p.prefill_impls) | set(p.decode_impls), key=("sdpa", "eager").index)
    models, rows = {}, []
    with torch.no_grad():      # not inference_mode: its tensors would become the parameters
        base = build_hf(config, "sdpa", seed=seed)
        models["sdpa"] = base
        for impl in impls:
            if impl in models:
                continue
            try:
                models[impl] = build_hf(config, impl, like=base)
            except Exception as e:  # noqa: BLE001 - the other variants still run
                log(traceback.format_exc())
                rows.append(Row(suite="model", name="prefill", label=f"model {p.preset}", shape="-",
                                anchor=f"HF {impl}", status="error", note=f"building HF {impl}: {_short(e)}"))
        state = tilekit_state(base, config)
    gpt = GPT(config, dtype="bfloat16", state=state)
    del state
    log(f"[model {p.preset}] built HF ({', '.join(models)}) and tilekit models in {time.perf_counter() - t0:.1f} s")
    with torch.inference_mode():
        prefill = {f"HF {i}": _forward(models[i]) for i in p.prefill_impls if i in models}
        if p.compile:
            try:
                prefill["HF compile"] = _compiled(base, log)
            except Exception as e:  # noqa: BLE001
                log(f"    torch.compile unavailable: {_short(e)}")
                rows.append(Row(suite="model", name="prefill", label=f"model {p.preset}", shape="-",
                                anchor="HF compile", status="skipped", note=f"torch.compile: {_short(e)}"))
        rows += run_prefill(p, config, gpt, prefill, calib, log, rng)
        decode = {f"HF {i}": models[i] for i in p.decode_impls if i in models}
        rows += run_decode(p, config, gpt, decode, calib, log, rng)
    del gpt, models, base, prefill, decode
    timing.free_memory()
    return rows


def run(mode: str, calib: dict, log=print) -> list[Row]:
    try:
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError as e:
        return [Row(suite="model", name="prefill", label="model benchmarks", shape="-", anchor="HF",
                    status="skipped", note=f"transformers is not installed ({e})")]
    rows = []
    for p in plan(mode):
        try:
            rows += run_preset(p, calib, log)
        except Exception as e:  # noqa: BLE001
            log(traceback.format_exc())
            rows.append(Row(suite="model", name="prefill", label=f"model {p.preset}", shape="-",
                            anchor="HF", status="error", note=_short(e)))
            timing.free_memory()
    return rows

