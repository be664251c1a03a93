"""Llama on tilekit's cuTile kernels: the weights and the math; tilekit.engine runs it.

A block is RMSNorm -> one fused QKV projection -> RoPE on the query and key heads (in place) ->
grouped-query attention -> output projection with the residual add in its epilogue -> RMSNorm ->
the SwiGLU gate/up projection (one kernel) -> down projection with the residual add. Weights
keep nn.Linear's [out, in] layout; the q, k and v projections are row views of one fused matrix
per block (a checkpoint's tensors load straight into them), so a block reads its input once for
all three. Names follow Hugging Face's LlamaForCausalLM.

Quantized (`quantize=`, or an FP8 / INT8 checkpoint; tilekit.models.quantization), the seven linears of a block
(and an untied LM head quantized at load, or stored as codes) hold 8-bit codes and fp32 scales and run on
kernels.quant_linear: the gate and up projections as one [gate; up]
matrix with the SwiGLU in the kernel's epilogue; with FP8 weights and at least base.W8A8_MIN_ROWS rows (prefill) the
activations are quantized per token (per 128-column group with block scales) and multiplied in FP8.

Tensor-parallel (`comm=`, a tilekit.parallel.Communicator of world size N; weights.shard_parts says what each rank
holds): a rank runs its share of the query and key/value heads and of the MLP's columns; the output and down
projections are row-parallel, each rank's partial product summed by one all-reduce of the residual stream (two
per layer), the residual added on rank 0 only, in the projection's epilogue, so it is counted once. The LM head
holds a vocabulary slice (CausalLM.vocab_parallel). Every collective is on the current stream, so the captured
decode step, all-reduces included, stays one CUDA graph replay per rank. Quantized linears shard too: a rank holds
its slice of the codes and the matching scales (tilekit.models.quantization, scale_part).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tilekit import parallel
from tilekit.autotune.arrays import MetaArray
from tilekit.kernels import apply_rope, embedding, rms_norm, swiglu_linear
from tilekit.kernels.apply_rope import rope_tables
from tilekit.models import quantization
from tilekit.models.llama import weights
from tilekit.models.llama.config import LlamaConfig, rope_inv_freq
from tilekit.models.llama.weights import EMBEDDING
from tilekit.models.base import DTYPES, Arrays, CausalLM

ROPE_TABLE_LIMIT = 1 << 17      # rotary tables cover min(context, this) positions (128K, Llama 3.1's context)


@dataclass
class Block:
    """One decoder layer's parameters (device arrays)."""

    attn_norm: object       # input_layernorm.weight
    qkv: object             # [q_proj; k_proj; v_proj] weights, [(H + 2 Hkv) D, C]
    o_proj: object
    mlp_norm: object        # post_attention_layernorm.weight
    gate: object
    up: object
    down: object
    qkv_scale: object = None        # quantized: fp32 scales of qkv, o_proj, [gate; up] and down,
    o_scale: object = None          # and the [gate; up] codes (gate and up are row views of it)
    gate_up: object = None
    gate_up_scale: object = None
    down_scale: object = None


class Activations:
    """The blocks' working buffers for B sequences of T tokens as (B*T, width) rows, allocated once (a pass
    allocates nothing and can be captured as a CUDA graph); q, k, v, the query-and-key heads `qk` and the
    attention output `heads` are (B, heads, T, D) views."""

    def __init__(self, config: LlamaConfig, batch: int, tokens: int, dtype: str, arrays: Arrays, fp8=None,
                 heads: tuple[int, int, int] | None = None):
        """heads: (query heads, key/value heads, MLP columns) of this rank (default: the config's, all of them)."""
        H, Hkv, I = heads or (config.n_head, config.n_kv_head, config.intermediate_size)
        M, C, D = batch * tokens, config.n_embd, config.head_dim
        self.x, self.other, self.h = (arrays.empty((M, C), dtype) for _ in range(3))
        self.qkv = arrays.empty((M, (H + 2 * Hkv) * D), dtype)
        self.y = arrays.empty((M, H * D), dtype)
        self.f = arrays.empty((M, I), dtype)
        heads = self.qkv.reshape(batch, tokens, H + 2 * Hkv, D).transpose(0, 2, 1, 3)
        self.q, self.k, self.v, self.qk = heads[:, :H], heads[:, H:H + Hkv], heads[:, H + Hkv:], heads[:, :H + Hkv]
        self.heads = self.y.reshape(batch, tokens, H, D).transpose(0, 2, 1, 3)
        self.fp8 = fp8          # FP8 activations (W8A8, base.FP8Activations) or None


