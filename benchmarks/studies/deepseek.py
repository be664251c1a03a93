"""DeepSeek-V2 (issue #33) at the V2-Lite shape, random weights, bf16: greedy decode against its bandwidth floor,
a compiled PyTorch decode step and Hugging Face transformers on the same weights, the latent KV cache against the
equivalent MHA cache, and prefill against the HF model compiled and eager.

    python -m benchmarks.studies.deepseek [--model deepseek-v2-lite] [--batch 1 --batch 8 --batch 32]
                                          [--prefill 1024 --prefill 4096] [--no-anchor] [--out DIR]

Decode rows (a 128-token prompt + 128 new tokens, greedy, no eos): the replayed decode step (CUDA graph) against
its floor: the weight bytes one step must read (every weight but the embedding table, of which only the batch's
rows, and of each MoE layer's routed experts only those its tokens select, counted from the router's outputs over
16 eager decode steps) plus the latent cache of the mean context, at the measured copy bandwidth; the same step
against the gpt-fast-style compiled step (benchmarks.suites.gptfast: static latent cache, absorbed attention,
experts gathered per token, torch.compile with CUDA graphs), both as back-to-back replays; generate()'s wall ms
per new token (prefill included) against transformers' DeepseekV2ForCausalLM generate() (dynamic cache, sdpa
attention, its default experts implementation, eager PyTorch) holding the very same device memory as weights
(views of tilekit's arrays; copies only where the layouts differ). An anchor counts only if its first new token's
logits agree within the bf16 model tolerance; else it is a failed row, not a number. Prefill rows: full-logits
forward() of B1 x T against the same HF model's forward, compiled (CUDA graphs) and eager. Kernels are compiled
up front in parallel worker processes (cuTile's disk cache), on the tuned configs where the database has them,
else the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.harness.compiling import Precompile, distinct_tasks
from benchmarks.studies.breakdown import NEW_TOKENS, PROMPT, _decode_generation, replay_ms

PRESET = "deepseek-v2-lite"
ROUTING_STEPS = 16          # eager decode steps whose router outputs count the routed experts a step reads
ANCHOR = "HF eager generate"
COMPILED = "compiled PyTorch step (gpt-fast style)"
DEFAULT_BATCHES, DEFAULT_PREFILL = (1, 8, 32), (1024, 4096)


# -- bytes --------------------------------------------------------------------------------------------------------

def moe_layers(config) -> int:
    return sum(config.is_moe_layer(i) for i in range(config.n_layer))


def expert_params(config) -> int:
    """Parameters of one routed expert: gate, up and down projections."""
    return 3 * config.moe_intermediate_size * config.n_embd


def active_weight_bytes(config, batch: int, routed_per_step: float, itemsize: int = 2) -> float:
    """Weight bytes one decode step of `batch` tokens must read: every tensor of the config but the embedding table
    (its `batch` rows only, unless the LM head is tied to it) and the routed experts, of which `routed_per_step`
    (summed over the MoE layers) are read."""
    from benchmarks.harness.report import streamed_params
    routed = moe_layers(config) * config.n_routed_experts * expert_params(config)
    return itemsize * (streamed_params(config, batch) - routed + routed_per_step * expert_params(config))


def cache_values_per_token_layer(cache, config, batch: int, capacity: int) -> float:
    """Values one token keeps per layer in a model's KV cache: the bytes of the cache's own allocations (not
    their views) over layers x batch x capacity x itemsize."""
    arrays = [a for a in vars(cache).values() if hasattr(a, "nbytes") and getattr(a, "base", None) is None]
    if not arrays:
        raise RuntimeError(f"{type(cache).__name__} holds no device arrays")
    return sum(a.nbytes for a in arrays) / (config.n_layer * batch * capacity * arrays[0].dtype.itemsize)


def mha_values(config) -> int:
    """Values per token and layer of the equivalent multi-head cache: H keys of qk_head_dim, H values of
    v_head_dim."""
    return config.n_head * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)


def kv_bytes(config, batch: int, values: float, context: float, itemsize: int = 2) -> float:
    """Cache bytes one decode step reads at a mean context."""
    return config.n_layer * batch * values * itemsize * context


# -- compiling ahead ----------------------------------------------------------------------------------------------

def workload_tasks(model, batches, prefills, config_of=None) -> list[tuple]:
    """(op, problem, config) of every kernel the run launches (generate at each batch, forward of each batch's
    prompts, each prefill length), each once, with config_of(op, problem) (default: the config this GPU's
    databases give it, else the default)."""
    calls = []
    for b in batches:
        calls += model.kernel_problems(b, PROMPT, NEW_TOKENS) + model.kernel_problems(b, PROMPT)
    for t in prefills:
        calls += model.kernel_problems(1, t)
    return distinct_tasks(calls, config_of)


# -- the anchor ---------------------------------------------------------------------------------------------------

def _torch_view(a):
    """A torch tensor on a CuPy (or NumPy) array's memory, bfloat16 through its bits; a copy if a is strided."""
    import numpy as np
    import torch
    if isinstance(a, np.ndarray):
        a, wrap = np.ascontiguousarray(a), torch.from_numpy
    else:
        import cupy
        a, wrap = cupy.ascontiguousarray(a), torch.from_dlpack
    if a.dtype.name == "bfloat16":
        return wrap(a.view(np.int16)).view(torch.bfloat16)
    return wrap(a)


