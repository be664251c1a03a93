"""Quantized weights on the host: per-channel absmax quantization (NumPy), the FP8 / INT8 checkpoint layouts read
through the loader (synthetic checkpoints of each, loaded into NumPy arrays), clear errors for schemes tilekit does
not read, and the compressed-tensors layout save_pretrained writes read back."""

import json
import math
import time

import ml_dtypes
import numpy as np
import pytest

from tilekit.kernels.quant_linear import dequantize_reference
from tilekit.models import quantization
from tilekit import checkpoints as hf
from tilekit.models.llama import weights
from tilekit.models.llama.config import LlamaConfig
from tilekit.models.quantization import QBLOCK, Scheme, quantize_weight

CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=160, intermediate_size=200, vocab_size=50,
                     max_position_embeddings=64, tie_word_embeddings=False, rope_scaling=None)
SHAPES = weights.state_dict_shapes(CONFIG)
LINEARS = quantization.linear_names(SHAPES, weights.QUANTIZED)
FP8 = ml_dtypes.float8_e4m3fn


def fp8_codes(values) -> np.ndarray:
    return np.clip(values, -448, 448).astype(FP8).view(np.uint8)


def file_quantized(w, kind: str, strategy: str):
    """(codes, file scale) of a float [out, in] weight as a checkpoint of `strategy` stores it."""
    top = 127.0 if kind == "int8" else 448.0
    if strategy == "block":
        out, k = w.shape
        pad = np.pad(np.abs(w), [(0, -out % QBLOCK), (0, -k % QBLOCK)])
        s = pad.reshape(-(-out // QBLOCK), QBLOCK, -1, QBLOCK).max((1, 3)).astype(np.float32) / top
        full = np.repeat(np.repeat(s, QBLOCK, 0), QBLOCK, 1)[:out, :k]
    else:
        s = (np.abs(w).max(1, keepdims=True) if strategy == "channel" else np.abs(w).max(keepdims=True)
             ).astype(np.float32) / top
        full = s
    q = w / full
    codes = np.clip(np.rint(q), -127, 127).astype(np.int8) if kind == "int8" else fp8_codes(q)
    return codes, s


def write_quantized(directory, kind: str, strategy: str, qconfig: dict | None, scale_shape, scale_name="weight_scale",
                    extras=(), config=CONFIG, more=None):
    """A synthetic quantized Llama checkpoint of `config` (and the fp32 tensors of `more`, name -> array); returns
    our name -> expected float64 dequantized weight."""
    state = weights.random_state_dict(config, 0)
    linears = quantization.linear_names(weights.state_dict_shapes(config), weights.QUANTIZED)
    tensors, raw, expected = {}, {}, {}
    for name, w in state.items():
        if name not in linears:
            tensors[name] = w
            continue
        codes, s = file_quantized(w.astype(np.float64), kind, strategy)
        tensors[name], raw[name] = codes, quantization.FILE_DTYPES[kind]
        scale = name[:-len("weight")] + scale_name
        tensors[scale], raw[scale] = s.reshape(scale_shape(w.shape)), "F32"
        for extra in extras:
            if extra in ("k_scale", "v_scale") and not name.endswith(f".{extra[0]}_proj.weight"):
                continue        # ModelOpt's places: k_proj.k_scale, v_proj.v_scale
            tensors[name[:-len("weight")] + extra], raw[name[:-len("weight")] + extra] = np.ones(1, np.float32), "F32"
        values = codes.view(FP8).astype(np.float64) if kind == "fp8" else codes.astype(np.float64)
        block = np.repeat(np.repeat(s, QBLOCK, 0), QBLOCK, 1)[:w.shape[0], :w.shape[1]] if strategy == "block" else s
        expected[name] = values * block
    for name, array in (more or {}).items():
        tensors[name], raw[name] = np.asarray(array, np.float32), "F32"
    hf_config = config.to_hf_dict()
    if qconfig is not None:
        hf_config["quantization_config"] = qconfig
    hf.write_checkpoint(directory, hf_config, tensors, raw=raw)
    return expected


def load_host(directory, quantize=None):
    """(scheme, our name -> NumPy array: codes, scales under scale_key names, float weights) through the loader."""
    checkpoint = hf.Checkpoint.at(directory)
    scheme = quantization.scheme_for(checkpoint, quantize)
    outs = {}
    for name, shape in SHAPES.items():
        if name in LINEARS:
            outs[name] = np.empty(shape, np.int8 if scheme.weight == "int8" else np.uint8)
            outs[quantization.scale_key(name)] = np.empty(quantization.model_scale_shape(scheme.scale, shape),
                                                          np.float32)
        else:
            outs[name] = np.empty(shape, np.float32)
    weights.LAYOUT.load(checkpoint, CONFIG, dtype="float32", outs=outs, device=hf.HostDevice(),
                        ignore=scheme.ignored,
                        rewrite=lambda plan, o, _: quantization.rewrite_plan(plan, LINEARS, scheme, o))
    return scheme, outs


def dequantized(outs, scheme):
    return {n: dequantize_reference(outs[n], outs[quantization.scale_key(n)], scheme.weight) for n in LINEARS}


def compressed(kind, strategy, **weights_extra):
    return {"quant_method": "compressed-tensors", "format": "float-quantized" if kind == "fp8" else "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(
                num_bits=8, type="float" if kind == "fp8" else "int", symmetric=True, strategy=strategy,
                dynamic=False, **weights_extra), "input_activations": {"num_bits": 8, "type": "float",
                                                                     "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"]}


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def reweighted(qconfig: dict, **changes) -> dict:
    """A compressed-tensors config with fields of its group's weights replaced."""
    group = qconfig["config_groups"]["group_0"]
    return {**qconfig, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **changes}}}}


