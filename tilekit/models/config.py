"""GPT-2 family hyper-parameters (the four Hugging Face presets and custom sizes), and the config helpers
every model family shares."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MAX_JSON_BYTES = 16 << 20  # config.json and safetensors indexes are small; a larger file is refused unread


@contextlib.contextmanager
def hf_config_fields(d: dict, unsupported: dict[str, bool], family: str):
    """Reading a Hugging Face config.json dict `d`: ValueError naming every key whose value asks for a
    variant tilekit does not compute (`unsupported`: key -> is it such a value), then, within the block,
    naming a required key the file lacks."""
    bad = [f"{k}={d[k]!r}" for k, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"config.json asks for a {family} variant tilekit does not compute: {', '.join(bad)}")
    try:
        yield
    except KeyError as e:
        raise ValueError(f"config.json lacks the {family} key {e.args[0]!r}") from None


def read_json(path: str | Path, what: str) -> dict:
    """The JSON object in `path`, an untrusted file: ValueError naming it if it is unreadable, too large,
    not strict JSON, not an object or repeats a key (json would silently keep the last)."""
    path = Path(path)

    def strict(pairs):
        d = dict(pairs)
        if len(d) < len(pairs):
            raise ValueError(f"repeated key {next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)!r}")
        return d

    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ValueError(f"larger than {MAX_JSON_BYTES} bytes")
        d = json.loads(path.read_bytes(), object_pairs_hook=strict, parse_constant=no_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"cannot read {what} {path}: a JSON object expected, got {type(d).__name__}")
    return d


MAX_SIZE = 1 << 24       # no model dimension comes near; a config file claiming more is refused
MAX_LAYERS = 4096


def check_positive_ints(config, names) -> None:
    """ValueError naming the first of `names` whose value in `config` is not a positive int (bools are
    not) of plausible size (a hostile config.json must not make the shape checks run for hours)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")
        most = MAX_LAYERS if name == "n_layer" else MAX_SIZE
        if value > most:
            raise ValueError(f"{type(config).__name__}.{name} = {value} is larger than any model tilekit runs "
                             f"(at most {most})")


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
        return cls.from_hf_dict(read_json(path, "model config"))

    def to_hf_dict(self) -> dict:
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd,
                "vocab_size": self.vocab_size, "n_positions": self.block_size, "n_ctx": self.block_size,
                "layer_norm_epsilon": self.layer_norm_epsilon, "activation_function": "gelu_new",
                "bos_token_id": self.vocab_size - 1, "eos_token_id": self.vocab_size - 1,
                "tie_word_embeddings": True}

    def replace(self, **changes) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, dict] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
}