def hf_on(model, impl: str = "sdpa", device: str = "cuda"):
    """The family's transformers model holding `model`'s weights: built on the meta device, its parameters then
    assigned views of tilekit's arrays in the files' layout (copies where layouts differ), its non-persistent
    buffers (rotary tables) rebuilt on `device`. Eval mode, attention `impl`, no end-of-text stop."""
    import torch

    from benchmarks.suites.model import hf_config
    from tilekit.models.families import family_of_config
    config = model.config
    family = family_of_config(config)
    dtype = getattr(torch, model.dtype)
    with torch.device("meta"):
        hf = family.hf_model_class()._from_config(hf_config(config, impl), attn_implementation=impl, dtype=dtype)
    state = {name: _torch_view(a) for name, a in family.weights.to_file(config, model.params, True).items()}
    hf.load_state_dict(state, strict=True, assign=True)
    for name, module in list(hf.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            with torch.device(device):
                rebuilt = type(module)(config=module.config)
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent), attr, rebuilt)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the HF model kept meta tensors: {left[:4]}")
    rounded = [n for n, b in hf.named_buffers() if n.endswith("inv_freq") and b.dtype != torch.float32]
    if rounded:
        raise RuntimeError(f"transformers built the rotary {rounded[0]} in a dtype other than float32")
    hf = hf.eval().requires_grad_(False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = config.vocab_size - 1
    return hf


def anchor_label(hf) -> str:
    experts = getattr(hf.config, "_experts_implementation", None)
    return f"{ANCHOR} ({hf.config._attn_implementation}" + (f", experts {experts})" if experts else ")")


# -- measuring ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def router_outputs(top_k: int):
    """Within the block, the number of distinct routed experts each moe_router call selects, with its row count:
    a list of (rows, distinct) filled as the (eager) calls run."""
    import cupy

    from tilekit.kernels.moe_router import MOE_ROUTER
    seen, original = [], MOE_ROUTER.plan_for

    def plan_for(arrays, flags=()):
        plan, arrays = original(arrays, flags)

        def run(arrays, scalars):
            out = plan(arrays, scalars)
            ids = arrays[2]                       # topk_ids (..., top_k + shared): the routed ones first
            ids = ids.reshape(-1, ids.shape[-1])[:, :top_k]
            seen.append((ids.shape[0], int(cupy.unique(ids).size)))
            return out
        return run, arrays

    MOE_ROUTER.plan_for = plan_for
    try:
        yield seen
    finally:
        del MOE_ROUTER.plan_for


def routed_per_step(model, prompt, steps: int = ROUTING_STEPS) -> float:
    """Routed experts one decode step reads, summed over the MoE layers: the distinct experts each layer's router
    selects for the batch's tokens, averaged over `steps` eager greedy decode steps after `prompt`."""
    batch = prompt.shape[0]
    with router_outputs(model.config.num_experts_per_tok) as seen:
        model.generate(prompt, steps + 1, temperature=0, eos_token_id=[], use_graph=False)
    decode = [n for rows, n in seen if rows == batch]
    if len(decode) != steps * moe_layers(model.config):
        raise RuntimeError(f"{len(decode)} router calls of {batch} rows in {steps} decode steps")
    return sum(decode) / steps


def _verdict(model, prompt, tokens, theirs, their_logits) -> dict:
    """An anchor's first-token logits and greedy tokens against tilekit's: its status (decode_verdict)."""
    from benchmarks.harness import checks
    from benchmarks.suites.model import decode_verdict
    error = checks.rel_error(model(prompt)[:, -1], their_logits)
    agree = [checks.leading_agreement(tokens[b, PROMPT:], theirs[b, PROMPT:]) for b in range(len(tokens))]
    status, note = decode_verdict(agree, NEW_TOKENS, error, checks.MODEL_TOLERANCE, False)
    return dict(logits_error=error, greedy_agreement=min(agree), greedy_agreement_per_sequence=agree, status=status,
                note=note)


def compiled_step_anchor(model, hf, prompt, tokens, step_ms: float) -> dict:
    """The gpt-fast-style step (benchmarks.suites.gptfast, torch.compile with CUDA graphs) on the same weights:
    its replayed step against tilekit's, both as the wall time of back-to-back replays."""
    import numpy as np
    import torch

    from benchmarks.harness import timing
    from benchmarks.suites.gptfast import decoder_for
    decoder = decoder_for(hf, len(prompt), PROMPT + NEW_TOKENS)
    prompt_t = torch.from_numpy(prompt).cuda()
    first = time.perf_counter()
    theirs, logits = decoder.generate(prompt_t, NEW_TOKENS)           # compiles and captures the step
    a = dict(name=COMPILED, measure="step", first_call_s=time.perf_counter() - first, ms=None, speedup=None,
             **_verdict(model, prompt, tokens, theirs.cpu().numpy(), logits))
    if a["status"] == "ok":
        def steps(n=50):
            decoder.pos.fill_(PROMPT)
            timing.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                decoder.decode_step()
            timing.synchronize()
            return (time.perf_counter() - start) * 1e3 / n
        steps()
        ms = float(np.median([steps() for _ in range(5)]))
        a.update(ms=ms, speedup=ms / step_ms)
    del decoder, theirs, logits
    return a


def hf_generate_anchor(model, hf, prompt, tokens, gen_ms: float) -> dict:
    """transformers' generate() on the same weights: its wall ms per new token against tilekit's generate()."""
    import torch

    from benchmarks.harness import timing
    prompt_t = torch.from_numpy(prompt).cuda()
    mask = torch.ones_like(prompt_t)

    def generate(check=False):
        return hf.generate(prompt_t, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                           output_logits=check, return_dict_in_generate=check)
    out = generate(check=True)
    a = dict(name=anchor_label(hf), measure="generate", ms=None, speedup=None,
             **_verdict(model, prompt, tokens, out.sequences.cpu().numpy(), out.logits[0]))
    del out
    if a["status"] == "ok":
        ms = timing.wall_time(generate, warmup=0, runs=1)["median_ms"] / NEW_TOKENS
        a.update(ms=ms, speedup=ms / gen_ms)
    return a


def _anchor(fn, name: str, measure: str, *args) -> dict:
    """fn(*args) under inference mode; a failure is a failed anchor that says why."""
    import torch

    from benchmarks.harness import timing
    try:
        with torch.inference_mode():
            return fn(*args)
    except Exception as e:  # noqa: BLE001 - the row says why, the others still run
        return dict(name=name, measure=measure, ms=None, speedup=None, status="failed",
                    note=f"{type(e).__name__}: {e}")
    finally:
        timing.free_memory()


def decode_row(model, hf, preset: str, batch: int, copy_gbs: float, log=print) -> dict:
    """One batch: the replayed step against its floor and the compiled PyTorch step, generate() against the HF
    model's generate()."""
    import numpy as np

    from benchmarks.harness import timing
    config = model.config
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, (batch, PROMPT))    # _decode_generation's
    first = time.perf_counter()
    gen = _decode_generation(model, batch)            # compiles what precompiling missed, captures the graphs
    first = time.perf_counter() - first
    tokens = np.stack(model.generate(prompt, NEW_TOKENS, temperature=0, eos_token_id=[]))   # its graphs replayed
    gen_ms = timing.wall_time(lambda: model.generate(prompt, NEW_TOKENS, temperature=0, eos_token_id=[]),
                              warmup=0, runs=3)["median_ms"] / NEW_TOKENS
    step_ms = float(np.median([replay_ms(gen, 50) for _ in range(5)]))
    values = cache_values_per_token_layer(gen.state.cache, config, batch, gen.state.cache.capacity)
    model.forget_graphs()
    routed = routed_per_step(model, prompt)
    weights = active_weight_bytes(config, batch, routed)
    cache = kv_bytes(config, batch, values, PROMPT + NEW_TOKENS / 2)
    floor = (weights + cache) / (copy_gbs * 1e9) * 1e3
    row = dict(preset=preset, batch=batch, prompt=PROMPT, new_tokens=NEW_TOKENS, step_ms=step_ms,
               floor_ms=floor, pct_floor=100 * floor / step_ms, weight_bytes=weights, kv_bytes=cache,
               routed_experts_per_layer=routed / moe_layers(config), generate_ms_per_token=gen_ms, first_generate_s=first,
               anchors=[])
    model.forget_graphs()
    if hf is not None:
        row["anchors"] = [_anchor(compiled_step_anchor, COMPILED, "step", model, hf, prompt, tokens, step_ms),
                          _anchor(hf_generate_anchor, anchor_label(hf), "generate", model, hf, prompt, tokens, gen_ms)]
    log(f"decode {preset} B{batch:<3d} step {step_ms:7.3f} ms = {row['pct_floor']:4.0f}% of the {floor:.3f} ms floor "
        f"({weights / 1e9:.2f} GB weights, {row['routed_experts_per_layer']:.1f} routed experts/layer, "
        f"{cache / 1e6:.1f} MB cache); generate {gen_ms:.3f} ms/token (first call {first:.1f} s)"
        + "".join(f"; {a['name']} {a['measure']} " + (f"{a['ms']:.3f} ms ({a['speedup']:.2f}x)" if a["speedup"]
                                                      else f"{a['status']}: {a['note']}") for a in row["anchors"]))
    model.forget_graphs()
    timing.free_memory()
    return row


