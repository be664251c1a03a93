"""tilekit's models (GPT-2, Llama) against PyTorch anchors on the same random weights: prefill and greedy decode.

The HF model is the family's transformers class (tilekit.models.families) built from config.to_hf_dict() on
the GPU, its biases and LayerNorm / RMSNorm weights nudged off 0 / 1 so the checks exercise them, and its
state dict (float32, under the family's names: without the prefix its HF class adds (GPT-2's "transformer."),
the buffers and a tied lm_head) builds tilekit's model of the family, so both hold identical weights.
Anchors, all on those weights: prefill: HF sdpa / eager and torch.compile(mode="reduce-overhead") of
the HF forward; decode: the gpt-fast-style step (benchmarks.suites.gptfast), HF generate with a static cache
(compiled) and with the dynamic cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from benchmarks.harness import checks, timing
from benchmarks.harness.report import Row, decode_floor_ms, fill_times, mark_error, prefill_flops

PROMPT, NEW_TOKENS = 128, 128
FP32_NEW_TOKENS = 16
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
COMPILED = ("gpt-fast step", "HF compile", "HF static")       # anchors whose first call compiles
COMPILE_BUDGET_S = {"gpt-fast step": 300.0, "HF compile": 90.0, "HF static": 90.0}   # per preset


@dataclass(frozen=True)
class ModelPlan:
    preset: str
    prefill: tuple = ()                       # ((batch, seq), anchors): "HF compile", "HF sdpa", "HF eager"
    decode: tuple = ()                        # (batch, anchors): "gpt-fast step", "HF static", "HF sdpa",
    dtype: str = "bfloat16"                   #   "HF eager", "gpt-fast eager"
    new_tokens: int = NEW_TOKENS
    prefill_reps: int = 10
    config: object = None                     # a model config instead of the preset's (tests)


def fp32_check(batches: tuple = (1,)) -> ModelPlan:
    """gpt2 in fp32, 16 greedy tokens: every token must equal HF's and the gpt-fast module's."""
    return ModelPlan("gpt2", decode=tuple((b, ("HF sdpa", "gpt-fast eager")) for b in batches), dtype="float32",
                     new_tokens=FP32_NEW_TOKENS)


def plan(mode: str) -> list[ModelPlan]:
    """Quick keeps the strongest anchors (the compiled decode step at B1 and B8, torch.compile prefill)
    for every model, the fp32 token check, and HF generate (static and dynamic cache) at gpt2 B1 only
    (static at llama-3.2-1b B1); full runs every anchor everywhere (Llama: the compiled decode step, HF
    static, HF compile and HF sdpa)."""
    if mode == "quick":
        prefill = tuple((shape, ("HF compile", "HF sdpa")) for shape in ((1, 128), (8, 1024)))
        step = (8, ("gpt-fast step",))
        return [ModelPlan("gpt2", prefill, ((1, ("gpt-fast step", "HF static", "HF sdpa")), step)),
                ModelPlan("gpt2-xl", prefill, ((1, ("gpt-fast step",)), step)),
                ModelPlan("llama-3.2-1b", prefill=(((1, 128), ("HF compile", "HF sdpa")), ((8, 1024), ("HF compile",))),
                          decode=((1, ("gpt-fast step", "HF static")), step)),
                fp32_check()]                 # last: its cold first call is mostly cuTile compiling fp32 kernels
    if mode == "full":
        shapes = tuple((b, t) for b in (1, 8) for t in (128, 512, 1024))
        prefill = tuple((shape, ("HF compile", "HF sdpa", "HF eager")) for shape in shapes)
        decode = tuple((b, ("gpt-fast step", "HF static", "HF sdpa", "HF eager")) for b in (1, 8))
        llama = ModelPlan("llama-3.2-1b", tuple((shape, ("HF compile", "HF sdpa")) for shape in shapes),
                          tuple((b, ("gpt-fast step", "HF static")) for b in (1, 8)), prefill_reps=20)
        return ([ModelPlan(p, prefill, decode, prefill_reps=20) for p in ("gpt2", "gpt2-xl")]
                + [llama, fp32_check((1, 8))])
    raise ValueError(f"mode must be 'quick' or 'full', got {mode!r}")


def model_config(preset: str):
    """The config of a preset of any family."""
    from tilekit.models.families import preset_config
    return preset_config(preset)


def prefill_label(preset: str, B: int, T: int) -> str:
    return f"prefill {preset} B{B} T{T}"


def decode_label(preset: str, B: int, new: int = NEW_TOKENS, dtype: str = "bfloat16") -> str:
    kind = "" if dtype == "bfloat16" else f" {dtype.replace('float', 'fp')}"
    return f"generate {preset}{kind} B{B} {PROMPT}+{new}"


def decode_verdict(agree: list[int], new: int, error: float, tolerance: float, exact: bool) -> tuple[str, str]:
    """(status, note) of a decode row: fp32 (`exact`) rows need every greedy token equal; all rows need
    the first-step logits within tolerance. `agree`: leading tokens equal, per sequence."""
    if exact and min(agree) < new:
        return "failed", f"greedy tokens differ from the anchor's after {min(agree)}/{new} (fp32 must match)"
    if not error < tolerance:
        return "failed", f"first-step logits relative error {error:.3g} >= {tolerance:g}"
    spread = "" if len(agree) == 1 else f" (least of {len(agree)} sequences; median {int(np.median(agree))})"
    return "ok", f"greedy tokens agree for the first {min(agree)}/{new}{spread}"


def _per_token(t: dict, n: int) -> dict:
    return {k: (v / n if k.endswith("_ms") else v) for k, v in t.items()}


# -- building the models ------------------------------------------------------------------------

def hf_config(config, impl: str):
    """The family's transformers config class (config_class of the class tilekit.patch runs) of
    config.to_hf_dict(), asking for attention `impl`."""
    from tilekit.models.families import family_of_config
    cls = family_of_config(config).hf_model_class().config_class
    d = {k: v for k, v in config.to_hf_dict().items() if k != "model_type"}
    try:
        return cls(**d, attn_implementation=impl)
    except TypeError:       # a config class that refuses keys it does not declare: build_hf sets `impl`
        return cls.from_dict(config.to_hf_dict())


def build_hf(config, impl: str, *, dtype: str = "bfloat16", seed: int | None = None, like=None):
    """The family's transformers model (GPT2LMHeadModel, LlamaForCausalLM) on the GPU, created in `dtype`,
    eval mode, attention `impl`, no end-of-text stop; weights random or `like`'s. Rotary inv_freq buffers stay
    float32, as from_pretrained leaves them (a model-wide .to(bfloat16) would round them and shift every RoPE
    angle)."""
    import torch

    from tilekit.models.families import family_of_config
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device("cuda"):
        model = family_of_config(config).hf_model_class()._from_config(
            hf_config(config, impl), attn_implementation=impl, dtype=getattr(torch, dtype))
    rounded = [name for name, b in model.named_buffers() if name.endswith("inv_freq") and b.dtype != torch.float32]
    if rounded:
        raise RuntimeError(f"transformers built the rotary {rounded[0]} in a dtype other than float32")
    model = model.eval().requires_grad_(False)
    if getattr(model.config, "_attn_implementation", None) != impl and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    actual = getattr(model.config, "_attn_implementation", None)
    if actual != impl:
        raise RuntimeError(f"transformers built attention {actual!r}, not {impl!r}")
    model.generation_config.eos_token_id = None          # generate exactly max_new_tokens, as tilekit does
    model.generation_config.pad_token_id = config.vocab_size - 1
    if like is not None:
        model.load_state_dict(like.state_dict())
    elif seed is not None:
        _nudge_affine(model, seed)
    return model


def nudged(name: str) -> bool:
    """Whether _nudge_affine moves this parameter: a bias, a GPT-2 LayerNorm's or a Llama RMSNorm's weight."""
    return name.endswith((".bias", "norm.weight")) or ".ln_" in name


def _nudge_affine(model, seed: int) -> None:
    """Biases and LayerNorm / RMSNorm parameters += N(0, 0.02), so they are neither 0 nor 1."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if nudged(name):
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32)
                p.add_((0.02 * noise).to(p.dtype))


