"""tilekit.patch on Hugging Face GPT-2, Llama and DeepSeek-V2 models: logits and greedy tokens against the same model unpatched
(dynamic cache, static cache, a left-padded batch), unpatch restoring it bit for bit, and every refusal raising
before anything changed."""

import contextlib
import re
from pathlib import Path

import numpy as np
import pytest

from tilekit.kernels.checks import assert_close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tilekit  # noqa: E402
from benchmarks.suites.model import build_hf, hf_config, nudged  # noqa: E402
from tilekit.models import GPTConfig, LlamaConfig  # noqa: E402

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parent / "data"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
NEW_TOKENS = 16
GPT2_SMALL = GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=1031, block_size=256)
GQA = LlamaConfig(n_layer=2, n_head=8, n_kv_head=2, n_embd=512, intermediate_size=1024, vocab_size=1031,
                  max_position_embeddings=512, rope_scaling=None, bos_token_id=1, eos_token_id=2)


def ready(model):
    """Eval mode; every generate makes all its new tokens and pads with the last token id."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.vocab_size - 1
    return model.eval()


def fixture(name: str, dtype: str):
    """A committed tiny checkpoint (tests/data) through transformers' from_pretrained, on the GPU."""
    cls = (transformers.GPT2LMHeadModel if "gpt2" in name else transformers.DeepseekV2ForCausalLM if "deepseek" in name
           else transformers.LlamaForCausalLM)
    return ready(cls.from_pretrained(DATA / name, dtype=getattr(torch, dtype), attn_implementation="sdpa").cuda())


