"""GPT-2 in NumPy on the CPU, composed from the kernels' float64 references: the oracle for the GPU model."""

from __future__ import annotations

import numpy as np

from tilekit.kernels.attention import attention_reference
from tilekit.kernels.embedding import embedding_reference
from tilekit.kernels.layer_norm import layer_norm_reference
from tilekit.kernels.linear import linear_reference
from tilekit.models.gpt2 import weights as gpt2_weights
from tilekit.models.gpt2.config import GPTConfig
from tilekit.models.reference import ReferenceLM


class ReferenceGPT(ReferenceLM):
    """GPT-2 (pre-LayerNorm, tanh GELU, LM head tied to wte) over a state dict of canonical names."""

    weights = gpt2_weights
    config: GPTConfig

    def _hidden(self, ids: np.ndarray) -> np.ndarray:
        """Final-LayerNorm hidden states (B, T, C) for validated ids."""
        cfg, w, cast = self.config, self.state, self._cast
        B, T = ids.shape
        H, D = cfg.n_head, cfg.head_dim
        positions = np.broadcast_to(np.arange(T), (B, T))
        x = cast(embedding_reference(ids, w["wte.weight"], w["wpe.weight"], positions))
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            h = cast(layer_norm_reference(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], cfg.layer_norm_epsilon))
            qkv = cast(linear_reference(h, w[p + "attn.c_attn.weight"], w[p + "attn.c_attn.bias"]))
            q, k, v = (a.reshape(B, T, H, D).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, axis=-1))
            y = cast(attention_reference(q, k, v, causal=True)).transpose(0, 2, 1, 3).reshape(B, T, cfg.n_embd)
            x = cast(linear_reference(y, w[p + "attn.c_proj.weight"], w[p + "attn.c_proj.bias"], residual=x))
            h = cast(layer_norm_reference(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], cfg.layer_norm_epsilon))
            h = cast(linear_reference(h, w[p + "mlp.c_fc.weight"], w[p + "mlp.c_fc.bias"], activation="gelu"))
            x = cast(linear_reference(h, w[p + "mlp.c_proj.weight"], w[p + "mlp.c_proj.bias"], residual=x))
        return cast(layer_norm_reference(x, w["ln_f.weight"], w["ln_f.bias"], cfg.layer_norm_epsilon))

    def _lm_head(self, x: np.ndarray) -> np.ndarray:
        """Logits through the LM head tied to the token embedding: x @ wte.T."""
        return self._cast(linear_reference(x, self.state["wte.weight"], weight_layout="out_in"))
