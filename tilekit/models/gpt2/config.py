"""GPT-2 family hyper-parameters: the four Hugging Face presets, custom sizes, Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass

from tilekit import checkpoints


@dataclass(frozen=True)
class GPTConfig(checkpoints.HFConfig):
    """Shape of a GPT-2 model; names follow nanoGPT and the HF config keys map onto them."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        checkpoints.check_positive_ints(self, ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"))
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        checkpoints.check_number(self, "layer_norm_epsilon")
        checkpoints.check_token_ids(self)

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
    def from_fields(cls, f: checkpoints.Fields) -> "GPTConfig":
        """Read a Hugging Face GPT2Config (config.json's fields), each checked; variants this model does not
        compute are refused, naming the field."""
        f.choice("model_type", ("gpt2",), "gpt2")
        f.variant("activation_function", "gelu_new", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"))
        f.variant("scale_attn_by_inverse_layer_idx", False, lambda v: v is False)
        f.variant("scale_attn_weights", True, lambda v: v is True)
        f.variant("tie_word_embeddings", True, lambda v: v is True)
        n_head = f.integer("n_head", low=1, high=checkpoints.MAX_SIZE)
        n_embd = f.integer("n_embd", low=1, high=checkpoints.MAX_SIZE)
        if n_embd % n_head:
            raise f.error("n_embd", f"is {n_embd}, not a multiple of n_head ({n_head})")
        f.variant("n_inner", None, lambda v: v is None or (type(v) is int and v == 4 * n_embd))
        vocab = f.integer("vocab_size", low=1, high=checkpoints.MAX_SIZE)
        positions = f.integer("n_ctx" if "n_ctx" in f and "n_positions" not in f else "n_positions", 1024, low=1,
                              high=checkpoints.MAX_SIZE)   # n_ctx: what configs older than n_positions name it
        return f.build(cls, n_layer=f.integer("n_layer", low=1, high=checkpoints.MAX_LAYERS), n_head=n_head, n_embd=n_embd,
                       vocab_size=vocab, block_size=positions,
                       layer_norm_epsilon=f.number("layer_norm_epsilon", 1e-5, positive=True),
                       bos_token_id=f.integer("bos_token_id", None, low=0, high=vocab - 1),
                       eos_token_id=f.token_ids("eos_token_id", None, vocab=vocab))

    def to_hf_dict(self) -> dict:
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "vocab_size": self.vocab_size, "n_positions": self.block_size, "n_ctx": self.block_size,
                "layer_norm_epsilon": self.layer_norm_epsilon, "activation_function": "gelu_new",
                "bos_token_id": self.bos_token_id, "eos_token_id": eos,
                "tie_word_embeddings": self.tie_word_embeddings}


_ENDOFTEXT = dict(bos_token_id=50256, eos_token_id=50256)   # <|endoftext|>, as the hub's config.json files say

PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, **_ENDOFTEXT),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, **_ENDOFTEXT),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280, **_ENDOFTEXT),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600, **_ENDOFTEXT),
}
