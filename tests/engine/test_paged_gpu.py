"""Continuous batching on the GPU (PagedExecutor, CUDA graphs on): every request's greedy tokens equal the same
request run alone through generate(), for GPT-2, Llama and DeepSeek-V2 (its paged latent cache), float32, bfloat16
and INT8 / FP8 weights, an FP8 KV cache, with ragged arrivals, chunked prefill, preemption and prefix hits; sampled tokens do not depend on the batch; the
server's async API streams and aborts."""

from pathlib import Path

import numpy as np
import pytest

from tests.engine.arrivals import run_ragged

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[1] / "data"
CASES = [("tiny-gpt2", "float32", None), ("tiny-llama", "float32", None), ("tiny-llama", "bfloat16", None),
         ("tiny-gpt2", "bfloat16", None), ("tiny-llama", "bfloat16", "int8")]


def load(name, dtype, quantize=None):
    from tilekit.models import load_model
    return load_model(DATA / name, dtype=dtype, quantize=quantize)


def new_engine(model, **kw):
    """An LLMEngine whose default pool takes 2% of the free memory and whose start-up compiles in 2 processes (the
    suite's workers share the GPU and the cores)."""
    from tilekit.engine.llm import LLMEngine
    return LLMEngine(model, gpu_memory_utilization=0.02, compile_workers=2, **kw)


@pytest.mark.parametrize("name,dtype,quantize", CASES)
@pytest.mark.parametrize("num_blocks,every", [(None, 2), (6, 1)])
def test_greedy_tokens_equal_generate_alone(name, dtype, quantize, num_blocks, every):
    model = load(name, dtype, quantize)
    V, ctx = model.config.vocab_size, model.context_length
    engine = new_engine(model, max_running=4, token_budget=48, block=16, num_blocks=num_blocks, max_len=min(ctx, 128))
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(0, V, 33)]
    prompts = [[int(t) for t in rng.integers(0, V, n)] for n in (5, 40, 17, 2, 30)] + [shared + [1], shared + [2]]
    lengths = [7, 9, 12, 20, 3, 6, 8] if every > 1 else [20, 14, 19, 25, 12, 16, 20]
    reqs = run_ragged(engine, prompts, lengths, every, temperature=0, ignore_eos=True)
    for r, p, n in zip(reqs, prompts, lengths):
        alone = [int(t) for t in model.generate([p], n, temperature=0, eos_token_id=[])[0][len(p):]]
        assert r.output == alone, (r.id, r.preemptions, r.cached_tokens)
    assert engine.pool.used == 0
    if num_blocks is None:
        assert reqs[-1].cached_tokens == 32
    else:
        assert engine.counters["preemptions"] > 0
    engine.close()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_prompts_prefilled_together_then_decoded_equal_generate_alone(name):
    """The simplest case: three prompts in one prefill pass, then decode-only (graph) steps; no preemption, no prefix
    hit. The first differing token tells a prefill fault (token 0) from a decode one."""
    model = load(name, "float32")
    engine = new_engine(model, max_running=4, token_budget=64, block=16, max_len=64)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, model.config.vocab_size, n)] for n in (5, 17, 30)]
    outs = engine.generate(prompts, 8, temperature=0, ignore_eos=True)
    for p, o in zip(prompts, outs):
        alone = [int(t) for t in model.generate([p], 8, temperature=0, eos_token_id=[])[0][len(p):]]
        first = next((i for i, (a, b) in enumerate(zip(o["token_ids"], alone)) if a != b), None)
        assert first is None, f"prompt of {len(p)} tokens: token {first} differs: {o['token_ids']} against {alone}"
    engine.close()


