"""A quantized Llama's weights on CPU (NumPy standing in for CuPy: tests/_numpy_cupy.py; no kernel runs): load-time
quantization and construction from a state agree and fill the model's own arrays (q, k, v and gate, up as row views
of fused matrices and scales), every checkpoint layout lands in them, and save_pretrained reads back bit for bit."""

import json

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tests.models.test_quantization import EXTRAS, LAYOUTS, write_quantized
from tilekit.kernels.quant_linear import dequantize_reference
from tilekit.models import Llama, LlamaConfig, quantization
from tilekit.models.llama.weights import random_state_dict, save_state_dict
from tilekit.models.quantization import Scheme, quantize_weight, scale_key

CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=384, vocab_size=50,
                     max_position_embeddings=64, tie_word_embeddings=False, rope_scaling=None)


def assert_same_params(a, b):
    assert a.params.keys() == b.params.keys()
    for name, array in a.params.items():
        assert array.dtype == b.params[name].dtype and np.array_equal(array.view(np.uint8),
                                                                      b.params[name].view(np.uint8)), name


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_load_time_quantization_fills_the_models_arrays(numpy_cupy, kind, tmp_path):
    state = random_state_dict(CONFIG, 2)
    save_state_dict(tmp_path, CONFIG, state)
    model = Llama.from_pretrained(tmp_path, quantize=kind)
    for name in model.quantized:
        codes, scale = quantize_weight(state[name], kind)
        np.testing.assert_array_equal(model.params[name], codes, err_msg=name)
        np.testing.assert_array_equal(model.params[scale_key(name)], scale, err_msg=name)
    blk, p = model.blocks[1], "model.layers.1."
    for fused, fused_scale, names in ((blk.qkv, blk.qkv_scale, [f"self_attn.{n}_proj" for n in "qkv"]),
                                      (blk.gate_up, blk.gate_up_scale, ["mlp.gate_proj", "mlp.up_proj"])):
        assert all(np.shares_memory(model.params[f"{p}{n}.weight"], fused) for n in names)
        np.testing.assert_array_equal(fused_scale, np.concatenate([model.params[f"{p}{n}.weight_scale"]
                                                                   for n in names]))
    assert_same_params(model, Llama(CONFIG, state=state, quantize=kind))
    dequantized = model.state_dict()
    assert dequantized.keys() == state.keys()
    name = p + "mlp.down_proj.weight"
    np.testing.assert_array_equal(dequantized[name], dequantize_reference(
        model.params[name], model.params[scale_key(name)], kind).astype(np.float32))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_lands_in_the_model_and_saves_back(numpy_cupy, layout, tmp_path):
    kind, strategy, qconfig, scale_shape = LAYOUTS[layout]
    expected = write_quantized(tmp_path / "in", kind, strategy, qconfig, scale_shape,
                               "weight_scale_inv" if layout == "block fp8" else "weight_scale", EXTRAS.get(layout, ()),
                               CONFIG)
    model = Llama.from_pretrained(tmp_path / "in")
    assert (model.quant.weight, model.quant.scale) == (kind, "block" if strategy == "block" else "channel")
    state = model.state_dict()
    for name, w in expected.items():
        np.testing.assert_array_equal(state[name], w.astype(np.float32), err_msg=name)
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "compressed-tensors"
    again = Llama.from_pretrained(tmp_path / "out")
    assert again.quant.source == "compressed-tensors" and again.quant.scale == model.quant.scale
    assert_same_params(again, model)
    assert "lm_head.weight" not in model.quantized        # the file's head is bf16: it stays so, saved and read


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_head_quantized_at_load_saves_and_reads_back_as_codes(numpy_cupy, kind, tmp_path):
    state = random_state_dict(CONFIG, 4)
    save_state_dict(tmp_path / "in", CONFIG, state)
    assert "lm_head.weight" not in Llama.from_pretrained(tmp_path / "in", quantize=kind).quantized     # by default
    model = Llama.from_pretrained(tmp_path / "in", quantize=kind, quantize_head=True)
    codes, scale = quantize_weight(state["lm_head.weight"], kind)
    np.testing.assert_array_equal(model.params["lm_head.weight"], codes)
    np.testing.assert_array_equal(model.params["lm_head.weight_scale"], scale)
    assert model.head is model.params["lm_head.weight"]
    model.save_pretrained(tmp_path / "out")
    qconfig = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in qconfig["ignore"]               # compressed-tensors: a Linear not ignored is quantized
    again = Llama.from_pretrained(tmp_path / "out")
    assert "lm_head.weight" in again.quantized and again.quant.head
    assert_same_params(again, model)
    tied = Llama(CONFIG.replace(tie_word_embeddings=True), quantize=Scheme(kind, head=True))   # the embedding's rows
    assert "lm_head.weight" not in tied.quantized and tied.head is tied.embed
    for bad, match in (({}, "with quantize="), ({"quantize": kind}, "file stores")):
        with pytest.raises(ValueError, match=match):
            Llama.from_pretrained(tmp_path / ("in" if not bad else "out"), quantize_head=True, **bad)
    save_state_dict(tmp_path / "tied", tied.config, random_state_dict(tied.config, 4))
    with pytest.raises(ValueError, match="tied to the token embedding"):
        Llama.from_pretrained(tmp_path / "tied", quantize=kind, quantize_head=True)
    with pytest.raises(TypeError, match="quantize_head must be a bool"):
        Llama.from_pretrained(tmp_path / "in", quantize=kind, quantize_head="yes")


