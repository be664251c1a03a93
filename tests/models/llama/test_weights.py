"""Llama configs and Hugging Face Llama checkpoint I/O: presets, round trips, refusals, hostile files."""

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import save_file

from tilekit.models.llama.weights import load_state_dict, random_state_dict, save_state_dict, state_dict_shapes
from tilekit.models import LLAMA_PRESETS, LlamaConfig
from tilekit.models.llama.config import RopeScaling

DATA = Path(__file__).resolve().parents[2] / "data"
CONFIG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, intermediate_size=24, vocab_size=50,
                     max_position_embeddings=32, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16),
                     tie_word_embeddings=False)
TIED = CONFIG.replace(tie_word_embeddings=True, rope_scaling=None)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def write_checkpoint(directory: Path, tensors: dict, config: LlamaConfig = CONFIG) -> Path:
    """A single-file checkpoint written by hand, tensor names exactly as given."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def write_sharded(directory: Path, state: dict, config: LlamaConfig = CONFIG, shards: int = 3) -> dict:
    """A sharded checkpoint (tensors dealt round-robin into `shards` files); returns its weight_map to edit."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    names = {f"model-{i + 1:05d}-of-{shards:05d}.safetensors": {} for i in range(shards)}
    weight_map = {}
    for i, (name, array) in enumerate(state.items()):
        shard = list(names)[i % shards]
        names[shard][name] = array
        weight_map[name] = shard
    for shard, tensors in names.items():
        save_file(tensors, directory / shard, metadata={"format": "pt"})
    write_index(directory, weight_map)
    return weight_map


def write_index(directory: Path, weight_map) -> Path:
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


# -- configs ----------------------------------------------------------------------------------------------

def test_presets_have_the_published_shapes():
    p = LLAMA_PRESETS
    assert [(p[n].n_layer, p[n].n_embd, p[n].n_head, p[n].n_kv_head, p[n].head_dim, p[n].intermediate_size)
            for n in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b", "tinyllama-1.1b")] == [
        (16, 2048, 32, 8, 64, 8192), (28, 3072, 24, 8, 128, 8192), (32, 4096, 32, 8, 128, 14336),
        (80, 8192, 64, 8, 128, 28672), (22, 2048, 32, 4, 64, 5632)]
    assert p["llama-3.2-1b"].tie_word_embeddings and not p["llama-3.1-8b"].tie_word_embeddings
    assert p["llama-3.1-8b"].rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert p["tinyllama-1.1b"].rope_scaling is None and p["tinyllama-1.1b"].rope_theta == 10000.0
    assert LlamaConfig.preset("llama-3.2-1b") is p["llama-3.2-1b"]
    assert LlamaConfig() == p["llama-3.2-1b"].replace(bos_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="llama-3.1-8b"):
        LlamaConfig.preset("llama-9")


def test_hub_config_json_reads_as_the_preset():
    """meta-llama/Llama-3.1-8B's config.json, as published (transformers 4 layout)."""
    hub = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
           "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
           "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
           "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
    assert LlamaConfig.from_hf_dict(hub) == LlamaConfig.preset("llama-3.1-8b")


@pytest.mark.parametrize("config", [*LLAMA_PRESETS.values(), CONFIG, TIED.replace(eos_token_id=[3, 4])])
def test_hf_dict_round_trip(config):
    assert LlamaConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


