"""GPT-2 in NumPy on the CPU, composed from the kernels' float64 references: the oracle for the GPU model;
and ReferenceLM, what it shares with the other reference models (llama_reference.py).

Every op computes in float64; its output is stored in the model's dtype, so float32 mirrors a GPU model whose
kernels write fp32 activations and float64 is the exact answer to compare both against.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np

from tilekit.kernels.attention import attention_reference
from tilekit.kernels.embedding import embedding_reference
from tilekit.kernels.layernorm import layer_norm_reference
from tilekit.kernels.linear import linear_reference
from tilekit.models import checkpoint as gpt2_checkpoint
from tilekit.models.config import GPTConfig


class ReferenceLM:
    """What the NumPy reference models share: validated weights in one dtype, loading, validated ids, `forward`
    and greedy generation by recomputation. A model names its family's `checkpoint` module (check_state_dict,
    load_state_dict) and writes `_hidden` (final-norm hidden states) and `_lm_head`."""

    checkpoint: ModuleType

    def __init__(self, config, state: dict[str, np.ndarray], dtype=np.float64):
        self.dtype = gpt2_checkpoint.float_dtype(dtype)
        self.checkpoint.check_state_dict(config, state)
        self.config = config
        self.state = {name: np.ascontiguousarray(array, dtype=self.dtype) for name, array in state.items()}

    @classmethod
    def from_pretrained(cls, path_or_name: str | Path, dtype=np.float64) -> "ReferenceLM":
        """Load a Hugging Face checkpoint directory or cached hub model name."""
        config, state = cls.checkpoint.load_state_dict(path_or_name, dtype=dtype)
        return cls(config, state, dtype)

    def forward(self, ids) -> np.ndarray:
        """Logits (B, T, vocab_size) for integer token ids (B, T)."""
        return self._lm_head(self._hidden(self._check_ids(ids)))

    def generate_greedy(self, ids, max_new_tokens: int) -> np.ndarray:
        """Append `max_new_tokens` argmax tokens to each row of `ids`, recomputing the whole prefix each step."""
        ids = self._check_ids(ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if ids.shape[1] + max_new_tokens > self.config.block_size:
            raise ValueError(f"ids length {ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
                             f"block_size {self.config.block_size}")
        for _ in range(max_new_tokens):
            logits = self._lm_head(self._hidden(ids)[:, -1])
            ids = np.concatenate([ids, logits.argmax(-1)[:, None]], axis=1)
        return ids

    def _check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
        if ids.ndim != 2 or ids.size == 0:
            raise ValueError(f"ids must be a non-empty 2-D (batch, time) array, got shape {ids.shape}")
        if ids.shape[1] > self.config.block_size:
            raise ValueError(f"ids has {ids.shape[1]} positions, more than block_size {self.config.block_size}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"ids must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{ids.min()}, {ids.max()}]")
        return ids.astype(np.int64)

    def _cast(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=self.dtype)


class ReferenceGPT(ReferenceLM):
    """GPT-2 (pre-LayerNorm, tanh GELU, LM head tied to wte) over a state dict of canonical names."""

    checkpoint = gpt2_checkpoint
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
