"""DeepSeek-V2 tensor names, shapes and checkpoint I/O: our layout (shared experts appended to the fused routed ones,
rotary rows half-split) against the hub's per-expert layout and transformers' fused one."""

import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from tilekit.models.deepseek_v2.config import PRESETS, DeepseekV2Config, YarnScaling
from tilekit.models.deepseek_v2.weights import (load_state_dict, random_state_dict, save_state_dict, state_dict_shapes,
                                                to_file)

CONFIG = DeepseekV2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=40, intermediate_size=24,
                          moe_intermediate_size=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                          first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=8, max_position_embeddings=64, rope_scaling=YarnScaling(4.0, 16),
                          bos_token_id=0, eos_token_id=1)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def write(directory, tensors: dict, config=CONFIG):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    return directory


def test_the_lite_shapes_count_its_published_parameters():
    shapes = state_dict_shapes(PRESETS["deepseek-v2-lite"])
    assert sum(math.prod(s) for s in shapes.values()) == 15_706_484_224
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (66, 2816, 2048)     # 64 routed + 2 shared
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (66, 2048, 1408)
    assert not any("shared_experts" in name for name in shapes)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert "model.layers.0.mlp.gate.weight" not in shapes and "model.layers.0.mlp.gate_proj.weight" in shapes


def test_query_compression_and_tied_head_change_the_names():
    shapes = state_dict_shapes(CONFIG.replace(q_lora_rank=12, tie_word_embeddings=True))
    a = "model.layers.0.self_attn."
    assert (shapes[a + "q_a_proj.weight"], shapes[a + "q_a_layernorm.weight"], shapes[a + "q_b_proj.weight"]) == (
        (12, 16), (12,), (2 * 12, 12))
    assert a + "q_proj.weight" not in shapes and "lm_head.weight" not in shapes


@pytest.mark.parametrize("fused", [False, True])
def test_save_and_load_round_trip_in_both_expert_layouts(tmp_path, fused):
    state = random_state_dict(CONFIG, seed=1)
    if fused:
        write(tmp_path, to_file(CONFIG, state, fused_experts=True))
    else:
        save_state_dict(tmp_path, CONFIG, state)
    config, loaded = load_state_dict(tmp_path)
    assert config == CONFIG
    assert_same_state(loaded, state)


def test_the_file_layout_splits_experts_and_interleaves_rotary_rows():
    """Expert j's gate then up rows; the shared MLP's rows and columns per shared expert; rotary pairs (2i, 2i+1)
    of each head stored as (i, i + P/2) in ours."""
    state = random_state_dict(CONFIG, seed=2)
    hub = to_file(CONFIG, state)
    p, g = "model.layers.1.mlp.", state["model.layers.1.mlp.experts.gate_up_proj"]
    down = state[p + "experts.down_proj"]
    assert p + "experts.gate_up_proj" not in hub and hub[p + "experts.3.up_proj.weight"].shape == (8, 16)
    np.testing.assert_array_equal(hub[p + "experts.2.gate_proj.weight"], g[2, :8])
    np.testing.assert_array_equal(hub[p + "experts.2.up_proj.weight"], g[2, 8:])
    np.testing.assert_array_equal(hub[p + "experts.1.down_proj.weight"], down[1])
    np.testing.assert_array_equal(hub[p + "shared_experts.up_proj.weight"], g[4, 8:])            # S = 1
    np.testing.assert_array_equal(hub[p + "shared_experts.down_proj.weight"], down[4])
    a = "model.layers.0.self_attn."
    q, q_file = state[a + "q_proj.weight"].reshape(2, 12, 16), hub[a + "q_proj.weight"].reshape(2, 12, 16)
    np.testing.assert_array_equal(q_file[:, :8], q[:, :8])
    np.testing.assert_array_equal(q_file[:, 8:], q[:, [8, 10, 9, 11]])
    kv, kv_file = state[a + "kv_a_proj_with_mqa.weight"], hub[a + "kv_a_proj_with_mqa.weight"]
    np.testing.assert_array_equal(kv_file[16:], kv[[16, 18, 17, 19]])


def test_bf16_per_expert_tensors_load(tmp_path):
    import ml_dtypes
    state = random_state_dict(CONFIG, seed=3)
    write(tmp_path, {k: v.astype(ml_dtypes.bfloat16) for k, v in to_file(CONFIG, state).items()})
    _, loaded = load_state_dict(tmp_path)
    np.testing.assert_array_equal(loaded["model.layers.1.mlp.experts.gate_up_proj"],
                                  state["model.layers.1.mlp.experts.gate_up_proj"].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("edit, match", [
    (lambda s: s.pop("model.layers.1.mlp.experts.3.down_proj.weight"), "missing tensor .*experts.3.down_proj"),
    (lambda s: s.update({"model.layers.1.mlp.experts.0.up_proj.weight": np.zeros((8, 15), np.float32)}),
     "experts.0.up_proj.weight' has shape"),
    (lambda s: s.update({"model.layers.1.mlp.experts.down_proj": np.zeros((4, 16, 8), np.float32)}),
     "unexpected tensor 'model.layers.1.mlp.experts.down_proj'"),
    (lambda s: s.pop("model.layers.1.mlp.shared_experts.gate_proj.weight"), "missing tensor .*shared_experts.gate"),
    (lambda s: s.update({"model.layers.0.mlp.experts.0.gate_proj.weight": np.zeros((8, 16), np.float32)}),
     "unexpected tensor 'model.layers.0.mlp.experts.0.gate_proj.weight'"),
    (lambda s: s.pop("model.layers.1.self_attn.kv_b_proj.weight"), "missing tensor .*kv_b_proj"),
])
def test_bad_checkpoints_are_one_clear_error(tmp_path, edit, match):
    tensors = to_file(CONFIG, random_state_dict(CONFIG, seed=4))
    edit(tensors)
    with pytest.raises(ValueError, match=match):
        load_state_dict(write(tmp_path, tensors))


def test_a_tied_head_may_be_stored_if_it_equals_the_embedding(tmp_path):
    tied = CONFIG.replace(tie_word_embeddings=True)
    state = random_state_dict(tied, seed=5)
    tensors = {**to_file(tied, state), "lm_head.weight": state["model.embed_tokens.weight"]}
    assert_same_state(load_state_dict(write(tmp_path, tensors, tied))[1], state)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="differs from 'model.embed_tokens.weight'"):
        load_state_dict(write(tmp_path, tensors, tied))


def test_random_weights_follow_their_stats():
    state = random_state_dict(PRESETS["deepseek-v2-lite"].replace(n_layer=2, vocab_size=64, bos_token_id=None,
                                                                  eos_token_id=None), seed=6)
    assert abs(state["model.layers.1.mlp.gate.weight"].std() * math.sqrt(2048) - 1) < 0.05
    assert abs(state["model.layers.0.self_attn.kv_a_layernorm.weight"].mean() - 1) < 0.05
    assert abs(state["model.layers.1.mlp.experts.down_proj"].std() - 0.01) < 0.001
