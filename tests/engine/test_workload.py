"""The tuning workload on CPU: recorded from the model's own step code on MetaArrays."""

import pytest

from tilekit.autotune.arrays import MetaArray
from tilekit.models import GPT, GPTConfig
from tilekit.engine.workload import forward_problems, generate_problems, model_problems


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
    assert ops == {"embedding", "layer_norm", "linear", "attention", "write_kv", "decode_attention", "next_token",
                   "residual_linear"}


def test_decode_steps_add_into_a_fixed_point_residual():
    """Decode steps (batch 1 and 8): both output projections add into a fixed-point residual; prefills
    keep the model dtype's residual and plain linears."""
    config = GPTConfig.preset("gpt2").replace(n_layer=2)
    for B in (1, 8):
        decode = GPT(config, meta=True).kernel_problems(B, 128, 128)
        prefill = GPT(config, meta=True).kernel_problems(B, 128)
        block = ["layer_norm", "linear", "decode_attention", "residual_linear", "layer_norm", "linear",
                 "residual_linear"]
        starts = [i for i, (op, _) in enumerate(decode) if op.name == "embedding"] + [len(decode)]
        parts = [decode[i:j] for i, j in zip(starts, starts[1:])]     # prefill, step, per next-token picker
        assert len(parts) == 4
        for step in parts[1::2]:
            assert [op.name for op, _ in step] == ["embedding"] + 2 * block + ["layer_norm", "linear", "next_token"]
            assert all(p["fixed"] == 1 for op, p in step if op.name in ("embedding", "layer_norm"))
        prompt = parts[0] + parts[2] + prefill
        assert all(p["fixed"] == 0 for op, p in prompt if op.name in ("embedding", "layer_norm"))
        assert "residual_linear" not in {op.name for op, _ in prompt}


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
