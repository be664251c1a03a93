"""Llama's weights in Hugging Face checkpoints: tensor names and shapes, loading, saving, random weights.

Tensor names are LlamaForCausalLM's ("model.layers.0.self_attn.q_proj.weight"), weights are nn.Linear's
[out, in], and lm_head.weight exists unless the config ties it to model.embed_tokens.weight. A checkpoint may be
single-file or sharded; tilekit.checkpoints reads and writes the files, every one untrusted input.
"""

from __future__ import annotations

import math

from tilekit import parallel
from tilekit import checkpoints
from tilekit.models.quantizable import Quantizable
from tilekit.models.llama.config import LlamaConfig

HUB_ORGS = ("meta-llama",)                          # where a bare hub name ("Llama-3.2-1B") is also looked up
PREFIX = ""                                         # LlamaForCausalLM's names are ours
EMBEDDING = "model.embed_tokens.weight"
BUFFER_SUFFIXES = (".rotary_emb.inv_freq",)  # a buffer that checkpoints of older transformers carry
QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")  # the linears a quantized model holds in 8 bits (tilekit.models.quantization)
QUANTIZED_HEAD = True     # and an untied LM head, quantized at load or stored as codes (quantization.head_quantized)
# a quantized checkpoint's static FP8 KV-cache scales, each layer's under one of these suffixes (keys', values'):
# compressed-tensors' names, then ModelOpt's (quantization.read_kv_scales)
KV_SCALES = (("self_attn.k_scale", "self_attn.k_proj.k_scale"), ("self_attn.v_scale", "self_attn.v_proj.v_scale"))
QUANTIZATION = Quantizable(QUANTIZED, head=QUANTIZED_HEAD, kv_scales=KV_SCALES)


def layer_prefixes(config: LlamaConfig) -> list[str]:
    """The tensor-name prefix of each decoder layer."""
    return [f"model.layers.{i}." for i in range(config.n_layer)]


def state_dict_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a Llama of this config has (lm_head only when untied)."""
    return checkpoints.decoder_shapes(config, block_shapes, EMBEDDING)


def weight_stats(config: LlamaConfig, name: str) -> tuple[float, float]:
    """(mean, standard deviation) of random weights for tensor `name`: projections and embeddings ~ N(0, 0.02),
    the residual ones (o_proj, down_proj) scaled by 1/sqrt(2 n_layer); RMSNorm weights ~ N(1, 0.1), not all ones,
    so that tests exercise them."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
    return 0.0, 0.02


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


def shard_parts(config: LlamaConfig, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """Name -> (axis, start, stop): the slice of each tensor that tensor-parallel rank `rank` of `world` holds
    (checkpoints.Target.part). Query heads split evenly, key/value heads too or, when fewer than the ranks, each rank holds
    the one its query heads share; q, k, v, gate and up split by rows (column-parallel), o_proj and down_proj by
    columns (row-parallel); an untied LM head by vocabulary rows. The embedding and the norms stay whole: a lookup
    reads B rows of the table, so a whole one costs memory (1 GiB at Llama-3.1-8B, 2 GiB at 70B, bf16) but no
    collective, and a tied LM head is then a row view of it."""
    H, Hkv, D, I = config.n_head, config.n_kv_head, config.head_dim, config.intermediate_size
    h0, h1 = parallel.even_span(H, rank, world, "n_head")
    g0, g1 = parallel.kv_head_span(Hkv, H, rank, world)
    i0, i1 = parallel.even_span(I, rank, world, "intermediate_size")
    parts = {}
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        parts.update({p + "self_attn.q_proj.weight": (0, h0 * D, h1 * D),
                      p + "self_attn.k_proj.weight": (0, g0 * D, g1 * D),
                      p + "self_attn.v_proj.weight": (0, g0 * D, g1 * D),
                      p + "self_attn.o_proj.weight": (1, h0 * D, h1 * D),
                      p + "mlp.gate_proj.weight": (0, i0, i1), p + "mlp.up_proj.weight": (0, i0, i1),
                      p + "mlp.down_proj.weight": (1, i0, i1)})
    if not config.tie_word_embeddings:
        parts[checkpoints.LM_HEAD] = (0, *parallel.vocab_span(config.vocab_size, rank, world))
    return parts


# The family's resolve / load / load_state_dict / save_state_dict / check_state_dict / random_state_dict
LAYOUT = checkpoints.CheckpointLayout(LlamaConfig, state_dict_shapes, weight_stats, EMBEDDING, PREFIX, BUFFER_SUFFIXES, HUB_ORGS)
resolve, load, check_state_dict = LAYOUT.resolve, LAYOUT.load, LAYOUT.check_state_dict
load_state_dict, save_state_dict = LAYOUT.load_state_dict, LAYOUT.save_state_dict
random_state_dict = LAYOUT.random_state_dict
