"""The context a Llama runs is bounded by its rotary tables as well as block_size: a longer sequence is refused,
naming both, before anything launches (MetaArray weights; no GPU)."""

import numpy as np
import pytest

from tilekit.models import Llama, LlamaConfig
from tilekit.models.llama import model as llama_model
from tilekit.models.runtime import capacity_for

CONFIG = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=96, vocab_size=1031,
                     max_position_embeddings=256)


def test_the_rotary_tables_bound_the_context(monkeypatch):
    monkeypatch.setattr(llama_model, "ROPE_TABLE_LIMIT", 128)
    model = Llama(CONFIG, meta=True)
    assert model.context_length == 128
    with pytest.raises(ValueError, match=r"ids has 129 positions, more than the 128 positions of the rotary tables "
                                         r"\(block_size 256\)"):
        model._check_range(np.zeros(129, np.int64), "ids")
    assert capacity_for(model, 100, 100)[0] == 128


def test_block_size_bounds_the_context_when_the_tables_cover_it():
    model = Llama(CONFIG, meta=True)
    assert model.context_length == 256
    with pytest.raises(ValueError, match="ids has 257 positions, more than block_size 256"):
        model._check_range(np.zeros(257, np.int64), "ids")
