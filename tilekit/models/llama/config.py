"""Llama family hyper-parameters: Llama 3.1/3.2 and TinyLlama presets, custom sizes, Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tilekit.models.hf import check_number, check_positive_ints, hf_config_fields, read_json


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
        check_number(self, "factor")
        if self.factor < 1:
            raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor!r}")
        check_number(self, "low_freq_factor")
        check_number(self, "high_freq_factor", low=self.low_freq_factor)
        check_positive_ints(self, ("original_max_position_embeddings",))


@dataclass(frozen=True)
class LlamaConfig:
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
        check_positive_ints(self, ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab_size",
                                   "max_position_embeddings"))
        if self.n_embd % self.n_head:  # transformers refuses such a config even with head_dim given
            raise ValueError(f"LlamaConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        check_positive_ints(self, ("head_dim",))
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even (rotary embeddings pair its halves), "
                             f"got {self.head_dim}")
        check_number(self, "rms_norm_eps")
        check_number(self, "rope_theta")
        if not isinstance(self.rope_scaling, (RopeScaling, type(None))):
            raise ValueError(f"LlamaConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for token in (self.bos_token_id, *eos):
            if token is not None and (not isinstance(token, int) or isinstance(token, bool)
                                      or not 0 <= token < self.vocab_size):
                raise ValueError(f"LlamaConfig token ids must be ints in [0, {self.vocab_size}), "
                                 f"got bos {self.bos_token_id!r}, eos {self.eos_token_id!r}")

    @property
    def block_size(self) -> int:
        """The longest sequence, by the name the shared runtime and references use."""
        return self.max_position_embeddings

    @classmethod
    def preset(cls, name: str) -> "LlamaConfig":
        """One of 'llama-3.2-1b', 'llama-3.2-3b', 'llama-3.1-8b', 'tinyllama-1.1b'."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown Llama preset {name!r}; choose from {sorted(PRESETS)}") from None

    @classmethod
    def from_hf_dict(cls, d: dict) -> "LlamaConfig":
        """Build from a Hugging Face LlamaConfig dict (config.json, transformers 4 or 5 layout, missing keys taking
        transformers' defaults); variants this model does not compute are refused, naming the key."""
        # transformers 4 writes rope_theta + rope_scaling (None for plain RoPE), 5 writes rope_parameters.
        rope_key = "rope_scaling" if d.get("rope_scaling") is not None else "rope_parameters"
        rope = d.get(rope_key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
        rope_keys = {"rope_type", "type", "rope_theta"} | (
            {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
            if rope_type == "llama3" else set())
        unsupported = {
            "model_type": d.get("model_type", "llama") != "llama",
            "hidden_act": d.get("hidden_act", "silu") != "silu",
            "attention_bias": d.get("attention_bias", False) is not False,
            "mlp_bias": d.get("mlp_bias", False) is not False,
            rope_key: (not isinstance(rope, dict) or rope_type not in ("default", "llama3")
                       or not rope.keys() <= rope_keys),
            "partial_rotary_factor": d.get("partial_rotary_factor", 1.0) != 1.0,
            "sliding_window": d.get("sliding_window") is not None,
            "use_sliding_window": d.get("use_sliding_window", False) is not False,
            "layer_types": d.get("layer_types") is not None and (not isinstance(d["layer_types"], list) or any(
                t != "full_attention" for t in d["layer_types"])),
        }
        with hf_config_fields(d, unsupported, "Llama"):
            max_positions = d.get("max_position_embeddings", 2048)
            scaling = None if rope_type == "default" else RopeScaling(
                factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope.get("original_max_position_embeddings", max_positions))
            n_head = d["num_attention_heads"]
            return cls(n_layer=d["num_hidden_layers"], n_head=n_head,
                       n_kv_head=n_head if d.get("num_key_value_heads") is None else d["num_key_value_heads"],
                       n_embd=d["hidden_size"],
                       intermediate_size=d["intermediate_size"], vocab_size=d["vocab_size"],
                       max_position_embeddings=max_positions, head_dim=d.get("head_dim"),
                       rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                       rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)), rope_scaling=scaling,
                       tie_word_embeddings=d.get("tie_word_embeddings", False),
                       bos_token_id=d.get("bos_token_id", 1), eos_token_id=d.get("eos_token_id", 2))

    @classmethod
    def from_json(cls, path: str | Path) -> "LlamaConfig":
        return cls.from_hf_dict(read_json(path))

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

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)


_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
               bos_token_id=128000, eos_token_id=128001)

# The published config.json files of meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B and
# TinyLlama/TinyLlama-1.1B-Chat-v1.0 (base models; the instruct ones differ only in their eos ids).
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                                rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True, **_LLAMA3),
    "llama-3.2-3b": LlamaConfig(n_layer=28, n_head=24, n_kv_head=8, n_embd=3072, intermediate_size=8192,
                                rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True, **_LLAMA3),
    "llama-3.1-8b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                                rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_word_embeddings=False, **_LLAMA3),
    "tinyllama-1.1b": LlamaConfig(n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, intermediate_size=5632,
                                  vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                                  rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                                  bos_token_id=1, eos_token_id=2),
}
