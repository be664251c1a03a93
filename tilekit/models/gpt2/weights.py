"""GPT-2's weights in Hugging Face checkpoints: tensor names and shapes, loading, saving, random weights.

Tensor names here are GPT2Model's ("h.0.ln_1.weight"; GPT2LMHeadModel puts "transformer." before them),
weights are laid out [in, out] like GPT-2's Conv1D, and the LM head is tied to wte. The files themselves are
read and written by tilekit.models.hf.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from tilekit.models import hf
from tilekit.models.gpt2.config import GPTConfig

WEIGHTS_FILES = (hf.WEIGHTS_NAME,)   # the weights files a GPT-2 checkpoint may have
HUB_ORGS = ("openai-community",)     # where a bare hub name ("gpt2") is also looked up
PREFIX = "transformer."  # what GPT2LMHeadModel puts before GPT2Model's names
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers that old checkpoints carry


def resolve(path_or_name: str | Path) -> Path:
    """The directory of a GPT-2 checkpoint: a directory, or a hub model name in the local cache."""
    return hf.resolve_checkpoint(path_or_name, WEIGHTS_FILES, HUB_ORGS)


def state_dict_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a GPT-2 of this config has (the tied LM head excluded)."""
    C, V, P = config.n_embd, config.vocab_size, config.block_size
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C)}
    for i in range(config.n_layer):
        shapes.update(block_shapes(config, i))
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


def block_shapes(config: GPTConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of block i."""
    C = config.n_embd
    return {
        f"h.{i}.ln_1.weight": (C,), f"h.{i}.ln_1.bias": (C,),
        f"h.{i}.attn.c_attn.weight": (C, 3 * C), f"h.{i}.attn.c_attn.bias": (3 * C,),
        f"h.{i}.attn.c_proj.weight": (C, C), f"h.{i}.attn.c_proj.bias": (C,),
        f"h.{i}.ln_2.weight": (C,), f"h.{i}.ln_2.bias": (C,),
        f"h.{i}.mlp.c_fc.weight": (C, 4 * C), f"h.{i}.mlp.c_fc.bias": (4 * C,),
        f"h.{i}.mlp.c_proj.weight": (4 * C, C), f"h.{i}.mlp.c_proj.bias": (C,),
    }


def check_state_dict(config: GPTConfig, state: dict, source: str = "state dict") -> None:
    """Raise ValueError listing every missing, unexpected, misshapen or non-float tensor of `source`."""
    hf.check_tensors(state_dict_shapes(config), state, f"{source} does not match {config}")


def load_state_dict(path_or_name: str | Path, dtype=np.float32) -> tuple[GPTConfig, dict[str, np.ndarray]]:
    """Config and validated tensors (canonical names, C-contiguous, `dtype`) of a GPT-2 checkpoint."""
    dtype = hf.float_dtype(dtype)
    directory = resolve(path_or_name)
    config = GPTConfig.from_json(directory / hf.CONFIG_NAME)
    source, tensors = hf.read_checkpoint_tensors(directory, BUFFER_SUFFIXES)
    state = {}
    for name, array in tensors.items():
        key = name.removeprefix(PREFIX)
        if key in state:
            raise ValueError(f"tensor {key!r} appears twice (with and without {PREFIX!r}) in {source}")
        state[key] = array
    hf.pop_tied_lm_head(state, "wte.weight", str(source))
    check_state_dict(config, state, source=str(source))
    return config, {name: np.ascontiguousarray(state[name], dtype=dtype) for name in state_dict_shapes(config)}


def save_state_dict(directory: str | Path, config: GPTConfig, state: dict[str, np.ndarray]) -> None:
    """Write config.json and a float32 model.safetensors that GPT2LMHeadModel.from_pretrained reads."""
    check_state_dict(config, state)
    hf.write_checkpoint(directory, config.to_hf_dict(), {PREFIX + name: array for name, array in state.items()})


def random_state_dict(config: GPTConfig, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """GPT-2 style random weights, deterministic for `seed`.

    Linear and embedding weights ~ N(0, 0.02), the residual projections (c_proj) scaled by 1/sqrt(2 n_layer)
    as in GPT-2. Biases and LayerNorm parameters are random too, not 0 and 1, so tests exercise them.
    """
    def stats(name: str) -> tuple[float, float]:
        if ".ln_" in name or name.startswith("ln_f."):
            return (1.0 if name.endswith(".weight") else 0.0), 0.1
        if name.endswith("c_proj.weight"):
            return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
        return 0.0, 0.02
    return hf.random_tensors(state_dict_shapes(config), seed, dtype, stats)
