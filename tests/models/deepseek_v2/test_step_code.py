"""DeepSeek-V2's own step code on the CPU: NumPy standing in for CuPy (tests/_numpy_cupy.py) and for each kernel
(numpy_kernels.py: the ops' semantics from their float64 references), so the model's buffers, views, latent cache,
routing constants and its prefill / absorbed decode run here against transformers' logits and greedy tokens. Also
the tuning workload it records on MetaArrays, its loading and saving, and tilekit.patch's refusals."""

import json
import types
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from tests._numpy_cupy import numpy_cupy, step_code_on_numpy  # noqa: F401  (numpy_cupy: a fixture)
from tests.models.deepseek_v2 import numpy_kernels
from tilekit.engine.steps import logits
from tilekit.engine.kv_cache import new_cache
from tilekit.kernels.checks import rel_err
from tilekit.models import DeepseekV2, DeepseekV2Config, families
from tilekit.models.deepseek_v2 import model as model_module
from tilekit.models.deepseek_v2 import patch as patch_rules
from tilekit.engine import kv_cache
from tilekit.models import base
from tilekit.engine.steps import capacity_for, forward_hidden, PromptBuffers
from tilekit.models.base import Arrays
from tilekit.engine.workload import model_problems

DATA = Path(__file__).resolve().parents[2] / "data"
FIXTURES = ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora"]   # V2-Lite-like with YaRN, hub layout; q_lora, tied, fused


@pytest.fixture
def cpu(numpy_cupy, monkeypatch):
    """The model's kernels as NumPy functions, its arrays NumPy's."""
    step_code_on_numpy(numpy_cupy, monkeypatch, (model_module, numpy_kernels, numpy_kernels.KERNELS),
                       (base, numpy_kernels, numpy_kernels.BASE_KERNELS), (kv_cache, numpy_kernels, numpy_kernels.CACHE_KERNELS))


def forward(model, ids: np.ndarray) -> np.ndarray:
    """forward()'s logits without graphs: the blocks over whole prompts."""
    B, T = ids.shape
    buf = PromptBuffers(model, B, T, Arrays())
    buf.ids[...] = ids.reshape(-1)
    forward_hidden(model, buf)
    return logits(model, buf.acts.h, Arrays()).reshape(B, T, -1)


def greedy(model, prompts: list, new: int) -> list[list[int]]:
    """generate()'s greedy steps without graphs: a padded prompt prefill into the latent cache, then decode steps
    (absorbed MLA) of each sequence's newest token at its own position."""
    B, lengths = len(prompts), np.array([len(p) for p in prompts], np.int32)
    capacity, T = capacity_for(model, int(lengths.max()), new)
    cache = new_cache(model, B, capacity, Arrays())
    buf = PromptBuffers(model, B, T, Arrays())
    for b, p in enumerate(prompts):
        buf.ids[b * T:b * T + len(p)] = p
    x = model.hidden(buf.acts, buf.ids, buf.positions, model.prefill_attend(cache, buf.zeros))
    h = np.empty((B, model.config.n_embd), np.float32)
    model.final_norm(x, h, rows=np.arange(B) * T + lengths - 1)
    tokens = model.lm_head(h).argmax(-1).astype(np.int32)
    out = [list(p) + [int(t)] for p, t in zip(prompts, tokens)]
    acts, positions = model.activations(B, 1, Arrays()), lengths.copy()
    for _ in range(new - 1):
        x = model.hidden(acts, tokens, positions, model.decode_attend(cache, positions))
        model.final_norm(x, acts.h)
        tokens = model.lm_head(acts.h).argmax(-1).astype(np.int32)
        positions += 1
        for seq, t in zip(out, tokens):
            seq.append(int(t))
    return out


@pytest.mark.parametrize("name", FIXTURES)
def test_forward_matches_transformers(cpu, name):
    model = DeepseekV2.from_pretrained(DATA / name, dtype="float32")
    logits = forward(model, np.load(DATA / name / "input_ids.npy"))
    assert rel_err(logits, np.load(DATA / name / "logits.npy")) <= 1e-5


@pytest.mark.parametrize("name", FIXTURES)
def test_latent_cache_decode_matches_transformers_for_32_tokens(cpu, name):
    model = DeepseekV2.from_pretrained(DATA / name, dtype="float32")
    ids, expected = np.load(DATA / name / "input_ids.npy"), np.load(DATA / name / "greedy_ids.npy")
    assert greedy(model, ids.tolist(), expected.shape[1] - ids.shape[1]) == expected.tolist()


