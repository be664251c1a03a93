"""The NumPy DeepSeek-V2 and its op references against Hugging Face transformers on the committed tiny checkpoints,
and the identities the GPU model will rest on (absorbed MLA, shared experts as always-chosen experts, rotary
pairs by permuted halves)."""

from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err
from tilekit.kernels.attention import attention_reference
from tilekit.kernels.mla_decode_attention import mla_decode_attention_reference
from tilekit.kernels.moe_down_combine import moe_down_combine_reference
from tilekit.kernels.moe_gate_up import moe_gate_up_reference
from tilekit.kernels.moe_permute import moe_permute_reference
from tilekit.kernels.moe_router import moe_router_reference
from tilekit.kernels.apply_rope import rope_reference
from tilekit.kernels.swiglu_linear import swiglu_reference
from tilekit.models.deepseek_v2.config import YarnScaling, rope_inv_freq
from tilekit.models.deepseek_v2.reference import ReferenceDeepseekV2, rope_interleaved_reference
from tilekit.models.deepseek_v2.weights import random_state_dict

DATA = Path(__file__).parents[2] / "data"
FIXTURES = ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora"]   # V2-Lite-like with YaRN, hub layout; q_lora, tied, fused


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request) -> tuple[ReferenceDeepseekV2, np.ndarray, Path]:
    directory = DATA / request.param
    return ReferenceDeepseekV2.from_pretrained(directory), np.load(directory / "input_ids.npy"), directory


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logits_match_transformers(name, dtype):
    expected = np.load(DATA / name / "logits.npy")
    model = ReferenceDeepseekV2.from_pretrained(DATA / name, dtype=dtype)
    logits = model.forward(np.load(DATA / name / "input_ids.npy"))
    assert logits.dtype == dtype and logits.shape == expected.shape
    assert rel_err(logits, expected) <= 1e-5


def test_generate_greedy_matches_transformers_for_32_tokens(fixture):
    model, ids, directory = fixture
    out = model.generate_greedy(ids, 32)
    np.testing.assert_array_equal(out, np.load(directory / "greedy_ids.npy"))


def test_the_fixture_exercises_yarn():
    """tiny-deepseek-v2's rotary frequencies fall in all three YaRN bands, its cos/sin and softmax factors are not
    1, and dropping the scaling changes its logits."""
    model = ReferenceDeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2")
    cfg = model.config
    ratio = rope_inv_freq(16, cfg.rope_theta, cfg.rope_scaling) / rope_inv_freq(16, cfg.rope_theta)
    assert ratio[0] == 1 and ratio[-1] == 1 / cfg.rope_scaling.factor and np.any((ratio < 1) & (ratio > 0.25))
    assert cfg.rope_scaling.cos_sin_factor != 1 and cfg.rope_scaling.softmax_factor != 1
    ids = np.load(DATA / "tiny-deepseek-v2" / "input_ids.npy")
    unscaled = ReferenceDeepseekV2(cfg.replace(rope_scaling=None), model.state).forward(ids)
    assert rel_err(unscaled, np.load(DATA / "tiny-deepseek-v2" / "logits.npy")) > 1e-4


def test_positions_past_the_original_window_are_where_yarn_matters():
    """tiny-deepseek-v2's config with room for 1024 positions (YaRN over a 64-position window): the reference's
    logits past the window move when the scaling is dropped (test_model.py checks the GPU model there)."""
    cfg = ReferenceDeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2").config.replace(max_position_embeddings=1024)
    state = random_state_dict(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 200))
    scaled = ReferenceDeepseekV2(cfg, state).forward(ids)
    plain = ReferenceDeepseekV2(cfg.replace(rope_scaling=None), state).forward(ids)
    assert cfg.rope_scaling.original_max_position_embeddings == 64 and rel_err(plain[:, 64:], scaled[:, 64:]) > 1e-3