def compiled_forward_anchor(model, hf, ids, ms: float) -> dict:
    """The HF model's forward under torch.compile (CUDA graphs, its grouped-GEMM experts) against tilekit's."""
    import torch
    compiled = torch.compile(hf, mode="reduce-overhead", dynamic=False)
    ids_t = torch.from_numpy(ids).cuda()

    def forward():
        torch.compiler.cudagraph_mark_step_begin()          # the last call's outputs may be overwritten
        return compiled(input_ids=ids_t, use_cache=False).logits
    first = time.perf_counter()
    forward()
    a = dict(name=f"HF compiled forward ({hf.config._attn_implementation})", measure="forward",
             first_call_s=time.perf_counter() - first)
    return {**a, **_forward_verdict(model, ids, forward, ms)}


def hf_forward_anchor(model, hf, ids, ms: float) -> dict:
    """The HF model's eager forward against tilekit's."""
    import torch
    ids_t = torch.from_numpy(ids).cuda()
    return dict(name=anchor_label(hf).replace(" generate", " forward"), measure="forward",
                **_forward_verdict(model, ids, lambda: hf(input_ids=ids_t, use_cache=False).logits, ms))


def _forward_verdict(model, ids, forward, ms: float) -> dict:
    """forward()'s full logits against tilekit's (the model tolerance), then its time against ms."""
    from benchmarks.harness import checks, timing
    ours, theirs = model(ids), forward()
    error = checks.rel_error(ours, theirs)
    agree = (_torch_view(ours).argmax(-1) == theirs.argmax(-1)).float().mean().item()
    del ours, theirs
    a = dict(logits_error=error, argmax_agreement=agree, ms=None, speedup=None)   # the check is the error
    if not error < checks.MODEL_TOLERANCE:
        return dict(a, status="failed", note=f"logits relative error {error:.3g} >= {checks.MODEL_TOLERANCE:g} "
                                             f"(argmax equal at {agree:.1%})")
    their_ms = timing.measure(forward, flush_l2=False, warmup=1, reps=5)["median_ms"]
    return dict(a, ms=their_ms, speedup=their_ms / ms, status="ok",
                note=f"logits error {error:.1e}, argmax equal at {agree:.1%} of positions")


