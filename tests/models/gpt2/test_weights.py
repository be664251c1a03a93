"""Hugging Face GPT-2 checkpoint I/O: round trips, name variants, every way a checkpoint can be wrong."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from tilekit.models.gpt2.weights import (check_state_dict, load_state_dict, random_state_dict, resolve,
                                       save_state_dict, state_dict_shapes)
from tilekit.models.gpt2.config import GPTConfig

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=8)


def write_checkpoint(directory: Path, tensors: dict, config: GPTConfig = CONFIG) -> Path:
    """A checkpoint written by hand, tensor names exactly as given."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@settings(max_examples=15, deadline=None)
@given(n_layer=st.integers(1, 3), n_head=st.integers(1, 3), head_dim=st.integers(1, 5),
       vocab_size=st.integers(1, 40), block_size=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_save_load_round_trip(n_layer, n_head, head_dim, vocab_size, block_size, seed):
    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, vocab_size=vocab_size,
                       block_size=block_size)
    state = random_state_dict(config, seed)
    with tempfile.TemporaryDirectory() as tmp:
        save_state_dict(tmp, config, state)
        loaded_config, loaded = load_state_dict(tmp)
    assert loaded_config == config
    assert_same_state(loaded, state)
    assert all(a.flags.c_contiguous for a in loaded.values())


def test_load_float64(tmp_path):
    state = random_state_dict(CONFIG, seed=1)
    save_state_dict(tmp_path, CONFIG, state)
    _, loaded = load_state_dict(tmp_path, dtype=np.float64)
    assert_same_state(loaded, {name: a.astype(np.float64) for name, a in state.items()})
    with pytest.raises(ValueError, match="dtype"):
        load_state_dict(tmp_path, dtype=np.float16)


def test_saved_names_carry_the_transformer_prefix(tmp_path):
    save_state_dict(tmp_path, CONFIG, random_state_dict(CONFIG, seed=2))
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert sorted(f.keys()) == sorted("transformer." + name for name in state_dict_shapes(CONFIG))


def test_unprefixed_names_buffers_and_tied_lm_head_load(tmp_path):
    """The hub's gpt2 layout: GPT2Model names, causal-mask buffers, maybe an lm_head equal to wte."""
    state = random_state_dict(CONFIG, seed=3)
    tensors = dict(state, **{"h.0.attn.bias": np.ones((1, 1, 8, 8), np.float32),
                             "h.1.attn.masked_bias": np.array(-1e4, np.float32),
                             "lm_head.weight": state["wte.weight"].copy()})
    _, loaded = load_state_dict(write_checkpoint(tmp_path, tensors))
    assert_same_state(loaded, state)


