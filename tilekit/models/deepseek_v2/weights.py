"""DeepSeek-V2's weights in Hugging Face checkpoints: tensor names and shapes, loading, saving, random weights.

Our names are transformers 5.17's DeepseekV2ForCausalLM parameters ("model.layers.1.self_attn.kv_b_proj.weight"),
weights nn.Linear's [out, in], in the layout the kernels read, which differs from the files' in two ways:
- each MoE layer's experts are fused as transformers keeps the routed ones, the shared MLP (width S * I) appended
  as S more experts of width I: mlp.experts.gate_up_proj [E + S, 2I, C] (each expert's gate rows, then its up
  rows) and mlp.experts.down_proj [E + S, C, I]; there is no mlp.shared_experts tensor;
- the rotary rows of q_proj (q_b_proj) and kv_a_proj_with_mqa are half-split (pairs 2i, 2i + 1 of a head's
  rotary features -> i, i + P/2), so that tilekit's RoPE kernel rotates what transformers' interleaved RoPE does.
Files keep the routed experts one by one (the hub, save_pretrained's default: mlp.experts.{j}.gate_proj/up_proj/
down_proj.weight) or fused (save_pretrained(save_original_format=False)); both load, converted on the device.
"""

from __future__ import annotations

import math

import numpy as np

from tilekit import parallel
from tilekit import checkpoints
from tilekit.models.quantizable import Quantizable
from tilekit.models.deepseek_v2.config import DeepseekV2Config

HUB_ORGS = ("deepseek-ai",)
PREFIX = ""
EMBEDDING = "model.embed_tokens.weight"
BUFFER_SUFFIXES = ()
# Quantized (tilekit.models.quantization): the linears a quantized model holds in 8 bits and runs on quant_linear
QUANTIZED = ("self_attn.q_proj", "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
             "mlp.gate_proj", "mlp.up_proj")
QUANTIZED_HEAD = True     # an untied LM head too, with quantize_head or stored as codes (quantization.head_quantized)
# and those it keeps in its dtype, dequantized as they load from a quantized checkpoint (name patterns): the experts
# and the projections into the residual stream (moe_down_combine, which has no 8-bit variant), kv_b_proj (read as
# strided per-head views by head_linear and mla_kv, no 8-bit variant either), and the router
DEQUANTIZED = (r"self_attn\.kv_b_proj", r"self_attn\.o_proj", r"mlp\.down_proj", r"mlp\.gate",
               r"mlp\.shared_experts\.(?:gate|up|down)_proj", r"mlp\.experts\.\d+\.(?:gate|up|down)_proj")
QUANTIZATION = Quantizable(QUANTIZED, DEQUANTIZED, head=QUANTIZED_HEAD)


