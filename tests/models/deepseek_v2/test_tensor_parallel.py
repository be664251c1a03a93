"""Tensor-parallel DeepSeek-V2 on the CPU: ranks as threads of a parallel.ThreadGroup, NumPy standing in for CuPy and
for each kernel (numpy_kernels.py), so the model's own sharded step code (its heads of q_proj / kv_b_proj / o_proj
over the whole latent cache, every expert's share of columns under the replicated router, the fixed-point residual
summed exactly across ranks, the vocabulary-sliced LM head) runs here against TP=1 and transformers' logits and
greedy tokens, prefill (plain MLA) and decode (absorbed MLA) alike. Also shard loading from both expert layouts, the
bytes each rank reads, the sharding plan's refusals and a rank's workload."""

from pathlib import Path

import numpy as np
import pytest

from tests._numpy_cupy import numpy_cupy  # noqa: F401  (a fixture)
from tests.models.deepseek_v2.test_step_code import cpu, forward, greedy  # noqa: F401  (cpu: a fixture)
from tests.models.ranks import (ReadCounter, assert_a_failing_rank_stops_the_others, assert_seeded_models_refused,
                                on_ranks)
from tilekit.engine.kv_cache import new_cache
from tilekit import parallel
from tilekit.kernels.checks import rel_err
from tilekit.models import DeepseekV2, DeepseekV2Config, families
from tilekit import checkpoints as hf
from tilekit.models.deepseek_v2 import weights
from tilekit.models.base import Arrays
from tilekit.engine.workload import model_problems

DATA = Path(__file__).resolve().parents[2] / "data"
# H 4, 8 routed + 2 shared experts of 32 columns, a dense first layer, untied, per-expert files (the hub's);
# H 2, 4 + 1 experts of 16 columns, query compression, tied, fused expert files
FIXTURES = [("tiny-deepseek-v2", (2, 4)), ("tiny-deepseek-v2-qlora", (2,))]


def load(name: str, comm=None) -> DeepseekV2:
    return DeepseekV2.from_pretrained(DATA / name, dtype="float32", comm=comm)


@pytest.mark.parametrize("name, world", [(name, world) for name, worlds in FIXTURES for world in worlds])
def test_sharded_logits_equal_one_rank_and_transformers(cpu, name, world):
    ids = np.load(DATA / name / "input_ids.npy")
    whole = forward(load(name), ids)
    per_rank = on_ranks(world, lambda comm: forward(load(name, comm), ids))
    for logits in per_rank[1:]:
        np.testing.assert_array_equal(logits, per_rank[0])       # every rank holds the same logits
    assert rel_err(per_rank[0], whole) <= 1e-6
    assert rel_err(per_rank[0], np.load(DATA / name / "logits.npy")) <= 1e-5


@pytest.mark.parametrize("name", [name for name, _ in FIXTURES])
def test_sharded_latent_cache_decode_equals_transformers(cpu, name):
    ids, expected = np.load(DATA / name / "input_ids.npy"), np.load(DATA / name / "greedy_ids.npy")
    new = expected.shape[1] - ids.shape[1]
    per_rank = on_ranks(2, lambda comm: greedy(load(name, comm), ids.tolist(), new))
    for tokens in per_rank:
        np.testing.assert_array_equal(np.array(tokens), expected)


@pytest.mark.parametrize("name", [name for name, _ in FIXTURES])
def test_state_dict_weights_shard_like_checkpoint_ones(cpu, name):
    """A rank's slices read from the file (its pieces: per-expert or fused experts, the shared MLP, rotary rows
    reordered) equal its slices of the whole state in our layout."""
    config, state = weights.load_state_dict(DATA / name)
    for rank, loaded in enumerate(on_ranks(2, lambda comm: load(name, comm))):
        given = DeepseekV2(config, dtype="float32", state=state, comm=parallel.ShapeOnly(rank, 2))
        assert loaded.params.keys() == given.params.keys() == state.keys()
        for key in given.params:
            np.testing.assert_array_equal(loaded.params[key], given.params[key], err_msg=key)


