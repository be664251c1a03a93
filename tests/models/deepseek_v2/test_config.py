"""DeepSeek-V2 configs: the V2-Lite preset, config.json in both transformers layouts, refusals naming the key."""

import json
import math

import pytest

from tilekit.models.deepseek_v2.config import PRESETS, DeepseekV2Config, YarnScaling, yarn_get_mscale

LITE = PRESETS["deepseek-v2-lite"]

# deepseek-ai/DeepSeek-V2-Lite's config.json as the hub has it (transformers 4.33 layout), training-only keys and
# auto_map left out.
HUB_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


def test_the_lite_preset_is_the_hub_config_in_both_layouts():
    assert DeepseekV2Config.from_hf_dict(HUB_LITE) == LITE == DeepseekV2Config.preset("deepseek-v2-lite")
    v5 = {k: v for k, v in HUB_LITE.items() if k not in ("rope_scaling", "rope_theta")}
    v5.update(head_dim=64, rope_parameters={**HUB_LITE["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000})
    assert DeepseekV2Config.from_hf_dict(v5) == LITE
    assert DeepseekV2Config.from_hf_dict(LITE.to_hf_dict()) == LITE
    with pytest.raises(ValueError, match="deepseek-v2-lite"):
        DeepseekV2Config.preset("deepseek-v2")


def test_mla_softmax_scale_and_yarn_factors():
    """192^-1/2 times (0.1 * 0.707 * ln 40 + 1)^2; mscale = mscale_all_dim leaves cos and sin alone."""
    assert LITE.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, rel=1e-15)
    assert LITE.rope_scaling.cos_sin_factor == 1.0
    v3_style = YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=0.707)
    assert v3_style.cos_sin_factor == pytest.approx(yarn_get_mscale(40, 1.0) / yarn_get_mscale(40, 0.707))
    assert YarnScaling(8.0, 64).cos_sin_factor == yarn_get_mscale(8.0) and YarnScaling(8.0, 64).softmax_factor == 1
    assert YarnScaling(4.0, 64, attention_factor=0.5).cos_sin_factor == 0.5
    assert LITE.replace(rope_scaling=None).softmax_scale == 192 ** -0.5


def test_transformers_defaults_fill_missing_keys():
    d = {k: HUB_LITE[k] for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size",
                                  "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                                  "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                  "v_head_dim")}
    config = DeepseekV2Config.from_hf_dict(d)
    assert (config.q_lora_rank, config.first_k_dense_replace, config.max_position_embeddings, config.rope_scaling,
            config.bos_token_id, config.eos_token_id) == (1536, 0, 2048, None, 1, 2)
    with pytest.raises(ValueError, match="field 'kv_lora_rank' is missing"):
        DeepseekV2Config.from_hf_dict({k: v for k, v in d.items() if k != "kv_lora_rank"})


def test_a_top_level_original_context_wins_as_in_transformers():
    config = DeepseekV2Config.from_hf_dict({**HUB_LITE, "original_max_position_embeddings": 2048})
    assert config.rope_scaling.original_max_position_embeddings == 2048


@pytest.mark.parametrize("key, value", [
    ("model_type", "deepseek_v3"), ("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True),
    ("num_key_value_heads", 8), ("topk_method", "group_limited_greedy"), ("topk_method", None),
    ("norm_topk_prob", True), ("scoring_func", "sigmoid"), ("moe_layer_freq", 2), ("n_shared_experts", 0),
    ("rope_scaling", {"type": "linear", "factor": 2.0}), ("rope_scaling", {"type": "yarn", "factor": 2.0, "foo": 1}),
    ("rope_scaling", [1, 2]),
])
def test_variants_it_does_not_compute_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"field '(rope_scaling.)?({key}|type|foo)' is .*(does not compute|expected)"):
        DeepseekV2Config.from_hf_dict({**HUB_LITE, key: value})