def synthetic(config, dtype: str, **overrides):
    """A random HF model of a tilekit GPTConfig or LlamaConfig (benchmarks.suites.model's HF configs), `overrides` set
    on its HF config, biases and norm weights moved off 0 and 1 (benchmarks.suites.model.nudged)."""
    llama = isinstance(config, LlamaConfig)
    hf = hf_config(config, "sdpa")
    for key, value in overrides.items():
        setattr(hf, key, value)
    cls = transformers.LlamaForCausalLM if llama else transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls._from_config(hf, attn_implementation="sdpa", dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if nudged(name):
                p.add_(0.02 * torch.randn_like(p))
    return ready(model)


# name -> (builder(dtype), prompt length of the logits test)
MODELS = {
    "tiny-gpt2": (lambda dtype: fixture("tiny-gpt2", dtype), 50),
    "tiny-llama": (lambda dtype: fixture("tiny-llama", dtype), 50),             # GQA, llama3 rope, untied head
    "tiny-llama-tied": (lambda dtype: fixture("tiny-llama-tied", dtype), 50),   # one key/value head, tied head
    "tiny-deepseek-v2": (lambda dtype: fixture("tiny-deepseek-v2", dtype), 50),        # MLA with YaRN, MoE
    "tiny-deepseek-v2-qlora": (lambda dtype: fixture("tiny-deepseek-v2-qlora", dtype), 40),   # q_lora, all MoE
    "gpt2-scaled": (lambda dtype: synthetic(GPT2_SMALL, dtype, scale_attn_by_inverse_layer_idx=True,
                                            reorder_and_upcast_attn=True), 200),
    "llama-gqa": (lambda dtype: build_hf(GQA, "sdpa", dtype=dtype, seed=0), 200),  # 8 heads over 2, head_dim 64
    "llama-attention-bias": (lambda dtype: synthetic(GQA, dtype, attention_bias=True), 200),
}


def build(name: str, dtype: str):
    return MODELS[name][0](dtype)


def random_ids(model, batch: int, length: int, rng=None):
    rng = np.random.default_rng() if rng is None else rng
    return torch.from_numpy(rng.integers(0, model.config.vocab_size - 1, (batch, length))).cuda()


@contextlib.contextmanager
def patched(model):
    tilekit.patch(model)
    try:
        yield model
    finally:
        tilekit.unpatch(model)


def greedy(model, ids, mask=None, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, **kw)


def snapshot(model) -> tuple:
    """What patch changes: the attention implementation, disable_compile and every instance-level forward."""
    return (model.config._attn_implementation, model.generation_config.disable_compile,
            {name: vars(m).get("forward") for name, m in model.named_modules()})


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_unpatched_and_unpatch_restores_them(name, dtype):
    model = build(name, dtype)
    ids = random_ids(model, 2, MODELS[name][1])
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        with patched(model):
            got = model(ids, use_cache=False).logits
        again = model(ids, use_cache=False).logits
    assert_close(got.double().cpu().numpy(), expected.double().cpu().numpy(), TOL[dtype], f"{name} {dtype}")
    assert torch.equal(again, expected), "unpatched logits changed"


@pytest.mark.parametrize("name", MODELS)
def test_fp32_greedy_tokens_match_unpatched(name):
    model = build(name, "float32")
    prompt = random_ids(model, 2, 24, np.random.default_rng(1))
    expected = greedy(model, prompt)
    with patched(model):
        got = greedy(model, prompt)
    assert got.shape == (2, 24 + NEW_TOKENS) and torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_left_padded_batch_matches_unpatched(name):
    """Padding makes transformers build a mask: every layer's attention falls back to sdpa, the rest is tilekit."""
    model = build(name, "float32")
    rng, width = np.random.default_rng(2), 24
    ids = torch.full((3, width), model.config.vocab_size - 1, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for row, n in enumerate((24, 15, 7)):
        ids[row, width - n:] = random_ids(model, 1, n, rng)[0]
        mask[row, width - n:] = 1
    expected = greedy(model, ids, mask)
    with patched(model):
        got = greedy(model, ids, mask)
    assert torch.equal(got, expected), (got, expected)


def test_static_cache_matches_unpatched():
    """A static cache's prefill sees more keys than queries and no mask (tilekit keeps the first ones, as sdpa
    does); its decode steps get a mask (sdpa)."""
    model = build("tiny-llama", "float32")
    prompt = random_ids(model, 2, 24, np.random.default_rng(3))
    expected = greedy(model, prompt, cache_implementation="static", disable_compile=True)
    with patched(model):
        got = greedy(model, prompt, cache_implementation="static")
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("name, swapped", [("tiny-gpt2", 2 * 7 + 2), ("tiny-llama", 2 * 10 + 2)])
def test_patch_swaps_each_module_and_unpatch_restores_the_model(name, swapped):
    """GPT-2: per block ln_1, c_attn, attn.c_proj, ln_2, mlp, c_fc, mlp.c_proj; Llama: per layer two norms, four
    attention projections, mlp and its three projections; both: the final norm and lm_head."""
    model = build(name, "float32")
    before = snapshot(model)
    tilekit.patch(model)
    assert model.config._attn_implementation == "tilekit" and model.generation_config.disable_compile is True
    assert len([m for m in model.modules() if "forward" in vars(m)]) == swapped
    tilekit.unpatch(model)
    assert snapshot(model) == before
    assert not any("forward" in vars(m) for m in model.modules())


def test_patch_twice_and_unpatch_twice_are_refused():
    model = build("tiny-gpt2", "float32")
    with patched(model):
        before = snapshot(model)
        with pytest.raises(ValueError, match="already patched"):
            tilekit.patch(model)
        assert snapshot(model) == before
    with pytest.raises(ValueError, match="not patched"):
        tilekit.unpatch(model)
    with pytest.raises(TypeError, match="builtins.object"):
        tilekit.patch(object())


def _with_half_norm(model):
    model.model.norm.half()
    return model


def _with_hooked_head(model):
    model.lm_head.forward = model.lm_head.forward      # an instance-level forward, as accelerate's hooks leave one
    return model


# case -> (builder of a model patch must refuse, what the error names)
REFUSALS = {
    "training": (lambda: build("tiny-gpt2", "float32").train(), "model.eval()"),
    "cpu": (lambda: build("tiny-gpt2", "float32").cpu(), "cpu"),
    "float64": (lambda: build("tiny-llama", "float32").double(), "dtype float64"),
    "mixed dtypes": (lambda: _with_half_norm(build("tiny-llama", "float32")), "model.norm.weight"),
    "hooked module": (lambda: _with_hooked_head(build("tiny-llama", "float32")), "lm_head already has a forward"),
    "erf gelu": (lambda: synthetic(GPT2_SMALL, "float32", activation_function="gelu"), "activation_function='gelu'"),
    "cross-attention": (lambda: synthetic(GPT2_SMALL, "float32", add_cross_attention=True), "add_cross_attention"),
    "gpt2 head_dim": (lambda: synthetic(GPT2_SMALL.replace(n_head=1, n_embd=512), "float32"), "head_dim 512"),
    "mlp bias": (lambda: synthetic(GQA, "float32", mlp_bias=True), "mlp_bias=True"),
    "gelu llama": (lambda: synthetic(GQA, "float32", hidden_act="gelu"), "hidden_act='gelu'"),
    "llama head_dim": (lambda: synthetic(GQA, "float32", head_dim=512), "head_dim 512"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_change_nothing(case):
    make, names = REFUSALS[case]
    model = make()
    before = snapshot(model)
    with pytest.raises(ValueError, match=re.escape(names)):
        tilekit.patch(model)
    assert snapshot(model) == before
    with pytest.raises(ValueError, match="not patched"):
        tilekit.unpatch(model)