def state_dict_shapes(config: DeepseekV2Config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of this config (our layout; lm_head only when untied)."""
    return checkpoints.decoder_shapes(config, block_shapes, EMBEDDING)


def block_shapes(config: DeepseekV2Config, i: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of decoder layer i."""
    C, H, R, dq = config.n_embd, config.n_head, config.kv_lora_rank, config.qk_head_dim
    E, I = config.n_routed_experts + config.n_shared_experts, config.moe_intermediate_size
    p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
    shapes = {p + "input_layernorm.weight": (C,)}
    if config.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (H * dq, C)
    else:
        Q = config.q_lora_rank
        shapes.update({a + "q_a_proj.weight": (Q, C), a + "q_a_layernorm.weight": (Q,),
                       a + "q_b_proj.weight": (H * dq, Q)})
    shapes.update({a + "kv_a_proj_with_mqa.weight": (R + config.qk_rope_head_dim, C), a + "kv_a_layernorm.weight": (R,),
                   a + "kv_b_proj.weight": (H * (config.qk_nope_head_dim + config.v_head_dim), R),
                   a + "o_proj.weight": (C, H * config.v_head_dim), p + "post_attention_layernorm.weight": (C,)})
    if config.is_moe_layer(i):
        shapes.update({p + "mlp.gate.weight": (config.n_routed_experts, C), p + "mlp.experts.gate_up_proj": (E, 2 * I, C),
                       p + "mlp.experts.down_proj": (E, C, I)})
    else:
        J = config.intermediate_size
        shapes.update({p + "mlp.gate_proj.weight": (J, C), p + "mlp.up_proj.weight": (J, C),
                       p + "mlp.down_proj.weight": (C, J)})
    return shapes


def weight_stats(config: DeepseekV2Config, name: str) -> tuple[float, float]:
    """(mean, standard deviation) of random weights for tensor `name`: RMSNorm weights N(1, 0.1); the router
    N(0, 1/sqrt(n_embd)), so that its logits are of unit scale and its top-k choices well apart; projections
    into the residual stream (o_proj, down projections) N(0, 0.02/sqrt(2 n_layer)); the rest N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name.endswith("mlp.gate.weight"):
        return 0.0, 1 / math.sqrt(config.n_embd)
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return 0.0, 0.02 / math.sqrt(2 * config.n_layer)
    return 0.0, 0.02


# -- our layout <-> the files' ---------------------------------------------------------------------------------

def _rotary(config: DeepseekV2Config, name: str) -> tuple[int, int] | None:
    """(rows per group, first rotary row of a group) of a tensor whose rotary rows are half-split in our layout."""
    if name.endswith(("q_proj.weight", "q_b_proj.weight")):
        return config.qk_head_dim, config.qk_nope_head_dim
    if name.endswith("kv_a_proj_with_mqa.weight"):
        return config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank
    return None


def _half_split(config: DeepseekV2Config, name: str):
    """The load transform of a tensor with rotary rows: interleaved pairs (file) -> half-split (ours)."""
    group, first = _rotary(config, name)
    half = config.qk_rope_head_dim // 2

    def transform(src, out):
        src, out = src.reshape(-1, group, src.shape[-1]), out.reshape(-1, group, out.shape[-1])
        checkpoints.convert(src[:, :first], out[:, :first])
        checkpoints.convert(src[:, first::2], out[:, first:first + half])
        checkpoints.convert(src[:, first + 1::2], out[:, first + half:])
    return transform


def _interleaved(config: DeepseekV2Config, name: str, w):
    """Our half-split rotary rows of `w` back in the file's interleaved order (a copy, NumPy or device)."""
    group, first = _rotary(config, name)
    half = config.qk_rope_head_dim // 2
    out = w.copy()
    src, dst = w.reshape(-1, group, w.shape[-1]), out.reshape(-1, group, w.shape[-1])
    dst[:, first::2] = src[:, first:first + half]
    dst[:, first + 1::2] = src[:, first + half:]
    return out


def _experts(config: DeepseekV2Config, i: int, fused: bool, span: tuple[int, int] | None) -> dict[str, checkpoints.Piece]:
    """File name -> Piece of layer i's experts: the routed ones one by one or fused, and the shared MLP's slices;
    `span`: the [start, stop) of each expert's intermediate columns a tensor-parallel rank holds (None: all)."""
    C, E, S, I = config.n_embd, config.n_routed_experts, config.n_shared_experts, config.moe_intermediate_size
    i0, i1 = span or (0, I)
    J = i1 - i0                       # the columns held of each expert
    part = (lambda *p: p) if span else (lambda *p: None)
    p = f"model.layers.{i}.mlp."
    gate_up, down = p + "experts.gate_up_proj", p + "experts.down_proj"
    if fused:
        pieces = {gate_up: checkpoints.Piece(gate_up, (E, 2 * I, C), np.s_[:E], part=part(1, i0, i1, 2)),
                  down: checkpoints.Piece(down, (E, C, I), np.s_[:E], part=part(2, i0, i1))}
    else:
        pieces = {}
        for j in range(E):
            pieces.update({f"{p}experts.{j}.gate_proj.weight": checkpoints.Piece(gate_up, (I, C), np.s_[j, :J],
                                                                        part=part(0, i0, i1)),
                           f"{p}experts.{j}.up_proj.weight": checkpoints.Piece(gate_up, (I, C), np.s_[j, J:],
                                                                      part=part(0, i0, i1)),
                           f"{p}experts.{j}.down_proj.weight": checkpoints.Piece(down, (C, I), np.s_[j], part=part(1, i0, i1))})

    def rows(src, out):               # (S * J, C) -> (S, J, C)
        checkpoints.convert(src.reshape(out.shape), out)

    def columns(src, out):            # (C, S * J) -> (S, C, J)
        checkpoints.convert(src.reshape(C, S, J).transpose(1, 0, 2), out)
    pieces.update({p + "shared_experts.gate_proj.weight": checkpoints.Piece(gate_up, (S * I, C), np.s_[E:, :J], rows,
                                                                   part(0, i0, i1, S)),
                   p + "shared_experts.up_proj.weight": checkpoints.Piece(gate_up, (S * I, C), np.s_[E:, J:], rows,
                                                                 part(0, i0, i1, S)),
                   p + "shared_experts.down_proj.weight": checkpoints.Piece(down, (C, S * I), np.s_[E:], columns,
                                                                   part(1, i0, i1, S))})
    return pieces


def stored(config: DeepseekV2Config, names: set[str], parts: dict | None = None) -> dict[str, checkpoints.Piece]:
    """File name -> Piece of every tensor a file keeps in another form than ours (CheckpointLayout.stored): the
    experts (each layer's routed ones fused if the file holds them so, else one by one) and the tensors with
    rotary rows; `parts` (shard_parts of a tensor-parallel rank): each piece reads only that rank's slice of its
    file tensor (whole heads of q_proj / q_b_proj, whose rotary rows reorder within a head)."""
    parts = parts or {}
    pieces = {}
    for name, shape in state_dict_shapes(config).items():
        if _rotary(config, name):
            pieces[name] = checkpoints.Piece(name, shape, (), _half_split(config, name), parts.get(name))
    for i in range(config.n_layer):
        if config.is_moe_layer(i):
            p = f"model.layers.{i}.mlp.experts."
            shard = parts.get(p + "gate_up_proj")
            pieces.update(_experts(config, i, p + "gate_up_proj" in names, shard and shard[1:3]))
    return pieces


def shard_parts(config: DeepseekV2Config, rank: int, world: int) -> dict[str, tuple[int, ...]]:
    """Name -> (axis, start, stop[, groups]): the slice of each tensor (our layout) that tensor-parallel rank `rank`
    of `world` holds (checkpoints.Target.part). Attention heads split evenly: q_proj (q_b_proj) and kv_b_proj by rows, whole
    heads (column-parallel), o_proj by columns (row-parallel); kv_a_proj_with_mqa (the latent and the rotary key:
    per token, not per head), q_a_proj, the norms and the router stay whole. The dense MLP's gate / up split by
    rows and down by columns; every expert, routed and shared, the same way: gate_up_proj's gate and up rows
    (two groups) and down_proj's columns, the span of moe_intermediate_size (per-expert sharding, see model.py).
    An untied LM head by vocabulary rows; the embedding stays whole (a tied head is a row view of it)."""
    c = config
    h0, h1 = parallel.even_span(c.n_head, rank, world, "n_head")
    dq, dkv, dv = c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim, c.v_head_dim
    moe = [c.is_moe_layer(i) for i in range(c.n_layer)]
    if all(moe):
        j0 = j1 = 0
    else:
        j0, j1 = parallel.even_span(c.intermediate_size, rank, world, "intermediate_size")
    if any(moe):
        i0, i1 = parallel.even_span(c.moe_intermediate_size, rank, world, "moe_intermediate_size")
    parts = {}
    for i in range(c.n_layer):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        parts.update({a + ("q_proj.weight" if c.q_lora_rank is None else "q_b_proj.weight"): (0, h0 * dq, h1 * dq),
                      a + "kv_b_proj.weight": (0, h0 * dkv, h1 * dkv), a + "o_proj.weight": (1, h0 * dv, h1 * dv)})
        if moe[i]:
            parts.update({p + "mlp.experts.gate_up_proj": (1, i0, i1, 2), p + "mlp.experts.down_proj": (2, i0, i1)})
        else:
            parts.update({p + "mlp.gate_proj.weight": (0, j0, j1), p + "mlp.up_proj.weight": (0, j0, j1),
                          p + "mlp.down_proj.weight": (1, j0, j1)})
    if not c.tie_word_embeddings:
        parts[checkpoints.LM_HEAD] = (0, *parallel.vocab_span(c.vocab_size, rank, world))
    return parts


def to_file(config: DeepseekV2Config, state, fused_experts: bool = False) -> dict:
    """Our tensors (NumPy or device arrays) in a file's layout: rotary rows interleaved (and a quantized weight's
    per-channel scales, NAME_scale, with them), the shared experts as one MLP, the routed experts one by one as on
    the hub (or fused). Views where the layouts agree, else copies."""
    E, S, I, C = config.n_routed_experts, config.n_shared_experts, config.moe_intermediate_size, config.n_embd
    out = {}
    for name, w in state.items():
        weight = name.removesuffix("_scale")
        if _rotary(config, name):
            out[name] = _interleaved(config, name, w)
        elif weight != name and _rotary(config, weight) and w.shape[0] == state[weight].shape[0]:
            out[name] = _interleaved(config, weight, w.reshape(-1, 1)).reshape(w.shape)   # per-channel scales
        elif name.endswith("mlp.experts.gate_up_proj"):
            p = name.removesuffix("experts.gate_up_proj")
            down = state[p + "experts.down_proj"]
            if fused_experts:
                out.update({name: w[:E], p + "experts.down_proj": down[:E]})
            else:
                for j in range(E):
                    out.update({f"{p}experts.{j}.gate_proj.weight": w[j, :I], f"{p}experts.{j}.up_proj.weight": w[j, I:],
                                f"{p}experts.{j}.down_proj.weight": down[j]})
            out.update({p + "shared_experts.gate_proj.weight": w[E:, :I].reshape(S * I, C),
                        p + "shared_experts.up_proj.weight": w[E:, I:].reshape(S * I, C),
                        p + "shared_experts.down_proj.weight": down[E:].transpose(1, 0, 2).reshape(C, S * I)})
        elif not name.endswith("mlp.experts.down_proj"):
            out[name] = w
    return out


# The family's resolve / load / load_state_dict / save_state_dict / check_state_dict / random_state_dict
LAYOUT = checkpoints.CheckpointLayout(DeepseekV2Config, state_dict_shapes, weight_stats, EMBEDDING, PREFIX, BUFFER_SUFFIXES,
                             HUB_ORGS, stored, to_file)
resolve, load, check_state_dict = LAYOUT.resolve, LAYOUT.load, LAYOUT.check_state_dict
load_state_dict, save_state_dict = LAYOUT.load_state_dict, LAYOUT.save_state_dict
random_state_dict = LAYOUT.random_state_dict
