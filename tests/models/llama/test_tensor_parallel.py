"""Tensor-parallel Llama on the CPU: ranks as threads of a parallel.ThreadGroup, NumPy standing in for CuPy and for
each kernel (numpy_kernels.py), so the model's own sharded step code (its slices of the checkpoint, its heads, the
residual added once, the all-reduces, the vocabulary-sliced LM head) runs here against TP=1 and against
transformers' logits and greedy tokens. Also shard loading, the sharding plan's refusals and a rank's workload."""

from pathlib import Path

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.models.deepseek_v2.test_step_code import forward, greedy
from tests.models.llama import numpy_kernels
from tests.models.ranks import (assert_a_failing_rank_stops_the_others, assert_seeded_models_refused,
                                on_ranks)
from tilekit import parallel
from tilekit.kernels.checks import rel_err
from tilekit.engine import kv_cache
from tilekit.models import Llama, LlamaConfig, base
from tilekit import checkpoints as hf
from tilekit.models.llama import model as model_module
from tilekit.models.llama import weights
from tilekit.engine.workload import model_problems

DATA = Path(__file__).resolve().parents[2] / "data"
FIXTURES = ["tiny-llama", "tiny-llama-tied"]   # H 4, Hkv 2, untied, sharded files; H 4, Hkv 1 (MQA), tied


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    """The model's kernels as NumPy functions, its arrays NumPy's."""
    step_code_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.MODEL_KERNELS),
                       (base, numpy_kernels, numpy_kernels.BASE_KERNELS), (kv_cache, numpy_kernels, numpy_kernels.CACHE_KERNELS))


def sharded_logits(path, ids, world: int) -> np.ndarray:
    """forward() of the checkpoint at `path` over `world` ranks, held alike by every rank, within 1e-6 of one
    rank's."""
    whole = forward(Llama.from_pretrained(path, dtype="float32"), ids)
    per_rank = on_ranks(world, lambda comm: forward(Llama.from_pretrained(path, dtype="float32", comm=comm), ids))
    for logits in per_rank[1:]:
        np.testing.assert_array_equal(logits, per_rank[0])       # every rank holds the same logits
    assert rel_err(per_rank[0], whole) <= 1e-6
    return per_rank[0]


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logits_equal_one_rank_and_transformers(cpu, name, world):
    logits = sharded_logits(DATA / name, np.load(DATA / name / "input_ids.npy"), world)
    assert rel_err(logits, np.load(DATA / name / "logits.npy")) <= 1e-5


def test_eight_ranks_equal_one(cpu, tmp_path):
    """TP=8, the most GPUs of one host: 8 query heads over 2 key/value heads (each held by 4 ranks), the MLP's
    columns and the vocabulary cut in 8, against one rank on random weights."""
    config, _ = weights.load_state_dict(DATA / "tiny-llama")
    config = config.replace(n_head=8, n_kv_head=2, vocab_size=600)       # 10 blocks of 64: ranks get 1 or 2
    weights.save_state_dict(tmp_path, config, weights.random_state_dict(config, seed=3), dtype="float32")
    sharded_logits(tmp_path, np.random.default_rng(0).integers(0, config.vocab_size, (2, 11)), 8)


@pytest.mark.parametrize("name", FIXTURES)
def test_sharded_greedy_tokens_equal_transformers(cpu, name):
    ids, expected = np.load(DATA / name / "input_ids.npy"), np.load(DATA / name / "greedy_ids.npy")
    new = expected.shape[1] - ids.shape[1]
    per_rank = on_ranks(2, lambda comm: greedy(Llama.from_pretrained(DATA / name, dtype="float32", comm=comm),
                                               list(ids), new))
    for tokens in per_rank:
        np.testing.assert_array_equal(np.array(tokens), expected)


def test_state_dict_weights_shard_like_checkpoint_ones(cpu):
    config, state = weights.load_state_dict(DATA / "tiny-llama")
    for rank, loaded in enumerate(on_ranks(2, lambda comm: Llama.from_pretrained(DATA / "tiny-llama",
                                                                                  dtype="float32", comm=comm))):
        given = Llama(config, dtype="float32", state=state, comm=parallel.ShapeOnly(rank, 2))
        assert loaded.params.keys() == given.params.keys()
        for name in given.params:
            np.testing.assert_array_equal(loaded.params[name], given.params[name], err_msg=name)