def tilekit_state(model, config) -> dict:
    """HF state dict -> tilekit's: float32 numpy under the family's names (the prefix its HF class adds
    dropped), a tied head and buffers dropped."""
    from tilekit.models.families import family_of_config
    weights = family_of_config(config).weights
    wanted = weights.state_dict_shapes(config)
    state, unknown = {}, []
    for name, t in model.state_dict().items():
        if (config.tie_word_embeddings and name == "lm_head.weight") or name.endswith(weights.BUFFER_SUFFIXES):
            continue
        name = name.removeprefix(weights.PREFIX)
        if name in wanted:
            state[name] = t.detach().float().cpu().numpy()
        else:
            unknown.append(name)
    if len(state) != len(wanted):
        raise ValueError(f"HF state dict lacks {len(wanted) - len(state)} of tilekit's tensors; "
                         f"names it has that tilekit does not know: {unknown[:6]}")
    return state


class Anchors:
    """The anchors of one preset over one HF sdpa model (the eager one is built on first use)."""

    def __init__(self, base, config, dtype: str):
        self.models, self.config, self.dtype = {"sdpa": base}, config, dtype
        self.compiled_forward = None

    def hf(self, impl: str):
        if impl not in self.models:
            self.models[impl] = build_hf(self.config, impl, dtype=self.dtype, like=self.models["sdpa"])
        return self.models[impl]

    def prefill(self, name: str):
        """callable(ids) -> full logits (B, T, V)."""
        import torch
        if name == "HF compile":
            if self.compiled_forward is None:
                self.compiled_forward = torch.compile(self.models["sdpa"], mode="reduce-overhead", dynamic=False)

            def forward(ids):
                torch.compiler.cudagraph_mark_step_begin()   # the last call's outputs may be overwritten
                return self.compiled_forward(input_ids=ids, use_cache=False).logits
            return forward
        model = self.hf(name.removeprefix("HF "))
        return lambda ids: model(input_ids=ids, use_cache=False).logits

    def decode(self, name: str, batch: int, new: int):
        """callable(prompt, check) -> (tokens (B, PROMPT + new), logits (B, V) of the first new token or None)."""
        if name.startswith("gpt-fast"):
            from benchmarks.suites.gptfast import decoder_for
            decoder = decoder_for(self.models["sdpa"], batch, PROMPT + new, compile=name == "gpt-fast step")
            return lambda prompt, check=False: decoder.generate(prompt, new)
        model = self.hf("sdpa" if name == "HF static" else name.removeprefix("HF "))
        extra = {"cache_implementation": "static"} if name == "HF static" else {}

        def generate(prompt, check=False):
            import torch
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                 do_sample=False, output_logits=check, return_dict_in_generate=check, **extra)
            return (out.sequences, out.logits[0]) if check else (out, None)
        return generate


