"""A quantized DeepSeek-V2 on the CPU (NumPy for CuPy and for the kernels, numpy_kernels.py, quant_linear from its
float64 reference): the workload it records, every checkpoint layout (DeepSeek block FP8 with weight_scale_inv,
compressed-tensors FP8 / INT8, load-time quantization of a float checkpoint) landing in the model, the experts,
o_proj, the dense down projection and kv_b_proj dequantized exactly, save_pretrained read back bit for bit, the
refusals, and its logits against the float model of its own dequantized weights (tight) and of the same float
weights (a stated bound). The GPU half is test_quantized_gpu.py."""

import json
import re

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tests.models.deepseek_v2.test_step_code import cpu, forward  # noqa: F401  (cpu: a fixture)
from tests.models.test_quantization import compressed, file_quantized
from tilekit.kernels.checks import rel_err
from tilekit.kernels.quant_linear import dequantize_reference
from tilekit.models import DEEPSEEK_V2_PRESETS, DeepseekV2, DeepseekV2Config, quantization
from tilekit import checkpoints as hf
from tilekit.models.deepseek_v2 import weights
from tilekit.models.quantization import quantize_weight, scale_key
from tilekit.models.base import W8A8_MIN_ROWS

# block-scaled weights need kv_lora_rank a multiple of 128 and each head's rotary rows inside one 128-row block
CONFIG = DeepseekV2Config(n_layer=2, n_head=2, n_embd=160, vocab_size=64, intermediate_size=96,
                          moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                          kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                          max_position_embeddings=256, routed_scaling_factor=1.5, rope_scaling=None, bos_token_id=0,
                          eos_token_id=1)
LORA = CONFIG.replace(q_lora_rank=136)
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "re:.*mlp\\.gate$"]}
LAYOUTS = {   # (weights, file strategy, quantization_config, scale name)
    "block fp8": ("fp8", "block", BLOCK_FP8, "weight_scale_inv"),
    "compressed-tensors fp8 channel": ("fp8", "channel", compressed("fp8", "channel"), "weight_scale"),
    "compressed-tensors fp8 tensor": ("fp8", "tensor", compressed("fp8", "tensor"), "weight_scale"),
    "compressed-tensors int8 channel": ("int8", "channel", compressed("int8", "channel"), "weight_scale"),
}
# Bounds of the quantized model's logits, float64 kernels on the CPU (these configs, seeds 4-6, 5 and 128 tokens,
# 2026-11-25): against the float model of the same weights int8 0.26-0.72%, fp8 1.4-3.3% (per-channel weights);
# FP8 activations (W8A8, from W8A8_MIN_ROWS rows) move them 0.95-1.1% from the model of the dequantized weights.
# Held with margin; bf16 arithmetic adds about 1% on the GPU (test_quantized_gpu.py).
W8A8_OWN = 0.03
VS_FLOAT = {"int8": 0.02, "fp8": 0.08}


def quantized_linears(names) -> list[str]:
    """The file's linear weights a quantized checkpoint of the hub stores in 8 bits: all but the router's."""
    pattern = re.compile(rf"\.(?:{'|'.join(weights.QUANTIZED + weights.DEQUANTIZED)})\.weight$")
    return [n for n in names if pattern.search(n) and not n.endswith("mlp.gate.weight")]


def write_quantized(directory, config, kind: str, strategy: str, qconfig: dict, scale_name: str, seed: int = 0,
                    edit=None):
    """A quantized checkpoint of random weights in the hub's layout (`edit(tensors, raw)` may change it before it
    is written); returns our name -> the float32 weights it dequantizes to (our layout: read back through a float
    checkpoint of the dequantized file tensors)."""
    files = weights.to_file(config, weights.random_state_dict(config, seed))
    tensors, raw, plain = {}, {}, {}
    for name, w in files.items():
        if name not in quantized_linears(files):
            tensors[name] = plain[name] = np.asarray(w, np.float32)
            continue
        codes, s = file_quantized(np.asarray(w, np.float64), kind, strategy)
        tensors[name], raw[name] = codes, quantization.FILE_DTYPES[kind]
        scale = name[:-len("weight")] + scale_name
        tensors[scale], raw[scale] = s.reshape({"channel": (-1, 1), "tensor": (1,), "block": s.shape}[strategy]), "F32"
        plain[name] = dequantize_reference(codes, s if strategy == "block" else np.broadcast_to(
            s.reshape(-1), (w.shape[0],)), kind).astype(np.float32)
    if edit is not None:
        edit(tensors, raw)
    hf.write_checkpoint(directory / "q", dict(config.to_hf_dict(), quantization_config=qconfig), tensors, raw=raw)
    hf.write_checkpoint(directory / "plain", config.to_hf_dict(), plain)
    return weights.load_state_dict(directory / "plain")[1]


