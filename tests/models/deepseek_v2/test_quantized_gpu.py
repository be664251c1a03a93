"""A quantized DeepSeek-V2 on the GPU: its logits against the float64 reference of its own dequantized weights
(tight) and against the bf16 model of the same weights (a stated bound, greedy agreement printed), every checkpoint
layout loaded on the device as the host loader does, load-time quantization equal to construction, save_pretrained
read back bit for bit, CUDA-graph decode equal to eager decode, and V2-Lite's layer shapes. The CPU half (the same
step code on NumPy kernels) is test_quantized.py."""

import numpy as np
import pytest

from tilekit.kernels.checks import rel_err

cupy = pytest.importorskip("cupy")

from tests.models.deepseek_v2.test_quantized import CONFIG, LAYOUTS, LORA, write_quantized  # noqa: E402
from tests.models.quantized_checks import W8A8_TOL, WEIGHT_ONLY_TOL, assert_near_bf16, logits  # noqa: E402
from tilekit.models import DEEPSEEK_V2_PRESETS, DeepseekV2, ReferenceDeepseekV2  # noqa: E402
from tilekit.models.deepseek_v2 import weights  # noqa: E402
from tilekit.models.base import W8A8_MIN_ROWS  # noqa: E402

pytestmark = pytest.mark.gpu

# The bounds (tests/models/quantized_checks.py) are Llama's: bf16 activations on exact dequantized weights hold the
# family's bf16 tolerance; FP8 activations (W8A8) measured about 1% here on the CPU (test_quantized.py), 3.3% for
# Llama; against the bf16 model int8 0.3-0.7% and fp8 1.4-3.3% on the CPU (test_quantized.VS_FLOAT), plus bf16's ~1%
# and the odd token routed to another expert.


ROUTING_MARGIN = 1e-2      # router probability gap, about 10x what bf16 activations move it by here


class MarginReference(ReferenceDeepseekV2):
    """The float64 reference, recording each token's smallest gap between its k-th and (k+1)-th router probability
    over the MoE layers: below about ROUTING_MARGIN, bf16 rounding upstream may route the token to another expert, a
    discontinuity no logits tolerance covers (seen once: 2.1% against the 2% bound, 4 experts top-2)."""

    margins = None

    def _moe(self, h, prefix):
        logits = h.reshape(-1, self.config.n_embd) @ self.state[prefix + "gate.weight"].astype(np.float64).T
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = np.sort(p / p.sum(-1, keepdims=True), -1)[:, ::-1]
        k = self.config.num_experts_per_tok
        gap = p[:, k - 1] - p[:, k]
        self.margins = gap if self.margins is None else np.minimum(self.margins, gap)
        return super()._moe(h, prefix)


