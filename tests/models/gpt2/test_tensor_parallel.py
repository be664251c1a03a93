"""Tensor-parallel GPT-2 on the CPU: ranks as threads of a parallel.ThreadGroup, NumPy standing in for CuPy and
for each kernel (numpy_kernels.py), so the model's own sharded step code (c_attn's q, k and v column blocks, the
fixed-point residual stream summed exactly across ranks, bias and residual counted once, the vocabulary-sliced
LM head) runs here against TP=1 and transformers' logits, prefill (model dtype) and decode (fixed point) alike."""

from pathlib import Path

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.models.deepseek_v2.test_step_code import forward, greedy
from tests.models.gpt2 import numpy_kernels
from tests.models.llama import numpy_kernels as runtime_kernels
from tests.models.ranks import on_ranks
from tilekit import parallel
from tilekit.kernels.checks import rel_err
from tilekit.engine import kv_cache
from tilekit.models import GPT, GPTConfig, base
from tilekit.models.gpt2 import model as model_module
from tilekit.models.gpt2 import weights

TINY = Path(__file__).resolve().parents[2] / "data" / "tiny-gpt2"      # 4 heads, vocabulary 1031


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    step_code_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.KERNELS),
                       (base, runtime_kernels, runtime_kernels.BASE_KERNELS), (kv_cache, runtime_kernels, runtime_kernels.CACHE_KERNELS))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fixed_rows", [0, 1 << 20])     # the residual stream in the model's dtype / fixed point
def test_sharded_logits_equal_one_rank_and_transformers(cpu, monkeypatch, world, fixed_rows):
    monkeypatch.setattr(GPT, "fixed_point_rows", fixed_rows)
    ids = np.load(TINY / "input_ids.npy")
    whole = forward(GPT.from_pretrained(TINY, dtype="float32"), ids)
    per_rank = on_ranks(world, lambda comm: forward(GPT.from_pretrained(TINY, dtype="float32", comm=comm), ids))
    for logits in per_rank[1:]:
        np.testing.assert_array_equal(logits, per_rank[0])
    assert rel_err(per_rank[0], whole) <= 1e-6
    assert rel_err(per_rank[0], np.load(TINY / "logits.npy")) <= 1e-5


def test_sharded_greedy_decode_equals_one_rank(cpu):
    """Prefill in the model's dtype, decode steps in fixed point (few rows)."""
    ids = list(np.load(TINY / "input_ids.npy"))
    expected = greedy(GPT.from_pretrained(TINY, dtype="float32"), ids, 12)
    for tokens in on_ranks(2, lambda comm: greedy(GPT.from_pretrained(TINY, dtype="float32", comm=comm), ids, 12)):
        assert tokens == expected


def test_each_rank_loads_its_column_blocks(cpu):
    config, state = weights.load_state_dict(TINY)
    C, D = config.n_embd, config.head_dim
    model = GPT.from_pretrained(TINY, dtype="float32", comm=parallel.ShapeOnly(1, 2))
    w = state["h.0.attn.c_attn.weight"]
    np.testing.assert_array_equal(model.params["h.0.attn.c_attn.weight"],
                                  np.concatenate([w[:, j * C + 2 * D:j * C + 4 * D] for j in range(3)], 1))
    np.testing.assert_array_equal(model.params["h.0.attn.c_proj.weight"], state["h.0.attn.c_proj.weight"][2 * D:])
    np.testing.assert_array_equal(model.params["h.0.attn.c_proj.bias"], state["h.0.attn.c_proj.bias"])
    np.testing.assert_array_equal(model.head, state["wte.weight"][576:])      # 9 of 17 blocks of 64 on rank 0
    given = GPT(config, dtype="float32", state=state, comm=parallel.ShapeOnly(1, 2))
    for name in given.params:
        np.testing.assert_array_equal(model.params[name], given.params[name], err_msg=name)


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"n_head \(12\) is not divisible by the tensor-parallel size 8"):
        GPT(GPTConfig(), meta=True, comm=parallel.ShapeOnly(0, 8))