def test_yarn_inv_freq_of_v2_lite():
    """64 rotary dims, base 10^4, original context 4096: frequencies up to floor(10.5) = 10 kept, from
    ceil(22.5) = 23 divided by 40, ramped between."""
    scaled, plain = rope_inv_freq(64, 10000.0, YarnScaling(40.0, 4096)), rope_inv_freq(64, 10000.0)
    np.testing.assert_array_equal(scaled[:11], plain[:11])
    np.testing.assert_allclose(scaled[23:], plain[23:] / 40, rtol=1e-15)
    assert np.all(np.diff(scaled) < 0)


def test_interleaved_rope_is_half_split_rope_on_permuted_features():
    """The GPU model can keep tilekit's half-split RoPE kernel: permute the rotary rows of q_proj and
    kv_a_proj_with_mqa (pairs 2i, 2i+1 -> i, i + D/2) at load, and scores are unchanged."""
    rng = np.random.default_rng(0)
    D, inv_freq = 16, rope_inv_freq(16, 10000.0, YarnScaling(4.0, 64))
    q, k = rng.standard_normal((2, 1, 3, 5, D))
    positions = np.arange(5)
    perm = np.concatenate([np.arange(0, D, 2), np.arange(1, D, 2)])
    np.testing.assert_allclose(rope_reference(q[..., perm], positions, inv_freq),
                               rope_interleaved_reference(q, positions, inv_freq)[..., perm], rtol=1e-12, atol=1e-12)
    scores = rope_interleaved_reference(q, positions, inv_freq) @ np.swapaxes(
        rope_interleaved_reference(k, positions, inv_freq), -1, -2)
    permuted = rope_reference(q[..., perm], positions, inv_freq) @ np.swapaxes(
        rope_reference(k[..., perm], positions, inv_freq), -1, -2)
    np.testing.assert_allclose(permuted, scores, rtol=1e-12, atol=1e-12)


def test_absorbed_mla_decode_equals_mla_on_decompressed_keys():
    """q_nope . (W_UK c) = (q_nope W_UK) . c and p (W_UV c) = W_UV (p c): mla_decode_attention's latent output
    up-projected by W_UV is the plain attention of the last token."""
    rng = np.random.default_rng(1)
    H, dn, dr, dv, R, n = 4, 16, 8, 12, 32, 9
    c, k_pe = rng.standard_normal((n, R)), rng.standard_normal((n, dr))
    q_nope, q_pe = rng.standard_normal((H, dn)), rng.standard_normal((H, dr))
    w_kv_b = rng.standard_normal((H, dn + dv, R)) / np.sqrt(R)             # kv_b_proj.weight as (H, dn + dv, R)
    w_uk, w_uv = w_kv_b[:, :dn], w_kv_b[:, dn:]
    k = np.concatenate([np.einsum("hdr,nr->hnd", w_uk, c), np.broadcast_to(k_pe, (H, n, dr))], -1)
    v = np.einsum("hdr,nr->hnd", w_uv, c)
    q = np.concatenate([q_nope, q_pe], -1)[:, None]
    plain = attention_reference(q[None], k[None], v[None], causal=True, scale=0.3)[0, :, 0]
    q_c = np.einsum("hd,hdr->hr", q_nope, w_uk)
    latent = mla_decode_attention_reference(q_c[None, :, None], q_pe[None, :, None], c[None], k_pe[None],
                                            np.array([n]), scale=0.3)[0, :, 0]
    np.testing.assert_allclose(np.einsum("hdr,hr->hd", w_uv, latent), plain, rtol=1e-12, atol=1e-12)