def test_random_state_dict_is_deterministic_and_gpt2_like():
    config = GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=500, block_size=32)
    a, b = random_state_dict(config, seed=5), random_state_dict(config, seed=5)
    assert_same_state(a, b)
    assert not np.array_equal(a["wte.weight"], random_state_dict(config, seed=6)["wte.weight"])
    assert_same_state({name: x.astype(np.float32) for name, x in random_state_dict(config, 5, np.float64).items()},
                      a)  # the same draws, only rounded
    assert np.std(a["wte.weight"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(a["h.0.mlp.c_proj.weight"]) == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    assert np.mean(a["h.0.ln_1.weight"]) == pytest.approx(1.0, abs=0.05)
    assert 0 < np.std(a["h.0.attn.c_attn.bias"]) and 0 < np.std(a["ln_f.bias"])


def broken(state: dict, name: str, how: str) -> dict:
    state = dict(state)
    if how == "missing":
        del state[name]
    elif how == "shape":
        state[name] = np.zeros(state[name].shape[:-1] + (state[name].shape[-1] + 1,), np.float32)
    else:
        state[name] = np.zeros(3, np.float32)
    return state


@pytest.mark.parametrize("name, how, message", [
    ("h.1.mlp.c_fc.bias", "missing", "missing tensor 'h.1.mlp.c_fc.bias'"),
    ("wpe.weight", "shape", r"'wpe.weight' has shape \(8, 17\), expected \(8, 16\)"),
    ("h.2.ln_1.weight", "unexpected", "unexpected tensor 'h.2.ln_1.weight'"),
])
def test_bad_tensors_are_named_with_the_file(tmp_path, name, how, message):
    directory = write_checkpoint(tmp_path, broken(random_state_dict(CONFIG, seed=4), name, how))
    with pytest.raises(ValueError, match=message) as info:
        load_state_dict(directory)
    assert str(directory / "model.safetensors") in str(info.value)


def test_untied_lm_head_is_rejected(tmp_path):
    state = random_state_dict(CONFIG, seed=4)
    directory = write_checkpoint(tmp_path, dict(state, **{"lm_head.weight": state["wte.weight"] + 1}))
    with pytest.raises(ValueError, match="model.safetensors: tensor 'lm_head.weight' differs from 'wte.weight', to "
                                         "which this model ties its LM head"):
        load_state_dict(directory)


def test_names_with_and_without_the_prefix_are_not_mixed(tmp_path):
    """A tensor under both names is one too many; with the prefix on some names, the others are unexpected."""
    state = random_state_dict(CONFIG, seed=4)
    tensors = {"transformer." + n: a for n, a in state.items()} | {"wpe.weight": state["wpe.weight"]}
    with pytest.raises(ValueError) as info:
        load_state_dict(write_checkpoint(tmp_path, tensors))
    assert str(info.value) == (f"{tmp_path}/model.safetensors: does not match {CONFIG}:\n"
                               "  unexpected tensor 'wpe.weight'")


def test_truncated_safetensors_is_named(tmp_path):
    save_state_dict(tmp_path, CONFIG, random_state_dict(CONFIG, seed=4))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_is_named(tmp_path, missing):
    save_state_dict(tmp_path, CONFIG, random_state_dict(CONFIG, seed=4))
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_state_dict(tmp_path)


def test_check_state_dict_rejects_non_float_arrays():
    state = random_state_dict(CONFIG, seed=4)
    state["ln_f.bias"] = state["ln_f.bias"].astype(np.int32)
    with pytest.raises(ValueError, match="tensor 'ln_f.bias' has dtype I32, expected BF16 or F16 or F32 or F64"):
        check_state_dict(CONFIG, state)


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return tmp_path / "hf"


def cache_snapshot(hub: Path, repo_id: str, revision: str, state: dict) -> Path:
    """A hub-cache snapshot laid out as huggingface_hub does: files are links into blobs/."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    blobs = repo / "blobs" / revision
    save_state_dict(blobs, CONFIG, state)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).symlink_to(blobs / name)
    return snapshot


def test_resolve_finds_the_hub_cache_and_prefers_refs_main(hf_home):
    hub = hf_home / "hub"
    main = cache_snapshot(hub, "openai-community/gpt2", "aaa111", random_state_dict(CONFIG, seed=7))
    cache_snapshot(hub, "openai-community/gpt2", "bbb222", random_state_dict(CONFIG, seed=8))  # newer, not main
    (hub / "models--openai-community--gpt2" / "refs").mkdir()
    (hub / "models--openai-community--gpt2" / "refs" / "main").write_text("aaa111\n")
    assert resolve("gpt2").directory == main
    assert resolve("openai-community/gpt2").directory == main
    _, state = load_state_dict("gpt2")
    assert_same_state(state, random_state_dict(CONFIG, seed=7))


def test_resolve_without_refs_takes_a_complete_snapshot(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "elsewhere"))
    snapshot = cache_snapshot(hf_home / "elsewhere", "gpt2", "ccc333", random_state_dict(CONFIG, seed=9))
    (snapshot.parent / "ddd444").mkdir()  # a snapshot that only has some other file
    assert resolve("gpt2").directory == snapshot


def test_resolve_reports_what_it_searched(hf_home, tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        resolve("gpt2")
    assert "models--gpt2" in str(info.value) and "models--openai-community--gpt2" in str(info.value)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        resolve(tmp_path / "no-such-dir")


@pytest.mark.parametrize("field,value", [("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True),
                                         ("n_inner", 100), ("scale_attn_weights", False)])
def test_unsupported_gpt2_variants_are_refused(field, value):
    from tilekit.models.gpt2.config import GPTConfig
    d = GPTConfig.preset("gpt2").to_hf_dict()
    d[field] = value
    with pytest.raises(ValueError, match=field):
        GPTConfig.from_hf_dict(d)


def test_written_config_names_the_end_of_text_token():
    from tilekit.models.gpt2.config import GPTConfig
    d = GPTConfig.preset("gpt2").to_hf_dict()
    assert d["eos_token_id"] == d["bos_token_id"] == 50256
    assert GPTConfig.from_hf_dict(d) == GPTConfig.preset("gpt2")


def test_block_params_name_every_block_tensor_in_field_order():
    """GPT builds Block(*tensors in BLOCK_PARAMS order) and writes them back under the same names."""
    import dataclasses

    from tilekit.models.gpt2.model import BLOCK_PARAMS, Block
    names = {n.removeprefix("h.0.") for n in state_dict_shapes(GPTConfig.preset("gpt2")) if n.startswith("h.0.")}
    assert sorted(BLOCK_PARAMS) == sorted(names) and len(BLOCK_PARAMS) == len(set(BLOCK_PARAMS))
    fields = [f.name for f in dataclasses.fields(Block)]
    stems = [n.replace("attn.c_attn", "attn").replace("attn.c_proj", "proj").replace("mlp.c_fc", "fc")
             .replace("mlp.c_proj", "mlp_proj").replace(".weight", "_w").replace(".bias", "_b") for n in BLOCK_PARAMS]
    assert stems == fields


@pytest.mark.parametrize("field, value", [("n_layer", 10 ** 9), ("n_embd", 1 << 30), ("vocab_size", 1 << 40)])
def test_implausible_sizes_in_a_config_are_refused(field, value):
    """A hostile config.json cannot make the shape checks run for hours."""
    with pytest.raises(ValueError, match=f"{field} = {value} is larger than any model"):
        GPTConfig(**{field: value, **({"n_head": 1} if field == "n_embd" else {})})