def assert_same_params(a, b):
    assert a.params.keys() == b.params.keys()
    for name, array in a.params.items():
        assert array.dtype == b.params[name].dtype and np.array_equal(array.view(np.uint8),
                                                                      b.params[name].view(np.uint8)), name


def test_modules_are_what_the_model_holds():
    shapes = weights.state_dict_shapes(LORA)
    linears = quantization.linear_names(shapes, weights.QUANTIZED)
    assert {n.split(".", 3)[3] for n in linears} == {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight",
                                                    "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate_proj.weight",
                                                    "mlp.up_proj.weight"}
    files = weights.to_file(LORA, {n: np.zeros(s, np.float32) for n, s in shapes.items()})
    kept = set(quantized_linears(files)) - set(linears)
    assert all("experts." in n or n.endswith(("kv_b_proj.weight", "o_proj.weight", "mlp.down_proj.weight"))
               for n in kept) and len(kept) == 2 * 2 + 1 + 3 * (4 + 1)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_workload_runs_the_quantized_ops(kind):
    """The attention's projections and the dense layer's gate and up are quant_linear calls (FP8 prefill with
    quantize_fp8 first); kv_b_proj, the experts, o_proj and the down projections keep their kernels; the recorded
    shapes are V2-Lite's."""
    config = DEEPSEEK_V2_PRESETS["deepseek-v2-lite"].replace(n_layer=2)
    calls = DeepseekV2(config, meta=True, quantize=kind).kernel_problems(1, 128, 4)
    names = {op.name for op, _ in calls}
    plain = {op.name for op, _ in DeepseekV2(config, meta=True).kernel_problems(1, 128, 4)}
    assert names == plain - {"swiglu_linear"} | {"quant_linear"} | ({"quantize_fp8"} if kind == "fp8" else set())
    quant = [p for op, p in calls if op.name == "quant_linear"]
    C, R, P, H = config.n_embd, config.kv_lora_rank, config.qk_rope_head_dim, config.n_head
    assert {(p["N"], p["K"], p["act"]) for p in quant} == {(R, C, "none"), (P, C, "none"),
                                                           (H * config.qk_head_dim, C, "none"),
                                                           (config.intermediate_size, C, "swiglu")}
    assert {p["wq"] for p in quant} == {kind}
    assert {p["xq"] for p in quant if p["M"] >= W8A8_MIN_ROWS} == {"fp8" if kind == "fp8" else "none"}
    assert {p["xq"] for p in quant if p["M"] < W8A8_MIN_ROWS} == {"none"}
    linears = [p for op, p in calls if op.name == "linear"]
    assert {(p["N"], p["K"]) for p in linears} == {(H * (config.qk_nope_head_dim + config.v_head_dim), R),
                                                   (config.vocab_size, C)}


def test_tune_workload_records_the_quantized_shapes():
    from tilekit.engine.workload import model_problems
    config = DEEPSEEK_V2_PRESETS["deepseek-v2-lite"]
    found = model_problems(config, batch_sizes=(1,), seq_lens=(128,), quantize="fp8")
    quant = {(p["M"], p["N"], p["K"], p["xq"]) for op, p in found if op.name == "quant_linear"}
    assert (1, config.kv_lora_rank, config.n_embd, "none") in quant
    assert (128, config.n_head * config.qk_head_dim, config.n_embd, "fp8") in quant