@pytest.mark.parametrize("dtype,quantize", [("float32", None), ("bfloat16", None), ("bfloat16", "fp8")])
@pytest.mark.parametrize("num_blocks,every", [(None, 2), (8, 1)])
def test_deepseek_greedy_tokens_equal_generate_alone(dtype, quantize, num_blocks, every):
    """DeepSeek-V2 over paged latents: decode rows and prompt-chunk rows in the absorbed form (paged_mla_decode_
    attention over the blocks), where generate() prefills whole prompts in the plain form: the same sums in another
    order. Ragged arrivals, a 40-token prompt in chunks of the 48-token budget, prefix hits and preemption."""
    model = load("tiny-deepseek-v2", dtype, quantize)
    engine = new_engine(model, max_running=4, token_budget=48, block=16, num_blocks=num_blocks, max_len=128)
    rng = np.random.default_rng(4)
    V = model.config.vocab_size
    shared = [int(t) for t in rng.integers(0, V, 33)]
    prompts = [[int(t) for t in rng.integers(0, V, n)] for n in (5, 40, 17, 2)] + [shared + [1], shared + [2]]
    lengths = [7, 9, 12, 20, 6, 8] if every > 1 else [20, 14, 19, 25, 16, 20]
    reqs = run_ragged(engine, prompts, lengths, every, temperature=0, ignore_eos=True)
    for r, p, n in zip(reqs, prompts, lengths):
        alone = [int(t) for t in model.generate([p], n, temperature=0, eos_token_id=[])[0][len(p):]]
        first = next((i for i, (a, b) in enumerate(zip(r.output, alone)) if a != b), None)
        assert first is None, (f"prompt of {len(p)} tokens: token {first} differs", r.preemptions, r.cached_tokens,
                               r.output, alone)
    assert engine.pool.used == 0
    if num_blocks is None:
        assert reqs[-1].cached_tokens == 32
    else:
        assert engine.counters["preemptions"] > 0
    engine.close()


def test_fp8_kv_cache_tokens_equal_generate_with_it():
    model = load("tiny-llama", "bfloat16")
    engine = new_engine(model, max_running=4, token_budget=48, block=16, max_len=128, kv_cache_dtype="fp8")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (9, 3, 21)]
    outs = engine.generate(prompts, 10, temperature=0, ignore_eos=True)
    for p, o in zip(prompts, outs):
        alone = model.generate([p], 10, temperature=0, eos_token_id=[], kv_cache_dtype="fp8")[0][len(p):]
        same = np.mean(np.asarray(o["token_ids"]) == alone)
        assert same >= 0.8, (o["token_ids"], alone)      # prefill attends FP8 codes here, the prompt's own k, v there


def test_sampled_tokens_do_not_depend_on_the_batch():
    model = load("tiny-llama", "float32")
    opts = dict(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.2, seed=3, ignore_eos=True)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (4, 11, 7)]
    one = new_engine(model, max_running=1, token_budget=32, block=16, max_len=64)
    alone = [one.generate([p], 12, **opts)[0]["token_ids"] for p in prompts]
    one.close()
    many = new_engine(model, max_running=4, token_budget=32, block=16, max_len=64)
    mixed = many.generate(prompts + [[5, 6]], 12, sampling=[{}, {}, {}, dict(temperature=0)], **opts)
    assert [o["token_ids"] for o in mixed[:3]] == alone
    assert len(set(map(tuple, alone))) == 3
    many.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_structured_output_on_the_gpu_engine_and_generate(dtype):
    """A JSON schema through the GPU engine (masked decode graphs) and through generate() (its masked decode step):
    both parse and validate, and their greedy tokens agree with each other."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yz"]}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99}},
              "required": ["k", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    model = load("tiny-gpt2", dtype)
    engine = new_engine(model, max_running=4, token_budget=64, block=16, max_len=64)
    prompts = [[64, 290, 318], [11, 12]]
    outs = engine.generate(prompts, 40, sampling=[dict(response_format=fmt), {}], temperature=0)
    tokenizer = model.runner.tokenizer()
    engine_tokens = [t for t in outs[0]["token_ids"] if t != 1030]
    jsonschema.validate(json.loads(tokenizer.decode(engine_tokens)), schema)
    assert outs[0]["finish_reason"] == "stop"
    seq = model.generate([prompts[0]], 40, temperature=0, response_format=fmt)[0]
    static_tokens = [int(t) for t in seq[len(prompts[0]):] if t != 1030]
    jsonschema.validate(json.loads(tokenizer.decode(static_tokens)), schema)
    assert static_tokens == engine_tokens
    engine.close()