def test_each_rank_loads_its_slices(cpu):
    config, state = weights.load_state_dict(DATA / "tiny-deepseek-v2")
    dq, dkv, dv, I, J = 32, 32, 16, 32, 96           # qk_head_dim, nope + v, v_head_dim, expert and dense widths
    E = config.n_routed_experts + config.n_shared_experts
    for rank in range(2):
        model = load("tiny-deepseek-v2", parallel.ShapeOnly(rank, 2))
        w, a, m = model.params, "model.layers.1.self_attn.", "model.layers.1.mlp."
        heads = slice(rank * 2, rank * 2 + 2)            # 2 of 4 heads
        for key, width in (("q_proj", dq), ("kv_b_proj", dkv)):
            rows = state[a + key + ".weight"].reshape(4, width, -1)[heads].reshape(-1, state[a + key + ".weight"]
                                                                                    .shape[1])
            np.testing.assert_array_equal(w[a + key + ".weight"], rows)
        np.testing.assert_array_equal(w[a + "o_proj.weight"], state[a + "o_proj.weight"][:, heads.start * dv:
                                                                                         heads.stop * dv])
        half = slice(rank * I // 2, (rank + 1) * I // 2)
        gate_up = state[m + "experts.gate_up_proj"]
        assert w[m + "experts.gate_up_proj"].shape == (E, I, config.n_embd)
        np.testing.assert_array_equal(w[m + "experts.gate_up_proj"],
                                      np.concatenate([gate_up[:, :I][:, half], gate_up[:, I:][:, half]], 1))
        np.testing.assert_array_equal(w[m + "experts.down_proj"], state[m + "experts.down_proj"][:, :, half])
        for key in (a + "kv_a_proj_with_mqa.weight", m + "gate.weight", "model.embed_tokens.weight"):
            np.testing.assert_array_equal(w[key], state[key])          # whole: see weights.shard_parts
        dense = slice(rank * J // 2, (rank + 1) * J // 2)
        np.testing.assert_array_equal(w["model.layers.0.mlp.up_proj.weight"],
                                      state["model.layers.0.mlp.up_proj.weight"][dense])
        np.testing.assert_array_equal(w["model.layers.0.mlp.down_proj.weight"],
                                      state["model.layers.0.mlp.down_proj.weight"][:, dense])
        v0, v1 = parallel.vocab_span(config.vocab_size, rank, 2)
        np.testing.assert_array_equal(model.head, state["lm_head.weight"][v0:v1])
        cache = new_cache(model, 2, 64, Arrays())       # the latent cache is per token: whole on every rank
        assert cache.entries.shape == (config.n_layer, 2, 64, config.kv_lora_rank + config.qk_rope_head_dim)


def test_a_rank_reads_only_its_rows(cpu, monkeypatch):
    """Row slices (q_proj, kv_b_proj, each routed expert's gate and up, the dense gate, the LM head) are read alone:
    a rank reads exactly its half of those tensors' bytes; column slices (o_proj, down projections) and the shared
    MLP's row blocks (one per shared expert) are read whole and sliced on the device, as hf.Target.part says."""
    counter = ReadCounter(monkeypatch, DATA / "tiny-deepseek-v2")
    p = "model.layers.1."
    halves = [p + "self_attn.q_proj.weight", p + "self_attn.kv_b_proj.weight", p + "mlp.experts.3.gate_proj.weight",
              p + "mlp.experts.5.up_proj.weight", "model.layers.0.mlp.gate_proj.weight", "lm_head.weight"]
    read = {}
    for rank in range(2):
        counter.clear()
        load("tiny-deepseek-v2", parallel.ShapeOnly(rank, 2))
        read[rank] = {name: counter.read(name) for name in counter.spans}
        for name in halves[:-1]:
            assert read[rank][name] == counter.size(name) // 2, name
        kv_a = p + "self_attn.kv_a_proj_with_mqa.weight"
        assert read[rank][kv_a] == counter.size(kv_a)
    assert read[0]["lm_head.weight"] + read[1]["lm_head.weight"] == counter.size("lm_head.weight")
    assert sum(read[0].values()) < sum(map(counter.size, counter.spans))


@pytest.mark.parametrize("changes, world, message", [
    (dict(n_head=6, n_embd=96), 4, r"n_head \(6\) is not divisible by the tensor-parallel size 4"),
    (dict(moe_intermediate_size=36), 8, r"moe_intermediate_size \(36\) is not divisible by the tensor-parallel "
                                        r"size 8"),
    (dict(intermediate_size=100), 8, r"intermediate_size \(100\) is not divisible by the tensor-parallel size 8"),
    (dict(vocab_size=100), 4, r"vocab_size \(100\) has fewer blocks of 64 than the tensor-parallel size 4"),
])
def test_unshardable_configs_are_refused(changes, world, message):
    base = DeepseekV2Config(n_layer=2, n_head=8, n_embd=64, vocab_size=600, intermediate_size=128,
                            moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                            max_position_embeddings=64, rope_scaling=None, first_k_dense_replace=1,
                            bos_token_id=0, eos_token_id=1)
    DeepseekV2(base, meta=True, comm=parallel.ShapeOnly(0, world))       # splits 8 ways
    with pytest.raises(ValueError, match=message):
        DeepseekV2(base.replace(**changes), meta=True, comm=parallel.ShapeOnly(0, world))


def test_random_or_quantized_sharded_models_are_refused(cpu):
    assert_seeded_models_refused(DeepseekV2, weights.load_state_dict(DATA / "tiny-deepseek-v2")[0], True)
    with pytest.raises(ValueError, match=r"DeepseekV2's tensor parallelism does not take quantized linears yet "
                                         r"\(load-time quantization\)"):
        DeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2", quantize="int8", comm=parallel.ShapeOnly(0, 2))


def test_a_rank_that_fails_stops_the_others(cpu):
    assert_a_failing_rank_stops_the_others(lambda comm: forward(load("tiny-deepseek-v2", comm), np.zeros((1, 4), int)))


def test_a_rank_runs_its_shard_shapes():
    """What `tilekit tune --model deepseek-v2-lite --tp 2` tunes: the kernels of one rank, traced on MetaArrays: half
    the heads, of each expert's columns, of the dense MLP's and of the vocabulary; the latent and rotary key rows
    whole (one GEMM with the rank's query heads)."""
    config = families.preset_config("deepseek-v2-lite").replace(n_layer=2)

    def shapes(comm) -> set:
        calls = DeepseekV2(config, meta=True, comm=comm).kernel_problems(1, 64, 4)
        return {(op.name, *(p.get(k) for k in ("M", "H", "N", "K", "I", "E"))) for op, p in calls}
    one, two = shapes(None), shapes(parallel.ShapeOnly(1, 2))
    assert {("mla_decode_attention", None, 16, None, None, None, None), ("moe_gate_up", 1, None, None, None, 1408, 66),
            ("linear", 1, None, 576 + 16 * 192, 2048, None, None), ("swiglu_linear", 1, None, 10944, 2048, None, None),
            ("linear", 1, None, 102400, 2048, None, None)} <= one
    assert {("mla_decode_attention", None, 8, None, None, None, None), ("moe_gate_up", 1, None, None, None, 704, 66),
            ("moe_down_combine", 1, None, None, None, 704, 66), ("moe_down_combine", 1, None, None, None, 8 * 128, 1),
            ("linear", 1, None, 576 + 8 * 192, 2048, None, None), ("swiglu_linear", 1, None, 5472, 2048, None, None),
            ("linear", 1, None, 51200, 2048, None, None), ("head_linear", 1, 8, 512, 128, None, None)} <= two
    assert not {s for s in one | two if s[0] == "linear" and s[3] in (512, 64)}      # no separate latent GEMM
    assert not {s for s in two if s[0] in ("mla_decode_attention", "moe_gate_up", "swiglu_linear")} & one


def test_the_tp_workload_holds_every_ranks_shapes():
    """`tilekit tune --model deepseek-v2-lite --tp 2`'s workload: both ranks' shard shapes, no whole-model ones."""
    config = families.preset_config("deepseek-v2-lite").replace(n_layer=2)
    found = {(op.name, p.get("I"), p.get("H")) for op, p in model_problems(config, batch_sizes=(1,), seq_lens=(64,),
                                                                           new_tokens=4, tp=2)}
    assert ("moe_gate_up", 704, None) in found and ("moe_gate_up", 1408, None) not in found
    assert ("mla_decode_attention", None, 8) in found and ("mla_decode_attention", None, 16) not in found


def test_pieces_of_a_sharded_tensor_must_name_their_slices():
    """The shared loader refuses a family's stored pieces that would fill a rank's shard from whole file tensors."""
    config, _ = weights.load_state_dict(DATA / "tiny-deepseek-v2")
    with pytest.raises(ValueError, match=r"stored pieces \[.*'model.layers.1.self_attn.q_proj.weight'.*\] of sharded "
                                         r"tensors name no part of their file tensors"):
        hf.load_weights(hf.Checkpoint.at(DATA / "tiny-deepseek-v2"), weights.state_dict_shapes(config),
                        dtype="float32", stored=lambda names: weights.stored(config, names),
                        parts=weights.shard_parts(config, 0, 2), device=hf.HostDevice())


@pytest.mark.parametrize("name", [name for name, _ in FIXTURES])
def test_a_shard_loads_without_preallocated_outputs(name):
    """weights.load(parts=) allocating its own arrays makes them the shard's shapes, equal to the whole's slices."""
    checkpoint = hf.Checkpoint.at(DATA / name)
    config = DeepseekV2Config.from_fields(checkpoint.config())
    parts = weights.shard_parts(config, 1, 2)
    whole = weights.load(checkpoint, config, dtype="float32", device=hf.HostDevice())
    shard = weights.load(checkpoint, config, dtype="float32", device=hf.HostDevice(), parts=parts)
    for key, part in parts.items():
        np.testing.assert_array_equal(shard[key], parallel.take_part(whole[key], part), err_msg=key)


def test_a_refused_model_leaves_nothing_for_close():
    """A model refused by its communicator's checks is not among the holders close() releases."""
    comm = parallel.ShapeOnly(0, 2)
    with pytest.raises(ValueError, match="come from state= or a checkpoint"):
        DeepseekV2(weights.load_state_dict(DATA / "tiny-deepseek-v2")[0], dtype="float32", comm=comm)
    comm.release_holders()          # nothing half-built to call
    assert not comm.__dict__.get("holders")
