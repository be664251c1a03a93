"""Does tuning matter? The same GPT run with heuristic defaults (TILEKIT_AUTOTUNE=off) and with the
tuning databases (TILEKIT_AUTOTUNE=cached: the user database over the shipped one).

Both sides are tilekit, so the "anchor" of a row is the untuned model and ratio = untuned / tuned.
Each row notes where the tuned side's configs came from (shipped / user / default), counted over
the model's kernel problems at that size, so a row measured without a matching database says so.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter

import numpy as np

from benchmarks.harness import checks, timing
from benchmarks.harness.markdown import SOURCES_PREFIX
from benchmarks.suites.model import NEW_TOKENS, PROMPT, _per_token, decode_label, prefill_label
from benchmarks.harness.report import Row, fill_times, mark_error, prefill_flops

UNTUNED = "AUTOTUNE=off"


def plan(mode: str) -> list[tuple[str, tuple, tuple]]:
    """(preset, prefill (B, T) pairs, decode batch sizes)."""
    if mode == "quick":
        return [(p, ((1, 128), (8, 1024)), (1,)) for p in ("gpt2", "gpt2-xl")]
    if mode == "full":
        return [(p, ((1, 128), (8, 128), (1, 1024), (8, 1024)), (1, 8))
                for p in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")]
    raise ValueError(f"mode must be 'quick' or 'full', got {mode!r}")


@contextlib.contextmanager
def autotune_mode(mode: str):
    """TILEKIT_AUTOTUNE=mode inside the block, every op's in-process plans forgotten on entry and exit."""
    from tilekit.autotune import store
    before = os.environ.get("TILEKIT_AUTOTUNE")
    os.environ["TILEKIT_AUTOTUNE"] = mode
    store.reset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TILEKIT_AUTOTUNE", None)
        else:
            os.environ["TILEKIT_AUTOTUNE"] = before
        store.reset()


def in_both_modes(gpt, measure) -> dict:
    """{mode: measure(mode)} for off, then cached; the model's graphs (which hold the configs they
    were captured with) are dropped before each."""
    out = {}
    for mode in ("off", "cached"):
        with autotune_mode(mode):
            gpt.forget_graphs()
            out[mode] = measure(mode)
    return out


def config_sources(config, batch: int, seq: int, *, prefill: bool) -> str:
    """'38 shipped, 2 default': where the cached mode's configs come from for a full-logits forward at
    (batch, seq), or for a greedy generation of NEW_TOKENS after a seq-token prompt."""
    from tilekit.device import device_info
    from tilekit.engine import workload
    device = device_info()
    problems = (workload.forward_problems(config, "bfloat16", batch, seq) if prefill else
                workload.generate_problems(config, "bfloat16", batch, seq, NEW_TOKENS))
    counts = Counter()
    for op, problem in problems:
        found = op.resolve(problem, device, "cached")
        nearest = found.match is not None and not found.match.exact
        counts[found.source + (f" ({found.match.rule})" if nearest else "")] += 1
    return ", ".join(f"{n} {source}" for source, n in counts.most_common())


def _row(name: str, label: str, shape: str, unit: str, work, params: dict) -> Row:
    return Row(suite="tuning", name=name, label=label, shape=shape, anchor=UNTUNED, unit=unit, work=work,
               tolerance=checks.MODEL_TOLERANCE, params=params)


def run_preset(preset: str, prefill: tuple, decode: tuple, log, seed: int = 0, config=None) -> list[Row]:
    """Prefill at each (B, T) and greedy decode at each B, untuned then tuned; `config` overrides the preset's."""
    from tilekit.models.families import family_of_config, preset_config
    config = config if config is not None else preset_config(preset)
    gpt = family_of_config(config).model_class(config, dtype="bfloat16", seed=seed)
    rng = np.random.default_rng(seed)
    rows = []
    for B, T in prefill:
        ids = rng.integers(0, config.vocab_size, (B, T), dtype=np.int64)
        r = _row("prefill", prefill_label(preset, B, T), f"B={B} T={T} V={config.vocab_size}", "TFLOP/s",
                 prefill_flops(config, B, T), {"preset": preset, "batch": B, "seq": T})
        rows.append(r)
        try:
            r.note = SOURCES_PREFIX + config_sources(config, B, T, prefill=True)
            log(f"[tuning {preset}] prefill B={B} T={T} ({r.note})")
            outs = {}

            def prefill_time(mode):
                outs[mode] = gpt(ids)
                return timing.measure(lambda: gpt(ids), flush_l2=True, warmup=2, reps=10)

            times = in_both_modes(gpt, prefill_time)
            r.error = checks.rel_error(outs["cached"], outs["off"])
            outs.clear()                  # the logits can be large: free them before the next shape
            if not r.error < r.tolerance:
                r.status, r.note = "failed", f"tuned and untuned logits differ by {r.error:.3g}"
                continue
            fill_times(r, times["cached"], times["off"])
            log(f"    untuned {r.anchor_ms:.2f} ms, tuned {r.tilekit_ms:.2f} ms, ratio {r.ratio:.2f}")
        except Exception as e:  # noqa: BLE001
            mark_error([r], e, log)
        timing.free_memory()
    for B in decode:
        prompt = rng.integers(0, config.vocab_size, (B, PROMPT), dtype=np.int64)
        r = _row("generate", decode_label(preset, B), f"B={B} prompt={PROMPT} new={NEW_TOKENS}", "tok/s",
                 float(B), {"preset": preset, "batch": B})
        rows.append(r)
        try:
            r.note = SOURCES_PREFIX + config_sources(config, B, PROMPT, prefill=False)
            log(f"[tuning {preset}] decode B={B} ({r.note})")
            tokens = {}

            def decode_time(mode):
                def generate():
                    tokens[mode] = gpt.generate(prompt, NEW_TOKENS, temperature=0)
                return _per_token(timing.wall_time(generate, warmup=1, runs=3), NEW_TOKENS)

            times = in_both_modes(gpt, decode_time)
            fill_times(r, times["cached"], times["off"])
            same = checks.leading_agreement(tokens["cached"][0][PROMPT:], tokens["off"][0][PROMPT:])
            r.note += f"; greedy tokens agree for the first {same}/{NEW_TOKENS} (sequence 0)"
            log(f"    untuned {r.anchor_ms:.3f} ms/token, tuned {r.tilekit_ms:.3f} ms/token, ratio {r.ratio:.2f}")
        except Exception as e:  # noqa: BLE001
            mark_error([r], e, log)
    return rows


def run(mode: str, log=print) -> list[Row]:
    rows = []
    for preset, prefill, decode in plan(mode):
        try:
            rows += run_preset(preset, prefill, decode, log)
        except Exception as e:  # noqa: BLE001
            rows += mark_error([Row(suite="tuning", name="prefill", label=f"tuning {preset}", shape="-",
                                    anchor=UNTUNED)], e, log)
        timing.free_memory()       # the preset's model is gone once run_preset returns
    return rows