def test_transformers_5_layout_and_defaults():
    """The fixtures' config.json files are transformers 5's (rope_parameters); absent keys take its defaults."""
    assert LlamaConfig.from_json(DATA / "tiny-llama" / "config.json").rope_scaling == RopeScaling(8.0, 1.0, 4.0, 256)
    assert LlamaConfig.from_json(DATA / "tiny-llama-tied" / "config.json").eos_token_id == 257
    minimal = LlamaConfig.from_hf_dict({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                        "num_attention_heads": 4, "vocab_size": 10,
                                        "rope_scaling": {"type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 2.0}})
    assert minimal == LlamaConfig(n_layer=2, n_head=4, n_kv_head=4, n_embd=64, intermediate_size=96, vocab_size=10,
                                  max_position_embeddings=2048, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                                  rope_scaling=RopeScaling(2.0, 1.0, 2.0, 2048), tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2)


VARIANT = "a variant tilekit does not compute"


@pytest.mark.parametrize("key, value, problem", [
    ("attention_bias", True, f"field 'attention_bias' is true, {VARIANT}"),
    ("mlp_bias", True, f"field 'mlp_bias' is true, {VARIANT}"),
    ("hidden_act", "gelu", f'field \'hidden_act\' is "gelu", {VARIANT}'),
    ("model_type", "mistral", 'field \'model_type\' is "mistral", expected one of "llama"'),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
     f'field \'rope_scaling.rope_type\' is "yarn", {VARIANT}'),
    ("rope_scaling", {"type": "linear", "factor": 2.0}, f'field \'rope_scaling.type\' is "linear", {VARIANT}'),
    ("rope_scaling", "llama3", 'field \'rope_scaling\' is "llama3", expected a JSON object'),
    ("rope_scaling", [], "field 'rope_scaling' is [], expected a JSON object"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "attention_factor": 2.0},
     f"field 'rope_scaling.attention_factor' is 2.0, {VARIANT}"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
     f'field \'rope_parameters.rope_type\' is "dynamic", {VARIANT}'),
    ("partial_rotary_factor", 0.5, f"field 'partial_rotary_factor' is 0.5, {VARIANT}"),
    ("sliding_window", 4096, f"field 'sliding_window' is 4096, {VARIANT}"),
    ("use_sliding_window", True, f"field 'use_sliding_window' is true, {VARIANT}"),
    ("layer_types", ["full_attention", "sliding_attention"],
     f'field \'layer_types\' is ["full_attention", "sliding_attention"], {VARIANT}'),
])
def test_unsupported_variants_are_refused_by_name(key, value, problem):
    d = dict(CONFIG.to_hf_dict(), **{key: value})
    if key == "rope_parameters":
        del d["rope_scaling"]
    with pytest.raises(ValueError) as info:
        LlamaConfig.from_hf_dict(d)
    assert str(info.value) == f"config.json: {problem}"


@pytest.mark.parametrize("changes, problem", [
    (dict(rope_theta=5e-324), "field 'rope_theta' is 5e-324: it gives rotary frequencies that are not finite and > 0 "
                              "(with head_dim 4)"),
    (dict(rope_theta=True), "field 'rope_theta' is true, expected a finite number > 0"),
    (dict(rope_theta=0), "field 'rope_theta' is 0, expected a finite number > 0"),
    (dict(eos_token_id=[]), "field 'eos_token_id' is [], expected a token id or a non-empty list of them (integers in "
                            "[0, 50))"),
    (dict(eos_token_id=50), "field 'eos_token_id' is 50, expected a token id or a non-empty list of them (integers in "
                            "[0, 50))"),
    (dict(bos_token_id=[1]), "field 'bos_token_id' is [1], expected an integer in [0, 49]"),
    (dict(num_hidden_layers=2.7), "field 'num_hidden_layers' is 2.7, expected an integer in [1, 4096]"),
    (dict(num_hidden_layers=2.0), "field 'num_hidden_layers' is 2.0, expected an integer in [1, 4096]"),
    (dict(hidden_size=True), "field 'hidden_size' is true, expected an integer in [1, 16777216]"),
    (dict(hidden_size=18), "field 'hidden_size' is 18, not a multiple of num_attention_heads (4)"),
    (dict(num_key_value_heads=3), "field 'num_attention_heads' is 4, not a multiple of num_key_value_heads (3)"),
    (dict(head_dim=5), "field 'head_dim' is 5, expected an even number (RoPE pairs its halves)"),
    (dict(rms_norm_eps=0.0), "field 'rms_norm_eps' is 0.0, expected a finite number > 0"),
    (dict(rms_norm_eps="1e-5"), 'field \'rms_norm_eps\' is "1e-5", expected a finite number > 0'),
    (dict(tie_word_embeddings=1), "field 'tie_word_embeddings' is 1, expected true or false"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}),
     "field 'rope_scaling.high_freq_factor' is 4.0, expected > low_freq_factor (4.0)"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     "field 'rope_scaling.factor' is 0.5, expected a finite number >= 1.0"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16.0}),
     "field 'rope_scaling.original_max_position_embeddings' is 16.0, expected an integer in [1, 16777216]"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e-324}, rope_scaling=None),
     "field 'rope_parameters.rope_theta' is 5e-324: it gives rotary frequencies that are not finite and > 0 "
     "(with head_dim 4)"),
])
def test_config_fields_are_type_and_range_checked(changes, problem):
    """Every field as #31 asks: integers stay integers, floats finite and positive where required, RoPE
    parameters giving finite non-zero frequencies, no empty eos list; the message names the file and the field."""
    with pytest.raises(ValueError) as info:
        LlamaConfig.from_hf_dict(dict(CONFIG.to_hf_dict(), **changes))
    assert str(info.value) == f"config.json: {problem}"


