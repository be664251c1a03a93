"""Llama's weights in Hugging Face checkpoints: tensor names and shapes, loading, saving, random weights.

Tensor names are LlamaForCausalLM's ("model.layers.0.self_attn.q_proj.weight"), weights are nn.Linear's
[out, in], and lm_head.weight exists unless the config ties it to model.embed_tokens.weight. A checkpoint may be
single-file or sharded; tilekit.models.hf reads and writes the files, every one untrusted input.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tilekit.models import hf
from tilekit.models.llama.config import LlamaConfig

WEIGHTS_FILES = (hf.WEIGHTS_NAME, hf.INDEX_NAME)   # the weights files a Llama checkpoint may have
HUB_ORGS = ("meta-llama",)                          # where a bare hub name ("Llama-3.2-1B") is also looked up
PREFIX = ""                                         # LlamaForCausalLM's names are ours
EMBEDDING = "model.embed_tokens.weight"
BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer that checkpoints of older transformers carry


def resolve(path_or_name: str | Path) -> Path:
    """The directory of a Llama checkpoint: a directory, or a hub model name in the local cache."""
    return hf.resolve_checkpoint(path_or_name, WEIGHTS_FILES, HUB_ORGS)


def state_dict_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama of this config has (lm_head only when untied)."""
    C, V = config.n_embd, config.vocab_size
    shapes = {EMBEDDING: (V, C)}
    for i in range(config.n_layer):
        shapes.update(block_shapes(config, i))
    shapes["model.norm.weight"] = (C,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def block_shapes(config: LlamaConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of decoder layer i."""
    C, I = config.n_embd, config.intermediate_size
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (C,),
        p + "self_attn.q_proj.weight": (q, C), p + "self_attn.k_proj.weight": (kv, C),
        p + "self_attn.v_proj.weight": (kv, C), p + "self_attn.o_proj.weight": (C, q),
        p + "post_attention_layernorm.weight": (C,),
        p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C), p + "mlp.down_proj.weight": (C, I),
    }


def check_state_dict(config: LlamaConfig, state: dict, source: str = "state dict") -> None:
    """Raise ValueError listing every missing, unexpected, misshapen or non-float tensor of `source`."""
    hf.check_tensors(state_dict_shapes(config), state, f"{source} does not match {config}")


def load_state_dict(path_or_name: str | Path, dtype=np.float32) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Config and validated tensors (canonical names, C-contiguous, `dtype`) of a Llama checkpoint.

    `path_or_name` is a directory or a hub model name in the local cache ("Llama-3.2-1B" is also looked up as
    "meta-llama/Llama-3.2-1B"). BF16, FP16 and FP32 tensors load, from one file or from shards.
    """
    dtype = hf.float_dtype(dtype)
    directory = resolve(path_or_name)
    config = LlamaConfig.from_json(directory / hf.CONFIG_NAME)
    source, state = hf.read_checkpoint_tensors(directory, BUFFER_SUFFIXES)
    if config.tie_word_embeddings:
        hf.pop_tied_lm_head(state, EMBEDDING, str(source))
    check_state_dict(config, state, source=str(source))
    return config, {name: np.ascontiguousarray(state[name], dtype=dtype) for name in state_dict_shapes(config)}


def save_state_dict(directory: str | Path, config: LlamaConfig, state: dict[str, np.ndarray]) -> None:
    """Write config.json and a float32 model.safetensors that LlamaForCausalLM.from_pretrained reads."""
    check_state_dict(config, state)
    hf.write_checkpoint(directory, config.to_hf_dict(), state)


def random_state_dict(config: LlamaConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Llama-style random weights, deterministic for `seed`.

    Projections and embeddings ~ N(0, 0.02), the residual ones (o_proj, down_proj) scaled by 1/sqrt(2 n_layer).
    RMSNorm weights ~ N(1, 0.1), not all ones, so tests exercise them.
    """
    return hf.random_tensors(state_dict_shapes(config), seed, dtype, lambda name: weight_stats(config, name))


def weight_stats(config: LlamaConfig, name: str) -> tuple[float, float]:
    """(mean, standard deviation) of random weights for tensor `name` (see random_state_dict)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
    return 0.0, 0.02
