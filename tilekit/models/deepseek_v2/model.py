"""DeepSeek-V2 on tilekit's cuTile kernels: the weights and the math; tilekit.engine runs it.

The residual stream is fixed point (int64, kernels/tiles.py) at every length: the MoE down projection adds the
router-weighted expert outputs into it with integer atomics (same bits every run), and so do the dense layers'
down projection and the attention output projection (moe_down_combine with one expert, over token-major rows:
one expert per head made every output element 16 atomic adds, 221 us for V2-Lite's at 1024 tokens on an H200).
Each norm reads the stream as it lies (rms_norm takes fixed point); fixed_cast gives the last layer's as floats.

Attention is multi-head latent attention (MLA). A token's latent entry (kv_lora_rank normed latent c, then the
qk_rope_head_dim rotary key k_pe) is what the cache keeps: (layers, B, capacity, R + P), 576 values per token
and layer for V2-Lite. Decode runs the absorbed form: the non-rotary query heads are projected into the latent
space through W_UK (head_linear over kv_b_proj's key rows), mla_decode_attention reads the latent cache once for
all heads and writes the new entry, and the latent outputs go through W_UV (head_linear over kv_b_proj's value
rows). Prompts (forward, prefill) run the plain form: kv_b_proj expands the latents into per-head keys and values,
mla_kv appends the shared rotary key to every head's key and zero-pads the values to the query head dim, and
tilekit's causal attention runs over them; write_kv copies the outputs' value columns into o_proj's rows. RoPE is
tilekit's half-split kernel on rotary rows stored half-split (weights.py), its tables times YaRN's cos/sin factor.
Without query compression, one GEMM makes the latent, the rotary key and the queries ([kv_a_proj_with_mqa;
q_proj], rows of one fused matrix, into one row of Activations.q) and one RoPE launch turns the rotary key and
every query head; with it, kv_a_proj_with_mqa, q_a_proj, its norm and q_b_proj. Names follow transformers'
DeepseekV2ForCausalLM.

Quantized (`quantize=`, or an FP8 / INT8 checkpoint; tilekit.models.quantization), weights.QUANTIZED run on
kernels.quant_linear: kv_a_proj_with_mqa (its latent and rotary rows as two row slices), q_proj or q_a_proj and
q_b_proj (the rotary key and the queries as two GEMMs then: a block-scaled matrix cannot share the fused one's
block grid) and the dense layer's [gate; up] with the SwiGLU in the epilogue. The rest stays in the model's dtype,
dequantized as it loads from a quantized checkpoint (weights.DEQUANTIZED): the routed and shared experts (no 8-bit
grouped GEMM: moe_gate_up / moe_down_combine read the model's dtype, so an FP8 checkpoint runs correctly but its
experts without the halved bytes), o_proj and the dense down projection (moe_down_combine adds them into the
fixed-point residual stream, which quant_linear's float epilogue does not), and kv_b_proj (head_linear and mla_kv
read it as strided per-head views, W_UK and W_UV).

Tensor-parallel (`comm=`, a tilekit.parallel.Communicator of world size N; weights.shard_parts says what each rank
holds): a rank runs its share of the attention heads, whole ones: its rows of q_proj (q_b_proj) and kv_b_proj
(column-parallel) and its columns of o_proj (row-parallel). The latent cache is not split: kv_a_proj_with_mqa makes
one latent entry per token (576 values for V2-Lite) that every head reads, so every rank computes the whole entry
and keeps the whole cache (replicated work and memory, the same bits on every rank); q_a_proj and the norms are
whole too. The dense MLP is column / row-parallel, and so is every expert, routed and shared: each rank holds the
same 1/N of each expert's intermediate columns (per-expert sharding), and the router is replicated. Why not expert
parallelism (E/N whole experts per rank, a masked combine): a decode step reads only the experts its tokens chose
(at B1 6 of V2-Lite's 64, plus the 2 shared); split per expert, each rank streams 1/N of each of them, so the step's
weight bytes divide evenly over the ranks whatever the router picks, where whole experts per rank put as many of
them on one rank as the routing happens to (all 6, at worst) and the step waits for it; prefill's work follows the
routing the same way. It also runs on the unchanged MoE kernels (all experts, narrower: 704 columns at TP=2), where
expert parallelism needs a permutation over each rank's own experts. Each partial product is added into the
fixed-point residual stream, rank 0's into the residual and the others' into zeros, and one all-reduce of the int64
stream sums them (two per layer): integer sums are exact in any order, so every rank then holds the same bits and
normalizes and routes alike without a broadcast (int64 messages: 4x bf16's bytes, 16 KiB a decode B1 all-reduce
for V2-Lite). The LM head holds a vocabulary slice (CausalLM.vocab_parallel). Every collective is on the current
stream: the captured decode step, all-reduces included, stays one CUDA graph replay per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np

from tilekit import parallel
from tilekit.autotune.arrays import MetaArray
from tilekit.kernels import (apply_rope, attention, embedding, fixed_cast, head_linear, linear, mla_kv,
                             moe_down_combine, moe_gate_up, moe_permute, moe_router, rms_norm, swiglu_linear, write_kv)
from tilekit.kernels.apply_rope import rope_tables
from tilekit.kernels.quant_linear import QBLOCK
from tilekit.kernels.tiles import FIXED_DTYPE
from tilekit.models import quantization
from tilekit.models.deepseek_v2 import weights
from tilekit.models.deepseek_v2.config import LORA_NORM_EPS, DeepseekV2Config, rope_inv_freq
from tilekit.models.deepseek_v2.weights import EMBEDDING
from tilekit.models.base import DTYPES, Arrays, CausalLM, LatentSpec

ROPE_TABLE_LIMIT = 1 << 18      # rotary tables cover min(context, this) positions (DeepSeek-V2: 160K)


@dataclass
class Block:
    """One decoder layer's parameters (device arrays); None where the layer has no such tensor."""

    attn_norm: object       # input_layernorm.weight
    kv_c: object            # kv_a_proj_with_mqa's latent rows [R, C]
    kv_pe: object           # its rotary rows [P, C]
    kv_a_q: object          # [kv_a_proj_with_mqa; q_proj] [R + P + H dq, C] (no query compression) or None
    q_a: object             # q_a_proj [Q, C] (query compression) or None
    q_a_norm: object
    q_b: object
    kv_norm: object         # kv_a_layernorm.weight
    kv_b: object            # kv_b_proj [H (dn + dv), R]
    w_uk: object            # its key rows per head [H, dn, R] (a view)
    w_uv: object            # its value rows per head [H, dv, R] (a view)
    o_proj: object          # o_proj [C, H dv] as one expert [1, C, H dv]
    mlp_norm: object        # post_attention_layernorm.weight
    gate: object            # MoE: the router [E, C]; dense: gate_proj
    up: object              # MoE: experts.gate_up_proj [E + S, 2I, C]; dense: up_proj
    down: object            # MoE: experts.down_proj [E + S, C, I]; dense: down_proj as one expert [1, C, J]
    moe: bool
    q: object = None        # quantized without query compression: q_proj alone (pe_q is None)
    kv_c_scale: object = None   # quantized: fp32 scales of kv_c, kv_pe, q, q_a and q_b,
    kv_pe_scale: object = None
    q_scale: object = None
    q_a_scale: object = None
    q_b_scale: object = None
    gate_up: object = None      # and the dense layer's [gate; up] codes (gate and up are row views of it)
    gate_up_scale: object = None