def test_unknown_fields_are_ignored_as_transformers_ignores_them():
    assert LlamaConfig.from_hf_dict(dict(CONFIG.to_hf_dict(), future_field={"x": [1]}, pretraining_tp=2)) == CONFIG


def test_missing_key_is_named():
    d = CONFIG.to_hf_dict()
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="^config.json: field 'intermediate_size' is missing, expected an integer"):
        LlamaConfig.from_hf_dict(d)
    d = CONFIG.to_hf_dict()
    del d["rope_scaling"]["low_freq_factor"]
    with pytest.raises(ValueError, match="^config.json: field 'rope_scaling.low_freq_factor' is missing"):
        LlamaConfig.from_hf_dict(d)


@pytest.mark.parametrize("changes, message", [
    (dict(n_kv_head=3), "divisible by n_kv_head"), (dict(n_embd=18), "divisible by n_head"),
    (dict(head_dim=5), "even"), (dict(n_layer=0), "n_layer"), (dict(vocab_size=True), "vocab_size"),
    (dict(n_head=4.0), "n_head"), (dict(head_dim=0), "head_dim"), (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rope_theta=math.nan), "rope_theta"), (dict(rope_theta="1e4"), "rope_theta"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings"), (dict(rope_scaling={"factor": 8.0}), "RopeScaling"),
    (dict(eos_token_id=50), "token ids"), (dict(bos_token_id=-1), "token ids"),
    (dict(eos_token_id=(1, "2")), "token ids"), (dict(eos_token_id=()), "token ids"),
    (dict(rope_theta=5e-324), "rope_theta 5e-324 gives rotary frequencies that are not finite"),
])
def test_invalid_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        CONFIG.replace(**changes)


@pytest.mark.parametrize("args, message", [((0.5, 1.0, 4.0, 16), "factor"), ((8.0, 1.0, 1.0, 16), "high_freq"),
                                           ((8.0, 0.0, 4.0, 16), "low_freq"), ((8.0, 1.0, 4.0, 16.0), "original")])
def test_invalid_rope_scaling_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(*args)


@pytest.mark.parametrize("text, problem", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("[1, 2]", "holds [1, 2], expected a JSON object"),
    ('{"hidden_size": NaN}', "not strict JSON (NaN is not a JSON number)"),
    ('{"a": 1, "a": 2}', "not strict JSON (repeated key 'a')"),
    ("[" * 100000 + "]" * 100000, "not valid JSON (nested too deeply)"),
])
def test_malformed_config_json_is_named(tmp_path, text, problem):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        LlamaConfig.from_json(path)
    assert str(info.value) == f"{path}: {problem}"


# -- checkpoints ------------------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(n_layer=st.integers(1, 2), n_kv_head=st.integers(1, 2), group=st.integers(1, 3), half_head=st.integers(1, 3),
       intermediate=st.integers(1, 9), vocab=st.integers(1, 20), tied=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_save_load_round_trip(tmp_path_factory, n_layer, n_kv_head, group, half_head, intermediate, vocab, tied, seed):
    n_head = n_kv_head * group
    config = LlamaConfig(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=2 * half_head * n_head,
                         intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=8,
                         tie_word_embeddings=tied)
    state = random_state_dict(config, seed)
    directory = tmp_path_factory.mktemp("ckpt")
    save_state_dict(directory, config, state)
    loaded_config, loaded = load_state_dict(directory)
    assert loaded_config == config
    assert_same_state(loaded, state)
    assert all(a.flags.c_contiguous for a in loaded.values())
    assert ("lm_head.weight" in loaded) == (not tied)


