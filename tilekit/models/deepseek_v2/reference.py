"""DeepSeek-V2 in NumPy on the CPU: the oracle for the GPU model.

It follows transformers 5.17's DeepseekV2ForCausalLM (which computes RoPE in float32 and routes in float32);
here everything is float64 (each op's reference from its kernel module where one exists), the exact answer both
are compared against. It reads our layout (weights.py: rotary rows half-split, shared experts appended to the
routed ones). Attention is MLA in its plain form: the latent expanded by kv_b_proj into per-head keys and values,
the one rotary key shared by every head.
"""

from __future__ import annotations

import numpy as np

from tilekit.kernels.apply_rope import rope_reference
from tilekit.kernels.attention import attention_reference
from tilekit.kernels.linear import linear_reference
from tilekit.kernels.moe_down_combine import moe_down_combine_reference
from tilekit.kernels.moe_gate_up import moe_gate_up_reference
from tilekit.kernels.moe_router import moe_router_reference
from tilekit.kernels.rms_norm import rms_norm_reference
from tilekit.kernels.swiglu_linear import swiglu_reference
from tilekit.models.deepseek_v2 import weights
from tilekit.models.deepseek_v2.config import LORA_NORM_EPS, DeepseekV2Config, rope_inv_freq
from tilekit.models.deepseek_v2.weights import EMBEDDING
from tilekit.models.reference import ReferenceLM



def rope_interleaved_reference(x, positions, inv_freq, factor: float = 1.0) -> np.ndarray:
    """float64 rotation of the pairs (x[2i], x[2i + 1]) of the last axis by position * inv_freq[i], scaled by
    `factor` (transformers' DeepSeek-V2 complex form, cos and sin times YaRN's attention factor)."""
    x = np.asarray(x, np.float64)
    angles = np.asarray(positions, np.float64)[..., None] * inv_freq
    cos, sin = np.cos(angles) * factor, np.sin(angles) * factor
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


class ReferenceDeepseekV2(ReferenceLM):
    """DeepSeek-V2 (pre-RMSNorm, multi-head latent attention with YaRN RoPE, dense then mixture-of-experts MLPs,
    tied or untied LM head) over a state dict of our names (weights.py)."""

    weights = weights
    config: DeepseekV2Config

    def __init__(self, config: DeepseekV2Config, state: dict[str, np.ndarray], dtype=np.float64):
        super().__init__(config, state, dtype)
        self.inv_freq = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
        self.rope_factor = 1.0 if config.rope_scaling is None else config.rope_scaling.cos_sin_factor

    def _linear(self, x: np.ndarray, name: str, residual=None) -> np.ndarray:
        """nn.Linear without bias, stored in the model's dtype."""
        return self._cast(linear_reference(x, self.state[name], weight_layout="out_in", residual=residual))

    def _norm(self, x: np.ndarray, name: str, eps: float) -> np.ndarray:
        return self._cast(rms_norm_reference(x, self.state[name], eps))

    def _mlp(self, x: np.ndarray, prefix: str) -> np.ndarray:
        """down(silu(gate(x)) * up(x))."""
        h = self._cast(swiglu_reference(self._linear(x, prefix + "gate_proj.weight"),
                                        self._linear(x, prefix + "up_proj.weight")))
        return self._linear(h, prefix + "down_proj.weight")

    def _attention(self, h: np.ndarray, prefix: str) -> np.ndarray:
        """MLA of the normed hidden states h (B, T, C): the heads' outputs (B, T, H * v_head_dim)."""
        cfg, cast = self.config, self._cast
        B, T, _ = h.shape
        H, dn, dv, R = cfg.n_head, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        positions = np.arange(T)

        def rope(x):      # half-split pairs (our layout), cos and sin times YaRN's factor
            return cast(rope_reference(x, positions, self.inv_freq) * self.rope_factor)

        if cfg.q_lora_rank is None:
            q = self._linear(h, prefix + "q_proj.weight")
        else:
            q = self._linear(self._norm(self._linear(h, prefix + "q_a_proj.weight"), prefix + "q_a_layernorm.weight",
                                        LORA_NORM_EPS), prefix + "q_b_proj.weight")
        q = q.reshape(B, T, H, cfg.qk_head_dim).transpose(0, 2, 1, 3)
        q = np.concatenate([q[..., :dn], rope(q[..., dn:])], -1)
        kv = self._linear(h, prefix + "kv_a_proj_with_mqa.weight")
        c = self._norm(kv[..., :R], prefix + "kv_a_layernorm.weight", LORA_NORM_EPS)
        k_pe = rope(kv[:, None, :, R:])                                           # (B, 1, T, rope): every head's
        kv = self._linear(c, prefix + "kv_b_proj.weight").reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)
        k = np.concatenate([kv[..., :dn], np.broadcast_to(k_pe, (B, H, T, cfg.qk_rope_head_dim))], -1)
        y = cast(attention_reference(q, k, kv[..., dn:], causal=True, scale=cfg.softmax_scale))
        return y.transpose(0, 2, 1, 3).reshape(B, T, H * dv)

    def _moe(self, h: np.ndarray, prefix: str) -> np.ndarray:
        """Routed experts (softmax router, top-k, scaled) plus the shared experts (experts E.. chosen by every token
        with weight 1), of h (B, T, C)."""
        cfg, cast = self.config, self._cast
        x = h.reshape(-1, cfg.n_embd)
        ids, w = moe_router_reference(x, self.state[prefix + "gate.weight"], cfg.num_experts_per_tok,
                                      scale=cfg.routed_scaling_factor, shared=cfg.n_shared_experts)
        act = cast(moe_gate_up_reference(x, self.state[prefix + "experts.gate_up_proj"], ids))
        return cast(moe_down_combine_reference(act, self.state[prefix + "experts.down_proj"], ids, w)).reshape(h.shape)

    def _hidden(self, ids: np.ndarray) -> np.ndarray:
        """Final-RMSNorm hidden states (B, T, C) for validated ids."""
        cfg, cast = self.config, self._cast
        eps = cfg.rms_norm_eps
        x = cast(self.state[EMBEDDING][ids])
        for i in range(cfg.n_layer):
            p = f"model.layers.{i}."
            y = self._attention(self._norm(x, p + "input_layernorm.weight", eps), p + "self_attn.")
            x = self._linear(y, p + "self_attn.o_proj.weight", residual=x)
            h = self._norm(x, p + "post_attention_layernorm.weight", eps)
            x = cast(x + (self._moe(h, p + "mlp.") if cfg.is_moe_layer(i) else self._mlp(h, p + "mlp.")))
        return self._norm(x, "model.norm.weight", eps)

    def _lm_head(self, x: np.ndarray) -> np.ndarray:
        """Logits x @ W.T, W the LM head or, when tied, the token embedding."""
        return self._linear(x, EMBEDDING if self.config.tie_word_embeddings else "lm_head.weight")
