"""The strongest decode anchor a PyTorch engineer writes by hand: GPT-2, Llama and DeepSeek-V2 in the style of
gpt-fast.

Static KV-cache buffers (one pair per layer, written in place; DeepSeek-V2's compressed latent), attention over the
whole cache under a causal mask, greedy argmax on the GPU.
One decode step reads its token and position from buffers and writes the next token back, so
`torch.compile(mode="reduce-overhead", fullgraph=True)` turns it into Inductor kernels replayed as a
CUDA graph with no host work between steps. The prompt's prefill runs the same module eagerly (gpt-fast's
default). The Hugging Face model's own modules (and so its weight tensors) do the arithmetic.
Imported only on the GPU path: it needs torch at import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache(torch.nn.Module):
    """One layer's keys and values (B, KV heads, capacity, D), written in place at the step's positions."""

    def __init__(self, shape: tuple, like: torch.Tensor):
        super().__init__()
        self.register_buffer("k", torch.zeros(shape, dtype=like.dtype, device=like.device))
        self.register_buffer("v", torch.zeros(shape, dtype=like.dtype, device=like.device))
        torch._dynamo.mark_static_address(self.k)
        torch._dynamo.mark_static_address(self.v)

    def update(self, pos, k, v):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        return self.k, self.v


class StaticDecoder(torch.nn.Module):
    """Greedy generation over static buffers: a cache per layer (`caches`), the tokens, the position and a
    causal mask. Subclasses hold the HF model's modules and define forward(ids, pos) -> logits (B, V)."""

    def __init__(self, batch: int, capacity: int, caches, like: torch.Tensor, *, compile: bool):
        super().__init__()
        self.kv = torch.nn.ModuleList(caches)
        self.register_buffer("causal", torch.ones(capacity, capacity, dtype=torch.bool, device=like.device).tril())
        self.register_buffer("tokens", torch.zeros(batch, capacity, dtype=torch.long, device=like.device))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=like.device))
        torch._dynamo.mark_static_address(self.tokens)
        torch._dynamo.mark_static_address(self.pos)
        self.decode_step = torch.compile(self.step, mode="reduce-overhead", fullgraph=True) if compile else self.step

    def step(self) -> None:
        """One greedy step on the buffers: the token at `pos` in, the next one written at pos + 1."""
        logits = self.forward(self.tokens.index_select(1, self.pos), self.pos)
        self.tokens[:, self.pos + 1] = logits.argmax(-1, keepdim=True)
        self.pos.add_(1)

    def generate(self, prompt, new_tokens: int):
        """(tokens (B, T0 + new_tokens), logits (B, V) of the first new token) for prompts (B, T0)."""
        T0 = prompt.shape[1]
        self.tokens[:, :T0] = prompt
        logits = self.forward(prompt, torch.arange(T0, device=prompt.device))
        self.tokens[:, T0] = logits.argmax(-1)
        self.pos.fill_(T0)
        for _ in range(new_tokens - 1):
            self.decode_step()
        return self.tokens[:, :T0 + new_tokens].clone(), logits


class GPT2Decoder(StaticDecoder):
    """Greedy GPT-2 generation for `batch` sequences of up to `capacity` tokens over an HF GPT2LMHeadModel."""

    model_type = "gpt2"

    def __init__(self, hf, batch: int, capacity: int, *, compile: bool = True):
        t, n_head = hf.transformer, hf.config.n_head
        w = t.wte.weight
        shape = (batch, n_head, capacity, w.shape[1] // n_head)
        super().__init__(batch, capacity, [KVCache(shape, w) for _ in t.h], w, compile=compile)
        self.wte, self.wpe, self.h, self.ln_f = t.wte, t.wpe, t.h, t.ln_f
        self.n_head = n_head

    def forward(self, ids, pos):
        """Logits (B, V) after the last of `ids` (B, T) at positions `pos` (T,); K and V go into the cache."""
        B, T = ids.shape
        x = self.wte(ids) + self.wpe(pos)
        mask = self.causal[pos]                      # (T, capacity): each query sees positions <= its own
        for blk, cache in zip(self.h, self.kv):
            q, k, v = blk.attn.c_attn(blk.ln_1(x)).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, *cache.update(pos, k, v), attn_mask=mask)
            x = x + blk.attn.c_proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + blk.mlp.c_proj(F.gelu(blk.mlp.c_fc(blk.ln_2(x)), approximate="tanh"))
        return F.linear(self.ln_f(x[:, -1]), self.wte.weight)


