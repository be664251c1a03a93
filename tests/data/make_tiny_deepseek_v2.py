"""Make tests/data/tiny-deepseek-v2/ and tests/data/tiny-deepseek-v2-qlora/: tiny random DeepSeek-V2s saved by
Hugging Face transformers, with their logits and greedy continuations.

tiny-deepseek-v2: V2-Lite's structure (no query compression, a dense first layer, then mixtures of 8 routed
experts, top-3, 2 shared experts, routed_scaling_factor 1.5) with YaRN on: a short original context so that the
rotary frequencies fall in all three bands (kept, ramped, interpolated), and mscale != mscale_all_dim so that
both the cos/sin factor and the softmax-scale correction differ from 1; an untied LM head; saved in bf16 with
the experts one by one, as the hub stores them. tiny-deepseek-v2-qlora: query compression (q_lora_rank), every
layer a mixture (4 experts, top-2, 1 shared), plain RoPE, the LM head tied to the embedding; saved in bf16 with
the experts fused (save_pretrained(save_original_format=False)). Dimensions are multiples of 16 (the kernels'
tiles), the vocabulary 259 ids (256 bytes and 3 special ids), odd so that kernels meet a ragged last tile.

The weights are tilekit's random_state_dict(CONFIG, SEED) rounded to bf16, so our own code can rebuild them (the
committed fixtures were drawn when our layout still had the shared experts as a tensor of their own: a rerun draws
other weights, as valid); the
logits come from transformers' DeepseekV2ForCausalLM (fp32 with those bf16 values, eager attention) and are the
ground truth the tests hold the NumPy and GPU models to. greedy_ids.npy is input_ids followed by 32 argmax tokens,
each from transformers' logits of the whole sequence so far. The script also checks that transformers reads what
tilekit's save_state_dict writes (both expert layouts) with the same logits, that tilekit's NumPy reference
agrees, and that every routing and greedy choice wins by a margin float32 rounding cannot cross.

Run from the repository root with CPU torch and transformers in a venv of their own (not the project's):

    python3 -m venv /work/venv-hf
    /work/venv-hf/bin/pip install torch==2.13.0 transformers==5.17.0 safetensors numpy ml_dtypes cuda-tile \
        cupy-cuda13x platformdirs filelock tokenizers                   # and what tilekit imports
    /work/venv-hf/bin/python tests/data/make_tiny_deepseek_v2.py

Last run with torch 2.13.0, transformers 5.17.0, safetensors 0.8.0, ml_dtypes 0.6.0.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DeepseekV2ForCausalLM

DATA = Path(__file__).resolve().parent
sys.path.insert(0, str(DATA.parents[1]))  # the repository root, so that tilekit imports without installing

from tilekit.models.deepseek_v2.config import DeepseekV2Config, YarnScaling  # noqa: E402
from tilekit.models.deepseek_v2.reference import ReferenceDeepseekV2  # noqa: E402
from tilekit.models.deepseek_v2.weights import load_state_dict, random_state_dict, save_state_dict, to_file  # noqa: E402
from tilekit.checkpoints import write_checkpoint  # noqa: E402

VOCAB = 259  # bytes 0-255, then bos 256 and eos 257, 258
MODELS = {
    "tiny-deepseek-v2": DeepseekV2Config(
        n_layer=3, n_head=4, n_embd=64, vocab_size=VOCAB, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
        routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=YarnScaling(4.0, 64, mscale=1.0, mscale_all_dim=0.8), tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=(257, 258)),
    "tiny-deepseek-v2-qlora": DeepseekV2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, intermediate_size=64, moe_intermediate_size=16,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=0,
        routed_scaling_factor=1.0, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=True, bos_token_id=256, eos_token_id=257),
}
SEED = 20261125001
NEW_TOKENS = 32
ROUTING_MARGIN = 1e-4     # the k-th and (k+1)-th router probabilities at least this far apart
GREEDY_MARGIN = 1e-4      # the best and second logits of every greedy step at least this far apart


def hf_model(config: DeepseekV2Config, state: dict) -> DeepseekV2ForCausalLM:
    hf_config = transformers.DeepseekV2Config.from_dict(config.to_hf_dict())
    model = DeepseekV2ForCausalLM._from_config(hf_config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict({name: torch.from_numpy(np.ascontiguousarray(array))
                           for name, array in to_file(config, state, fused_experts=True).items()},
                          strict=not config.tie_word_embeddings)  # a tied model has no lm_head.weight of its own
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "the LM head must stay tied"
    attention = model.model.layers[0].self_attn
    assert abs(attention.scaling - config.softmax_scale) < 1e-12, (attention.scaling, config.softmax_scale)
    assert abs(model.model.rotary_emb.attention_scaling - (config.rope_scaling.cos_sin_factor if config.rope_scaling
                                                           else 1.0)) < 1e-12
    return model


def logits_and_routing_margin(model, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers' logits, and the smallest gap between a token's k-th and (k+1)-th router probabilities."""
    gaps = []

    def hook(module, inputs, outputs):
        p = outputs[0].softmax(-1).sort(-1, descending=True).values
        gaps.append(float((p[:, module.top_k - 1] - p[:, module.top_k]).min()))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers
               if hasattr(layer.mlp, "gate") and isinstance(layer.mlp.gate, torch.nn.Module)]
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(ids)).logits.numpy()
    finally:
        for h in handles:
            h.remove()
    return logits, min(gaps)