def test_ragged_batches_equal_single_runs(cpu):
    model = DeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2", dtype="float32")
    prompts = [[5, 17, 200, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [42]]
    assert greedy(model, prompts, 6) == [greedy(model, [p], 6)[0] for p in prompts]


def test_the_step_writes_one_latent_entry_per_token(cpu):
    """After a prefill of T tokens and one decode step, positions 0..T of the cache hold entries and the rest is
    zero; the decode step's entry is the one a prefill of T + 1 tokens writes."""
    model = DeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2-qlora", dtype="float32")
    ids = [3, 9, 27, 81, 243 % 259, 7]
    cache = new_cache(model, 1, 64, Arrays())
    buf = PromptBuffers(model, 1, 5, Arrays())
    buf.ids[...] = ids[:5]
    model.hidden(buf.acts, buf.ids, buf.positions, model.prefill_attend(cache, buf.zeros))
    acts, positions = model.activations(1, 1, Arrays()), np.array([5], np.int32)
    model.hidden(acts, np.array([ids[5]], np.int32), positions, model.decode_attend(cache, positions))
    whole = new_cache(model, 1, 64, Arrays())
    buf = PromptBuffers(model, 1, 6, Arrays())
    buf.ids[...] = ids
    model.hidden(buf.acts, buf.ids, buf.positions, model.prefill_attend(whole, buf.zeros))
    entries = cache.entries[:, 0]
    assert np.all(entries[:, :6].any(-1)) and not entries[:, 6:].any()
    np.testing.assert_allclose(entries, whole.entries[:, 0], rtol=1e-5, atol=1e-6)


def test_from_pretrained_and_save_pretrained(cpu, tmp_path):
    """Our layout in the model's arrays (the fused q/kv_a rows shared), the hub's in the file it saves."""
    model = families.load_model(DATA / "tiny-deepseek-v2", dtype="bfloat16")
    config, host = DeepseekV2.weights.load_state_dict(DATA / "tiny-deepseek-v2")
    assert type(model) is DeepseekV2 and model.config == config and model.params.keys() == host.keys()
    for name, array in model.params.items():
        np.testing.assert_array_equal(array.astype(np.float32), host[name], err_msg=name)
    a = "model.layers.1.self_attn."
    assert np.shares_memory(model.params[a + "q_proj.weight"], model.blocks[1].kv_a_q)
    assert np.shares_memory(model.params[a + "kv_a_proj_with_mqa.weight"], model.blocks[1].kv_a_q)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as saved, \
            safe_open(DATA / "tiny-deepseek-v2" / "model.safetensors", "np") as original:
        assert sorted(saved.keys()) == sorted(original.keys())
        for name in original.keys():
            assert np.array_equal(saved.get_tensor(name).view(np.uint16), original.get_tensor(name).view(np.uint16))
    assert DeepseekV2Config.from_hf_dict(json.loads((tmp_path / "config.json").read_text())) == config


def test_the_workload_is_the_step_code_on_meta_arrays():
    """V2-Lite's decode step: absorbed MLA (head_linear, mla_decode_attention) and the MoE ops at the shapes phase 1
    tuned them for; prompts: plain MLA (mla_kv, attention over 192-wide heads) and the cache written by write_kv;
    `tune --model deepseek-v2-lite` asks the families table for the same."""
    config = families.preset_config("deepseek-v2-lite")
    model = DeepseekV2(config, meta=True)
    calls = model.kernel_problems(1, 128, 128)
    keys = {(op.name, op.problem_key(p)[1]) for op, p in calls}
    assert keys <= {(op.name, op.problem_key(p)[1]) for op, p in model_problems(config, "bfloat16", (1,), (128,))}
    step = [(op.name, p) for op, p in calls][len(calls) // 2:]                  # the greedy picker's half
    step = step[[n for n, _ in step].index("embedding", 1):]                      # its decode step
    names = [n for n, _ in step]
    assert "attention" not in names and names.count("mla_decode_attention") == 27
    problems = {n: p for n, p in step}
    assert problems["mla_decode_attention"].items() >= dict(B=1, H=16, nq=1, R=512, P=64, new_kv=1).items()
    assert problems["moe_gate_up"].items() >= dict(M=1, slots=8, E=66, I=1408, C=2048).items()
    assert problems["moe_router"].items() >= dict(M=1, E=64, C=2048, K=6, shared=2, renorm=0).items()
    assert {p["wt"] for n, p in step if n == "head_linear"} == {"kn", "nk"}
    prompt = [(op.name, p) for op, p in model.kernel_problems(2, 64)]
    assert {n for n, _ in prompt} >= {"mla_kv", "attention", "fixed_cast"}
    assert all(p["D"] == 192 for n, p in prompt if n == "attention")
    # o_proj: one expert over token-major rows (M, H dv), the prompts' value columns copied there by write_kv
    o_proj = [p for n, p in prompt if n == "moe_down_combine" and p["I"] == 16 * 128]
    assert len(o_proj) == 27 and all(p["E"] == 1 and p["slots"] == 1 and p["M"] == 128 for p in o_proj)
    copies = [p for n, p in prompt if n == "write_kv" and p["B"] == 1 and p["T"] == 128]
    assert len(copies) == 27 and all(p["H"] == 16 and p["D"] == 128 for p in copies)
    assert [p for n, p in step if n == "moe_down_combine" and p["I"] == 2048][0].items() >= dict(E=1, M=1).items()
    assert not [p for op, p in calls if op.name == "moe_down_combine" and p["E"] == 16]


def hf_config(**changes):
    base = dict(hidden_act="silu", mlp_bias=False, topk_method="greedy", n_routed_experts=64)
    return types.SimpleNamespace(**{**base, **changes})


@pytest.mark.parametrize("changes, problem", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"), (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy'"),
    (dict(n_routed_experts=320), "n_routed_experts=320 (moe_router takes at most 256)")])
def test_patch_refuses_what_the_kernels_do_not_compute(changes, problem):
    assert patch_rules.config_problems(hf_config()) == []
    assert any(problem in p for p in patch_rules.config_problems(hf_config(**changes)))
