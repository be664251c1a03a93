"""The kernel problems a model runs: what `tilekit tune --model` tunes and `db explain` reports.

Recorded from the engine's own step code run on a model with MetaArray weights (kernel_problems), so every key
tuned here is, by construction, a key that forward() or generate() asks for.
"""

from __future__ import annotations

import inspect

from tilekit import parallel
from tilekit.autotune.op import recording
from tilekit.engine.picker import WORKLOAD_PICKERS
from tilekit.engine.steps import DecodeState, PromptBuffers, capacity_for, forward_hidden, logits, prefill_pieces
from tilekit.models import quantization
from tilekit.models.base import META
from tilekit.models.families import family_of_config

NEW_TOKENS = 128       # generate()'s continuation length in the tuning workload


def kernel_problems(model, batch: int, seq_len: int, new_tokens: int | None = None) -> list[tuple]:
    """(op, problem) of every kernel call of forward() on (batch, seq_len) ids, or, with new_tokens, of generate()
    continuing batch prompts of seq_len tokens by new_tokens (its prompt prefill and a decode step, greedy and with
    Hugging Face's default sampling: WORKLOAD_PICKERS): the very step code, run on `model`'s meta twin."""
    if not model.meta:
        model = model.meta_twin()
    with recording() as calls:
        if new_tokens is None:
            buf = PromptBuffers(model, batch, seq_len, META)
            forward_hidden(model, buf)
            logits(model, buf.acts.h, META)
        else:
            capacity, padded = capacity_for(model, seq_len, new_tokens)
            for picker in WORKLOAD_PICKERS:
                state = DecodeState(model, batch, capacity, META, picker)
                for start, n in prefill_pieces(model, padded, seq_len - 1, state.cache):
                    state.prefill(PromptBuffers(model, batch, n, META), start, final=start + n == padded)
                state.step()
    return calls


def meta_model(config, dtype: str, quantize: str | quantization.Scheme | None = None, rank: int = 0, tp: int = 1,
               quantize_head: bool = False):
    """A model of `config` (a config of any family) with shapes and no memory; `quantize`: its linears in
    "int8" or "fp8" (families that support it), `quantize_head` its untied LM head too, or the Scheme a checkpoint's
    model holds (CausalLM.loaded_scheme, its head decided); tp > 1: tensor-parallel rank `rank` of tp (its shard's
    shapes)."""
    cls = family_of_config(config).model_class
    options = {}
    for name, value, what in (("quantize", quantize, "quantized linears"), ("comm", tp > 1, "tensor parallelism")):
        if value and name not in inspect.signature(cls).parameters:
            raise ValueError(f"{cls.__name__} models have no {what}")
    if quantize_head and quantize is None:
        raise ValueError("quantize_head goes with quantize='int8' or 'fp8'")
    if isinstance(quantize, quantization.Scheme):
        if quantize_head:
            raise ValueError("quantize_head goes with quantize='int8' or 'fp8' (a Scheme holds its head)")
        options["quantize"] = quantize
    elif quantize is not None:
        options["quantize"] = quantization.Scheme(quantize, head=quantize_head)
    if quantize is not None:
        quantization.check_head(cls, config, options["quantize"])
    if tp > 1:
        options["comm"] = parallel.ShapeOnly(rank, tp)
    return cls(config, dtype=dtype, meta=True, **options)


def forward_problems(config, dtype: str, batch: int, seq: int) -> list[tuple]:
    """(op, problem) of forward() on (batch, seq) ids: full logits."""
    return kernel_problems(meta_model(config, dtype), batch, seq)


def generate_problems(config, dtype: str, batch: int, prompt_len: int, new_tokens: int) -> list[tuple]:
    """(op, problem) of greedy generate() continuing batch prompts of prompt_len tokens by new_tokens."""
    return kernel_problems(meta_model(config, dtype), batch, prompt_len, new_tokens)


def model_problems(config, dtype: str = "bfloat16", batch_sizes=(1, 8), seq_lens=(128, 1024),
                   new_tokens: int = NEW_TOKENS, quantize: str | quantization.Scheme | None = None, tp: int = 1,
                   quantize_head: bool = False) -> list[tuple]:
    """Distinct (op, problem) keys of forward() on B x T ids and of generate() adding new_tokens to
    B prompts of T tokens (shortened to fit the context), for every B and T (with `quantize`: of the model
    with quantized linears, as meta_model takes it, `quantize_head` its LM head too; tp > 1: of every rank of the
    model split over tp GPUs, each running its shard's shapes; no communication is needed to tune them)."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    models = [meta_model(config, dtype, quantize, rank, tp, quantize_head) for rank in range(tp)]
    P = config.block_size
    found: dict[tuple, tuple] = {}
    for model in models:
        for B in batch_sizes:
            for T in seq_lens:
                T = min(T, P)
                calls = kernel_problems(model, B, T)
                new = min(new_tokens, P - 1)
                calls += kernel_problems(model, B, max(1, min(T, P - new)), new)
                for op, problem in calls:
                    found.setdefault((op.name, op.problem_key(problem)[1]), (op, problem))
    return list(found.values())