class Llama(CausalLM):
    """A Llama-family model (Llama 2/3.x, TinyLlama) whose forward pass runs entirely on tilekit kernels."""

    weights = weights
    config_class = LlamaConfig
    shards_quantized = True

    def __init__(self, config: LlamaConfig, *, dtype: str = "bfloat16", seed: int = 0,
                 state: dict[str, np.ndarray] | None = None, empty: bool = False, meta: bool = False,
                 quantize: str | quantization.Scheme | None = None, comm: parallel.Communicator | None = None):
        """Weights from `state` (Hugging Face names, any float dtype, checked against the config), or random ones
        drawn on the GPU from `seed` (as weights.random_state_dict scales them), or uninitialised (empty=True:
        from_pretrained streams them in). meta=True: MetaArray weights (no GPU, no memory), for tracing the
        kernels the model runs. quantize: "int8" or "fp8" (the linears quantized per channel), or a checkpoint's
        quantization.Scheme. comm: this rank's Communicator of a tensor-parallel group (its weights then come from
        `state` or a checkpoint, sliced to its shard; parallel.ShapeOnly with meta=True traces a rank's kernels)."""
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.config, self.dtype, self.meta = config, dtype, meta
        self._init_quant(quantize, empty or meta)
        self.widest_input = max(config.n_embd, config.n_head * config.head_dim, config.intermediate_size)
        self._init_shard(comm, state is not None or empty or meta)
        qkv = self._allocate()
        self._init_weights(state, seed, empty)
        w = self.params
        self.embed = w[EMBEDDING]
        self.norm = w["model.norm.weight"]
        self.head = self.head_weight(self.embed, None if config.tie_word_embeddings else w["lm_head.weight"])
        self.blocks = []
        for i in range(config.n_layer):
            p = f"model.layers.{i}."
            self.blocks.append(Block(
                w[p + "input_layernorm.weight"], qkv[i][0], w[p + "self_attn.o_proj.weight"],
                w[p + "post_attention_layernorm.weight"], w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                w[p + "mlp.down_proj.weight"]))
            if quantize:
                scale = quantization.scale_key
                blk = self.blocks[-1]
                blk.qkv_scale, blk.o_scale = qkv[i][1], w[scale(p + "self_attn.o_proj.weight")]
                blk.gate_up, blk.gate_up_scale = qkv[i][2], qkv[i][3]
                blk.down_scale = w[scale(p + "mlp.down_proj.weight")]
        positions = self.rope_positions = min(config.block_size, ROPE_TABLE_LIMIT)
        if meta:
            self.cos = self.sin = MetaArray((positions, config.head_dim // 2), "float32")
        else:
            import cupy
            inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
            self.cos, self.sin = (cupy.asarray(t) for t in rope_tables(positions, inv_freq))

    def _init_shard(self, comm: parallel.Communicator | None, weights_given: bool) -> None:
        """base's _init_comm, and this rank's query head, key/value head and MLP column counts."""
        rank = self._init_comm(comm, weights_given)
        world, C = 1 if self.comm is None else self.comm.world_size, self.config
        h0, h1 = parallel.even_span(C.n_head, rank, world, "n_head")
        g0, g1 = parallel.kv_head_span(C.n_kv_head, C.n_head, rank, world)
        i0, i1 = parallel.even_span(C.intermediate_size, rank, world, "intermediate_size")
        self.heads = (h1 - h0, g1 - g0, i1 - i0)

    def _allocate(self) -> list:
        """self.params (base's _allocate_params): q, k and v of a layer row views of one fused matrix, and
        quantized also gate and up; returns each layer's (qkv, its scales, [gate; up], its scales)."""
        groups, halves = [], []
        for i in range(self.config.n_layer):
            p = f"model.layers.{i}."
            groups.append([f"{p}self_attn.{n}_proj.weight" for n in "qkv"])
            if self.quant:
                halves.append([f"{p}mlp.{n}_proj.weight" for n in ("gate", "up")])
        qkv, gate_up = self._allocate_params(groups, halves)
        return [q + (gate_up[i] if self.quant else (None, None)) for i, q in enumerate(qkv)]

    # -- the math ---------------------------------------------------------------------------------
    def meta_twin(self) -> "Llama":
        """This model with MetaArray weights: what a dry run of its kernels needs."""
        return Llama(self.config, dtype=self.dtype, meta=True, quantize=self.quant, comm=self.shape_only_comm())

    def activations(self, batch: int, tokens: int, arrays: Arrays) -> Activations:
        return Activations(self.config, batch, tokens, self.dtype, arrays,
                           self.fp8_activations(batch * tokens, arrays), self.heads)

    def cache_dims(self) -> tuple[int, int, int]:
        """(layers, key/value heads, head_dim) of the KV cache."""
        return self.config.n_layer, self.heads[1], self.config.head_dim

    def hidden(self, acts: Activations, ids, positions, attend):
        """Token embeddings through every block; returns the residual stream (B*T, C) before the final norm.

        positions: int32 (B*T,) position of each token (RoPE); attend(layer, q, k, v, out) writes one
        layer's attention into out (B, H, T, D) and fills the KV cache where there is one."""
        eps = self.config.rms_norm_eps
        x, other = acts.x, acts.other
        lead = self.comm is None or self.comm.rank == 0     # the rank that adds the residual
        embedding(ids, self.embed, out=x)
        rms_norm(x, self.blocks[0].attn_norm, eps, out=acts.h)
        for i, blk in enumerate(self.blocks):
            self.project(acts.fp8, acts.h, blk.qkv, blk.qkv_scale, out=acts.qkv)
            apply_rope(acts.qk, positions, self.cos, self.sin)
            attend(i, acts.q, acts.k, acts.v, acts.heads)
            self.project(acts.fp8, acts.y, blk.o_proj, blk.o_scale, residual=x if lead else None, out=other)
            x, other = other, x
            self.sum_ranks_then_norm(x, blk.mlp_norm, eps, acts.h)
            if self.quant:
                self.project(acts.fp8, acts.h, blk.gate_up, blk.gate_up_scale, out=acts.f, activation="swiglu")
            else:
                swiglu_linear(acts.h, blk.gate, blk.up, out=acts.f)
            self.project(acts.fp8, acts.f, blk.down, blk.down_scale, residual=x if lead else None, out=other)
            x, other = other, x
            if i + 1 < len(self.blocks):      # the next block's norm (the final norm may take a few rows only)
                self.sum_ranks_then_norm(x, self.blocks[i + 1].attn_norm, eps, acts.h)
            else:
                self.sum_ranks(x)
        return x                  # an even number of swaps: acts.x

    def final_norm(self, x, out, rows=None) -> None:
        """The final RMSNorm of x (of the rows `rows` only, when given) into out."""
        rms_norm(x, self.norm, self.config.rms_norm_eps, rows=rows, out=out)
