"""tilekit.patch / unpatch without a GPU: importing them imports neither torch nor transformers, anything but a
transformers GPT-2 or Llama is refused naming its type, and a model on the CPU is refused, unchanged, with every
problem named (tests/test_patched_models.py runs patched models on a GPU)."""

import subprocess
import sys

import pytest

import tilekit


def test_import_tilekit_imports_neither_torch_nor_transformers():
    probe = ("import sys, tilekit, tilekit.patch; from tilekit.patch import patch, unpatch; "
             "assert tilekit.patch is patch and tilekit.unpatch is unpatch; "
             "print(sorted(m for m in ('torch', 'transformers', 'tilekit.kernels') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("thing", [object(), "gpt2", None, 3])
def test_anything_but_a_supported_model_is_refused_naming_its_type(thing):
    kind = f"{type(thing).__module__}.{type(thing).__qualname__}"
    with pytest.raises(TypeError, match=f"GPT2LMHeadModel or LlamaForCausalLM or DeepseekV2ForCausalLM, got {kind}"):
        tilekit.patch(thing)
    with pytest.raises(TypeError, match=kind):
        tilekit.unpatch(thing)


def test_a_cpu_model_in_training_mode_is_refused_unchanged():
    pytest.importorskip("torch", reason="patching a model needs torch")
    transformers = pytest.importorskip("transformers", reason="patching a model needs transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, mlp_bias=True)
    model = transformers.LlamaForCausalLM(config).train()
    attention = model.config._attn_implementation
    with pytest.raises(ValueError) as refused:
        tilekit.patch(model)
    for named in ("model.eval()", "cpu", "mlp_bias=True"):
        assert named in str(refused.value)
    assert model.config._attn_implementation == attention
    assert not any("forward" in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match="not patched"):
        tilekit.unpatch(model)
    with pytest.raises(TypeError, match="MistralForCausalLM"):
        tilekit.patch(transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)))


def test_benchmark_help_and_table_need_no_gpu():
    from benchmarks.suites.patched import table
    out = subprocess.run([sys.executable, "-m", "benchmarks.suites.patched", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--model" in out.stdout and "--out" in out.stdout
    row = {"model": "llama-3.2-1b", "hf_ms_per_token": 8.5, "tilekit_ms_per_token": 6.25, "speedup": 1.36,
           "logits_rel_error": 0.021, "greedy_agreement": 97, "new_tokens": 128}
    lines = table([row]).splitlines()
    assert lines[0].split()[:2] == ["model", "HF"] and lines[1].split() == [
        "llama-3.2-1b", "8.500", "6.250", "1.36x", "2.10e-02", "97/128"]
