"""The Llama model on the GPU: against Hugging Face's logits and greedy tokens (the committed tiny checkpoints),
against the float64 NumPy reference at real Llama layer shapes, and its KV-cache, graph and workload paths."""

from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err

cupy = pytest.importorskip("cupy")

from tilekit.models import LLAMA_PRESETS, Llama, LlamaConfig, ReferenceLlama  # noqa: E402
from tilekit.models.llama.weights import random_state_dict  # noqa: E402

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[2] / "data"
FIXTURES = ["tiny-llama", "tiny-llama-tied"]       # GQA + llama3 rope + untied + sharded; MQA + tied
MODEL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_hugging_face(name, dtype):
    model = Llama.from_pretrained(DATA / name, dtype=dtype)
    ids = np.load(DATA / name / "input_ids.npy")
    err = rel_err(cupy.asnumpy(model(ids)).astype(np.float64), np.load(DATA / name / "logits.npy"))
    assert err <= MODEL_TOL[dtype], (name, dtype, err)


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_match_hugging_face(name):
    model = Llama.from_pretrained(DATA / name, dtype="float32")
    ids = np.load(DATA / name / "input_ids.npy")
    expected = np.load(DATA / name / "greedy_ids.npy")
    out = model.generate(ids, expected.shape[1] - ids.shape[1], temperature=0)
    np.testing.assert_array_equal(np.stack(out), expected)
    eager = model.generate(ids, expected.shape[1] - ids.shape[1], temperature=0, use_graph=False)
    np.testing.assert_array_equal(np.stack(eager), expected)


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b", "tinyllama-1.1b"])
def test_logits_match_reference_at_preset_shapes(preset):
    """Every per-layer shape of the preset (one layer and a smaller vocabulary keep the float64 reference quick)."""
    config = LLAMA_PRESETS[preset].replace(n_layer=1, vocab_size=1031, bos_token_id=1, eos_token_id=2)
    state = random_state_dict(config, seed=1)
    reference = ReferenceLlama(config, state)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 37))
    expected = reference.forward(ids)
    for dtype in ("float32", "bfloat16"):
        err = rel_err(cupy.asnumpy(Llama(config, dtype=dtype, state=state)(ids)).astype(np.float64), expected)
        assert err <= MODEL_TOL[dtype], (preset, dtype, err)


@pytest.fixture(scope="module")
def small_llama():
    config = LlamaConfig(n_layer=2, n_head=8, n_kv_head=2, n_embd=256, intermediate_size=688, vocab_size=1031,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    return Llama(config, dtype="float32", seed=3)


def test_kv_cache_greedy_equals_recomputation(small_llama):
    prompts = [[5, 17, 900, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42]]   # different lengths in one batch
    out = small_llama.generate(prompts, 12, temperature=0)
    for prompt, seq in zip(prompts, out):
        expected = list(prompt)
        for _ in range(12):
            expected.append(int(np.argmax(cupy.asnumpy(small_llama(np.array([expected])))[0, -1])))
        assert seq.tolist() == expected


def test_random_device_weights_are_deterministic_and_scaled():
    config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=256, vocab_size=300,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    a, b = Llama(config, dtype="float32", seed=7), Llama(config, dtype="float32", seed=7)
    ids = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(cupy.asnumpy(a(ids)), cupy.asnumpy(b(ids)))
    state = a.state_dict()
    assert abs(float(np.std(state["model.layers.0.self_attn.q_proj.weight"])) - 0.02) < 0.002
    assert abs(float(np.mean(state["model.norm.weight"])) - 1.0) < 0.05


def test_save_round_trip(tmp_path):
    model = Llama.from_pretrained(DATA / "tiny-llama", dtype="float32")
    model.save_pretrained(tmp_path)
    again = Llama.from_pretrained(tmp_path, dtype="float32")
    ids = np.load(DATA / "tiny-llama" / "input_ids.npy")
    np.testing.assert_array_equal(cupy.asnumpy(model(ids)), cupy.asnumpy(again(ids)))
    saved = ReferenceLlama.from_pretrained(tmp_path).forward(ids)
    assert rel_err(saved, np.load(DATA / "tiny-llama" / "logits.npy")) <= 1e-5


def test_the_tuning_workload_is_what_forward_and_generate_request(small_llama):
    from tilekit.autotune.op import recording
    with recording() as calls:
        small_llama(np.array([[1, 2, 3]] * 2), use_graph=False)
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in small_llama.kernel_problems(2, 3)}
    with recording() as calls:
        small_llama.generate([[1, 2, 3, 4, 5]], 3, temperature=0, use_graph=False)
        small_llama.generate([[1, 2, 3, 4, 5]], 3, temperature=1.0, top_k=50, use_graph=False)   # HF's default sampling
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in small_llama.kernel_problems(1, 5, 3)}
