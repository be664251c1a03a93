"""Llama in NumPy on the CPU: the oracle for the GPU model.

It follows Hugging Face transformers' LlamaForCausalLM, which computes RoPE frequencies in float32; here
everything is float64 (each op's reference from its kernel module), the exact answer both are compared against.
"""

from __future__ import annotations

import numpy as np

from tilekit.kernels.attention import attention_reference
from tilekit.kernels.linear import linear_reference
from tilekit.kernels.rms_norm import rms_norm_reference
from tilekit.kernels.apply_rope import rope_reference
from tilekit.kernels.swiglu_linear import swiglu_reference
from tilekit.models.llama import weights as llama_weights
from tilekit.models.llama.config import LlamaConfig, rope_inv_freq
from tilekit.models.llama.weights import EMBEDDING
from tilekit.models.reference import ReferenceLM


class ReferenceLlama(ReferenceLM):
    """Llama (pre-RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied or untied LM head) over a state dict
    of Hugging Face names."""

    weights = llama_weights
    config: LlamaConfig

    def __init__(self, config: LlamaConfig, state: dict[str, np.ndarray], dtype=np.float64):
        super().__init__(config, state, dtype)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)

    def _hidden(self, ids: np.ndarray) -> np.ndarray:
        """Final-RMSNorm hidden states (B, T, C) for validated ids."""
        cfg, w, cast = self.config, self.state, self._cast
        B, T = ids.shape
        D, eps = cfg.head_dim, cfg.rms_norm_eps
        positions = np.arange(T)

        def heads(x: np.ndarray, n: int) -> np.ndarray:  # (B, T, n * D) -> (B, n, T, D)
            return x.reshape(B, T, n, D).transpose(0, 2, 1, 3)

        def linear(x: np.ndarray, name: str, residual=None) -> np.ndarray:  # nn.Linear without bias
            return linear_reference(x, w[name], weight_layout="out_in", residual=residual)

        x = cast(w[EMBEDDING][ids])
        for i in range(cfg.n_layer):
            p = f"model.layers.{i}."
            h = cast(rms_norm_reference(x, w[p + "input_layernorm.weight"], eps))
            q = cast(rope_reference(heads(linear(h, p + "self_attn.q_proj.weight"), cfg.n_head), positions,
                                    self.inv_freq))
            k = cast(rope_reference(heads(linear(h, p + "self_attn.k_proj.weight"), cfg.n_kv_head), positions,
                                    self.inv_freq))
            v = cast(heads(linear(h, p + "self_attn.v_proj.weight"), cfg.n_kv_head))
            y = cast(attention_reference(q, k, v)).transpose(0, 2, 1, 3).reshape(B, T, cfg.n_head * D)
            x = cast(linear(y, p + "self_attn.o_proj.weight", residual=x))
            h = cast(rms_norm_reference(x, w[p + "post_attention_layernorm.weight"], eps))
            h = cast(swiglu_reference(linear(h, p + "mlp.gate_proj.weight"), linear(h, p + "mlp.up_proj.weight")))
            x = cast(linear(h, p + "mlp.down_proj.weight", residual=x))
        return cast(rms_norm_reference(x, w["model.norm.weight"], eps))

    def _lm_head(self, x: np.ndarray) -> np.ndarray:
        """Logits x @ W.T, W the LM head or, when tied, the token embedding."""
        head = EMBEDDING if self.config.tie_word_embeddings else "lm_head.weight"
        return self._cast(linear_reference(x, self.state[head], weight_layout="out_in"))
