"""The NumPy Llama and its op references against Hugging Face transformers on the committed tiny checkpoints."""

from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err
from tilekit.kernels.attention import attention_reference
from tilekit.models.llama.weights import random_state_dict
from tilekit.models.llama.config import LlamaConfig, RopeScaling
from tilekit.kernels.rms_norm import rms_norm_reference
from tilekit.kernels.apply_rope import rope_reference
from tilekit.kernels.swiglu_linear import swiglu_reference
from tilekit.models.llama.config import rope_inv_freq
from tilekit.models.llama.reference import ReferenceLlama

DATA = Path(__file__).resolve().parents[2] / "data"
FIXTURES = ["tiny-llama", "tiny-llama-tied"]  # GQA + llama3 rope + untied, sharded; MQA + plain rope + tied


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request) -> tuple[ReferenceLlama, np.ndarray, Path]:
    directory = DATA / request.param
    return ReferenceLlama.from_pretrained(directory), np.load(directory / "input_ids.npy"), directory


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logits_match_transformers(name, dtype):
    expected = np.load(DATA / name / "logits.npy")
    logits = ReferenceLlama.from_pretrained(DATA / name, dtype=dtype).forward(np.load(DATA / name / "input_ids.npy"))
    assert logits.dtype == dtype and logits.shape == expected.shape
    assert rel_err(logits, expected) <= 1e-5


def test_the_fixture_exercises_rope_scaling():
    """tiny-llama's frequencies fall in all three llama3 bands, and dropping the scaling changes its logits."""
    directory = DATA / "tiny-llama"
    model, ids = ReferenceLlama.from_pretrained(directory), np.load(directory / "input_ids.npy")
    cfg = model.config
    ratio = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) / rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    factor = cfg.rope_scaling.factor
    assert ratio[0] == 1 and ratio[-1] == 1 / factor and np.any((ratio < 1) & (ratio > 1 / factor))
    unscaled = ReferenceLlama(cfg.replace(rope_scaling=None), model.state).forward(ids)
    assert rel_err(unscaled, np.load(directory / "logits.npy")) > 1e-4


def test_generate_greedy_matches_transformers(fixture):
    model, ids, directory = fixture
    out = model.generate_greedy(ids, 8)
    np.testing.assert_array_equal(out, np.load(directory / "greedy_ids.npy"))
    for t in range(ids.shape[1], out.shape[1]):  # every new token is the argmax given everything before it
        np.testing.assert_array_equal(out[:, t], model.forward(out[:, :t])[:, -1].argmax(-1))
    np.testing.assert_array_equal(model.generate_greedy(ids, 0), ids)


def test_forward_is_causal_and_rows_are_independent(fixture):
    model, ids, _ = fixture
    logits = model.forward(ids)
    changed = ids.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % model.config.vocab_size
    np.testing.assert_allclose(model.forward(changed)[:, :10], logits[:, :10], rtol=0, atol=1e-12)
    np.testing.assert_allclose(model.forward(ids[1:]), logits[1:], rtol=0, atol=1e-12)


def test_limits_and_bad_ids_are_named():
    model = ReferenceLlama.from_pretrained(DATA / "tiny-llama-tied")
    ids = np.zeros((1, 60), np.int64)
    with pytest.raises(ValueError, match="block_size 64"):
        model.generate_greedy(ids, 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_greedy(ids, -1)
    for bad, error in [(np.zeros((1, 4), np.float32), TypeError), (np.array([[0, 259]]), ValueError),
                       (np.zeros((1, 65), np.int64), ValueError), (np.zeros(3, np.int64), ValueError)]:
        with pytest.raises(error, match="ids"):
            model.forward(bad)


def test_constructor_validates_state_and_dtype():
    config = LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, intermediate_size=12, vocab_size=11,
                         max_position_embeddings=4)
    state = random_state_dict(config, seed=0)
    assert ReferenceLlama(config, state, dtype=np.float32).forward(np.array([[1, 2, 3]])).shape == (1, 3, 11)
    with pytest.raises(ValueError, match="dtype"):
        ReferenceLlama(config, state, dtype=np.float16)
    del state["model.layers.0.mlp.gate_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.weight"):
        ReferenceLlama(config, state)


# -- op references ----------------------------------------------------------------------------------------

def test_rms_norm_reference():
    x = np.random.default_rng(0).standard_normal((3, 5, 32)) * 4
    w = np.linspace(0.5, 1.5, 32)
    y = rms_norm_reference(x, w, 1e-6)
    np.testing.assert_allclose(np.sqrt(np.mean((y / w) ** 2, axis=-1)), 1, rtol=1e-6)
    np.testing.assert_allclose(rms_norm_reference(np.zeros((2, 32)), w, 1e-6), 0)


def test_rope_reference_rotates_half_pairs_by_position():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 2, 1, 16))  # (B=1, H=2, T=1, D=16) each
    inv_freq = rope_inv_freq(16, 10000.0)
    np.testing.assert_allclose(rope_reference(q, np.zeros((1, 1, 1)), inv_freq), q)  # position 0: identity
    # Attention scores depend only on the distance between positions.
    scores = [np.sum(rope_reference(q, np.full((1, 1, 1), m), inv_freq) * rope_reference(k, np.full((1, 1, 1), n),
                                                                                          inv_freq), -1)
              for m, n in ((7, 3), (24, 20))]
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-12)
    # Feature i and i + D/2 rotate together by position * inv_freq[i].
    x = np.zeros(16)
    x[2] = 1
    y = rope_reference(x, 5, inv_freq)
    np.testing.assert_allclose([y[2], y[10]], [np.cos(5 * inv_freq[2]), np.sin(5 * inv_freq[2])])
    assert np.count_nonzero(y) == 2


def test_rope_inv_freq_llama3_bands():
    """Llama 3.1 8B: wavelengths under 8192 / 4 kept, over 8192 / 1 divided by 8, smooth between."""
    scaling = RopeScaling(8.0, 1.0, 4.0, 8192)
    plain, scaled = rope_inv_freq(128, 500000.0), rope_inv_freq(128, 500000.0, scaling)
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 2048, wavelen > 8192
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8)
    medium = ~high & ~low
    assert medium.any() and np.all((scaled[medium] < plain[medium]) & (scaled[medium] > plain[medium] / 8))
    assert np.all(np.diff(scaled) < 0)  # still decreasing: the interpolation joins both ends


def test_attention_reference_shares_kv_heads_between_query_groups():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 4, 6, 8)), rng.standard_normal((2, 2, 6, 8)), rng.standard_normal((2, 2, 6, 8))
    out = attention_reference(q, k, v)
    for h in range(4):
        np.testing.assert_allclose(out[:, h], attention_reference(q[:, h:h + 1], k[:, h // 2:h // 2 + 1],
                                                                  v[:, h // 2:h // 2 + 1])[:, 0])


def test_swiglu_reference():
    gate = np.array([-1000.0, -2.0, 0.0, 1.5, 1000.0])
    up = np.array([3.0, 2.0, 5.0, -1.0, 2.0])
    with np.errstate(all="raise"):
        y = swiglu_reference(gate, up)
    np.testing.assert_allclose(y, [0.0, -2 / (1 + np.exp(2)) * 2, 0.0, -1.5 / (1 + np.exp(-1.5)), 2000.0], rtol=1e-12)