def rotate_half(x):
    """Hugging Face's RoPE layout: (x1, x2) halves of the head dimension -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaDecoder(StaticDecoder):
    """Greedy Llama generation for `batch` sequences of up to `capacity` tokens over an HF LlamaForCausalLM:
    rotate-half RoPE from tables built once by the model's rotary embedding, SDPA over the key/value heads repeated
    for each query group (as gpt-fast does: SDPA's enable_gqa with a mask may fall back to its math backend),
    SwiGLU."""

    model_type = "llama"

    def __init__(self, hf, batch: int, capacity: int, *, compile: bool = True):
        m, c = hf.model, hf.config
        w = m.embed_tokens.weight
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        shape = (batch, c.num_key_value_heads, capacity, head_dim)
        super().__init__(batch, capacity, [KVCache(shape, w) for _ in m.layers], w, compile=compile)
        self.embed, self.layers, self.norm, self.lm_head = m.embed_tokens, m.layers, m.norm, hf.lm_head
        self.head_dim, self.group = head_dim, c.num_attention_heads // c.num_key_value_heads
        # cos, sin (1, capacity, D) in the weights' dtype, as HF computes them (x only lends dtype and device)
        cos, sin = m.rotary_emb(w, torch.arange(capacity, device=w.device)[None])
        self.register_buffer("cos", cos[0].contiguous())
        self.register_buffer("sin", sin[0].contiguous())
        torch._dynamo.mark_static_address(self.cos)
        torch._dynamo.mark_static_address(self.sin)

    def forward(self, ids, pos):
        """Logits (B, V) after the last of `ids` (B, T) at positions `pos` (T,); K and V go into the cache."""
        B, T = ids.shape
        x = self.embed(ids)
        mask = self.causal[pos]                      # (T, capacity): each query sees positions <= its own
        cos, sin = self.cos[pos], self.sin[pos]      # (T, D), broadcast over batch and heads
        for layer, cache in zip(self.layers, self.kv):
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)     # (B, H, T, D)
            k = attn.k_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)     # (B, Hkv, T, D)
            v = attn.v_proj(h).view(B, T, -1, self.head_dim).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            keys, values = (t.repeat_interleave(self.group, dim=1) for t in cache.update(pos, k, v))
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)   # gpt-fast's GQA: a fast backend
            x = x + attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
            h = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return self.lm_head(self.norm(x[:, -1]))


def rotate_pairs(x, cos, sin):
    """DeepSeek's RoPE layout (HF's apply_rotary_emb): adjacent pairs of the head dimension rotated as complex
    numbers, in float32, back to x's dtype."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


class LatentCache(torch.nn.Module):
    """One layer's compressed keys and values (B, capacity, latent + rope): the normalised latent and the rotated
    shared rope key of each position, written in place."""

    def __init__(self, shape: tuple, like: torch.Tensor):
        super().__init__()
        self.register_buffer("kv", torch.zeros(shape, dtype=like.dtype, device=like.device))
        torch._dynamo.mark_static_address(self.kv)

    def update(self, pos, latent_and_rope):
        self.kv[:, pos] = latent_and_rope
        return self.kv