def test_shared_experts_are_experts_every_token_chooses_with_weight_one():
    """A shared MLP of width S * I equals S more experts of width I, appended and chosen by every token with weight
    1: the GPU model's grouped GEMM serves routed and shared experts at once."""
    rng = np.random.default_rng(2)
    M, C, I, E, S, k = 7, 16, 8, 6, 2, 3
    x, gate = rng.standard_normal((M, C)), rng.standard_normal((E, C))
    gate_up, down = rng.standard_normal((E, 2 * I, C)) / 4, rng.standard_normal((E, C, I)) / 4
    shared_gate, shared_up, shared_down = (rng.standard_normal(s) / 4 for s in ((S * I, C), (S * I, C), (C, S * I)))
    ids, w = moe_router_reference(x, gate, k, scale=1.5)
    routed = moe_down_combine_reference(moe_gate_up_reference(x, gate_up, ids), down, ids, w)
    shared = swiglu_reference(x @ shared_gate.T, x @ shared_up.T) @ shared_down.T
    all_gate_up = np.concatenate([gate_up, np.stack([np.concatenate([shared_gate[j * I:(j + 1) * I],
                                                                     shared_up[j * I:(j + 1) * I]]) for j in range(S)])])
    all_down = np.concatenate([down, np.stack([shared_down[:, j * I:(j + 1) * I] for j in range(S)])])
    ids, w = moe_router_reference(x, gate, k, scale=1.5, shared=S)
    assert ids.shape == (M, k + S) and np.all(ids[:, k:] == [E, E + 1]) and np.all(w[:, k:] == 1)
    both = moe_down_combine_reference(moe_gate_up_reference(x, all_gate_up, ids), all_down, ids, w)
    np.testing.assert_allclose(both, routed + shared, rtol=1e-12, atol=1e-12)


def test_router_reference_orders_by_probability_and_breaks_ties_to_the_lower_index():
    x = np.array([[1.0, 0.0], [0.0, 0.0]])
    gate = np.array([[0.0, 1.0], [2.0, 0.0], [2.0, 0.0], [1.0, 0.0]])
    ids, w = moe_router_reference(x, gate, 3, renormalize=True, scale=2.0)
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    np.testing.assert_allclose(w.sum(-1), 2.0)
    np.testing.assert_allclose(w[1], [2 / 3] * 3)


def test_permute_reference_is_a_stable_sort_by_expert():
    ids = np.array([[2, 0], [0, 1], [2, 3]], np.int32)
    offsets, order = moe_permute_reference(ids, 5)
    assert offsets.tolist() == [0, 2, 3, 5, 6, 6] and order.tolist() == [1, 2, 3, 0, 4, 5]


def test_moe_is_a_per_token_sum_over_its_experts():
    rng = np.random.default_rng(3)
    x, ids = rng.standard_normal((4, 8)), np.array([[0, 2], [1, 0], [2, 2], [3, 1]])
    w, gate_up, down = rng.random((4, 2)), rng.standard_normal((4, 10, 8)), rng.standard_normal((4, 8, 5))
    out = moe_down_combine_reference(moe_gate_up_reference(x, gate_up, ids), down, ids, w)
    for t in range(4):
        expected = sum(w[t, s] * swiglu_reference(x[t] @ gate_up[e, :5].T, x[t] @ gate_up[e, 5:].T) @ down[e].T
                       for s, e in enumerate(ids[t]))
        np.testing.assert_allclose(out[t], expected, rtol=1e-12)


def test_forward_is_causal_and_rows_are_independent(fixture):
    model, ids, _ = fixture
    logits = model.forward(ids)
    changed = ids.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % model.config.vocab_size
    np.testing.assert_allclose(model.forward(changed)[:, :10], logits[:, :10], rtol=0, atol=1e-12)
    np.testing.assert_allclose(model.forward(ids[1:]), logits[1:], rtol=0, atol=1e-12)


def test_constructor_validates_state_and_dtype():
    model = ReferenceDeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2-qlora")
    state = random_state_dict(model.config, seed=0)
    with pytest.raises(ValueError, match="dtype"):
        ReferenceDeepseekV2(model.config, state, dtype=np.float16)
    del state["model.layers.1.mlp.experts.gate_up_proj"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.gate_up_proj"):
        ReferenceDeepseekV2(model.config, state)
