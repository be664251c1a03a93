"""from_pretrained / save_pretrained / random init of every family, their weights on the CPU (NumPy standing in for
CuPy: tests/_numpy_cupy.py): the checkpoint's tensors land in the model's own arrays (Llama's q, k and v in rows of
one fused matrix) in the model's dtype, nothing is allocated for a file that does not match, and a saved model
reads back as Hugging Face writes it. The GPU tests run the same paths on CuPy."""

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tilekit.autotune.arrays import numpy_dtype
from tilekit.models import GPT, GPTConfig, Llama, LlamaConfig, families

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("name, cls", [("tiny-llama", Llama), ("tiny-llama-tied", Llama), ("tiny-gpt2", GPT)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_from_pretrained_fills_the_models_own_arrays(numpy_cupy, name, cls, dtype):
    model = families.load_model(DATA / name, dtype=dtype)
    config, host = cls.weights.load_state_dict(DATA / name, dtype=np.float64)
    assert type(model) is cls and model.config == config and model.checkpoint.directory == DATA / name
    assert model.params.keys() == host.keys()
    for key, array in model.params.items():
        assert array.dtype == numpy_dtype(dtype)
        assert np.array_equal(array, host[key].astype(numpy_dtype(dtype))), key
    if cls is Llama:
        p = "model.layers.1.self_attn."
        assert np.array_equal(model.blocks[1].qkv, np.concatenate([model.params[p + f"{n}_proj.weight"]
                                                                  for n in "qkv"]))
        assert all(np.shares_memory(model.params[p + f"{n}_proj.weight"], model.blocks[1].qkv) for n in "qkv")
        assert (model.head is model.embed) == config.tie_word_embeddings
    else:
        assert model.blocks[1].attn_w is model.params["h.1.attn.c_attn.weight"]


def test_nothing_is_allocated_for_a_checkpoint_that_does_not_match(numpy_cupy, tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(Llama, "_allocate", lambda self: made.append(self))
    config = json.loads((DATA / "tiny-llama-tied" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=97)))
    (tmp_path / "model.safetensors").symlink_to(DATA / "tiny-llama-tied" / "model.safetensors")
    with pytest.raises(ValueError, match="resolves to .*, outside"):
        Llama.from_pretrained(tmp_path)                    # a link out of the directory
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").write_bytes((DATA / "tiny-llama-tied" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError) as info:
        Llama.from_pretrained(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}/model.safetensors: does not match LlamaConfig(")
    assert "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (96, 64), expected (97, 64)" in str(info.value)
    assert made == []


@pytest.mark.parametrize("cls, config", [(Llama, LlamaConfig(
    n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=40, vocab_size=60, max_position_embeddings=16,
    tie_word_embeddings=False, eos_token_id=(3, 4))), (GPT, GPTConfig(
        n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=8, eos_token_id=49))])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_save_pretrained_writes_the_models_dtype_and_reads_back(numpy_cupy, tmp_path, cls, config, dtype):
    model = cls(config, dtype=dtype, seed=5)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["torch_dtype"] == dtype and cls.config_class.from_hf_dict(saved) == config
    prefix = cls.weights.PREFIX
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert sorted(f.keys()) == sorted(prefix + n for n in model.params)
        for name, array in model.params.items():
            assert np.array_equal(f.get_tensor(prefix + name).view(np.uint8), array.view(np.uint8)), name
    again = cls.from_pretrained(tmp_path, dtype=dtype)
    assert again.config == config
    for name, array in model.params.items():
        assert np.array_equal(again.params[name].view(np.uint8), array.view(np.uint8)), name


@pytest.mark.parametrize("cls, config", [(Llama, LlamaConfig(
    n_layer=4, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=256, vocab_size=500, max_position_embeddings=16)),
    (GPT, GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=500, block_size=32))])
def test_random_weights_are_drawn_per_tensor_as_the_family_scales_them(numpy_cupy, cls, config):
    a, b, c = (cls(config, dtype="float32", seed=s).params for s in (7, 7, 8))
    stats = {name: cls.weights.weight_stats(config, name) for name in a}
    for name, array in a.items():
        assert np.array_equal(array, b[name]) and not np.array_equal(array, c[name]), name
        mean, std = stats[name]
        assert abs(array.mean() - mean) < 5 * std / np.sqrt(array.size) + 1e-7, name
        assert array.size < 64 or abs(array.std() / std - 1) < 0.35, name
    assert len({s for s in stats.values()}) >= 3                    # norms, projections, residual projections


def test_a_state_dict_in_any_float_dtype_is_copied_and_converted(numpy_cupy):
    config = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=10, block_size=4)
    state = GPT.weights.random_state_dict(config, seed=1, dtype=np.float64)
    state["wte.weight"] = state["wte.weight"].astype(ml_dtypes.bfloat16)
    model = GPT(config, dtype="float32", state=state)
    for name, array in state.items():
        assert np.array_equal(model.params[name], array.astype(np.float32)), name
    with pytest.raises(ValueError, match="pass state= or empty=True, not both"):
        GPT(config, state=state, empty=True)
    with pytest.raises(ValueError, match="tensor 'ln_f.bias' has dtype I64, expected BF16 or F16 or F32 or F64"):
        GPT(config, state=dict(state, **{"ln_f.bias": np.zeros(8, np.int64)}))
