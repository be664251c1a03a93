"""The context a Llama runs is bounded by its rotary tables as well as block_size: a longer sequence is refused,
naming both, before anything launches (MetaArray weights; no GPU). Past Llama 3.1's original window (its
"llama3" RoPE scaling), the model's prefill and decode logits follow the float64 reference (GPU tests)."""

import math

import numpy as np
import pytest

from tests.models.steps import check_past_the_window
from tilekit.kernels.checks import rel_err
from tilekit.models import Llama, LlamaConfig, ReferenceLlama
from tilekit.models.llama import model as llama_model
from tilekit.models.llama.config import RopeScaling, rope_inv_freq
from tilekit.models.llama.weights import random_state_dict
from tilekit.engine.steps import capacity_for

CONFIG = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, vocab_size=1031,
                     max_position_embeddings=256)


def test_the_rotary_tables_bound_the_context(monkeypatch):
    monkeypatch.setattr(llama_model, "ROPE_TABLE_LIMIT", 128)
    model = Llama(CONFIG, meta=True)
    assert model.context_length == 128
    with pytest.raises(ValueError, match=r"ids has 129 positions, more than the 128 positions of the rotary tables "
                                         r"\(block_size 256\)"):
        model.runner.check_range(np.zeros(129, np.int64), "ids")
    assert capacity_for(model, 100, 100)[0] == 128


def test_block_size_bounds_the_context_when_the_tables_cover_it():
    model = Llama(CONFIG, meta=True)
    assert model.context_length == 256
    with pytest.raises(ValueError, match="ids has 257 positions, more than block_size 256"):
        model.runner.check_range(np.zeros(257, np.int64), "ids")


# Llama 3.1's scaling (factor 8, bands 1 / 4) over a 128-position original window, run to 8x past it
LONG = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=256, vocab_size=1031,
                   max_position_embeddings=1024, rope_theta=10000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 128),
                   bos_token_id=1, eos_token_id=2)
MODEL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}              # tests/models/llama/test_model.py's


def test_llama3_scaling_keeps_short_wavelengths_and_stretches_long_ones():
    """Llama 3.1's rule on its own numbers (theta 500000, head_dim 128, factor 8, original window 8192): wavelengths
    under 8192 / 4 kept, over 8192 / 1 stretched 8x, between them a blend that meets both ends."""
    plain = rope_inv_freq(128, 500000.0)
    scaled = rope_inv_freq(128, 500000.0, RopeScaling(8.0, 1.0, 4.0, 8192))
    wavelen = 2 * math.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_array_equal(scaled[short], plain[short])
    np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-15)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()
    assert np.all(np.diff(wavelen[middle] / (2 * math.pi / scaled[middle])) <= 0)   # less kept as wavelengths grow


def test_positions_past_the_original_window_are_where_scaling_matters():
    """The reference's logits past LONG's 128-position window move when the scaling is dropped (so the GPU test
    below checks the scaled rotation there)."""
    state = random_state_dict(LONG, seed=2)
    ids = np.random.default_rng(0).integers(0, LONG.vocab_size, (1, 300))
    scaled = ReferenceLlama(LONG, state).forward(ids)
    plain = ReferenceLlama(LONG.replace(rope_scaling=None), state).forward(ids)
    assert rel_err(plain[:, 128:], scaled[:, 128:]) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama3_scaling_past_the_original_window_matches_the_reference(dtype):
    """A 900-token prompt (7x the window) and four decode steps after it, prefill and decode logits against the
    float64 reference at every position past the window."""
    state = random_state_dict(LONG, seed=2)
    check_past_the_window(Llama(LONG, dtype=dtype, state=state), ReferenceLlama(LONG, state), 900, 128,
                          MODEL_TOL[dtype])
