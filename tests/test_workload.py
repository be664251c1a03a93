"""The tuning workload on CPU: recorded from the model's own step code on MetaArrays."""

import pytest

from tilekit.autotune.arrays import MetaArray
from tilekit.models import GPT, GPTConfig
from tilekit.models.workload import forward_problems, generate_problems, model_problems


def keys(calls):
    return {(op.name, op.problem_key(p)[1]) for op, p in calls}


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-xl"])
def test_model_problems_cover_forward_and_generate(preset):
    config = GPTConfig.preset(preset)
    tuned = keys(model_problems(config, "bfloat16", (1, 8), (128, 1024)))
    for B in (1, 8):
        assert keys(forward_problems(config, "bfloat16", B, 128)) <= tuned
        assert keys(generate_problems(config, "bfloat16", B, 128, 128)) <= tuned      # the benchmark's 128 + 128
        assert keys(generate_problems(config, "bfloat16", B, 896, 128)) <= tuned      # the longest that fits
    ops = {name for name, _ in tuned}
    assert ops == {"embedding", "layer_norm", "linear", "attention", "kv_write", "decode_attention", "greedy"}


def test_generate_sizes_its_cache_like_generate():
    """128 + 128 tokens: a 256-position cache and a 128-token padded prompt, as generate() makes them."""
    calls = generate_problems(GPTConfig.preset("gpt2"), "bfloat16", 1, 128, 128)
    decode = [p for op, p in calls if op.name == "decode_attention"]
    assert decode and all(p["capacity"] == 256 for p in decode)
    prefill = [p for op, p in calls if op.name == "attention"]
    assert prefill and all(p["Tq"] == p["Tk"] == 128 for p in prefill)


def test_meta_model_holds_no_memory():
    model = GPT(GPTConfig.preset("gpt2-xl"), meta=True)
    assert isinstance(model.wte, MetaArray) and model.wte.shape == (50257, 1600)
    assert model.kernel_problems(8, 1024)          # records without a GPU