def test_each_rank_loads_its_slices(cpu):
    config, state = weights.load_state_dict(DATA / "tiny-llama")
    D, I, V = config.head_dim, config.intermediate_size, config.vocab_size
    for rank in range(2):
        model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32", comm=parallel.ShapeOnly(rank, 2))
        p = "model.layers.1."
        q, k, o = (model.params[p + f"self_attn.{n}_proj.weight"] for n in "qko")
        np.testing.assert_array_equal(q, state[p + "self_attn.q_proj.weight"][rank * 2 * D:(rank + 1) * 2 * D])
        np.testing.assert_array_equal(k, state[p + "self_attn.k_proj.weight"][rank * D:(rank + 1) * D])
        np.testing.assert_array_equal(o, state[p + "self_attn.o_proj.weight"][:, rank * 2 * D:(rank + 1) * 2 * D])
        np.testing.assert_array_equal(model.params[p + "mlp.down_proj.weight"],
                                      state[p + "mlp.down_proj.weight"][:, rank * I // 2:(rank + 1) * I // 2])
        v0, v1 = parallel.vocab_span(V, rank, 2)
        assert (v0, v1) == ((0, 192), (192, 259))[rank]     # an odd vocabulary splits unevenly, in blocks of 64
        np.testing.assert_array_equal(model.head, state["lm_head.weight"][v0:v1])
        np.testing.assert_array_equal(model.embed, state["model.embed_tokens.weight"])   # whole: see shard_parts
        assert model.cache_dims() == (config.n_layer, 1, D)


def test_mqa_replicates_the_key_value_head(cpu):
    config, state = weights.load_state_dict(DATA / "tiny-llama-tied")      # one key/value head
    for rank in range(4):
        model = Llama(config, dtype="float32", state=state, comm=parallel.ShapeOnly(rank, 4))
        np.testing.assert_array_equal(model.params["model.layers.0.self_attn.v_proj.weight"],
                                      state["model.layers.0.self_attn.v_proj.weight"])
        v0, v1 = parallel.vocab_span(259, rank, 4)
        np.testing.assert_array_equal(model.head, state["model.embed_tokens.weight"][v0:v1])


@pytest.mark.parametrize("changes, world, message", [
    (dict(n_head=6, n_kv_head=2), 4, r"n_head \(6\) is not divisible by the tensor-parallel size 4"),
    (dict(n_head=12, n_kv_head=3), 4, r"key/value heads \(3\) neither divides"),
    (dict(intermediate_size=130), 4, r"intermediate_size \(130\) is not divisible"),
])
def test_unshardable_configs_are_refused(changes, world, message):
    config = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=96, intermediate_size=128, vocab_size=100,
                         max_position_embeddings=64, head_dim=16).replace(**changes)
    with pytest.raises(ValueError, match=message):
        Llama(config, meta=True, comm=parallel.ShapeOnly(0, world))


def test_random_sharded_models_are_refused_quantized_ones_shard(cpu):
    assert_seeded_models_refused(Llama, weights.load_state_dict(DATA / "tiny-llama")[0], False)


def test_a_rank_that_fails_stops_the_others(cpu):
    assert_a_failing_rank_stops_the_others(lambda comm: forward(
        Llama.from_pretrained(DATA / "tiny-llama", dtype="float32", comm=comm), np.zeros((1, 4), int)))
    group = parallel.ThreadGroup(2, timeout=0.5)      # a rank that never arrives: the other times out
    with pytest.raises(parallel.RankError, match="rank 0: all_reduce: another rank failed or did not arrive"):
        group.communicator(0).all_reduce(np.ones(3))


def test_a_rank_runs_its_shard_shapes():
    """What `tilekit tune --tp 2` tunes: the kernels of one rank, traced on MetaArrays."""
    config = LlamaConfig.preset("llama-3.1-8b")

    def linears(comm):
        calls = Llama(config, meta=True, comm=comm).kernel_problems(1, 64, 4)
        return {(p["N"], p["K"]) for op, p in calls if op.name == "linear"}
    one, two = linears(None), linears(parallel.ShapeOnly(1, 2))
    assert {(4096, 14336), ((32 + 2 * 8) * 128, 4096), (128256, 4096)} <= one
    assert {(4096, 14336 // 2), ((16 + 2 * 4) * 128, 4096), (128256 // 2, 4096)} <= two   # down, q/k/v, LM head
    assert not one & {(4096, 14336 // 2), (128256 // 2, 4096)}


def test_sliced_targets_read_rows_and_columns(tmp_path):
    a = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    hf.write_checkpoint(tmp_path, {"model_type": "llama"}, {"a": a, "b": a + 1})
    plan = {"a": hf.Target((5, 7), "float32", part=(0, 1, 4)), "b": hf.Target((5, 7), "float32", part=(1, 2, 7))}
    with hf.Checkpoint.at(tmp_path).tensor_files() as files:
        out = hf.load_tensors(files, plan, device=hf.HostDevice(), progress=False)
        np.testing.assert_array_equal(out["a"], a[1:4])
        np.testing.assert_array_equal(out["b"], (a + 1)[:, 2:7])
        fused = hf.load_tensors(files, {"a": hf.Target((5, 7), "float32", part=(0, 1, 4)),
                                        "b": hf.Target((5, 7), "float32", part=(0, 3, 5, 1))},
                                device=hf.HostDevice(), progress=False)
        np.testing.assert_array_equal(fused["b"], (a + 1)[3:5])
        six = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)       # three column blocks of two: [q | k | v]
        np.testing.assert_array_equal(parallel.take_part(six, (1, 1, 2, 3)), six[:, [1, 3, 5]])
        assert parallel.part_problem((4, 6), (1, 0, 3, 3)) and parallel.part_problem((4, 7), (1, 0, 1, 3))
        with pytest.raises(ValueError, match=r"part \(1, 3, 9\) is not a slice \(axis, start, stop\[, groups\]\)"):
            hf.load_tensors(files, {"a": hf.Target((5, 7), "float32", part=(1, 3, 9))}, device=hf.HostDevice(),
                            ignore=("b",), progress=False)
        with pytest.raises(ValueError, match=r"out is float32 \(5, 7\), expected float32 \(3, 7\)"):
            hf.load_tensors(files, {"a": hf.Target((5, 7), "float32", out=np.empty((5, 7), np.float32),
                                                   part=(0, 1, 4))}, device=hf.HostDevice(), ignore=("b",),
                            progress=False)


def test_the_tp_workload_holds_every_ranks_shapes():
    """An odd vocabulary splits unevenly: `tilekit tune --tp 2` tunes both ranks' LM heads."""
    config, _ = weights.load_state_dict(DATA / "tiny-llama")
    heads = {(p["N"], p["K"]) for op, p in model_problems(config, batch_sizes=(1,), seq_lens=(16,), new_tokens=4,
                                                          tp=2) if op.name == "linear" and p["K"] == 64}
    assert {(192, 64), (67, 64)} <= heads and (259, 64) not in heads
