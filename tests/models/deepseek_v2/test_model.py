"""The DeepSeek-V2 model on the GPU: against transformers' logits and greedy tokens (the committed tiny checkpoints),
against the float64 NumPy reference at V2-Lite's layer shapes, ragged batches against single runs, CUDA-graph decode
against eager decode, sampling in the graph, its recorded workload, and loading (the hub's per-expert layout fused on
the device). The same step code runs on the CPU in test_step_code.py."""

from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err

cupy = pytest.importorskip("cupy")

from tilekit.models import DEEPSEEK_V2_PRESETS, DeepseekV2, ReferenceDeepseekV2  # noqa: E402
from tilekit import checkpoints as hf
from tilekit.models.deepseek_v2.weights import random_state_dict  # noqa: E402

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[2] / "data"
FIXTURES = ["tiny-deepseek-v2", "tiny-deepseek-v2-qlora"]   # V2-Lite-like with YaRN, hub layout; q_lora, tied, fused
MODEL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}              # the Llama family's


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_hugging_face(name, dtype):
    """bf16 routes on bf16 activations: a token whose k-th and (k+1)-th router probabilities are close may pick other
    experts than transformers' float32 run (a jump in its logits); the fixtures' routing margins keep that rare, and
    the overall error is held to the Llama family's tolerance."""
    model = DeepseekV2.from_pretrained(DATA / name, dtype=dtype)
    ids = np.load(DATA / name / "input_ids.npy")
    err = rel_err(cupy.asnumpy(model(ids)).astype(np.float64), np.load(DATA / name / "logits.npy"))
    assert err <= MODEL_TOL[dtype], (name, dtype, err)


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_tokens_match_hugging_face_for_32_steps(name):
    model = DeepseekV2.from_pretrained(DATA / name, dtype="float32")
    ids, expected = np.load(DATA / name / "input_ids.npy"), np.load(DATA / name / "greedy_ids.npy")
    for use_graph in (True, False):
        out = model.generate(ids, expected.shape[1] - ids.shape[1], temperature=0, use_graph=use_graph)
        np.testing.assert_array_equal(np.stack(out), expected)


def test_logits_match_reference_at_v2_lite_shapes():
    """Every per-layer shape of V2-Lite (the dense layer and one MoE layer; a smaller vocabulary keeps the float64
    reference quick)."""
    config = DEEPSEEK_V2_PRESETS["deepseek-v2-lite"].replace(n_layer=2, vocab_size=1031, bos_token_id=1,
                                                             eos_token_id=2)
    state = random_state_dict(config, seed=1)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 37))
    expected = ReferenceDeepseekV2(config, state).forward(ids)
    for dtype in ("float32", "bfloat16"):
        err = rel_err(cupy.asnumpy(DeepseekV2(config, dtype=dtype, state=state)(ids)).astype(np.float64), expected)
        assert err <= MODEL_TOL[dtype], (dtype, err)


def test_yarn_past_the_original_window_matches_the_reference():
    """tiny-deepseek-v2's shapes and YaRN (64-position window) with room for 1024 positions, random weights: a
    600-token prompt and four absorbed-MLA decode steps after it, against the float64 reference past the window.
    float32 only: over 600 tokens a bf16 run would likely route some token to other experts (see
    test_logits_match_hugging_face), which says nothing about the rotation."""
    dtype = "float32"
    from tests.models.steps import check_past_the_window
    config = DeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2", dtype="float32").config.replace(
        max_position_embeddings=1024)
    state = random_state_dict(config, seed=3)
    check_past_the_window(DeepseekV2(config, dtype=dtype, state=state), ReferenceDeepseekV2(config, state), 600, 64,
                          MODEL_TOL[dtype])