def test_load_float64_and_bf16(tmp_path):
    state = random_state_dict(CONFIG, seed=1)
    bf16 = {name: a.astype(ml_dtypes.bfloat16) for name, a in state.items()}
    _, loaded = load_state_dict(write_checkpoint(tmp_path, bf16), dtype=np.float64)
    assert_same_state(loaded, {name: a.astype(np.float64) for name, a in bf16.items()})
    with pytest.raises(ValueError, match="dtype"):
        load_state_dict(tmp_path, dtype=np.float16)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    state = random_state_dict(CONFIG, seed=2)
    write_sharded(tmp_path, state)
    config, loaded = load_state_dict(tmp_path)
    assert config == CONFIG
    assert_same_state(loaded, state)


def test_single_file_wins_over_an_index_as_in_transformers(tmp_path):
    state = random_state_dict(CONFIG, seed=3)
    write_checkpoint(tmp_path, state)
    write_index(tmp_path, {"model.embed_tokens.weight": "../elsewhere.safetensors"})
    assert_same_state(load_state_dict(tmp_path)[1], state)


def test_hf_sharded_fixture_loads():
    config, state = load_state_dict(DATA / "tiny-llama")
    assert config.n_kv_head == 2 and not config.tie_word_embeddings and state.keys() == state_dict_shapes(config).keys()
    assert all(np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a) for a in state.values())


def test_tied_checkpoints_and_buffers(tmp_path):
    """A tied checkpoint may carry lm_head.weight equal to the embedding; old ones carry rotary inv_freq buffers."""
    state = random_state_dict(TIED, seed=4)
    assert "lm_head.weight" not in state
    tensors = dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"].copy(),
                             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32)})
    assert_same_state(load_state_dict(write_checkpoint(tmp_path / "a", tensors, TIED))[1], state)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    with pytest.raises(ValueError) as info:
        load_state_dict(write_checkpoint(tmp_path / "b", tensors, TIED))
    assert str(info.value) == (f"{tmp_path}/b/model.safetensors: tensor 'lm_head.weight' differs from "
                               "'model.embed_tokens.weight', to which this model ties its LM head")


def test_every_bad_tensor_is_listed_with_the_file(tmp_path):
    state = random_state_dict(CONFIG, seed=5)
    del state["lm_head.weight"], state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)  # as if n_kv_head were 4
    state["model.layers.0.input_layernorm.weight"] = np.zeros(16, np.int64)
    state["model.layers.2.input_layernorm.weight"] = np.zeros(16, np.float32)
    directory = write_checkpoint(tmp_path, state)
    with pytest.raises(ValueError) as info:
        load_state_dict(directory)
    message = str(info.value)
    assert str(directory / "model.safetensors") in message
    for line in ("'model.layers.0.self_attn.k_proj.weight' has shape (16, 16), expected (8, 16)",
                 "'model.layers.0.input_layernorm.weight' has dtype I64, expected BF16 or F16 or F32",
                 "unexpected tensor 'model.layers.2.input_layernorm.weight'",
                 "missing tensor 'model.layers.1.mlp.up_proj.weight' (shape (24, 16))",
                 "missing tensor 'lm_head.weight' (shape (50, 16))"):
        assert line in message


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "directory"])
def test_malformed_safetensors_is_named(tmp_path, damage):
    save_state_dict(tmp_path, CONFIG, random_state_dict(CONFIG, seed=6))
    weights = tmp_path / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 64)
    elif damage == "empty":
        weights.write_bytes(b"")
    else:
        weights.unlink()
        weights.mkdir()
        write_index(tmp_path, {"model.norm.weight": "model.safetensors"})
    with pytest.raises((ValueError, FileNotFoundError), match="model.safetensors"):
        load_state_dict(tmp_path)


