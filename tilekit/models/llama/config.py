"""Llama family hyper-parameters: Llama 3.1/3.2 and TinyLlama presets, custom sizes, Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tilekit import checkpoints

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency adjustment (Hugging Face rope_type "llama3"): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor are kept, and the band between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        checkpoints.check_number(self, "factor")
        if self.factor < 1:
            raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor!r}")
        checkpoints.check_number(self, "low_freq_factor")
        checkpoints.check_number(self, "high_freq_factor", low=self.low_freq_factor)
        checkpoints.check_positive_ints(self, ("original_max_position_embeddings",))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """float64 (head_dim / 2,) rotary inverse frequencies theta^(-2i / head_dim), with Llama 3.1's adjustment."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):   # rope_problem() judges the result
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if scaling is None:
            return inv_freq
        old_context = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated smoothly.
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor
                                                                     - scaling.low_freq_factor)
        scaled = np.where(wavelen > old_context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
        medium = (wavelen >= old_context / scaling.high_freq_factor) & (wavelen <= old_context
                                                                         / scaling.low_freq_factor)
        return np.where(medium, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)


def rope_problem(head_dim: int, theta: float, scaling: RopeScaling | None) -> str | None:
    """Why these RoPE parameters cannot rotate, or None (checkpoints.rotary_problem)."""
    return checkpoints.rotary_problem(rope_inv_freq(head_dim, theta, scaling), "head_dim", head_dim)


@dataclass(frozen=True)
class LlamaConfig(checkpoints.HFConfig):
    """Shape of a Llama model: nanoGPT names where GPT-2 has the same thing, Hugging Face names elsewhere.

    The defaults are Llama-3.2-1B's. head_dim defaults to n_embd // n_head; n_kv_head < n_head is grouped-query
    attention. bos/eos token ids are the config's (eos may be several ids), kept so that a saved config.json
    tells generation where to stop.
    """

    n_layer: int = 16
    n_head: int = 32
    n_kv_head: int = 8
    n_embd: int = 2048
    intermediate_size: int = 8192
    vocab_size: int = 128256
    max_position_embeddings: int = 131072
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = RopeScaling(32.0, 1.0, 4.0, 8192)
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        checkpoints.check_positive_ints(self, ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab_size",
                                   "max_position_embeddings"))
        if self.n_embd % self.n_head:  # transformers refuses such a config even with head_dim given
            raise ValueError(f"LlamaConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        checkpoints.check_positive_ints(self, ("head_dim",))
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even (rotary embeddings pair its halves), "
                             f"got {self.head_dim}")
        checkpoints.check_rotary_config(self, RopeScaling, rope_problem, self.head_dim)

    @property
    def block_size(self) -> int:
        """The longest sequence, by the name the engine and the references use."""
        return self.max_position_embeddings

    @classmethod
    def preset(cls, name: str) -> "LlamaConfig":
        """One of 'llama-3.2-1b', 'llama-3.2-3b', 'llama-3.1-8b', 'tinyllama-1.1b'."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown Llama preset {name!r}; choose from {sorted(PRESETS)}") from None

    @classmethod
    def from_fields(cls, f: checkpoints.Fields) -> "LlamaConfig":
        """Read a Hugging Face LlamaConfig (config.json's fields, transformers 4 or 5 layout), each checked, absent
        ones taking transformers' defaults; variants this model does not compute are refused, naming the field."""
        f.choice("model_type", ("llama",), "llama")
        f.variant("hidden_act", "silu", lambda v: v == "silu")
        for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
            f.variant(key, False, lambda v: v is False)
        f.variant("sliding_window", None, lambda v: v is None)
        f.variant("partial_rotary_factor", 1.0, lambda v: type(v) in (int, float) and v == 1)
        f.variant("layer_types", None, lambda v: v is None or (
            isinstance(v, list) and all(t == "full_attention" for t in v)))
        n_head = f.integer("num_attention_heads", low=1, high=checkpoints.MAX_SIZE)
        n_embd = f.integer("hidden_size", low=1, high=checkpoints.MAX_SIZE)
        n_kv_head = f.integer("num_key_value_heads", None, low=1, high=checkpoints.MAX_SIZE) or n_head
        head_dim = f.integer("head_dim", None, low=1, high=checkpoints.MAX_SIZE) or n_embd // n_head
        if n_embd % n_head:
            raise f.error("hidden_size", f"is {n_embd}, not a multiple of num_attention_heads ({n_head})")
        if n_head % n_kv_head:
            raise f.error("num_attention_heads", f"is {n_head}, not a multiple of num_key_value_heads ({n_kv_head})")
        if head_dim % 2:
            raise f.error("head_dim", f"is {head_dim}, expected an even number (RoPE pairs its halves)")
        vocab = f.integer("vocab_size", low=1, high=checkpoints.MAX_SIZE)
        positions = f.integer("max_position_embeddings", 2048, low=1, high=checkpoints.MAX_SIZE)
        rope, kind, theta = checkpoints.rope_fields(f, {"default": (), "llama3": LLAMA3_KEYS},
                                           f.number("rope_theta", 10000.0, positive=True))
        scaling = None
        if kind == "llama3":
            low = rope.number("low_freq_factor", positive=True)
            high = rope.number("high_freq_factor", positive=True)
            if high <= low:
                raise rope.error("high_freq_factor", f"is {high}, expected > low_freq_factor ({low})")
            scaling = RopeScaling(rope.number("factor", low=1.0), low, high, rope.integer(
                "original_max_position_embeddings", positions, low=1, high=checkpoints.MAX_SIZE))
        checkpoints.refuse_rope_theta(f, rope, theta, rope_problem(head_dim, theta, scaling))
        return f.build(cls, n_layer=f.integer("num_hidden_layers", low=1, high=checkpoints.MAX_LAYERS), n_head=n_head,
                       n_kv_head=n_kv_head, n_embd=n_embd,
                       intermediate_size=f.integer("intermediate_size", low=1, high=checkpoints.MAX_SIZE), vocab_size=vocab,
                       max_position_embeddings=positions, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
                       **checkpoints.common_fields(f, vocab))

    def to_hf_dict(self) -> dict:
        """A config.json that transformers' LlamaForCausalLM reads (the transformers 4 layout, as the hub has it)."""
        scaling = None if self.rope_scaling is None else {"rope_type": "llama3",
                                                          **dataclasses.asdict(self.rope_scaling)}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
                "num_key_value_heads": self.n_kv_head, "hidden_size": self.n_embd, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
                "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": scaling, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id, "eos_token_id": eos}


_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
               bos_token_id=128000, eos_token_id=128001)

# The published config.json files of meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B, -3.1-70B and
# TinyLlama/TinyLlama-1.1B-Chat-v1.0 (base models; the instruct ones differ only in their eos ids).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                                rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True, **_LLAMA3),
    "llama-3.2-3b": LlamaConfig(n_layer=28, n_head=24, n_kv_head=8, n_embd=3072, intermediate_size=8192,
                                rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True, **_LLAMA3),
    "llama-3.1-8b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_word_embeddings=False, **_LLAMA3),
    "llama-3.1-70b": LlamaConfig(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                                 rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_word_embeddings=False, **_LLAMA3),
    "tinyllama-1.1b": LlamaConfig(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, intermediate_size=5632,
                                  vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                                  rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2),
}
