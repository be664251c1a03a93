"""What the NumPy reference models of every family share (<family>/reference.py): the oracles for the GPU models.

A reference model is composed from the kernels' float64 references. Every op computes in float64; its output
is stored in the model's dtype, so float32 mirrors a GPU model whose kernels write fp32 activations and float64
is the exact answer to compare both against.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from tilekit.checkpoints import float_dtype
from tilekit.models.running import LanguageModel


class ReferenceLM(LanguageModel):
    """What the NumPy reference models share: validated weights in one dtype, loading, validated ids, `forward`,
    and generation by recomputation (greedy, or sampled with the GPU models' options, text and chat included:
    slow, for checking). A model names its family's `weights` module (resolve, check_state_dict,
    load_state_dict) and writes `_hidden` (final-norm hidden states) and `_lm_head`."""

    weights: ModuleType

    def __init__(self, config, state: dict[str, np.ndarray], dtype=np.float64):
        self.dtype = float_dtype(dtype)
        self.weights.check_state_dict(config, state)
        self.config = config
        self.state = {name: np.ascontiguousarray(array, dtype=self.dtype) for name, array in state.items()}

    @classmethod
    def from_pretrained(cls, path_or_name, dtype=np.float64) -> "ReferenceLM":
        """Load a Hugging Face checkpoint (a directory or cached hub model name) into host arrays of `dtype`."""
        checkpoint = cls.weights.resolve(path_or_name)
        config, state = cls.weights.load_state_dict(checkpoint, dtype=dtype)
        model = cls(config, state, dtype)
        model.checkpoint = checkpoint
        return model

    def forward(self, ids) -> np.ndarray:
        """Logits (B, T, vocab_size) for integer token ids (B, T)."""
        return self._lm_head(self._hidden(self.check_ids(ids)))

    def generate_greedy(self, ids, max_new_tokens: int) -> np.ndarray:
        """Append `max_new_tokens` argmax tokens to each row of `ids`, recomputing the whole prefix each step."""
        ids = self.check_ids(ids)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if ids.shape[1] + max_new_tokens > self.config.block_size:
            raise ValueError(f"ids length {ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
                             f"block_size {self.config.block_size}")
        for _ in range(max_new_tokens):
            logits = self._lm_head(self._hidden(ids)[:, -1])
            ids = np.concatenate([ids, logits.argmax(-1)[:, None]], axis=1)
        return ids

    def next_logits(self, seqs) -> np.ndarray:
        """(B, vocab_size) logits of each sequence's next token (its whole prefix recomputed): what generate()
        samples from (tilekit.engine.recompute)."""
        return np.stack([self._lm_head(self._hidden(np.array([s]))[:, -1])[0] for s in seqs])

    def check_ids(self, ids) -> np.ndarray:
        """Host int64 copy of (B, T) ids after checking dtype, shape, range and length."""
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