def test_logits_match_hugging_face_at_v2_lite_shapes(tmp_path):
    """V2-Lite's layer shapes (the dense layer and one MoE layer: 64 experts, top-6, 2 shared, YaRN; a smaller
    vocabulary) written by transformers' DeepseekV2ForCausalLM (random weights, the router's scaled up so the top-6
    margins stay clear of bf16 rounding) and loaded by tilekit: logits against transformers' float32 run on the GPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = DEEPSEEK_V2_PRESETS["deepseek-v2-lite"].replace(n_layer=2, vocab_size=1031, bos_token_id=1,
                                                             eos_token_id=2)
    torch.manual_seed(0)
    hf_model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**config.to_hf_dict()))
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    hf_model.save_pretrained(tmp_path)
    hf_model = hf_model.float().cuda().eval()
    ids = np.random.default_rng(3).integers(0, config.vocab_size, (2, 37))
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(ids).cuda()).logits.double().cpu().numpy()
    del hf_model
    for dtype in ("float32", "bfloat16"):
        model = DeepseekV2.from_pretrained(tmp_path, dtype=dtype)
        err = rel_err(cupy.asnumpy(model(ids)).astype(np.float64), expected)
        assert err <= MODEL_TOL[dtype], (dtype, err)


@pytest.fixture(scope="module")
def tiny():
    return DeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2", dtype="float32")


def test_ragged_batches_equal_single_runs(tiny):
    prompts = [[5, 17, 200, 4], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [42]]
    batch = tiny.generate(prompts, 20, temperature=0)
    assert [s.tolist() for s in batch] == [tiny.generate([p], 20, temperature=0)[0].tolist() for p in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager_decode(dtype):
    """Call 1 captures the decode step, call 2 the prompt prefill, call 3 replays both: every call equals eager
    kernels on its own fresh ragged prompts, greedy and sampled (the pick inside the graph)."""
    model = DeepseekV2.from_pretrained(DATA / "tiny-deepseek-v2", dtype=dtype)
    rng = np.random.default_rng(1)
    for call in range(3):
        prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (20, 7, 33)]
        for kw in (dict(temperature=0), dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=3)):
            graph = model.generate(prompts, 30, **kw)
            eager = model.generate(prompts, 30, use_graph=False, **kw)
            assert [s.tolist() for s in graph] == [s.tolist() for s in eager], (call, kw)
    model.forget_graphs()


def test_forward_graph_equals_eager(tiny):
    ids = np.random.default_rng(8).integers(0, tiny.config.vocab_size, (2, 40))
    eager = cupy.asnumpy(tiny(ids, use_graph=False))
    for _ in range(2):                               # capture, then replay
        assert rel_err(cupy.asnumpy(tiny(ids)), eager) < 1e-6


def test_generate_options_and_stop_rules(tiny):
    prompts = [[1, 2, 3], [7, 8]]
    a = tiny.generate(prompts, 10, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=11)
    b = tiny.generate(prompts, 10, temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=11)
    assert [s.tolist() for s in a] == [s.tolist() for s in b]
    top1 = tiny.generate(prompts, 10, temperature=1.0, top_k=1, seed=5)
    assert [s.tolist() for s in top1] == [s.tolist() for s in tiny.generate(prompts, 10, temperature=0)]
    free = tiny.generate([[10, 11, 12]], 8, temperature=0)[0]
    eos = int(free[5])                               # the third new token: the row stops at its first
    stopped = tiny.generate([[10, 11, 12]], 8, temperature=0, eos_token_id=eos)[0]
    assert stopped.tolist() == free[:3 + free[3:].tolist().index(eos) + 1].tolist()


def test_the_tuning_workload_is_what_forward_and_generate_request(tiny):
    from tilekit.autotune.op import recording
    with recording() as calls:
        tiny(np.array([[1, 2, 3]] * 2), use_graph=False)
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in tiny.kernel_problems(2, 3)}
    with recording() as calls:
        tiny.generate([[1, 2, 3, 4, 5]], 3, temperature=0, use_graph=False)
        tiny.generate([[1, 2, 3, 4, 5]], 3, temperature=1.0, top_k=50, use_graph=False)
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in tiny.kernel_problems(1, 5, 3)}


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_from_pretrained_fuses_on_the_device_as_the_host_loader_does(name, dtype):
    model = DeepseekV2.from_pretrained(DATA / name, dtype=dtype)
    host = DeepseekV2.weights.load(model.checkpoint, model.config, dtype=dtype, device=hf.HostDevice())
    assert model.params.keys() == host.keys()
    for key, array in model.params.items():
        assert isinstance(array, cupy.ndarray) and array.dtype == host[key].dtype, key
        uint = f"u{array.dtype.itemsize}"
        assert np.array_equal(cupy.asnumpy(array).view(uint), host[key].view(uint)), key


def test_save_round_trip(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    again = DeepseekV2.from_pretrained(tmp_path, dtype="float32")
    ids = np.load(DATA / "tiny-deepseek-v2" / "input_ids.npy")
    np.testing.assert_array_equal(cupy.asnumpy(tiny(ids)), cupy.asnumpy(again(ids)))
    assert rel_err(ReferenceDeepseekV2.from_pretrained(tmp_path).forward(ids),
                   np.load(DATA / "tiny-deepseek-v2" / "logits.npy")) <= 1e-5