# -- one preset ---------------------------------------------------------------------------------

def _row(p: ModelPlan, name: str, label: str, shape: str, anchor: str, **kw) -> Row:
    return Row(suite="model", name=name, label=label, shape=shape, anchor=anchor, dtype=p.dtype, **kw)


def _first_call(name: str, budgets: dict, fn, r: Row):
    """fn(), charged to the anchor's compile budget when it is a compiled one; the row notes the seconds
    and whether Inductor fell back from CUDA graphs."""
    if name not in budgets:
        return fn()
    from torch._dynamo.utils import counters
    skips = counters["inductor"]["cudagraph_skips"]
    out, seconds = budgets[name].first_call(fn)
    skipped = counters["inductor"]["cudagraph_skips"] - skips
    r.params.update(compile_s=round(seconds, 1), cudagraph_skips=skipped)
    r.note = f"first call (compile) {seconds:.1f} s" + (f"; Inductor skipped CUDA graphs {skipped}x" if skipped else "")
    return out


def run_prefill(p: ModelPlan, config, gpt, anchors: Anchors, budgets: dict, calib: dict, log, rng) -> list[Row]:
    """Every (B, T) of the plan against every prefill anchor: full logits checked, then timed."""
    import torch
    rows = []
    for (B, T), names in p.prefill:
        ids = rng.integers(0, config.vocab_size, (B, T), dtype=np.int64)
        ids_t = torch.from_numpy(ids).cuda()
        log(f"[model {p.preset}] prefill B={B} T={T}")
        new = [_row(p, "prefill", prefill_label(p.preset, B, T), f"B={B} T={T} V={config.vocab_size}", name,
                    unit="TFLOP/s", work=prefill_flops(config, B, T), roofline=calib.get("matmul_peak_tflops"),
                    roofline_name="matmul_peak_tflops", tolerance=checks.MODEL_TOLERANCE,
                    params={"preset": p.preset, "batch": B, "seq": T}) for name in names]
        rows += new
        try:
            out = gpt(ids)
        except Exception as e:  # noqa: BLE001
            mark_error(new, e, log, "tilekit")
            continue
        tk_time = None
        for r in new:
            name = r.anchor
            if _budget_spent(r, budgets):
                continue
            try:
                forward = anchors.prefill(name)
                r.error = checks.rel_error(out, _first_call(name, budgets, lambda: forward(ids_t), r))
                if not r.error < r.tolerance:
                    r.status, r.note = "failed", f"logits relative error {r.error:.3g} >= {r.tolerance:g}"
                    continue
                if tk_time is None:
                    tk_time = timing.measure(lambda: gpt(ids), flush_l2=True, warmup=2, reps=p.prefill_reps)
                fill_times(r, tk_time, timing.measure(lambda: forward(ids_t), flush_l2=True, warmup=2,
                                                      reps=p.prefill_reps))
                log(f"    vs {name}: tilekit {r.tilekit_ms:.2f} ms, {name} {r.anchor_ms:.2f} ms, "
                    f"ratio {r.ratio:.2f}, err {r.error:.1e} {r.note}")
            except Exception as e:  # noqa: BLE001
                mark_error([r], e, log, name)
        del out
        timing.free_memory()
    return rows