def prefill_row(model, hf, preset: str, seq: int, log=print) -> dict:
    """forward() on 1 x seq ids, full logits, against the HF model's forward compiled and eager."""
    import numpy as np

    from benchmarks.harness import timing
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (1, seq))
    ms = timing.measure(lambda: model(ids), flush_l2=False, warmup=2, reps=10)["median_ms"]
    row = dict(preset=preset, batch=1, seq=seq, forward_ms=ms, tokens_per_s=seq / ms * 1e3, anchors=[])
    if hf is not None:
        name = anchor_label(hf).replace(" generate", " forward")
        row["anchors"] = [_anchor(compiled_forward_anchor, "HF compiled forward", "forward", model, hf, ids, ms),
                          _anchor(hf_forward_anchor, name, "forward", model, hf, ids, ms)]
    log(f"prefill {preset} B1 T{seq} {ms:8.2f} ms ({row['tokens_per_s']:.0f} tokens/s)"
        + "".join(f"; {a['name']} " + (f"{a['ms']:.2f} ms ({a['speedup']:.2f}x)" if a["speedup"]
                                       else f"{a['status']}: {a['note']}") for a in row["anchors"]))
    model.forget_graphs()
    timing.free_memory()
    return row


def cache_row(model, preset: str) -> dict:
    """The latent cache's values per token and layer, from a one-sequence cache of the model, against MHA's."""
    from tilekit.engine.kv_cache import new_cache
    from tilekit.models.base import Arrays
    cache = new_cache(model, 1, 16, Arrays())
    values = cache_values_per_token_layer(cache, model.config, 1, 16)
    mha = mha_values(model.config)
    return dict(preset=preset, values_per_token_layer=values, bytes_per_token_layer=2 * values,
                mha_values_per_token_layer=mha, mha_bytes_per_token_layer=2 * mha, ratio=mha / values)


