"""GPT-2's weights in Hugging Face checkpoints: tensor names and shapes, loading, saving, random weights.

Tensor names here are GPT2Model's ("h.0.ln_1.weight"; GPT2LMHeadModel puts "transformer." before them),
weights are laid out [in, out] like GPT-2's Conv1D, and the LM head is tied to wte. The files themselves are
read and written by tilekit.models.checkpoints.
"""

from __future__ import annotations

import math

from tilekit import parallel
from tilekit import checkpoints
from tilekit.models.quantizable import Quantizable
from tilekit.models.gpt2.config import GPTConfig

HUB_ORGS = ("openai-community",)     # where a bare hub name ("gpt2") is also looked up
PREFIX = "transformer."  # what GPT2LMHeadModel puts before GPT2Model's names
EMBEDDING = "wte.weight"
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers that old checkpoints carry
QUANTIZATION = Quantizable()      # no quantized linears (tilekit.models.quantization)


def state_dict_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a GPT-2 of this config has (the tied LM head excluded)."""
    C, V, P = config.n_embd, config.vocab_size, config.block_size
    shapes = {EMBEDDING: (V, C), "wpe.weight": (P, C)}
    for i in range(config.n_layer):
        shapes.update(block_shapes(config, i))
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


def weight_stats(config: GPTConfig, name: str) -> tuple[float, float]:
    """(mean, standard deviation) of random weights for tensor `name`: linear and embedding weights ~ N(0, 0.02),
    the residual projections (c_proj) scaled by 1/sqrt(2 n_layer) as in GPT-2; biases and LayerNorm parameters
    are random too (LayerNorm weights ~ N(1, 0.1)), not 0 and 1, so that tests exercise them."""
    if ".ln_" in name or name.startswith("ln_f."):
        return (1.0 if name.endswith(".weight") else 0.0), 0.1
    if name.endswith("c_proj.weight"):
        return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
    return 0.0, 0.02


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


def shard_parts(config: GPTConfig, rank: int, world: int) -> dict[str, tuple[int, ...]]:
    """Name -> (axis, start, stop[, groups]): the slice of each tensor tensor-parallel rank `rank` of `world` holds
    (checkpoints.Target.part). Weights are [in, out]: c_attn (its q, k and v column blocks alike) and c_fc split by
    columns (column-parallel), both c_proj by rows (row-parallel; their biases whole, added by rank 0). wte (also
    the tied LM head, of which each rank uses a row view), wpe and the LayerNorms stay whole."""
    C, D = config.n_embd, config.head_dim
    h0, h1 = parallel.even_span(config.n_head, rank, world, "n_head")
    i0, i1 = parallel.even_span(4 * C, rank, world, "the MLP width (4 n_embd)")
    parts = {}
    for i in range(config.n_layer):
        parts.update({f"h.{i}.attn.c_attn.weight": (1, h0 * D, h1 * D, 3),
                      f"h.{i}.attn.c_attn.bias": (0, h0 * D, h1 * D, 3),
                      f"h.{i}.attn.c_proj.weight": (0, h0 * D, h1 * D), f"h.{i}.mlp.c_fc.weight": (1, i0, i1),
                      f"h.{i}.mlp.c_fc.bias": (0, i0, i1), f"h.{i}.mlp.c_proj.weight": (0, i0, i1)})
    return parts


# The family's resolve / load / load_state_dict / save_state_dict / check_state_dict / random_state_dict
LAYOUT = checkpoints.CheckpointLayout(GPTConfig, state_dict_shapes, weight_stats, EMBEDDING, PREFIX, BUFFER_SUFFIXES, HUB_ORGS)
resolve, load, check_state_dict = LAYOUT.resolve, LAYOUT.load, LAYOUT.check_state_dict
load_state_dict, save_state_dict = LAYOUT.load_state_dict, LAYOUT.save_state_dict
random_state_dict = LAYOUT.random_state_dict