def test_block_scaled_q_and_k_need_128_row_multiples(numpy_cupy, tmp_path):
    config = CONFIG.replace(n_embd=160, head_dim=40)      # k and v projections of 80 rows
    write_quantized(tmp_path, *LAYOUTS["block fp8"][:2], LAYOUTS["block fp8"][2], LAYOUTS["block fp8"][3],
                    "weight_scale_inv", config=config)
    with pytest.raises(ValueError, match="multiples of 128 rows"):
        Llama.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="come from a checkpoint"):
        Llama(CONFIG, quantize=quantization.Scheme("fp8", "block"))


def test_gpt_refuses_quantize(numpy_cupy):
    from pathlib import Path

    from tilekit.models import GPT
    with pytest.raises(ValueError, match="GPT has no quantized linears"):
        GPT.from_pretrained(Path(__file__).resolve().parents[2] / "data" / "tiny-gpt2", quantize="int8")


def test_a_head_stored_as_codes_needs_its_scales(numpy_cupy, tmp_path):
    """A compressed-tensors file whose lm_head holds int8 codes (not in `ignore`) loads it quantized; without its
    scale tensor it is a ModelFileError naming the tensor, before anything is allocated."""
    from tilekit import checkpoints as hf
    state = random_state_dict(CONFIG, 6)
    save_state_dict(tmp_path / "in", CONFIG, state)
    model = Llama.from_pretrained(tmp_path / "in", quantize="int8", quantize_head=True)
    tensors = {name: np.asarray(a) for name, a in model.params.items()}
    linears = tuple(name for name in model.quantized)
    files, raw = quantization.file_tensors(tensors, linears, model.quant)
    hf_config = dict(CONFIG.to_hf_dict(), quantization_config=quantization.compressed_tensors_config(
        model.quant, head=True))
    hf.write_checkpoint(tmp_path / "ok", hf_config, files, raw=raw)
    again = Llama.from_pretrained(tmp_path / "ok")
    assert again.quant.head and "lm_head.weight" in again.quantized
    np.testing.assert_array_equal(again.params["lm_head.weight"], model.params["lm_head.weight"])
    del files["lm_head.weight_scale"], raw["lm_head.weight_scale"]
    hf.write_checkpoint(tmp_path / "bad", hf_config, files, raw=raw)
    with pytest.raises(hf.ModelFileError, match="lm_head.weight_scale"):
        Llama.from_pretrained(tmp_path / "bad")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5])
