"""generate() without a KV cache or a GPU, for the NumPy reference models: every step recomputes each whole prefix
(model.next_logits), its logits processed by the float64 reference and sampled with NumPy's generator; the stop
rules as on the GPU. Slow, for checking: the oracle the GPU runners are compared against."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tilekit.engine.runner import Runner
from tilekit.engine.sampling import GenerationSettings, SamplingParams, process_logits, sample_reference, token_counts
from tilekit.engine.grammar import constraint_masks, constraints_took, ends_only
from tilekit.engine.stops import StopChecker
from tilekit.kernels.token_bitmask import token_bitmask_reference

OPTIONS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "min_new_tokens", "eos_token_ids", "stop_strings", "seed")


class RecomputeRunner(Runner):
    """The runner of a NumPy reference model (tilekit.models.reference.ReferenceLM)."""

    def generate(self, ids, max_new_tokens: int | None = None, *, sampling: list[SamplingParams] | None = None,
                 on_token=None, **options) -> list[np.ndarray]:
        """What the GPU model's generate() returns, by recomputing every prefix each step: prompts `ids` (a 2-D
        array, or a list of token lists of different lengths), options as for generate() (temperature, top_k,
        ..., eos_token_id, stop_strings, seed), each processed as the GPU does and sampled with NumPy's
        generator (the same seed gives the same tokens here, not the GPU's)."""
        model = self.model
        if isinstance(ids, (list, tuple)) and ids and all(isinstance(p, (list, tuple, np.ndarray)) for p in ids):
            prompts = [model.check_ids(np.asarray([p]))[0] for p in ids]
        else:
            prompts = list(model.check_ids(ids))
        if "eos_token_id" in options:
            options["eos_token_ids"] = options.pop("eos_token_id")
        settings, rows, streams = self.generation_plan(prompts, max_new_tokens, sampling,
                                                       **{k: options.pop(k, None) for k in OPTIONS})
        constraints = self.constraints(options.pop("response_format", None), len(prompts))
        if options:
            raise ValueError(f"unknown generation argument(s): {', '.join(sorted(options))}")
        return generate_by_recomputation(model, prompts, settings, rows, streams, model.next_logits, on_token,
                                         constraints)


def generate_by_recomputation(model, prompts: Sequence[np.ndarray], settings: GenerationSettings,
                              rows: Sequence[SamplingParams], streams, step_logits: Callable,
                              on_token: Callable | None, constraints: list | None = None) -> list[np.ndarray]:
    """generate() without a KV cache or a GPU, for the NumPy references: each step's logits come from
    step_logits(sequences) (recomputing every prefix), masked by each row's constraint (structured output; the row
    stops when it is complete), processed by process_logits and sampled by sample_reference with one generator
    seeded from settings.seed; the stop rules as on the GPU."""
    B, V = len(prompts), model.config.vocab_size
    seqs = [list(int(t) for t in p) for p in prompts]
    rng = np.random.default_rng(settings.seed)
    stops = StopChecker(B, settings)
    pad = settings.eos_token_ids[0] if settings.eos_token_ids else 0
    for step in range(settings.max_new_tokens):
        outputs = [s[len(p):] for s, p in zip(seqs, prompts)]
        logits = step_logits(seqs)
        counts, output_counts = token_counts(seqs, V), token_counts(outputs, V)
        eos = settings.eos_token_ids
        if constraints:
            masks = constraint_masks(constraints, stops.done)
            logits = token_bitmask_reference(logits, masks)
            held = [0 if ends_only(m, eos) else settings.min_new_tokens for m in masks]   # a complete grammar ends
            processed = np.concatenate([process_logits(logits[b:b + 1], counts[b:b + 1], output_counts[b:b + 1],
                                                       rows[b:b + 1], step, eos_token_ids=eos, min_new_tokens=h)
                                        for b, h in enumerate(held)])
        else:
            processed = process_logits(logits, counts, output_counts, rows, step, eos_token_ids=eos,
                                       min_new_tokens=settings.min_new_tokens)
        tokens = np.where(stops.done, pad, sample_reference(processed, rng))
        for s, t in zip(seqs, tokens):
            s.append(int(t))
        running = ~stops.done
        stops.update(tokens, None if streams is None else [st.push(t) for st, t in zip(streams, tokens)])
        if constraints:
            constraints_took(constraints, tokens, running, stops)
        if on_token is not None:
            on_token(tokens)
        if stops.all_done:
            break
    return [np.asarray(s[:len(p) + n], np.int64) for s, p, n in zip(seqs, prompts, stops.lengths)]


class RecomputeExecutor:
    """Continuous batching's executor for a NumPy reference model (tilekit.engine.llm; the server on the CPU): each
    step's picks come from recomputing each picked request's whole sequence, processed as the GPU does and sampled
    with a generator seeded by (the request's seed, the position), so a request's tokens do not depend on what it
    was batched with. No KV cache is kept: the scheduler's blocks are bookkeeping only."""

    def __init__(self, model):
        self.model = model

    def forget(self, request) -> None:
        """A request has finished or was aborted (nothing kept for it here)."""

    def prepare_masks(self, constraints: dict) -> None:
        """The next step's masks (each pick here asks its matcher then)."""

    def collect(self, handle) -> dict:
        """The picks launch() computed."""
        return handle

    def launch(self, step, constraints: dict | None = None) -> dict:
        """{request id: token} of the step's picks, computed now (collect() returns them); constraints: {request id:
        its structured output's matcher}."""
        picked = {}
        for request in step.picks:
            seq = request.tokens
            output = request.output
            V = self.model.config.vocab_size
            logits = self.model.next_logits([seq])
            mask = constraints[request.id].mask() if constraints and request.id in constraints else None
            if mask is not None:
                logits = token_bitmask_reference(logits, mask[None])
            held = 0 if mask is not None and ends_only(mask, request.eos_token_ids) else request.min_new_tokens
            processed = process_logits(logits, token_counts([seq], V),
                                       token_counts([output], V), [request.sampling], len(output),
                                       eos_token_ids=request.eos_token_ids, min_new_tokens=held)
            rng = np.random.default_rng([request.seed, len(seq)])
            picked[request.id] = int(sample_reference(processed, rng)[0])
        return picked

    def release(self) -> None:
        """Nothing captured."""