@pytest.mark.parametrize("config", [CONFIG, LORA], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("tokens", [5, W8A8_MIN_ROWS + 3])
def test_logits_match_reference_of_dequantized_weights(config, kind, tokens):
    """Compared on the tokens routed clear of a tie (the last MoE layer's choice reaches no other token here)."""
    model = DeepseekV2(config, state=weights.random_state_dict(config, seed=3), quantize=kind)
    ids = np.random.default_rng().integers(0, config.vocab_size, (2, tokens))
    reference = MarginReference(config, model.state_dict())
    expected = reference.forward(ids)
    clear = (reference.margins >= ROUTING_MARGIN).reshape(ids.shape)
    assert config.n_layer == 2 and clear.mean() >= 0.5, clear.mean()
    tol = W8A8_TOL if kind == "fp8" and 2 * tokens >= W8A8_MIN_ROWS else WEIGHT_ONLY_TOL
    err = rel_err(logits(model, ids)[clear], expected[clear])
    assert err <= tol, err


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_against_the_bf16_model(kind):
    assert_near_bf16(DeepseekV2, LORA, weights.random_state_dict(LORA, seed=4), kind, "deepseek-v2 ")


@pytest.mark.parametrize("config", [CONFIG, LORA], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_layouts_load_as_on_the_host_and_run(layout, config, tmp_path):
    """Each layout's codes, scales and dequantized experts on the device equal the host loader's bit for bit (fp32),
    the logits the float64 reference of the dequantized weights, and save_pretrained reads back bit for bit."""
    expected = write_quantized(tmp_path, config, *LAYOUTS[layout])
    model = DeepseekV2.from_pretrained(tmp_path / "q", dtype="float32")
    state = model.state_dict()
    for name, w in expected.items():
        np.testing.assert_array_equal(state[name], w, err_msg=name)
    ids = np.random.default_rng().integers(0, config.vocab_size, (2, 9))
    assert rel_err(logits(model, ids), ReferenceDeepseekV2(config, expected).forward(ids)) <= 1e-5
    model.save_pretrained(tmp_path / "out")
    again = DeepseekV2.from_pretrained(tmp_path / "out", dtype="float32")
    for name, array in model.params.items():
        np.testing.assert_array_equal(cupy.asnumpy(again.params[name]).view(np.uint8),
                                      cupy.asnumpy(array).view(np.uint8), err_msg=name)
    np.testing.assert_array_equal(logits(again, ids), logits(model, ids))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_load_time_quantization_equals_construction(kind, tmp_path):
    """Codes, scales and the float tensors (experts, kv_b_proj, o_proj) alike."""
    state = weights.random_state_dict(LORA, seed=5)
    weights.save_state_dict(tmp_path, LORA, state, dtype="float32")
    loaded = DeepseekV2.from_pretrained(tmp_path, quantize=kind)
    built = DeepseekV2(LORA, state=state, quantize=kind)
    for name, array in built.params.items():
        np.testing.assert_array_equal(cupy.asnumpy(loaded.params[name]), cupy.asnumpy(array), err_msg=name)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_cuda_graph_decode_equals_eager_decode(kind):
    model = DeepseekV2(CONFIG, state=weights.random_state_dict(CONFIG, seed=6), quantize=kind)
    rng = np.random.default_rng(1)
    for call in range(3):
        prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (20, 7, W8A8_MIN_ROWS + 5)]
        graph = model.generate(prompts, 12, temperature=0)
        eager = model.generate(prompts, 12, temperature=0, use_graph=False)
        assert [s.tolist() for s in graph] == [s.tolist() for s in eager], call
    model.forget_graphs()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_v2_lite_layer_shapes(kind):
    """V2-Lite's dense layer and one MoE layer (a small vocabulary keeps the float64 reference quick): the quantized
    linears at their real shapes (split-K decode GEMVs, W8A8 prefill)."""
    config = DEEPSEEK_V2_PRESETS["deepseek-v2-lite"].replace(n_layer=2, vocab_size=1031, bos_token_id=1,
                                                             eos_token_id=2)
    model = DeepseekV2(config, state=weights.random_state_dict(config, seed=1), quantize=kind)
    expected_state = model.state_dict()
    for tokens in (3, W8A8_MIN_ROWS):
        ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, tokens))
        tol = W8A8_TOL if kind == "fp8" and tokens >= W8A8_MIN_ROWS else WEIGHT_ONLY_TOL
        err = rel_err(logits(model, ids), ReferenceDeepseekV2(config, expected_state).forward(ids))
        assert err <= tol, (tokens, err)
    out = model.generate([[5, 6, 7]], 4, temperature=0)[0]
    assert len(out) == 7


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_tuning_workload_is_what_forward_and_generate_request(kind):
    """What `tilekit tune --model ... --quantize` tunes (kernel_problems on MetaArrays) is what the quantized model
    asks for, W8A8 prefill included."""
    from tilekit.autotune.op import recording
    model = DeepseekV2(CONFIG, state=weights.random_state_dict(CONFIG, seed=7), quantize=kind)
    T = W8A8_MIN_ROWS + 1
    with recording() as calls:
        model(np.ones((1, T), np.int64), use_graph=False)
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in model.kernel_problems(1, T)}
    with recording() as calls:
        model.generate([[1, 2, 3, 4, 5]], 3, temperature=0, use_graph=False)
        model.generate([[1, 2, 3, 4, 5]], 3, temperature=1.0, top_k=50, use_graph=False)
    assert {(op.name, op.problem_key(p)[1]) for op, p in calls} == \
        {(op.name, op.problem_key(p)[1]) for op, p in model.kernel_problems(1, 5, 3)}
