"""Make tests/data/tiny-llama/ and tests/data/tiny-llama-tied/: tiny random Llamas saved by Hugging Face
transformers, with their logits.

tiny-llama: grouped-query attention (4 heads, 2 KV heads), Llama 3.1 rope scaling with a short original
context so that its frequencies fall in all three bands (kept, interpolated, stretched), an untied LM head,
saved in bf16 and sharded (model.safetensors.index.json + shards). tiny-llama-tied: multi-query attention
(1 KV head), plain RoPE, the LM head tied to the embedding, bf16 in one model.safetensors. The vocabulary,
259 ids, is 256 bytes and 3 special ids, odd so that kernels meet a ragged last tile.

The weights are tilekit's random_state_dict(CONFIG, SEED) rounded to bf16, so our own code can rebuild them;
the logits come from transformers' LlamaForCausalLM (fp32 with those bf16 values, eager attention) and are the
ground truth the tests hold the NumPy and GPU models to. greedy_ids.npy is input_ids followed by 8 argmax
tokens, each from transformers' logits of the whole sequence so far. The script also checks that
transformers reads a checkpoint written by tilekit's save_state_dict and computes the same logits.

Run from the repository root with CPU torch and transformers in a venv of their own (not the project's):

    python3 -m venv /tmp/fixture-venv
    /tmp/fixture-venv/bin/pip install torch==2.13.0 transformers safetensors \
        numpy ml_dtypes cuda-tile cupy-cuda13x platformdirs filelock          # and what tilekit imports
    /tmp/fixture-venv/bin/python tests/data/make_tiny_llama.py

Last run with torch 2.13.0, transformers 5.23.0, safetensors 0.8.0, ml_dtypes 0.6.0.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaForCausalLM

DATA = Path(__file__).resolve().parent
sys.path.insert(0, str(DATA.parents[1]))  # the repository root, so that tilekit imports without installing

from tilekit.models.llama.weights import load_state_dict, random_state_dict, save_state_dict  # noqa: E402
from tilekit.models.llama.config import LlamaConfig, RopeScaling  # noqa: E402

VOCAB = 259  # bytes 0-255, then bos 256 and eos 257, 258
MODELS = {
    "tiny-llama": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128, vocab_size=VOCAB,
                              max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500000.0,
                              rope_scaling=RopeScaling(8.0, 1.0, 4.0, 256), tie_word_embeddings=False,
                              bos_token_id=256, eos_token_id=(257, 258)),
    "tiny-llama-tied": LlamaConfig(n_layer=2, n_head=4, n_kv_head=1, n_embd=64, intermediate_size=96,
                                   vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6,
                                   rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                                   bos_token_id=256, eos_token_id=257),
}
SEED = 20250101
NEW_TOKENS = 8


def hf_model(config: LlamaConfig, state: dict) -> LlamaForCausalLM:
    hf_config = transformers.LlamaConfig.from_dict(config.to_hf_dict())
    model = LlamaForCausalLM._from_config(hf_config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict({name: torch.from_numpy(array) for name, array in state.items()},
                          strict=not config.tie_word_embeddings)  # a tied model has no lm_head.weight of its own
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "the LM head must stay tied"
    return model


def logits_of(model: LlamaForCausalLM, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def make(name: str, config: LlamaConfig) -> None:
    out = DATA / name
    # bf16-valued float32 weights: what the bf16 checkpoint holds, exactly.
    state = {k: torch.from_numpy(a).to(torch.bfloat16).float().numpy()
             for k, a in random_state_dict(config, SEED).items()}
    model = hf_model(config, state)

    # One row starting with bos, one of random ids (the special ids included).
    rng = np.random.default_rng(SEED)
    input_ids = rng.integers(0, VOCAB, size=(2, 16))
    input_ids[0, 0], input_ids[1, -3:] = 256, (256, 257, 258)
    logits = logits_of(model, input_ids)
    greedy = input_ids
    for _ in range(NEW_TOKENS):
        greedy = np.concatenate([greedy, logits_of(model, greedy)[:, -1].argmax(-1)[:, None]], axis=1)

    out.mkdir(exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    model.to(torch.bfloat16).save_pretrained(out, max_shard_size="100KB" if name == "tiny-llama" else "10MB")
    np.save(out / "input_ids.npy", input_ids)
    np.save(out / "logits.npy", logits.astype(np.float32))
    np.save(out / "greedy_ids.npy", greedy)

    loaded_config, loaded = load_state_dict(out)
    assert loaded_config == config and loaded.keys() == state.keys() and all(
        np.array_equal(loaded[k], state[k]) for k in state), "the checkpoint must hold the bf16-rounded state"
    with tempfile.TemporaryDirectory() as tmp:  # transformers reads what tilekit writes
        save_state_dict(tmp, config, state)
        again = LlamaForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
        assert np.array_equal(logits_of(again.eval(), input_ids), logits), "tilekit's save must round-trip"
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {files}, {sum(p.stat().st_size for p in out.iterdir())} bytes")


if __name__ == "__main__":
    for name, config in MODELS.items():
        make(name, config)