def chunk(config: DeepseekV2Config) -> int:
    """The width the latent entries are copied in by write_kv (as heads of that width): it divides the latent,
    the rotary key and the query's non-rotary part."""
    return math.gcd(config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim)


class Activations:
    """The blocks' working buffers for B sequences of T tokens (M = B*T rows), allocated once; the routing
    constants of the one-expert (dense down projection) and one-expert-per-head (attention output) combines.

    q holds per token [pad | latent c | rotary key k_pe] (padded to whole dq = qk_head_dim wide slots) then the H
    query heads, dq wide each, so that the heads are a view and one GEMM writes the latent, k_pe and the queries."""

    def __init__(self, config: DeepseekV2Config, batch: int, tokens: int, dtype: str, arrays: Arrays, fp8=None,
                 shard: tuple[int, int, int] | None = None):
        """shard: (attention heads, dense MLP columns, columns of each expert) of this rank (default: the config's,
        all of them)."""
        c = config
        self.fp8 = fp8          # FP8 activations (W8A8, base.FP8Activations) or None
        H, J, I = shard or (c.n_head, c.intermediate_size, c.moe_intermediate_size)
        M, C, R, P = batch * tokens, c.n_embd, c.kv_lora_rank, c.qk_rope_head_dim
        dn, dv, dq = c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim
        slots = c.num_experts_per_tok + c.n_shared_experts
        self.x = arrays.empty((M, C), FIXED_DTYPE)
        self.xf, self.h = arrays.empty((M, C), dtype), arrays.empty((M, C), dtype)
        self.cn = arrays.empty((M, R), dtype)
        self.qa = None if c.q_lora_rank is None else arrays.empty((M, c.q_lora_rank), dtype)
        self.qan = None if c.q_lora_rank is None else arrays.empty((M, c.q_lora_rank), dtype)
        L = -(-(R + P) // dq)                   # leading dq-wide slots: [pad | latent c | rotary key k_pe]
        lead, g = L * dq, chunk(config)
        self.q = arrays.empty((M, lead + H * dq), dtype)
        q_slots = self.q.reshape(batch, tokens, L + H, dq)
        heads = q_slots[:, :, L:].transpose(0, 2, 1, 3)                                      # (B, H, T, dq)
        self.heads, self.q_pe = heads, heads[:, :, :, dn:]
        self.q_nope = self.q.reshape(M, L + H, dq)[:, L:, :dn]                              # (M, H, dn)
        self.c = self.q[:, lead - R - P:lead - P]                                           # (M, R)
        self.k_pe = self.q[:, lead - P:lead]                                                # (M, P)
        self.k_pe_heads = q_slots[:, :, L - 1:L, dn:].transpose(0, 2, 1, 3)                  # (B, 1, T, P)
        # the rotary key ends slot L - 1 (dn + P = dq), so it and every query head's rotary part are H + 1 heads of
        # one stride: one RoPE launch
        self.rope_heads = q_slots[:, :, L - 1:, dn:].transpose(0, 2, 1, 3)
        self.entry_q = self.q[:, lead - R - P:]     # one GEMM's output: the latent, k_pe, then the query heads
        self.q_out = self.q[:, lead:]               # the query heads alone (q_proj's or q_b_proj's output)
        # the new latent entries as write_kv's heads (prefill)
        self.c_chunks = self.cn.reshape(batch, tokens, R // g, g).transpose(0, 2, 1, 3)
        self.pe_chunks = self.q.reshape(batch, tokens, (lead + H * dq) // g, g)[:, :, (lead - P) // g:lead // g]
        self.pe_chunks = self.pe_chunks.transpose(0, 2, 1, 3)
        # the output projection's rows (M, H dv), token-major: W_UV's outputs (decode) or the attention outputs'
        # value columns (prompts, whose values are padded to dq: write_kv copies them, as one sequence of M tokens)
        self.y = arrays.empty((M, H, dv), dtype)
        self.y_heads = self.y.reshape(1, M, H, dv).transpose(0, 2, 1, 3)                   # (1, H, M, dv)
        if tokens == 1:                         # a decode step: the absorbed form
            self.q_c = arrays.empty((batch, 1, H, R), dtype)            # queries in the latent space
            self.latent_out = arrays.empty((batch, 1, H, R), dtype)
        # prompts (plain form): the attention's output heads, token-major, v padded to dq
        self.o = arrays.empty((M, H, dq), dtype)
        self.o_heads = self.o.reshape(batch, tokens, H, dq).transpose(0, 2, 1, 3)            # (B, H, T, dq)
        self.o_values = self.o.reshape(1, M, H, dq)[:, :, :, :dv].transpose(0, 2, 1, 3)     # (1, H, M, dv)
        self.start = arrays.zeros((1,), "int32")
        # and their per-head keys and values
        self.kv = arrays.empty((M, H * (dn + dv)), dtype)
        self.k = arrays.empty((M, H, dq), dtype)
        self.v = arrays.zeros((M, H, dq), dtype)                         # columns past dv stay zero
        # MoE and dense MLP
        self.topk_ids, self.topk_weights = arrays.empty((M, slots), "int32"), arrays.empty((M, slots), "float32")
        self.offsets = arrays.empty((c.n_routed_experts + c.n_shared_experts + 1,), "int32")
        self.sorted_pairs = arrays.empty((M * slots,), "int32")
        self.act = arrays.empty((M * slots, I), dtype)
        self.f = arrays.empty((M, J), dtype)
        self.dense_routing = _routing(arrays, M, 1)


def _routing(arrays: Arrays, M: int, experts: int) -> tuple:
    """(weights, offsets, sorted pairs) routing token m's slot e to expert e with weight 1 for every token: the
    rows of expert e are m = 0..M-1 of its block."""
    if arrays.meta:
        return (MetaArray((M, experts), "float32"), MetaArray((experts + 1,), "int32"),
                MetaArray((M * experts,), "int32"))
    import cupy
    pairs = cupy.arange(M * experts, dtype=cupy.int32).reshape(M, experts).T.reshape(-1)
    return (cupy.ones((M, experts), cupy.float32), cupy.arange(experts + 1, dtype=cupy.int32) * M,
            cupy.ascontiguousarray(pairs))


class DeepseekV2(CausalLM):
    """A DeepSeek-V2 model (MLA, mixture of experts) whose forward pass runs entirely on tilekit kernels."""

    weights = weights
    config_class = DeepseekV2Config
    prefill_chunk = 0      # prompts prefill whole: a chunk's plain-form attention would expand every earlier latent

    @classmethod
    def check_quantized_config(cls, config, scheme) -> None:
        """Block-scaled weights (128x128 scales) need kv_a_proj_with_mqa's latent rows to end on a block (its latent
        and rotary rows run as two row slices) and each head's rotary rows inside one block (they are reordered on
        load, weights.py, and each row keeps its block's scales)."""
        if scheme is None or scheme.scale != "block":
            return
        R, P, dq, dn = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_head_dim, config.qk_nope_head_dim
        if R % QBLOCK:
            raise ValueError(f"block-scaled weights need kv_lora_rank to be a multiple of {QBLOCK}, got {R}")
        starts = [R] + [h * dq + dn for h in range(config.n_head)]
        if any(s // QBLOCK != (s + P - 1) // QBLOCK for s in starts):
            raise ValueError(f"block-scaled weights need each head's {P} rotary rows inside one {QBLOCK}-row block "
                             f"(qk_nope_head_dim {dn}, qk_head_dim {dq})")

    def __init__(self, config: DeepseekV2Config, *, dtype: str = "bfloat16", seed: int = 0,
                 state: dict[str, np.ndarray] | None = None, empty: bool = False, meta: bool = False,
                 quantize: str | quantization.Scheme | None = None, comm: parallel.Communicator | None = None):
        """Weights from `state` (our names and layout, weights.py; any float dtype, checked against the config),
        or random ones drawn on the GPU from `seed`, or uninitialised (empty=True: from_pretrained streams them
        in). meta=True: MetaArray weights (no GPU, no memory), for tracing the kernels the model runs. quantize:
        "int8" or "fp8" (weights.QUANTIZED quantized per channel), or a checkpoint's quantization.Scheme. comm: this
        rank's Communicator of a tensor-parallel group (its weights then come from `state` or a checkpoint, sliced
        to its shard; parallel.ShapeOnly with meta=True traces a rank's kernels)."""
        if not isinstance(config, DeepseekV2Config):
            raise TypeError(f"config must be a DeepseekV2Config, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.config, self.dtype, self.meta = config, dtype, meta
        self._init_quant(quantize, empty or meta)
        self.check_quantized_config(config, self.quant)
        self.widest_input = max(config.n_embd, config.q_lora_rank or 0)
        self._init_shard(comm, state is not None or empty or meta)
        fused = self._allocate()
        self._init_weights(state, seed, empty)
        c, w = config, self.params
        self.embed = w[EMBEDDING]
        self.norm = w["model.norm.weight"]
        self.head = self.head_weight(self.embed, None if c.tie_word_embeddings else w["lm_head.weight"])
        H, R, C, dn = self.shard[0], c.kv_lora_rank, c.n_embd, c.qk_nope_head_dim
        self.blocks = []
        for i in range(c.n_layer):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            kv_a, kv_b = w[a + "kv_a_proj_with_mqa.weight"], w[a + "kv_b_proj.weight"]
            heads = kv_b.reshape(H, dn + c.v_head_dim, R)
            lora = c.q_lora_rank is not None
            if c.is_moe_layer(i):
                mlp = (w[p + "mlp.gate.weight"], w[p + "mlp.experts.gate_up_proj"], w[p + "mlp.experts.down_proj"])
            else:
                down = w[p + "mlp.down_proj.weight"]
                mlp = (w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], down.reshape(1, *down.shape))
            self.blocks.append(Block(
                w[p + "input_layernorm.weight"], kv_a[:R], kv_a[R:], None if lora or self.quant else fused[i][0],
                w.get(a + "q_a_proj.weight"), w.get(a + "q_a_layernorm.weight"), w.get(a + "q_b_proj.weight"),
                w[a + "kv_a_layernorm.weight"], kv_b, heads[:, :dn], heads[:, dn:],
                w[a + "o_proj.weight"].reshape(1, C, H * c.v_head_dim),
                w[p + "post_attention_layernorm.weight"], *mlp, c.is_moe_layer(i)))
            if self.quant:
                self._quantized_block(self.blocks[-1], i, fused[i])
        positions = self.rope_positions = min(c.block_size, ROPE_TABLE_LIMIT)
        if meta:
            self.cos = self.sin = MetaArray((positions, c.qk_rope_head_dim // 2), "float32")
        else:
            import cupy
            factor = 1.0 if c.rope_scaling is None else c.rope_scaling.cos_sin_factor
            inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
            self.cos, self.sin = (cupy.asarray(t * np.float32(factor)) for t in rope_tables(positions, inv_freq))

    def _init_shard(self, comm: parallel.Communicator | None, weights_given: bool) -> None:
        """base's _init_comm, and self.shard: this rank's attention heads, dense MLP columns and columns of each
        expert (the spans weights.shard_parts gives it)."""
        self._init_comm(comm, weights_given)       # shard_parts has refused any split that is not even
        world, c = 1 if self.comm is None else self.comm.world_size, self.config
        self.shard = (c.n_head // world, c.intermediate_size // world, c.moe_intermediate_size // world)

    def _allocate(self) -> list:
        """self.params (base's _allocate_params); without query compression and unquantized, a layer's
        kv_a_proj_with_mqa and q_proj are row views of one matrix (latent rows, rotary rows, query rows), so that
        one GEMM makes the latent, the rotary key and the queries; quantized, the dense layer's gate and up are row
        views of one [gate; up]. Returns each layer's fused (matrix, scales), or None."""
        groups, halves, layers = [], [], []
        for i in range(self.config.n_layer):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            if self.config.q_lora_rank is None and not self.quant:
                groups.append([a + "kv_a_proj_with_mqa.weight", a + "q_proj.weight"])
                layers.append(("group", len(groups) - 1))
            elif self.quant and not self.config.is_moe_layer(i):
                halves.append([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
                layers.append(("halves", len(halves) - 1))
            else:
                layers.append(None)
        fused = dict(zip(("group", "halves"), self._allocate_params(groups, halves)))
        return [None if at is None else fused[at[0]][at[1]] for at in layers]

    def _quantized_block(self, blk: Block, i: int, fused) -> None:
        """A quantized layer's codes and scales in its Block: kv_a's latent and rotary rows (and their scales) as
        row slices, q_proj (q_a_proj, q_b_proj), and the dense layer's [gate; up]."""
        w, a, R = self.params, f"model.layers.{i}.self_attn.", self.config.kv_lora_rank
        scale = quantization.scale_key
        kv_scale = w[scale(a + "kv_a_proj_with_mqa.weight")]
        split = R if self.quant.scale == "channel" else R // QBLOCK
        blk.kv_c_scale, blk.kv_pe_scale = kv_scale[:split], kv_scale[split:]
        if self.config.q_lora_rank is None:
            blk.q, blk.q_scale = w[a + "q_proj.weight"], w[scale(a + "q_proj.weight")]
        else:
            blk.q_a_scale, blk.q_b_scale = w[scale(a + "q_a_proj.weight")], w[scale(a + "q_b_proj.weight")]
        if not blk.moe:
            blk.gate_up, blk.gate_up_scale = fused

    # -- the math ---------------------------------------------------------------------------------
    def meta_twin(self) -> "DeepseekV2":
        """This model with MetaArray weights: what a dry run of its kernels needs."""
        return DeepseekV2(self.config, dtype=self.dtype, meta=True, quantize=self.quant, comm=self.shape_only_comm())

    def activations(self, batch: int, tokens: int, arrays: Arrays) -> Activations:
        return Activations(self.config, batch, tokens, self.dtype, arrays,
                           self.fp8_activations(batch * tokens, arrays), self.shard)

    def cache_spec(self) -> LatentSpec:
        """The latent cache: each token's [c, k_pe] per layer, whole on every tensor-parallel rank."""
        c = self.config
        return LatentSpec(c.n_layer, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, chunk(c), self.dtype)

    def forward_attend(self):
        """Plain MLA over whole prompts, no cache."""
        return self._prompt_attention

    def prefill_attend(self, cache, start):
        """Plain MLA over the prompts, their latent entries written into the cache at `start` (cache.write)."""
        def attend(i, blk, acts):
            cache.write(i, acts.c_chunks, acts.pe_chunks, start)
            return self._prompt_attention(i, blk, acts)
        return attend

    def decode_attend(self, cache, positions):
        """Absorbed MLA of each sequence's newest token over its latent cache (cache.decode), the token's entry
        written at `positions`."""
        cfg = self.config

        def attend(i, blk, acts):
            B, R = acts.heads.shape[0], cfg.kv_lora_rank
            M, H = acts.q_nope.shape[:2]
            head_linear(acts.q_nope, blk.w_uk, out=acts.q_c.reshape(M, H, R), weight_layout="kn")
            cache.decode(i, acts.q_c.transpose(0, 2, 1, 3), acts.q_pe, acts.cn.reshape(B, 1, R), acts.k_pe_heads[:, 0],
                         positions, cfg.softmax_scale, acts.latent_out.transpose(0, 2, 1, 3))
            head_linear(acts.latent_out.reshape(M, H, R), blk.w_uv, out=acts.y, weight_layout="nk")
        return attend

    def _prompt_attention(self, i, blk, acts):
        """Keys and values from the latents (kv_b_proj, mla_kv), causal attention; the output heads' value columns
        into acts.y."""
        cfg = self.config
        M, H = acts.q_nope.shape[:2]
        linear(acts.cn, blk.kv_b, weight_layout="out_in", out=acts.kv)
        mla_kv(acts.kv.reshape(M, H, cfg.qk_nope_head_dim + cfg.v_head_dim), acts.k_pe, acts.k, acts.v,
               dn=cfg.qk_nope_head_dim)
        B, T = acts.heads.shape[0], acts.heads.shape[2]
        k, v = (a.reshape(B, T, H, cfg.qk_head_dim).transpose(0, 2, 1, 3) for a in (acts.k, acts.v))
        attention(acts.heads, k, v, causal=True, scale=cfg.softmax_scale, out=acts.o_heads)
        write_kv(acts.o_values, acts.o_values, acts.y_heads, acts.y_heads, acts.start)      # a row copy

    def hidden(self, acts: Activations, ids, positions, attend):
        """Token embeddings through every block; returns the residual stream (B*T, C) as floats.

        positions: int32 (B*T,) position of each token (RoPE); attend(layer, block, acts) runs one layer's
        attention from the normed latents acts.cn, the rotary key and the roped query heads in acts.q, filling the
        cache where there is one, and leaves the heads' outputs in acts.y (M, H, dv), o_proj's rows."""
        cfg = self.config
        x = acts.x
        embedding(ids, self.embed, out=x)
        for i, blk in enumerate(self.blocks):
            self._norm(acts, blk.attn_norm)
            if blk.kv_a_q is not None:
                self.project(acts.fp8, acts.h, blk.kv_a_q, None, out=acts.entry_q)
            else:
                self.project(acts.fp8, acts.h, blk.kv_c, blk.kv_c_scale, out=acts.c)
                if blk.q_a is None:
                    self.project(acts.fp8, acts.h, blk.q, blk.q_scale, out=acts.q_out)
                else:
                    self.project(acts.fp8, acts.h, blk.q_a, blk.q_a_scale, out=acts.qa)
                    rms_norm(acts.qa, blk.q_a_norm, LORA_NORM_EPS, out=acts.qan)
                    self.project(acts.fp8, acts.qan, blk.q_b, blk.q_b_scale, out=acts.q_out)
                self.project(acts.fp8, acts.h, blk.kv_pe, blk.kv_pe_scale, out=acts.k_pe)
            rms_norm(acts.c, blk.kv_norm, LORA_NORM_EPS, out=acts.cn)
            apply_rope(acts.rope_heads, positions, self.cos, self.sin)
            attend(i, blk, acts)
            rows = acts.y.reshape(acts.y.shape[0], -1)
            self.add_partial(x, lambda: moe_down_combine(rows, blk.o_proj, *acts.dense_routing, x))
            self._norm(acts, blk.mlp_norm)
            if blk.moe:
                moe_router(acts.h, blk.gate, cfg.num_experts_per_tok, scale=cfg.routed_scaling_factor,
                           shared=cfg.n_shared_experts, topk_ids=acts.topk_ids, topk_weights=acts.topk_weights)
                moe_permute(acts.topk_ids, cfg.n_routed_experts + cfg.n_shared_experts, offsets=acts.offsets,
                            sorted_pairs=acts.sorted_pairs)
                moe_gate_up(acts.h, blk.up, acts.offsets, acts.sorted_pairs, out=acts.act)
                self.add_partial(x, lambda: moe_down_combine(acts.act, blk.down, acts.topk_weights, acts.offsets,
                                                              acts.sorted_pairs, x))
            else:
                if self.quant:
                    self.project(acts.fp8, acts.h, blk.gate_up, blk.gate_up_scale, out=acts.f, activation="swiglu")
                else:
                    swiglu_linear(acts.h, blk.gate, blk.up, out=acts.f)
                self.add_partial(x, lambda: moe_down_combine(acts.f, blk.down, *acts.dense_routing, x))
        return fixed_cast(x, acts.xf)

    def _norm(self, acts: Activations, weight) -> None:
        """acts.h = RMSNorm of the fixed-point residual stream."""
        rms_norm(acts.x, weight, self.config.rms_norm_eps, out=acts.h)

    def final_norm(self, x, out, rows=None) -> None:
        """The final RMSNorm of x (of the rows `rows` only, when given) into out."""
        rms_norm(x, self.norm, self.config.rms_norm_eps, rows=rows, out=out)