def test_quantize_is_checked():
    with pytest.raises(ValueError, match="quantize must be"):
        DeepseekV2(CONFIG, meta=True, quantize="int4")
    with pytest.raises(ValueError, match="come from a checkpoint"):
        DeepseekV2(CONFIG, quantize=quantization.Scheme("fp8", "block"))
    with pytest.raises(ValueError, match="kv_lora_rank to be a multiple of 128"):
        DeepseekV2(CONFIG.replace(kv_lora_rank=96), meta=True, quantize=quantization.Scheme("fp8", "block"))
    with pytest.raises(ValueError, match="rotary rows inside one 128-row block"):
        DeepseekV2(CONFIG.replace(qk_nope_head_dim=112), meta=True, quantize=quantization.Scheme("fp8", "block"))
    DeepseekV2(CONFIG, meta=True, quantize=quantization.Scheme("fp8", "block"))


@pytest.mark.parametrize("config", [CONFIG, LORA], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_lands_in_the_model_and_saves_back(numpy_cupy, layout, config, tmp_path):
    kind, strategy, qconfig, scale_name = LAYOUTS[layout]
    expected = write_quantized(tmp_path, config, kind, strategy, qconfig, scale_name)
    model = DeepseekV2.from_pretrained(tmp_path / "q", dtype="float32")
    assert (model.quant.weight, model.quant.scale) == (kind, "block" if strategy == "block" else "channel")
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, w in expected.items():
        np.testing.assert_array_equal(state[name], w, err_msg=name)
    for name in model.quantized:
        assert model.params[name].dtype == np.dtype(np.int8 if kind == "int8" else np.uint8), name
    assert model.params["model.layers.1.mlp.experts.gate_up_proj"].dtype == np.float32
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "compressed-tensors" and "re:.*\\.self_attn\\.kv_b_proj$" in saved["ignore"]
    again = DeepseekV2.from_pretrained(tmp_path / "out", dtype="float32")
    assert again.quant.source == "compressed-tensors" and again.quant.scale == model.quant.scale
    assert_same_params(again, model)


def test_scales_before_their_weights(numpy_cupy, tmp_path):
    """A file may keep a weight's scales first (safetensors' own writer orders by dtype, fp32 before FP8)."""
    def scales_first(tensors, raw):
        order = sorted(tensors, key=lambda n: not n.endswith("_scale_inv"))
        moved = {n: tensors.pop(n) for n in order}
        tensors.update(moved)
    expected = write_quantized(tmp_path, CONFIG, *LAYOUTS["block fp8"], edit=scales_first)
    state = DeepseekV2.from_pretrained(tmp_path / "q", dtype="float32").state_dict()
    for name, w in expected.items():
        np.testing.assert_array_equal(state[name], w, err_msg=name)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_load_time_quantization_fills_the_models_arrays(numpy_cupy, kind, tmp_path):
    """A float checkpoint (hub layout: rotary rows interleaved, experts one by one) quantized as it loads equals
    the model built from the same weights; the experts and kv_b_proj stay float."""
    state = weights.random_state_dict(LORA, 2)
    weights.save_state_dict(tmp_path, LORA, state)
    model = DeepseekV2.from_pretrained(tmp_path, dtype="float32", quantize=kind)
    for name in model.quantized:
        codes, scale = quantize_weight(state[name], kind)
        np.testing.assert_array_equal(model.params[name], codes, err_msg=name)
        np.testing.assert_array_equal(model.params[scale_key(name)], scale, err_msg=name)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.self_attn.kv_b_proj.weight"):
        np.testing.assert_array_equal(model.params[name], state[name])
    assert_same_params(model, DeepseekV2(LORA, dtype="float32", state=state, quantize=kind))


def test_refusals(numpy_cupy, tmp_path):
    kind, strategy, qconfig, scale_name = LAYOUTS["block fp8"]
    write_quantized(tmp_path, CONFIG, kind, strategy, dict(qconfig, weight_block_size=[64, 64]), scale_name)
    with pytest.raises(hf.ModelFileError, match="weight_block_size.*not \\[128, 128\\]"):
        DeepseekV2.from_pretrained(tmp_path / "q")
    write_quantized(tmp_path, CONFIG, kind, strategy, {"quant_method": "gptq", "bits": 4}, scale_name)
    with pytest.raises(hf.ModelFileError, match='quant_method. is "gptq"'):
        DeepseekV2.from_pretrained(tmp_path / "q")
    write_quantized(tmp_path, CONFIG.replace(kv_lora_rank=96), kind, strategy, qconfig, scale_name)
    with pytest.raises(hf.ModelFileError, match="config.json: block-scaled weights need kv_lora_rank to be a "
                                                "multiple of 128, got 96"):
        DeepseekV2.from_pretrained(tmp_path / "q")
    write_quantized(tmp_path, CONFIG, kind, strategy, qconfig, scale_name)
    with pytest.raises(ValueError, match="quantize='int8', but .* holds fp8 weights"):
        DeepseekV2.from_pretrained(tmp_path / "q", quantize="int8")
    # an expert's codes without their scales, a linear the model holds in 8 bits stored as floats
    name, q = "model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"

    def edit(tensors, raw):
        for dropped in (name + "_scale_inv", q + "_scale_inv"):
            tensors.pop(dropped), raw.pop(dropped)
        tensors[q], raw[q] = np.zeros(tensors[q].shape, np.float32), "F32"
    write_quantized(tmp_path, CONFIG, kind, strategy, qconfig, scale_name, edit=edit)
    with pytest.raises(hf.ModelFileError) as e:
        DeepseekV2.from_pretrained(tmp_path / "q")
    assert f"missing tensor '{name}_scale_inv'" in str(e.value)
    assert f"tensor '{q}' has dtype F32, expected F8_E4M3" in str(e.value)


# -- logits (the model's step code, NumPy kernels) ----------------------------------------------------------------

@pytest.mark.parametrize("config", [CONFIG, LORA], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("layout", ["block fp8", "compressed-tensors int8 channel"])
def test_checkpoint_logits_match_the_float_model_of_its_weights(cpu, layout, config, tmp_path):
    """Weight-only: exactly the float model of the dequantized weights, up to float32 rounding."""
    expected = write_quantized(tmp_path, config, *LAYOUTS[layout])
    model = DeepseekV2.from_pretrained(tmp_path / "q", dtype="float32")
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 5))
    err = rel_err(forward(model, ids), forward(DeepseekV2(config, dtype="float32", state=expected), ids))
    assert err <= 1e-5, err


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [5, W8A8_MIN_ROWS])
def test_logits_against_the_float_model_of_the_same_weights(cpu, kind, tokens):
    state = weights.random_state_dict(LORA, 4)
    ids = np.random.default_rng(1).integers(0, LORA.vocab_size, (1, tokens))
    model = DeepseekV2(LORA, dtype="float32", state=state, quantize=kind)
    own = rel_err(forward(model, ids), forward(DeepseekV2(LORA, dtype="float32", state=model.state_dict()), ids))
    assert own <= (1e-5 if kind == "int8" or tokens < W8A8_MIN_ROWS else W8A8_OWN), own
    err = rel_err(forward(model, ids), forward(DeepseekV2(LORA, dtype="float32", state=state), ids))
    assert err <= VS_FLOAT[kind], err


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_quantized_head_saves_back_and_computes_its_dequantized_logits(cpu, kind, tmp_path):
    """quantize_head=True: the untied LM head in 8 bits too (weight-only); the model computes the float model of its
    own dequantized weights, and saves and loads back as it is."""
    weights.save_state_dict(tmp_path / "in", LORA, weights.random_state_dict(LORA, 5))
    model = DeepseekV2.from_pretrained(tmp_path / "in", dtype="float32", quantize=kind, quantize_head=True)
    assert "lm_head.weight" in model.quantized and model.params["lm_head.weight"].itemsize == 1
    ids = np.random.default_rng(2).integers(0, LORA.vocab_size, (2, 5))
    own = forward(DeepseekV2(LORA, dtype="float32", state=model.state_dict()), ids)
    assert rel_err(forward(model, ids), own) <= 1e-5
    model.save_pretrained(tmp_path / "out")
    assert_same_params(DeepseekV2.from_pretrained(tmp_path / "out", dtype="float32"), model)