# -- the table ----------------------------------------------------------------------------------------------------

def _anchor_cells(row: dict, measure: str) -> str:
    """The anchor columns of a table line: the row's anchor of this measure (or every prefill anchor's name)."""
    a = next((a for a in row["anchors"] if a["measure"] == measure), None)
    if a is None:
        return f"{'-':>10}{'-':>9}  no anchor"
    if a["speedup"] is None:
        return f"{'-':>10}{'-':>9}  {a['status']} ({a['name']}: {a['note']})"
    return f"{a['ms']:>10.3f}{a['speedup']:>8.2f}x  {a['status']} ({a['name']})"


def format_table(results: dict) -> str:
    """The short summary printed last: tilekit, its floor, the anchor and tilekit's speedup over it."""
    lines = [f"{'row':<30}{'tilekit':>10}{'floor':>9}{'% floor':>9}{'anchor':>10}{'speedup':>9}  status (anchor)"]
    for r in results["decode"]:
        lines.append(f"{'decode B' + str(r['batch']) + ' step ms':<30}{r['step_ms']:>10.3f}{r['floor_ms']:>9.3f}"
                     f"{r['pct_floor']:>8.0f}%" + _anchor_cells(r, "step"))
        lines.append(f"{'decode B' + str(r['batch']) + ' generate ms/token':<30}{r['generate_ms_per_token']:>10.3f}"
                     f"{'':>18}" + _anchor_cells(r, "generate"))
    for r in results["prefill"]:
        label = f"{'prefill B1 T' + str(r['seq']) + ' ms':<30}{r['forward_ms']:>10.2f}{'':>18}"
        for i in range(max(1, len(r["anchors"]))):
            lines.append(label + _anchor_cells(dict(r, anchors=r["anchors"][i:]), "forward"))
    c = results["cache"]
    lines.append(f"latent cache {c['values_per_token_layer']:.0f} values ({c['bytes_per_token_layer']:.0f} B) per token "
                 f"and layer vs MHA {c['mha_values_per_token_layer']} ({c['mha_bytes_per_token_layer']} B): "
                 f"{c['ratio']:.1f}x smaller")
    lines.append(f"{results['preset']}, random weights, bf16; copy bandwidth {results['copy_gbs']:.0f} GB/s; "
                 f"HF model: {results['anchor']}; decode {PROMPT} prompt + {NEW_TOKENS} new tokens")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.studies.deepseek", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=PRESET, help=f"a mixture-of-experts preset (default {PRESET})")
    ap.add_argument("--batch", type=int, action="append",
                    help="decode batch size (repeatable; default 1, 8, 32; 0: no decode rows)")
    ap.add_argument("--prefill", type=int, action="append",
                    help="prefill length T at batch 1 (repeatable; default 1024, 4096; 0: no prefill rows)")
    ap.add_argument("--no-anchor", action="store_true", help="no transformers model (tilekit and floors only)")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                    help="write deepseek.json here, after each row (default: $OUT when set)")
    args = ap.parse_args(argv)
    from tilekit.models.families import preset_config, preset_names
    if args.model not in preset_names():
        ap.error(f"--model {args.model}: not a preset ({', '.join(preset_names())})")
    if not hasattr(preset_config(args.model), "num_experts_per_tok"):
        ap.error(f"--model {args.model}: not a mixture-of-experts preset")
    if any(b < 0 for b in args.batch or ()) or any(t < 0 for t in args.prefill or ()):
        ap.error(f"--batch and --prefill must be >= 0, got {args.batch} and {args.prefill}")
    args.batch = [b for b in args.batch or DEFAULT_BATCHES if b]
    args.prefill = [t for t in args.prefill or DEFAULT_PREFILL if t]
    return args


