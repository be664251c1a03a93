"""The NumPy GPT-2 against Hugging Face transformers' logits for the committed tiny checkpoint."""

from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err
from tilekit.models.gpt2.weights import random_state_dict
from tilekit.models.gpt2.config import GPTConfig
from tilekit.models.gpt2.reference import ReferenceGPT

TINY = Path(__file__).resolve().parents[2] / "data" / "tiny-gpt2"


@pytest.fixture(scope="module")
def ids() -> np.ndarray:
    return np.load(TINY / "input_ids.npy")


@pytest.fixture(scope="module")
def model() -> ReferenceGPT:
    return ReferenceGPT.from_pretrained(TINY)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_logits_match_transformers(ids, dtype):
    expected = np.load(TINY / "logits.npy")
    logits = ReferenceGPT.from_pretrained(TINY, dtype=dtype).forward(ids)
    assert logits.dtype == dtype and logits.shape == expected.shape
    assert rel_err(logits, expected) <= 1e-5


def test_forward_is_causal_and_rows_are_independent(model, ids):
    logits = model.forward(ids)
    changed = ids.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % model.config.vocab_size
    np.testing.assert_allclose(model.forward(changed)[:, :10], logits[:, :10], rtol=0, atol=1e-12)
    np.testing.assert_allclose(model.forward(ids[1:]), logits[1:], rtol=0, atol=1e-12)


def test_generate_greedy(model, ids):
    out = model.generate_greedy(ids, 4)
    assert out.shape == (2, 20) and np.array_equal(out[:, :16], ids)
    np.testing.assert_array_equal(out[:, 16], model.forward(ids)[:, -1].argmax(-1))
    for t in range(17, 20):  # every new token is the argmax given everything before it
        np.testing.assert_array_equal(out[:, t], model.forward(out[:, :t])[:, -1].argmax(-1))
    np.testing.assert_array_equal(model.generate_greedy(ids, 4), out)
    np.testing.assert_array_equal(model.generate_greedy(ids, 0), ids)


def test_generate_greedy_rejects_running_past_block_size(model, ids):
    with pytest.raises(ValueError, match="block_size"):
        model.generate_greedy(ids, model.config.block_size - ids.shape[1] + 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_greedy(ids, -1)


@pytest.mark.parametrize("bad, error", [
    (np.zeros((1, 4), np.float32), TypeError),
    (np.zeros(4, np.int64), ValueError),
    (np.zeros((1, 0), np.int64), ValueError),
    (np.array([[0, -1]]), ValueError),
    (np.array([[0, 1031]]), ValueError),
    (np.zeros((1, 65), np.int64), ValueError),
])
def test_bad_ids_are_named(model, bad, error):
    with pytest.raises(error, match="ids"):
        model.forward(bad)
    with pytest.raises(error, match="ids"):
        model.generate_greedy(bad, 1)


def test_constructor_validates_state_and_dtype():
    config = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4)
    state = random_state_dict(config, seed=0)
    ReferenceGPT(config, state, dtype=np.float32).forward(np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="dtype"):
        ReferenceGPT(config, state, dtype=np.float16)
    del state["h.0.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match="h.0.mlp.c_fc.bias"):
        ReferenceGPT(config, state)
