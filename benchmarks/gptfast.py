"""The strongest decode anchor a PyTorch engineer writes by hand: GPT-2 in the style of gpt-fast.

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
    """One layer's keys and values (B, H, capacity, D), written in place at the step's positions."""

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


class GPT2Decoder(torch.nn.Module):
    """Greedy GPT-2 generation for `batch` sequences of up to `capacity` tokens over an HF GPT2LMHeadModel."""

    def __init__(self, hf, batch: int, capacity: int, *, compile: bool = True):
        super().__init__()
        t = hf.transformer
        self.wte, self.wpe, self.h, self.ln_f = t.wte, t.wpe, t.h, t.ln_f
        self.n_head = hf.config.n_head
        w = t.wte.weight
        shape = (batch, self.n_head, capacity, w.shape[1] // self.n_head)
        self.kv = torch.nn.ModuleList(KVCache(shape, w) for _ in t.h)
        self.register_buffer("causal", torch.ones(capacity, capacity, dtype=torch.bool, device=w.device).tril())
        self.register_buffer("tokens", torch.zeros(batch, capacity, dtype=torch.long, device=w.device))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=w.device))
        torch._dynamo.mark_static_address(self.tokens)
        torch._dynamo.mark_static_address(self.pos)
        self.decode_step = torch.compile(self.step, mode="reduce-overhead", fullgraph=True) if compile else self.step

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