def make(name: str, config: DeepseekV2Config, fused_experts: bool) -> None:
    out = DATA / name
    # bf16-valued float32 weights: what the bf16 checkpoint holds, exactly.
    state = {k: torch.from_numpy(a).to(torch.bfloat16).float().numpy()
             for k, a in random_state_dict(config, SEED).items()}
    model = hf_model(config, state)

    # One row starting with bos, one of random ids (the special ids included).
    rng = np.random.default_rng(SEED)
    input_ids = rng.integers(0, VOCAB, size=(2, 16))
    input_ids[0, 0], input_ids[1, -3:] = 256, (256, 257, 258)
    logits, routing = logits_and_routing_margin(model, input_ids)
    greedy, greedy_margin = input_ids, np.inf
    for _ in range(NEW_TOKENS):
        step, margin = logits_and_routing_margin(model, greedy)
        top2 = np.sort(step[:, -1], -1)[:, -2:]
        routing, greedy_margin = min(routing, margin), min(greedy_margin, float((top2[:, 1] - top2[:, 0]).min()))
        greedy = np.concatenate([greedy, step[:, -1].argmax(-1)[:, None]], axis=1)
    assert routing > ROUTING_MARGIN and greedy_margin > GREEDY_MARGIN, (
        f"{name}: choices too close for float32 (routing {routing:.2e}, greedy {greedy_margin:.2e}): change SEED")

    out.mkdir(exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    model.to(torch.bfloat16).save_pretrained(out, save_original_format=not fused_experts)
    np.save(out / "input_ids.npy", input_ids)
    np.save(out / "logits.npy", logits.astype(np.float32))
    np.save(out / "greedy_ids.npy", greedy)

    loaded_config, loaded = load_state_dict(out)
    assert loaded_config == config and loaded.keys() == state.keys() and all(
        np.array_equal(loaded[k], state[k]) for k in state), "the checkpoint must hold the bf16-rounded state"
    for fused in (False, True):  # transformers reads what tilekit writes, in both expert layouts
        with tempfile.TemporaryDirectory() as tmp:
            if fused:
                write_checkpoint(tmp, config.to_hf_dict(), to_file(config, state, fused_experts=True))
            else:
                save_state_dict(tmp, config, state)
            again = DeepseekV2ForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
            assert np.array_equal(logits_and_routing_margin(again.eval(), input_ids)[0], logits), (
                f"tilekit's save (fused experts: {fused}) must round-trip")
    reference = ReferenceDeepseekV2(config, state)
    err = np.linalg.norm(reference.forward(input_ids) - logits) / np.linalg.norm(logits)
    assert err <= 1e-5 and np.array_equal(reference.generate_greedy(input_ids, NEW_TOKENS), greedy), err
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {files}, {sum(p.stat().st_size for p in out.iterdir())} bytes; reference rel err {err:.1e}, "
          f"margins: routing {routing:.1e}, greedy {greedy_margin:.1e}")


if __name__ == "__main__":
    for (name, config), fused in zip(MODELS.items(), (False, True)):
        make(name, config, fused)