LAYOUTS = {
    "compressed-tensors fp8 channel": ("fp8", "channel", compressed("fp8", "channel"), lambda s: (s[0], 1)),
    "compressed-tensors fp8 tensor": ("fp8", "tensor", compressed("fp8", "tensor"), lambda s: (1,)),
    "compressed-tensors fp8 block": ("fp8", "block", compressed("fp8", "block", block_structure=[128, 128]),
                                     lambda s: (math.ceil(s[0] / 128), math.ceil(s[1] / 128))),
    "compressed-tensors int8 channel": ("int8", "channel", compressed("int8", "channel"), lambda s: (s[0], 1)),
    "compressed-tensors fp8 channel, KV-cache scales": ("fp8", "channel", {**compressed("fp8", "channel"),
                                                                          "kv_cache_scheme": KV_CACHE_SCHEME},
                                                       lambda s: (s[0], 1)),
    "fbgemm_fp8": ("fp8", "channel", {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                      "modules_to_not_convert": ["lm_head"]}, lambda s: (s[0], 1)),
    "modelopt FP8": ("fp8", "tensor", {"quant_method": "modelopt", "quant_algo": "FP8",
                                       "exclude_modules": ["lm_head"]}, lambda s: ()),
    "block fp8": ("fp8", "block", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]},
                  lambda s: (math.ceil(s[0] / 128), math.ceil(s[1] / 128))),
}
EXTRAS = {"fbgemm_fp8": ("input_scale_ub",), "modelopt FP8": ("input_scale", "k_scale"),
          "compressed-tensors fp8 channel, KV-cache scales": ("k_scale", "v_scale")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_layouts_load_exactly(layout, tmp_path):
    kind, strategy, qconfig, scale_shape = LAYOUTS[layout]
    expected = write_quantized(tmp_path, kind, strategy, qconfig, scale_shape,
                               "weight_scale_inv" if layout == "block fp8" else "weight_scale", EXTRAS.get(layout, ()))
    scheme, outs = load_host(tmp_path)
    assert (scheme.weight, scheme.scale) == (kind, "block" if strategy == "block" else "channel")
    for name, w in dequantized(outs, scheme).items():
        np.testing.assert_array_equal(w, expected[name], err_msg=f"{layout}: {name}")
    state = weights.random_state_dict(CONFIG, 0)
    np.testing.assert_array_equal(outs["model.norm.weight"], state["model.norm.weight"])


def test_modelopt_hf_quant_config_file(tmp_path):
    _, _, _, scale_shape = LAYOUTS["modelopt FP8"]
    expected = write_quantized(tmp_path, "fp8", "tensor", None, scale_shape, extras=("input_scale",))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    scheme, outs = load_host(tmp_path)
    assert scheme.source == "ModelOpt FP8"
    for name, w in dequantized(outs, scheme).items():
        np.testing.assert_array_equal(w, expected[name])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_load_time_quantization_of_a_float_checkpoint(kind, tmp_path):
    state = weights.random_state_dict(CONFIG, 1)
    weights.save_state_dict(tmp_path, CONFIG, state, dtype="bfloat16")
    scheme, outs = load_host(tmp_path, kind)
    assert scheme == Scheme(kind)
    for name in LINEARS:
        codes, scale = quantize_weight(state[name].astype(ml_dtypes.bfloat16), kind)
        np.testing.assert_array_equal(outs[name], codes)
        np.testing.assert_array_equal(outs[quantization.scale_key(name)], scale)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantize_weight_is_per_channel_absmax(kind):
    rng = np.random.default_rng()
    w = rng.standard_normal((70, 300)) * rng.uniform(0.01, 10, (70, 1))
    w[3] = 0
    codes, scale = quantize_weight(w, kind)
    top = 127 if kind == "int8" else 448
    np.testing.assert_allclose(scale[4:], np.abs(w[4:]).max(1).astype(np.float32) / np.float32(top), rtol=1e-7)
    assert scale[3] > 0 and not dequantize_reference(codes, scale, kind)[3].any()
    # against the float32 weights the quantizer reads; w / scale in float32 moves a quotient of up to 448 by up to
    # 448 * 2**-24 of a step, which decides ties: a slack of 1e-5 (1e-6 against float64 failed 10 of 800 draws)
    error = np.abs(dequantize_reference(codes, scale, kind) - w.astype(np.float32))
    if kind == "int8":
        assert np.all(error <= (0.5 + 1e-5) * scale[:, None])
    else:                               # half an e4m3 step: 2**-4 relative for normals, 2**-10 * scale below
        assert np.all(error <= np.maximum(np.abs(w) * 2.0 ** -4, 2.0 ** -10 * scale[:, None]) * (1 + 1e-5))


@pytest.mark.parametrize("qconfig, field", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
    ({**compressed("fp8", "channel"), "format": "pack-quantized"}, "format"),
    ({**compressed("fp8", "group")}, "weights"),
    ({**compressed("fp8", "channel"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "quant_algo"),
    ({**compressed("fp8", "channel"), "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "type": ["float"], "num_bits": 8}}}}, "weights"),
    ({"quant_method": ["fp8"]}, "quant_method"),
    ([], "quantization_config"),
    ({**compressed("fp8", "channel"), "format": "int-quantized"}, "type"),        # int format, float weights
    ({**compressed("int8", "channel"), "format": "float-quantized"}, "type"),
    (reweighted(compressed("fp8", "channel"), num_bits=8.0), "weights"),         # JSON integers are integers
    (compressed("fp8", "block", block_structure=[128.0, 128]), "block_structure"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128.0]}, "weight_block_size"),
    (reweighted(compressed("fp8", "channel"), group_size=128), "weights.group_size"),
    (reweighted(compressed("fp8", "channel"), group_size=-1.0), "weights.group_size"),
    (reweighted(compressed("fp8", "channel"), group_size=True), "weights.group_size"),
    (reweighted(compressed("fp8", "tensor"), group_size=-1), "weights.group_size"),
    ({**compressed("fp8", "channel"), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
    ({**compressed("fp8", "channel"), "sparsity_config": ["dense"]}, "sparsity_config"),
    ({**compressed("fp8", "channel"), "kv_cache_scheme": [KV_CACHE_SCHEME]}, "kv_cache_scheme"),
    ({**compressed("fp8", "channel"), "transform_config": {"config_groups": {"v": {"type": "hadamard"}}}},
     "transform_config"),
])
def test_unsupported_schemes_are_named(qconfig, field, tmp_path):
    hf.write_checkpoint(tmp_path, dict(CONFIG.to_hf_dict(), quantization_config=qconfig), {})
    with pytest.raises(hf.ModelFileError, match=field) as e:
        quantization.scheme_of(hf.Checkpoint.at(tmp_path))
    assert "config.json" in str(e.value)


def test_a_group_size_sparsity_or_transform_is_named_with_its_field(tmp_path):
    """Read as if absent, a group size needed scales of another shape (named by tensor, not by field), and a
    transform or a sparse layout would have been misread."""
    for qconfig, message in [
        (reweighted(compressed("fp8", "channel"), group_size=128), "field 'quantization_config.config_groups.group_0"
         ".weights.group_size' is 128: groups of columns are not read (null, or -1 with strategy channel)"),
        ({**compressed("fp8", "channel"), "sparsity_config": {"format": "sparse-24-bitmask"}},
         "field 'quantization_config.sparsity_config' is {\"format\": \"sparse-24-bitmask\"}: a sparse layout (dense "
         "weights are read); " + quantization.READ),
        ({**compressed("fp8", "channel"), "transform_config": {"config_groups": {}}},
         "field 'quantization_config.transform_config' is {\"config_groups\": {}}: transforms applied as the model "
         "runs (tilekit applies none); " + quantization.READ)]:
        hf.write_checkpoint(tmp_path, dict(CONFIG.to_hf_dict(), quantization_config=qconfig), {})
        with pytest.raises(hf.ModelFileError) as e:
            quantization.scheme_of(hf.Checkpoint.at(tmp_path))
        assert str(e.value) == f"{tmp_path / 'config.json'}: {message}"


@pytest.mark.parametrize("qconfig", [
    reweighted(compressed("fp8", "channel"), group_size=-1), reweighted(compressed("fp8", "channel"), group_size=None),
    {**compressed("fp8", "channel"), "sparsity_config": {"format": "dense", "sparsity_structure": "unstructured"}},
    {**compressed("fp8", "channel"), "sparsity_config": {}, "transform_config": None},
    {**compressed("fp8", "channel"), "sparsity_config": None, "transform_config": {}},
])
def test_a_whole_row_group_size_and_a_dense_layout_are_read(qconfig, tmp_path):
    hf.write_checkpoint(tmp_path, dict(CONFIG.to_hf_dict(), quantization_config=qconfig), {})
    assert quantization.scheme_of(hf.Checkpoint.at(tmp_path)).source == "compressed-tensors"


def test_kv_cache_scales_are_read_past_only_where_the_config_declares_them(tmp_path):
    """A compressed-tensors kv_cache_scheme's static k_scale / v_scale tensors are not weights of the model (the
    FP8 KV cache reads them: read_kv_scales); without the field they are tensors the model does not have."""
    qconfig = compressed("fp8", "channel")
    write_quantized(tmp_path, "fp8", "channel", qconfig, lambda s: (s[0], 1), extras=("k_scale",))
    with pytest.raises(hf.ModelFileError, match=r"\n  unexpected tensor '.*\.k_scale'"):
        load_host(tmp_path)


def test_module_patterns_from_a_file_are_never_compiled(tmp_path):
    """'re:' patterns in targets and ignore lists are compared as text, never compiled: a pathological one (nested
    quantifiers), an invalid one or a million of them cost a scan of the list, not a hang or a re.error."""
    patterns = ["re:(a+)+$", "re:(", "re:(.*a){30}"] + ["re:(x+x+)+y"] * 10 ** 6
    qconfig = {**compressed("fp8", "channel"), "ignore": ["lm_head"] + patterns}
    qconfig["config_groups"]["group_0"]["targets"] = ["Linear"] + patterns[:3]
    hf.write_checkpoint(tmp_path, dict(CONFIG.to_hf_dict(), quantization_config=qconfig), {})
    start = time.monotonic()
    assert quantization.scheme_of(hf.Checkpoint.at(tmp_path), mixed=True).float_head is not None
    with pytest.raises(hf.ModelFileError, match=r"field 'quantization_config.ignore' leaves modules other than the LM "
                                                r"head unquantized \('re:\(a\+\)\+\$', 're:\(', 're:\(\.\*a\)\{30\}', "
                                                r"\.\.\.\)"):
        quantization.scheme_of(hf.Checkpoint.at(tmp_path))
    assert time.monotonic() - start < 10


def patch_tensor(path, name: str, offset: int, data: bytes) -> None:
    """Overwrite bytes of tensor `name` in a safetensors file, `offset` bytes into its data."""
    raw = bytearray(path.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    at = 8 + length + json.loads(raw[8:8 + length])[name]["data_offsets"][0] + offset
    raw[at:at + len(data)] = data
    path.write_bytes(raw)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_a_nan_fp8_code_is_refused_naming_its_tensor(code, tmp_path):
    """e4m3 has no infinity: 0x7F and 0xFF are its NaNs, which loaded as they are made the layer's outputs NaN.
    (An int8 checkpoint's 0x7F is 127, a code like any other.)"""
    name = "model.layers.1.mlp.down_proj.weight"
    for kind in ("int8", "fp8"):
        write_quantized(tmp_path / kind, kind, "channel", compressed(kind, "channel"), lambda s: (s[0], 1))
        patch_tensor(tmp_path / kind / "model.safetensors", name, 5, bytes([code]))
    assert load_host(tmp_path / "int8")[1][name].reshape(-1)[5] == np.int8(code - (code > 127) * 256)
    with pytest.raises(hf.ModelFileError) as info:
        load_host(tmp_path / "fp8")
    assert str(info.value) == f"{tmp_path / 'fp8' / 'model.safetensors'}: tensor '{name}' holds a value that is not " \
                              "finite"


@pytest.mark.parametrize("kind, fits, overflows", [("fp8", 7e35, 8e35), ("int8", 2.6e36, 2.7e36)])
def test_a_scale_that_makes_codes_overflow_float32_is_refused(kind, fits, overflows, tmp_path):
    """A finite scale so large that the largest code (448 in e4m3, -128 in int8) times it is infinite in fp32, the
    kernels' weights: as a weight that is not finite, named at load rather than as infinite logits."""
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    for scale in (fits, overflows):
        write_quantized(tmp_path / str(scale), kind, "channel", compressed(kind, "channel"), lambda s: (s[0], 1))
        patch_tensor(tmp_path / str(scale) / "model.safetensors", name, 4 * 3, np.float32(scale).tobytes())
    assert load_host(tmp_path / str(fits))[1][name][3] == np.float32(fits)
    with pytest.raises(hf.ModelFileError) as info:
        load_host(tmp_path / str(overflows))
    top = {"fp8": 448, "int8": 128}[kind]
    assert str(info.value) == f"{tmp_path / str(overflows) / 'model.safetensors'}: tensor '{name}' holds a scale " \
                              f"that times the largest {kind} code ({top}) overflows float32"


def test_a_null_quantization_config_is_none(tmp_path):
    hf.write_checkpoint(tmp_path, dict(CONFIG.to_hf_dict(), quantization_config=None), {})
    assert quantization.scheme_of(hf.Checkpoint.at(tmp_path)) is None


def test_quantize_must_agree_with_the_checkpoint(tmp_path):
    write_quantized(tmp_path, "fp8", "channel", compressed("fp8", "channel"), lambda s: (s[0], 1))
    with pytest.raises(ValueError, match="holds fp8 weights"):
        quantization.scheme_for(hf.Checkpoint.at(tmp_path), "int8")
    with pytest.raises(ValueError, match="quantize must be"):
        quantization.scheme_for(hf.Checkpoint.at(tmp_path), "int4")


@pytest.mark.parametrize("kind, scale", [("int8", "channel"), ("fp8", "channel"), ("fp8", "block")])
def test_saved_compressed_tensors_read_back(kind, scale, tmp_path):
    """What save_pretrained writes (file_tensors, compressed_tensors_config) loads back bit for bit."""
    _, outs = load_host(_written(tmp_path / "a", kind, scale))
    scheme = Scheme(kind, scale)
    tensors, raw = quantization.file_tensors(outs, LINEARS, scheme)
    hf.write_checkpoint(tmp_path / "b", dict(CONFIG.to_hf_dict(), quantization_config=quantization.
                                             compressed_tensors_config(scheme)), tensors, raw=raw)
    again_scheme, again = load_host(tmp_path / "b")
    assert (again_scheme.weight, again_scheme.scale) == (kind, scale)
    for name, array in outs.items():
        np.testing.assert_array_equal(again[name], array, err_msg=name)


def _written(directory, kind, scale):
    if scale == "block":
        write_quantized(directory, kind, "block", compressed(kind, "block", block_structure=[128, 128]),
                        LAYOUTS["block fp8"][3])
    else:
        write_quantized(directory, kind, "channel", compressed(kind, "channel"), lambda s: (s[0], 1))
    return directory


def _with_kv_scales(directory, scales: dict) -> None:
    """A compressed-tensors fp8 checkpoint declaring static KV-cache scales, with tensors `scales` (name -> value)."""
    write_quantized(directory, "fp8", "channel", {**compressed("fp8", "channel"), "kv_cache_scheme": KV_CACHE_SCHEME},
                    lambda s: (s[0], 1), more=scales)


KV_NAMES = (("self_attn.k_scale", "self_attn.k_proj.k_scale"), ("self_attn.v_scale", "self_attn.v_proj.v_scale"))
LAYERS = [f"model.layers.{i}." for i in range(CONFIG.n_layer)]


@pytest.mark.parametrize("qconfig, declared", [
    ({**compressed("fp8", "channel"), "kv_cache_scheme": KV_CACHE_SCHEME}, True),
    ({**compressed("fp8", "channel"), "kv_cache_scheme": {**KV_CACHE_SCHEME, "strategy": "attn_head"}}, False),
    ({**compressed("fp8", "channel"), "kv_cache_scheme": {**KV_CACHE_SCHEME, "dynamic": True}}, False),
    (compressed("fp8", "channel"), False),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, True),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, False),
])
def test_static_kv_cache_scales_are_declared_by_the_schemes_that_store_them(qconfig, declared, tmp_path):
    hf.write_checkpoint(tmp_path, dict(CONFIG.to_hf_dict(), quantization_config=qconfig), {})
    assert quantization.scheme_of(hf.Checkpoint.at(tmp_path)).kv_scales is declared


@pytest.mark.parametrize("k_name, v_name, shape", [("self_attn.k_scale", "self_attn.v_scale", ()),
                                                    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale", (1,))])
def test_kv_cache_scales_are_read_per_layer_under_either_name(k_name, v_name, shape, tmp_path):
    rng = np.random.default_rng(3)
    k, v = rng.uniform(0.01, 0.1, (2, CONFIG.n_layer)).astype(np.float32)
    _with_kv_scales(tmp_path, {**{p + k_name: k[i].reshape(shape) for i, p in enumerate(LAYERS)},
                               **{p + v_name: v[i].reshape(shape) for i, p in enumerate(LAYERS)}})
    got_k, got_v = quantization.read_kv_scales(hf.Checkpoint.at(tmp_path), LAYERS, KV_NAMES)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


def test_a_config_declaring_kv_cache_scales_that_no_tensor_holds_is_refused(tmp_path):
    _with_kv_scales(tmp_path, {})
    with pytest.raises(hf.ModelFileError, match=r"its config declares static KV-cache scales, but no tensor holds "
                                                r"them \(read: 'self_attn\.k_scale' or 'self_attn\.k_proj\.k_scale'"):
        quantization.read_kv_scales(hf.Checkpoint.at(tmp_path), LAYERS, KV_NAMES)


def _both(value=0.05, shape=()):
    names = ("self_attn.k_scale", "self_attn.v_scale")
    return {p + n: np.full(shape, value, np.float32) for p in LAYERS for n in names}


@pytest.mark.parametrize("scales, match", [
    ({n: s for n, s in _both().items() if n != "model.layers.1.self_attn.v_scale"},
     r"missing tensor 'model.layers.1.self_attn.v_scale' \(1 of 2 layers have their value scale\)"),
    (_both(shape=(2,)), r"tensor 'model.layers.0.self_attn.k_scale' has shape \(2,\)"),
    ({**_both(), "model.layers.0.self_attn.k_proj.k_scale": np.float32(0.05)},
     r"'model.layers.0.self_attn.k_scale' and 'model.layers.0.self_attn.k_proj.k_scale' both give one scale"),
    ({**_both(), "model.layers.1.self_attn.k_scale": np.float32(-0.05)},
     r"'model.layers.1.self_attn.k_scale' is -0.05"),
    ({**_both(), "model.layers.0.self_attn.v_scale": np.float32(0.0)}, r"'model.layers.0.self_attn.v_scale' is 0.0"),
    ({**_both(), "model.layers.0.self_attn.v_scale": np.float32(1e-45)}, r"'model.layers.0.self_attn.v_scale' is 1"),
    ({**_both(), "model.layers.0.self_attn.v_scale": np.float32(1e36)},
     r"'model.layers.0.self_attn.v_scale' is 9\.99\d*e\+35: a KV-cache scale must be between 1\.175e-38 and "
     r"7\.596e\+35"),
    ({n: s for n, s in _both().items() if n.endswith("k_scale")},
     r"missing tensor 'model.layers.0.self_attn.v_scale' \(no layer has a value scale\)"),
    ({**_both(), "model.layers.0.self_attn.attn.k_scale": np.float32(0.05)},
     r"tensor 'model.layers.0.self_attn.attn.k_scale': a KV-cache scale under a name tilekit does not read"),
    ({**_both(), "model.layers.7.self_attn.k_scale": np.float32(0.05)},
     r"tensor 'model.layers.7.self_attn.k_scale': a KV-cache scale under a name"),
])
def test_unusable_kv_cache_scales_are_refused_naming_the_file_and_tensor(scales, match, tmp_path):
    _with_kv_scales(tmp_path, scales)
    with pytest.raises(hf.ModelFileError, match=r"(?s)model\.safetensors: .*" + match):
        quantization.read_kv_scales(hf.Checkpoint.at(tmp_path), LAYERS, KV_NAMES)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_kv_cache_scale_that_is_not_finite_is_refused(bad, tmp_path):
    _with_kv_scales(tmp_path, {**_both(), "model.layers.1.self_attn.v_scale": np.float32(bad)})
    with pytest.raises(hf.ModelFileError, match=r"model\.layers\.1\.self_attn\.v_scale"):
        quantization.read_kv_scales(hf.Checkpoint.at(tmp_path), LAYERS, KV_NAMES)