@pytest.mark.parametrize("changes, match", [
    (dict(n_head=0), "n_head must be a positive int"), (dict(kv_lora_rank=512.0), "kv_lora_rank must be a positive"),
    (dict(q_lora_rank=True), "q_lora_rank must be a positive int"), (dict(n_embd=2047), "divisible by n_head"),
    (dict(qk_rope_head_dim=63), "must be even"), (dict(num_experts_per_tok=65), "exceeds n_routed_experts"),
    (dict(first_k_dense_replace=28), "first_k_dense_replace"), (dict(first_k_dense_replace=-1), "first_k_dense"),
    (dict(routed_scaling_factor=math.inf), "routed_scaling_factor"), (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(routed_scaling_factor=1e308), r"routed_scaling_factor must lie in \(0, 1000\]"),
    (dict(eos_token_id=102400), "token ids"), (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    (dict(rope_scaling={"factor": 40}), "rope_scaling must be a YarnScaling"),
    (dict(rope_theta=1.0), "rope_theta 1.0 leaves YaRN's correction range undefined"),
    (dict(rope_theta=5e-324, rope_scaling=None), "rope_theta 5e-324 gives rotary frequencies that are not finite"),
])
def test_bad_values_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        LITE.replace(**changes)


@pytest.mark.parametrize("changes, match", [
    (dict(factor=0.5), "factor must be >= 1"), (dict(factor=math.nan), "factor must be a finite"),
    (dict(original_max_position_embeddings=4096.0), "original_max_position_embeddings"),
    (dict(beta_fast=0.5), "beta_fast .* must be >= beta_slow"), (dict(mscale=-1.0), "mscale must be None"),
    (dict(attention_factor=math.inf), "attention_factor"), (dict(truncate="yes"), "truncate must be a bool"),
    (dict(mscale_all_dim=1e300), r"mscale_all_dim must be None or a number in \[0, 1000\]"),
    (dict(mscale=math.nan), "mscale must be None"),
])
def test_bad_yarn_values_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        YarnScaling(**{**dict(factor=40.0, original_max_position_embeddings=4096), **changes})


def test_hostile_config_json_is_one_clear_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HUB_LITE, "rope_scaling": {"type": "yarn", "factor": "40"}}))
    with pytest.raises(ValueError, match="field 'rope_scaling.factor' is \"40\", expected a finite number"):
        DeepseekV2Config.from_json(path)
    path.write_text('{"hidden_size": 1, "hidden_size": 2}')
    with pytest.raises(ValueError, match="repeated key 'hidden_size'"):
        DeepseekV2Config.from_json(path)
    path.write_text(json.dumps({**HUB_LITE, "rope_scaling": {**HUB_LITE["rope_scaling"], "beta_fast": 1,
                                                             "beta_slow": 32}}))
    with pytest.raises(ValueError, match=f"{path}: field 'rope_scaling.beta_fast' is 1.0: it must be >= beta_slow"):
        DeepseekV2Config.from_json(path)


@pytest.mark.parametrize("field, where", [("mscale_all_dim", "rope_scaling"), ("mscale", "rope_scaling"),
                                          ("attention_factor", "rope_scaling"), ("routed_scaling_factor", None)])
def test_scale_factors_past_any_model_name_their_field(tmp_path, field, where):
    """1e300 overflowed MLA's softmax factor (an OverflowError traceback) or made every logit non-finite."""
    config = json.loads(json.dumps(HUB_LITE))
    (config[where] if where else config)[field] = 1e300
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    name = f"{where}.{field}" if where else field
    with pytest.raises(ValueError, match=f"{path}: field '{name}' is 1e\\+300, expected a finite number"):
        DeepseekV2Config.from_json(path)


def test_a_config_claiming_millions_of_expert_mlps_is_refused_at_once():
    """n_routed_experts times the layers beyond any model (a loader keeps objects per expert and layer): the field's
    error, not minutes of building load plans."""
    from tilekit.checkpoints import ModelFileError
    with pytest.raises(ModelFileError, match="n_routed_experts.*expert MLPs"):
        DeepseekV2Config.from_hf_dict(dict(HUB_LITE, num_hidden_layers=4096, n_routed_experts=4096))
    assert DeepseekV2Config.from_hf_dict(dict(HUB_LITE, n_routed_experts=256)).n_routed_experts == 256