def run(config, preset: str, batches: list[int], prefill: list[int], anchor: bool = True, log=print,
        saved=lambda results: None) -> tuple[dict, int]:
    """Every row of one config (random weights from seed 0); (results, rows that failed). saved(results) runs
    after each row."""
    from benchmarks.harness.timing import copy_bandwidth
    from tilekit.device import device_info
    from tilekit.models.families import family_of_config
    model_class = family_of_config(config).model_class
    compiling = Precompile(workload_tasks(model_class(config, dtype="bfloat16", meta=True), batches, prefill),
                           device_info().arch)
    compiling.start()
    log(f"compiling {len(compiling.tasks)} kernels in the background")
    copy_gbs = copy_bandwidth()["gbs"]
    log(f"copy bandwidth {copy_gbs:.0f} GB/s")
    model = model_class(config, dtype="bfloat16", seed=0)
    log(f"built tilekit's {preset} ({sum(a.size for a in model.params.values()) / 1e9:.2f}B parameters)")
    hf, anchor_note = None, "none (--no-anchor)"
    if anchor:
        try:
            import transformers
            transformers.logging.set_verbosity_error()
            hf = hf_on(model)
            anchor_note = anchor_label(hf)
            log(f"built the HF model on the same weights: {anchor_note}")
        except Exception as e:  # noqa: BLE001 - the tilekit rows and floors still run
            anchor_note = f"none: {type(e).__name__}: {e}"
            log(f"no anchor: {type(e).__name__}: {e}")
    compiling.join()
    log(compiling.summary())
    results = {"preset": preset, "copy_gbs": copy_gbs, "anchor": anchor_note, "cache": cache_row(model, preset),
               "decode": [], "prefill": []}
    failed = 0
    rows = [("decode", b, decode_row, copy_gbs) for b in batches] + [("prefill", t, prefill_row) for t in prefill]
    for part, size, row, *extra in rows:
        try:
            results[part].append(row(model, hf, preset, size, *extra, log=log))
        except Exception as e:  # noqa: BLE001 - the other rows still run
            failed += 1
            log(f"{part} {size} failed: {type(e).__name__}: {e}")
        saved(results)
    model.forget_graphs()
    anchors = [a for r in results["decode"] + results["prefill"] for a in r["anchors"]]
    return results, failed + sum(a["status"] == "failed" for a in anchors)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

    def saved(results):
        results["seconds"] = time.perf_counter() - start
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "deepseek.json").write_text(json.dumps(results, indent=1, default=float) + "\n")

    from tilekit.models.families import preset_config
    results, failed = run(preset_config(args.model), args.model, args.batch, args.prefill, not args.no_anchor, log,
                          saved)
    saved(results)
    print(format_table(results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