def _budget_spent(r: Row, budgets: dict) -> bool:
    """True, with r marked skipped and why, when r's compiled anchor has spent its compile budget."""
    if r.anchor in budgets and (reason := budgets[r.anchor].skip_reason()):
        r.status, r.note = "skipped", reason
        return True
    return False


def run_decode(p: ModelPlan, config, gpt, anchors: Anchors, budgets: dict, calib: dict, log, rng) -> list[Row]:
    """Greedy generation of p.new_tokens after a PROMPT-token random prompt: checked, then wall-clock timed."""
    import torch
    rows, new, exact = [], p.new_tokens, p.dtype == "float32"
    for B, names in p.decode:
        floor = (decode_floor_ms(config, B, PROMPT, new, calib["copy_bandwidth_gbs"], ITEMSIZE[p.dtype])
                 if calib.get("copy_bandwidth_gbs") else None)
        prompt = rng.integers(0, config.vocab_size, (B, PROMPT), dtype=np.int64)
        prompt_t = torch.from_numpy(prompt).cuda()
        log(f"[model {p.preset}] decode {p.dtype} B={B}: {PROMPT} prompt + {new} new tokens")
        block = [_row(p, "generate", decode_label(p.preset, B, new, p.dtype), f"B={B} prompt={PROMPT} new={new}",
                      name, unit="tok/s", work=float(B), roofline=floor, roofline_name="decode_floor_ms",
                      tolerance=checks.TOLERANCE["float32"] if exact else checks.MODEL_TOLERANCE,
                      params={"preset": p.preset, "batch": B, "new_tokens": new}) for name in names]
        rows += block
        try:
            tk_tokens = np.stack(gpt.generate(prompt, new, temperature=0))
            if tk_tokens.shape != (B, PROMPT + new):
                raise RuntimeError(f"tilekit generated tokens of shape {tk_tokens.shape}")
            tk_logits = gpt(prompt)[:, -1]                    # the first generated position's logits
            tk_time = _per_token(timing.wall_time(lambda: gpt.generate(prompt, new, temperature=0),
                                                  warmup=0, runs=3), new)
        except Exception as e:  # noqa: BLE001
            mark_error(block, e, log, "tilekit")
            continue
        for r in block:
            name = r.anchor
            if _budget_spent(r, budgets):
                continue
            try:
                generate = anchors.decode(name, B, new)
                tokens, logits = _first_call(name, budgets, lambda: generate(prompt_t, check=True), r)
                tokens = tokens.cpu().numpy()
                agree = [checks.leading_agreement(tk_tokens[b, PROMPT:], tokens[b, PROMPT:]) for b in range(B)]
                r.error = checks.rel_error(tk_logits, logits)
                r.params.update(greedy_agreement=min(agree), greedy_agreement_per_sequence=agree)
                compile_note = r.note
                r.status, r.note = decode_verdict(agree, new, r.error, r.tolerance, exact)
                r.note = "; ".join(filter(None, (r.note, compile_note)))
                if r.status != "ok":
                    continue
                an = _per_token(timing.wall_time(lambda: generate(prompt_t), warmup=0, runs=3), new)
                fill_times(r, tk_time, an)
                log(f"    vs {name}: tilekit {r.tilekit_ms:.3f} ms/token, {name} {r.anchor_ms:.3f} ms/token, "
                    f"ratio {r.ratio:.2f}, floor {floor or 0:.3f} ms; {r.note}")
            except Exception as e:  # noqa: BLE001
                mark_error([r], e, log, name)
        del tk_logits
        timing.free_memory()
    return rows