def test_a_scale_that_is_not_finite_or_negative_is_refused_naming_its_tensor(numpy_cupy, bad, tmp_path):
    """A compressed-tensors checkpoint whose scale tensor holds NaN, inf or a negative value: a ModelFileError
    naming the file and the tensor (a zero scale, an all-zero row's, loads)."""
    from tilekit import checkpoints as hf
    state = random_state_dict(CONFIG, 7)
    save_state_dict(tmp_path / "in", CONFIG, state)
    model = Llama.from_pretrained(tmp_path / "in", quantize="int8")
    tensors = {name: np.asarray(a) for name, a in model.params.items()}
    files, raw = quantization.file_tensors(tensors, tuple(model.quantized), model.quant)
    hf_config = dict(CONFIG.to_hf_dict(), quantization_config=quantization.compressed_tensors_config(model.quant))
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    files[name] = files[name].copy()
    files[name].reshape(-1)[3] = 0.0
    hf.write_checkpoint(tmp_path / "zero", hf_config, files, raw=raw)
    assert Llama.from_pretrained(tmp_path / "zero").params[name][3] == 0
    files[name].reshape(-1)[3] = bad
    hf.write_checkpoint(tmp_path / "bad", hf_config, files, raw=raw)
    with pytest.raises(hf.ModelFileError, match=r"model\.safetensors: tensor .*o_proj\.weight_scale.* negative or "
                                                r"not finite"):
        Llama.from_pretrained(tmp_path / "bad")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_load_time_quantization_refuses_a_weight_that_is_not_finite(numpy_cupy, kind, tmp_path):
    from tilekit import checkpoints as hf
    state = random_state_dict(CONFIG, 8)
    state["model.layers.0.mlp.up_proj.weight"][5, 7] = np.inf
    save_state_dict(tmp_path, CONFIG, state)
    with pytest.raises(hf.ModelFileError, match=r"tensor .*up_proj\.weight.* not finite"):
        Llama.from_pretrained(tmp_path, quantize=kind)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(quantize="int4"), ValueError, "quantize must be"), (dict(quantize_head=1), TypeError, "quantize_head"),
    (dict(dtype="int8"), ValueError, "dtype must be"), (dict(empty=True), TypeError, "sets empty itself"),
    (dict(state={}), TypeError, "sets state itself"), (dict(comm=5), TypeError, "comm must be")])
def test_from_pretrained_checks_its_arguments_before_reading_anything(kwargs, error, match, tmp_path):
    with pytest.raises(error, match=match):
        Llama.from_pretrained(tmp_path / "no such checkpoint", **kwargs)


def test_a_head_stored_as_codes_that_the_config_lists_unquantized_is_refused(numpy_cupy, tmp_path):
    """The file contradicting its config (`ignore` names lm_head, the weights store it as codes): the config's
    field named, not a quantized head loaded silently."""
    from tilekit import checkpoints as hf
    state = random_state_dict(CONFIG, 9)
    save_state_dict(tmp_path / "in", CONFIG, state)
    model = Llama.from_pretrained(tmp_path / "in", quantize="fp8", quantize_head=True)
    tensors = {name: np.asarray(a) for name, a in model.params.items()}
    files, raw = quantization.file_tensors(tensors, tuple(model.quantized), model.quant)
    qconfig = quantization.compressed_tensors_config(model.quant, head=False)      # ignore: ["lm_head"]
    hf.write_checkpoint(tmp_path / "bad", dict(CONFIG.to_hf_dict(), quantization_config=qconfig), files, raw=raw)
    with pytest.raises(hf.ModelFileError, match=r"config\.json: field .*ignore.* lists the LM head unquantized"):
        Llama.from_pretrained(tmp_path / "bad")
