"""GPT-2 family hyper-parameters: the four Hugging Face presets, custom sizes, Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tilekit.models.hf import check_positive_ints, hf_config_fields, read_json


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 model; names follow nanoGPT and the HF config keys map onto them."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        check_positive_ints(self, ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"))
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"GPTConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def tie_word_embeddings(self) -> bool:
        """GPT-2's LM head is always its token embedding (by the name LlamaConfig has the flag)."""
        return True

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        """One of 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'."""
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown GPT-2 preset {name!r}; choose from {sorted(PRESETS)}") from None

    @classmethod
    def from_hf_dict(cls, d: dict) -> "GPTConfig":
        """Build from a Hugging Face GPT2Config dict (config.json); variants this model does not compute are refused."""
        unsupported = {
            "activation_function": (d.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh")),
            "scale_attn_by_inverse_layer_idx": bool(d.get("scale_attn_by_inverse_layer_idx", False)),
            "scale_attn_weights": not d.get("scale_attn_weights", True),
            "n_inner": d.get("n_inner") not in (None, 4 * d.get("n_embd", 0)),
        }
        with hf_config_fields(d, unsupported, "GPT-2"):
            return cls(n_layer=int(d["n_layer"]), n_head=int(d["n_head"]), n_embd=int(d["n_embd"]),
                       vocab_size=int(d["vocab_size"]), block_size=int(d.get("n_positions", d.get("n_ctx", 1024))),
                       layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)))

    @classmethod
    def from_json(cls, path: str | Path) -> "GPTConfig":
        return cls.from_hf_dict(read_json(path))

    def to_hf_dict(self) -> dict:
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "vocab_size": self.vocab_size, "n_positions": self.block_size, "n_ctx": self.block_size,
                "layer_norm_epsilon": self.layer_norm_epsilon, "activation_function": "gelu_new",
                "bos_token_id": self.vocab_size - 1, "eos_token_id": self.vocab_size - 1,
                "tie_word_embeddings": self.tie_word_embeddings}

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
