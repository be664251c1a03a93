"""The strongest decode anchor a PyTorch engineer writes by hand: GPT-2 and Llama in the style of gpt-fast.

Static KV-cache buffers (one pair per layer, written in place), SDPA over the whole cache under a
causal mask, greedy argmax on the GPU.
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
    """Greedy generation over static buffers: a KV cache per layer, the tokens, the position and a causal
    mask. Subclasses hold the HF model's modules and define forward(ids, pos) -> logits (B, V)."""

    def __init__(self, batch: int, capacity: int, layers: int, cache_shape: tuple, like: torch.Tensor, *,
                 compile: bool):
        super().__init__()
        self.kv = torch.nn.ModuleList(KVCache(cache_shape, like) for _ in range(layers))
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
        super().__init__(batch, capacity, len(t.h), (batch, n_head, capacity, w.shape[1] // n_head), w,
                         compile=compile)
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
        super().__init__(batch, capacity, len(m.layers), (batch, c.num_key_value_heads, capacity, head_dim), w,
                         compile=compile)
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


def decoder_for(hf, batch: int, capacity: int, *, compile: bool = True) -> StaticDecoder:
    """The decoder written for the HF model's model_type, over that model."""
    decoders = {cls.model_type: cls for cls in StaticDecoder.__subclasses__()}
    model_type = hf.config.model_type
    if model_type not in decoders:
        raise ValueError(f"no gpt-fast decoder for model_type {model_type!r} (written: {', '.join(decoders)})")
    return decoders[model_type](hf, batch, capacity, compile=compile)