class DeepseekV2Decoder(StaticDecoder):
    """Greedy DeepSeek-V2 generation for `batch` sequences of up to `capacity` tokens over an HF
    DeepseekV2ForCausalLM, as a PyTorch engineer writes it for speed: multi-head latent attention in the absorbed
    form over a static latent cache (the query's no-rope part taken into the latent through kv_b_proj's key half,
    the output back out through its value half, so a step reads the cache once, as FlashMLA does); a decode step's
    experts gathered per token (gpt-fast's Mixtral: each token's top-k expert matrices indexed, then batched
    products); longer inputs (the eager prompt) through the HF MoE module (its grouped GEMM), as gathering per token
    would copy every expert of every token."""

    model_type = "deepseek_v2"

    def __init__(self, hf, batch: int, capacity: int, *, compile: bool = True):
        m, c = hf.model, hf.config
        w = m.embed_tokens.weight
        shape = (batch, capacity, c.kv_lora_rank + c.qk_rope_head_dim)
        super().__init__(batch, capacity, [LatentCache(shape, w) for _ in m.layers], w, compile=compile)
        self.embed, self.layers, self.norm, self.lm_head = m.embed_tokens, m.layers, m.norm, hf.lm_head
        self.heads, self.rank = c.num_attention_heads, c.kv_lora_rank
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        freqs = m.rotary_emb(w, torch.arange(capacity, device=w.device)[None])[0]    # complex (capacity, rope / 2)
        self.register_buffer("cos", freqs.real.float().contiguous())
        self.register_buffer("sin", freqs.imag.float().contiguous())
        torch._dynamo.mark_static_address(self.cos)
        torch._dynamo.mark_static_address(self.sin)

    def attention(self, attn, cache, h, pos, mask, cos, sin):
        B, T, _ = h.shape
        q = attn.q_proj(h) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
        q_nope, q_pe = q.view(B, T, self.heads, -1).split([self.nope, self.rope], dim=-1)
        latent, k_pe = attn.kv_a_proj_with_mqa(h).split([self.rank, self.rope], dim=-1)
        q_pe = rotate_pairs(q_pe, cos[:, None], sin[:, None])
        k_pe = rotate_pairs(k_pe, cos, sin)
        kv = cache.update(pos, torch.cat((attn.kv_a_layernorm(latent), k_pe), dim=-1))    # (B, capacity, rank + rope)
        up = attn.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        q_latent = torch.einsum("bthd,hdr->bthr", q_nope, up[:, :self.nope])
        scores = torch.einsum("bthr,bsr->bhts", torch.cat((q_latent, q_pe), dim=-1), kv).float() * attn.scaling
        p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).type_as(h)
        o_latent = torch.einsum("bhts,bsr->bthr", p, kv[..., :self.rank])
        o = torch.einsum("bthr,hvr->bthv", o_latent, up[:, self.nope:])
        return attn.o_proj(o.reshape(B, T, -1))

    @staticmethod
    def feed_forward(mlp, h):
        if not hasattr(mlp, "experts") or h.shape[1] > 1:
            return mlp(h)                                  # the dense layer; the prompt through HF's grouped GEMM
        x = h.view(-1, h.shape[-1])
        _, weights, experts = mlp.gate(x)                  # (N, k) routing weights (scaled as HF does), expert ids
        gate, up = torch.einsum("nd,nkod->nko", x, mlp.experts.gate_up_proj[experts]).chunk(2, dim=-1)
        y = torch.einsum("nki,nkdi->nkd", mlp.experts.act_fn(gate) * up, mlp.experts.down_proj[experts])
        y = torch.einsum("nkd,nk->nd", y.float(), weights).type_as(x)
        return (y + mlp.shared_experts(x)).view_as(h)

    def forward(self, ids, pos):
        """Logits (B, V) after the last of `ids` (B, T) at positions `pos` (T,); the latents go into the cache."""
        x = self.embed(ids)
        mask = self.causal[pos]                      # (T, capacity): each query sees positions <= its own
        cos, sin = self.cos[pos], self.sin[pos]      # (T, rope / 2)
        for layer, cache in zip(self.layers, self.kv):
            x = x + self.attention(layer.self_attn, cache, layer.input_layernorm(x), pos, mask, cos, sin)
            x = x + self.feed_forward(layer.mlp, layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x[:, -1]))


def decoder_for(hf, batch: int, capacity: int, *, compile: bool = True) -> StaticDecoder:
    """The decoder written for the HF model's model_type, over that model."""
    decoders = {cls.model_type: cls for cls in StaticDecoder.__subclasses__()}
    model_type = hf.config.model_type
    if model_type not in decoders:
        raise ValueError(f"no gpt-fast decoder for model_type {model_type!r} (written: {', '.join(decoders)})")
    return decoders[model_type](hf, batch, capacity, compile=compile)