def run_preset(p: ModelPlan, calib: dict, log, seed: int = 0) -> list[Row]:
    import torch

    from tilekit.models.families import family_of_config
    config = p.config if p.config is not None else model_config(p.preset)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    with torch.no_grad():      # not inference_mode: its tensors would become the parameters
        base = build_hf(config, "sdpa", dtype=p.dtype, seed=seed)
        state = tilekit_state(base, config)
    gpt = family_of_config(config).model_class(config, dtype=p.dtype, state=state)
    del state
    log(f"[model {p.preset}] built HF sdpa and tilekit models ({p.dtype}) in {time.perf_counter() - t0:.1f} s")
    anchors = Anchors(base, config, p.dtype)
    budgets = {name: timing.CompileBudget(COMPILE_BUDGET_S[name]) for name in COMPILED}
    try:
        with torch.inference_mode():
            return (run_prefill(p, config, gpt, anchors, budgets, calib, log, rng)
                    + run_decode(p, config, gpt, anchors, budgets, calib, log, rng))
    finally:
        del gpt, anchors, base
        torch._dynamo.reset()           # compiled graphs and their CUDA-graph pools go with the preset
        timing.free_memory()


def run(mode: str, calib: dict, log=print, presets: list[str] | None = None) -> list[Row]:
    """The model rows of `mode`'s plan, of the models in `presets` only when given."""
    try:
        import torch._dynamo
        import transformers
        transformers.logging.set_verbosity_error()
    except ImportError as e:
        return [Row(suite="model", name="prefill", label="model benchmarks", shape="-", anchor="HF",
                    status="skipped", note=f"transformers is not installed ({e})")]
    for knob in ("recompile_limit", "cache_size_limit"):      # one graph per shape and batch: keep them all
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
    rows = []
    for p in [p for p in plan(mode) if presets is None or p.preset in presets]:
        try:
            rows += run_preset(p, calib, log)
        except Exception as e:  # noqa: BLE001
            rows += mark_error([Row(suite="model", name="prefill", label=f"model {p.preset} {p.dtype}", shape="-",
                                    anchor="HF")], e, log)
            timing.free_memory()
    return rows