def test_missing_files_are_named(tmp_path):
    save_state_dict(tmp_path, CONFIG, random_state_dict(CONFIG, seed=7))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path}: lacks model.safetensors or model.safetensors.index"):
        load_state_dict(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path}/config.json: no such file$"):
        load_state_dict(tmp_path)


def test_random_state_dict_is_deterministic_and_llama_like():
    config = CONFIG.replace(n_embd=64, intermediate_size=256, vocab_size=500, n_layer=4)
    a = random_state_dict(config, seed=9)
    assert_same_state(a, random_state_dict(config, seed=9))
    assert not np.array_equal(a["lm_head.weight"], random_state_dict(config, seed=10)["lm_head.weight"])
    assert np.std(a["model.embed_tokens.weight"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(a["model.layers.0.mlp.down_proj.weight"]) == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    norm = a["model.layers.0.post_attention_layernorm.weight"]
    assert np.mean(norm) == pytest.approx(1.0, abs=0.05) and np.std(norm) > 0.05


# -- hostile indexes --------------------------------------------------------------------------------------

@pytest.fixture
def sharded(tmp_path) -> tuple[Path, dict]:
    write_sharded(tmp_path / "ckpt", random_state_dict(CONFIG, seed=11))
    return tmp_path / "ckpt", json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())


def load_fails(directory: Path, match: str, error: type = ValueError) -> str:
    with pytest.raises(error, match=match) as info:
        load_state_dict(directory)
    assert str(directory) in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("shard, problem", [
    ("../outside.safetensors", 'to "../outside.safetensors", which is not a plain file name'),
    ("/etc/passwd", 'to "/etc/passwd", which is not a plain file name'),
    ("sub/model.safetensors", 'to "sub/model.safetensors", which is not a plain file name'),
    ("", 'to "", which is not a plain file name'), (".", 'to ".", which is not a plain file name'),
    ("..", 'to "..", which is not a plain file name'),
    ("a\\b.safetensors", 'to "a\\\\b.safetensors", which is not a plain file name'),
    ("nul\0.safetensors", 'to "nul\\u0000.safetensors", which has control characters'),
    ("x" * 5000, 'to "' + "x" * 99 + '..., which is longer than 255 bytes'),
])
def test_index_cannot_name_anything_but_a_file_in_the_directory(sharded, shard, problem):
    directory, index = sharded
    (directory.parent / "outside.safetensors").write_bytes((directory / index["weight_map"]["model.norm.weight"])
                                                           .read_bytes())
    index["weight_map"]["model.norm.weight"] = shard
    path = write_index(directory, index["weight_map"])
    with pytest.raises(ValueError) as info:
        load_state_dict(directory)
    assert str(info.value) == f"{path}: field 'weight_map' maps 'model.norm.weight' {problem}"


def test_index_naming_an_absent_file_or_a_directory(sharded):
    directory, index = sharded
    (directory / "sub").mkdir()
    for shard, error, problem in (("absent.safetensors", FileNotFoundError, "no such file"),
                                  ("sub", ValueError, "is not a regular file but a directory")):
        write_index(directory, dict(index["weight_map"], **{"model.norm.weight": shard}))
        load_fails(directory, f"^{directory}/{shard}: {problem}$", error)


@pytest.mark.parametrize("link", ["outside", "loop"])
def test_index_cannot_link_out_of_the_directory_or_in_a_loop(sharded, link):
    directory, index = sharded
    shard = index["weight_map"]["model.norm.weight"]
    outside = directory.parent / "outside.safetensors"
    (directory / shard).rename(outside)
    if link == "loop":
        (directory / "other.safetensors").symlink_to(shard)
        outside = directory / "other.safetensors"
    (directory / shard).symlink_to(outside)
    load_fails(directory, f"^{directory}/{shard}: " + (f"resolves to {directory.parent}/outside.safetensors, outside "
                                                       f"{directory}$" if link == "outside" else
                                                       "cannot be opened \\(Too many levels of symbolic links\\)$"))


def test_hub_snapshot_links_into_blobs_load(tmp_path, monkeypatch):
    """huggingface_hub's layout: snapshot files are links to ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--meta-llama--Tiny"
    weight_map = write_sharded(repo / "blobs", random_state_dict(CONFIG, seed=12))
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ["config.json", "model.safetensors.index.json", *set(weight_map.values())]:
        (snapshot / name).symlink_to(Path("..", "..", "blobs", name))
    assert_same_state(load_state_dict(snapshot)[1], random_state_dict(CONFIG, seed=12))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_state_dict("Tiny")[0] == CONFIG  # a bare name is looked up under meta-llama/


def test_index_cannot_name_one_file_twice(sharded):
    directory, index = sharded
    first = sorted(set(index["weight_map"].values()))[0]
    (directory / "alias.safetensors").symlink_to(first)
    index["weight_map"]["model.norm.weight"] = "alias.safetensors"
    write_index(directory, index["weight_map"])
    load_fails(directory, f"model.safetensors.index.json: names one file twice: 'alias.safetensors' and '{first}'")


@pytest.mark.parametrize("text, problem", [
    ("{", "not valid JSON (Expecting property name enclosed in double quotes at line 1 column 2)"),
    ("[]", "holds [], expected a JSON object"),
    ('{"weight_map": {}}', "field 'weight_map' is {}, expected a map of tensor names to shard files"),
    ('{"metadata": {}}', "field 'weight_map' is missing, expected a JSON object"),
    ('{"weight_map": ["a"]}', 'field \'weight_map\' is ["a"], expected a JSON object'),
    ('{"weight_map": {"a": 1}}', "field 'weight_map' maps 'a' to 1, which is not a string"),
    ('{"weight_map": {"model.norm.weight": "a", "model.norm.weight": "b"}}',
     "not strict JSON (repeated key 'model.norm.weight')"),
])
def test_malformed_index_is_named(sharded, text, problem):
    directory, _ = sharded
    (directory / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ValueError) as info:
        load_state_dict(directory)
    assert str(info.value) == f"{directory}/model.safetensors.index.json: {problem}"


def test_index_too_large_is_refused_unread(sharded, monkeypatch):
    from tilekit import checkpoints as hf
    limit = (sharded[0] / "config.json").stat().st_size         # the index is larger than the config
    monkeypatch.setattr(hf.files, "MAX_JSON_BYTES", limit)
    load_fails(sharded[0], f"model.safetensors.index.json: is larger than {limit} bytes$")


def test_every_tensor_must_sit_in_the_one_shard_the_index_maps_it_to(sharded):
    directory, index = sharded
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    moved = next(name for name, shard in weight_map.items() if shard == shards[0])
    other = next(name for name, shard in weight_map.items() if shard == shards[1])
    write_index(directory, dict(weight_map, **{moved: shards[1], other: shards[0]}))  # two tensors swapped
    load_fails(directory, f"{shards[0]}: does not match model.safetensors.index.json: it holds tensors the index maps "
                          f"elsewhere or not at all '{moved}'; it lacks tensors the index maps to it '{other}'$")
    write_index(directory, {name: shard for name, shard in weight_map.items() if name != moved})  # unlisted
    load_fails(directory, f"{shards[0]}: does not match model.safetensors.index.json: it holds tensors the index maps "
                          f"elsewhere or not at all '{moved}'$")
    write_index(directory, dict(weight_map, **{"model.extra.weight": shards[2]}))  # listed, absent
    load_fails(directory, f"{shards[2]}: does not match model.safetensors.index.json: it lacks tensors the index maps "
                          "to it 'model.extra.weight'$")


def test_a_tensor_in_two_shards_is_refused(sharded):
    directory, index = sharded
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    from safetensors.numpy import load_file
    tensors = load_file(directory / shards[1])
    save_file(dict(tensors, **{name: load_file(directory / shards[0])[name]}), directory / shards[1],
              metadata={"format": "pt"})
    load_fails(directory, f"{shards[1]}: does not match model.safetensors.index.json: it holds tensors the index maps "
                          f"elsewhere or not at all '{name}'$")
