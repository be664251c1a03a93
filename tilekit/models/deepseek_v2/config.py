"""DeepSeek-V2 family hyper-parameters: the DeepSeek-V2-Lite preset, custom sizes, Hugging Face config.json.

Names follow Hugging Face's DeepseekV2Config (nanoGPT's where GPT-2 and Llama have the same thing: n_layer,
n_head, n_embd). What the model computes is transformers 5.17's DeepseekV2ForCausalLM; where that and
DeepSeek's own modeling code disagree (norm_topk_prob, scoring_func, moe_layer_freq, which transformers
ignores) the config is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tilekit import checkpoints

MAX_EXPERT_MLPS = 1 << 16     # routed experts times layers (DeepSeek-V3: 256 x 61); a loader keeps a few
                              # objects per expert and layer

MAX_FACTOR = 1e3        # mscale, mscale_all_dim, attention_factor, routed_scaling_factor: real ones are 0.7-16; 1e300
                        # overflowed the softmax factor (a traceback) or made every logit non-finite
LORA_NORM_EPS = 1e-6    # q_a_layernorm and kv_a_layernorm keep RMSNorm's default eps, whatever rms_norm_eps says
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _optional_number(owner, name: str) -> None:
    """ValueError unless owner.name is None or a number in [0, MAX_FACTOR]."""
    value = getattr(owner, name)
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                              or not 0 <= value <= MAX_FACTOR):
        raise ValueError(f"{type(owner).__name__}.{name} must be None or a number in [0, {MAX_FACTOR:g}], "
                         f"got {value!r}")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling (Hugging Face rope_type "yarn"): wavelengths between the beta_fast and beta_slow
    rotation counts of the original context are ramped from kept to divided by `factor`. mscale and
    mscale_all_dim (0 or None: unset) give the cos/sin factor and the softmax-scale correction."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        checkpoints.check_number(self, "factor")
        if self.factor < 1:
            raise ValueError(f"YarnScaling.factor must be >= 1, got {self.factor!r}")
        checkpoints.check_positive_ints(self, ("original_max_position_embeddings",))
        checkpoints.check_number(self, "beta_slow")
        checkpoints.check_number(self, "beta_fast")
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"YarnScaling.beta_fast ({self.beta_fast}) must be >= beta_slow ({self.beta_slow})")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            _optional_number(self, name)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnScaling.truncate must be a bool, got {self.truncate!r}")

    @property
    def cos_sin_factor(self) -> float:
        """What transformers multiplies cos and sin by (its attention_scaling)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """The factor on MLA's softmax scale: mscale(factor, mscale_all_dim)^2, 1 when mscale_all_dim is unset."""
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def rope_inv_freq(dim: int, theta: float, scaling: YarnScaling | None = None) -> np.ndarray:
    """float64 (dim / 2,) rotary inverse frequencies theta^(-2i / dim), with YaRN's ramp between extrapolation
    (kept) and interpolation (divided by factor) over the dimensions that make beta_fast..beta_slow rotations in
    the original context."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / ((high + 0.001 if low == high else high) - low),
                   0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def rope_problem(dim: int, theta: float, scaling: YarnScaling | None) -> str | None:
    """Why these RoPE parameters cannot rotate, or None: YaRN's correction range undefined (rope_theta 1, or a beta
    so small that its rotation count overflows), or frequencies checkpoints.rotary_problem refuses."""
    try:
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            inv_freq = rope_inv_freq(dim, theta, scaling)
    except (ZeroDivisionError, OverflowError, ValueError):
        return (f"leaves YaRN's correction range undefined (with beta_fast {scaling.beta_fast}, beta_slow "
                f"{scaling.beta_slow})")
    return checkpoints.rotary_problem(inv_freq, "qk_rope_head_dim", dim)


@dataclass(frozen=True)
class DeepseekV2Config(checkpoints.HFConfig):
    """Shape of a DeepSeek-V2 model (multi-head latent attention, a mixture of experts after the first
    first_k_dense_replace dense layers). The defaults are DeepSeek-V2-Lite's.

    Attention: queries from q_proj (q_lora_rank None) or q_a_proj -> RMSNorm -> q_b_proj, each head
    qk_nope_head_dim + qk_rope_head_dim wide; keys and values from a kv_lora_rank-wide latent plus one shared
    qk_rope_head_dim-wide rotary key, expanded by kv_b_proj to qk_nope_head_dim keys and v_head_dim values per
    head. MoE layers: a softmax router over n_routed_experts picks num_experts_per_tok, weighted by their
    probabilities times routed_scaling_factor, plus n_shared_experts always-on experts (one MLP of width
    n_shared_experts * moe_intermediate_size).
    """

    n_layer: int = 27
    n_head: int = 16
    n_embd: int = 2048
    vocab_size: int = 102400
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = YarnScaling(40.0, 4096, 32.0, 1.0, 0.707, 0.707)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 100000
    eos_token_id: int | tuple[int, ...] | None = 100001

    def __post_init__(self):
        checkpoints.check_positive_ints(self, ("n_layer", "n_head", "n_embd", "vocab_size", "intermediate_size",
                                   "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
                                   "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim", "max_position_embeddings"))
        if self.q_lora_rank is not None:
            checkpoints.check_positive_ints(self, ("q_lora_rank",))
        if self.n_embd % self.n_head:  # transformers refuses such a config
            raise ValueError(f"DeepseekV2Config.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"DeepseekV2Config.qk_rope_head_dim must be even (rotary embeddings rotate pairs), "
                             f"got {self.qk_rope_head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"DeepseekV2Config.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"n_routed_experts ({self.n_routed_experts})")
        first = self.first_k_dense_replace
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first <= self.n_layer:
            raise ValueError(f"DeepseekV2Config.first_k_dense_replace must be an int in [0, {self.n_layer}], "
                             f"got {first!r}")
        checkpoints.check_number(self, "routed_scaling_factor")
        if not 0 < self.routed_scaling_factor <= MAX_FACTOR:
            raise ValueError(f"DeepseekV2Config.routed_scaling_factor must lie in (0, {MAX_FACTOR:g}], got "
                             f"{self.routed_scaling_factor!r}")
        checkpoints.check_rotary_config(self, YarnScaling, rope_problem, self.qk_rope_head_dim)

    @property
    def block_size(self) -> int:
        """The longest sequence, by the name the engine and the references use."""
        return self.max_position_embeddings

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA's attention scale: qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2."""
        factor = 1.0 if self.rope_scaling is None else self.rope_scaling.softmax_factor
        return self.qk_head_dim ** -0.5 * factor

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def preset(cls, name: str) -> "DeepseekV2Config":
        """One of PRESETS ('deepseek-v2-lite')."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown DeepSeek-V2 preset {name!r}; choose from {sorted(PRESETS)}") from None

    @classmethod
    def from_fields(cls, f: checkpoints.Fields) -> "DeepseekV2Config":
        """Read a Hugging Face DeepseekV2Config (config.json's fields, transformers 4 or 5 layout), each checked,
        absent ones taking transformers 5.17's defaults; variants this model does not compute are refused, naming
        the field."""
        f.choice("model_type", ("deepseek_v2",), "deepseek_v2")
        f.variant("hidden_act", "silu", lambda v: v == "silu")
        for key in ("attention_bias", "mlp_bias", "norm_topk_prob"):   # transformers 5.17 ignores norm_topk_prob
            f.variant(key, False, lambda v: v is False)
        f.variant("topk_method", "greedy", lambda v: v == "greedy")
        f.variant("scoring_func", "softmax", lambda v: v == "softmax")          # ignored by transformers 5.17
        f.variant("moe_layer_freq", 1, lambda v: v == 1)                        # ignored by transformers 5.17
        f.variant("n_shared_experts", 2, lambda v: v not in (None, 0))
        n_head = f.integer("num_attention_heads", low=1, high=checkpoints.MAX_SIZE)
        f.variant("num_key_value_heads", None, lambda v: v in (None, n_head))
        positions = f.integer("max_position_embeddings", 2048, low=1, high=checkpoints.MAX_SIZE)
        rope, kind, theta = checkpoints.rope_fields(f, {"default": (), "yarn": YARN_KEYS},
                                           f.number("rope_theta", 10000.0, positive=True))
        scaling = None
        if kind == "yarn":
            # as transformers: a top-level original_max_position_embeddings wins, then the rope dict's
            original = f.integer("original_max_position_embeddings", None, low=1, high=checkpoints.MAX_SIZE) or \
                rope.integer("original_max_position_embeddings", positions, low=1, high=checkpoints.MAX_SIZE)
            beta_fast, beta_slow = rope.number("beta_fast", 32.0, positive=True), rope.number("beta_slow", 1.0,
                                                                                                positive=True)
            if beta_fast < beta_slow:
                raise rope.error("beta_fast", f"is {beta_fast}: it must be >= beta_slow ({beta_slow})")
            scaling = YarnScaling(
                rope.number("factor", low=1.0), original, beta_fast, beta_slow,
                rope.number("mscale", None, low=0.0, high=MAX_FACTOR), rope.number("mscale_all_dim", None, low=0.0,
                                                                                   high=MAX_FACTOR),
                rope.number("attention_factor", None, low=0.0, high=MAX_FACTOR),
                rope.boolean("truncate", True))
        rope_dim = f.integer("qk_rope_head_dim", low=1, high=checkpoints.MAX_SIZE)
        if rope_dim % 2 == 0:                                                           # odd: build says so
            checkpoints.refuse_rope_theta(f, rope, theta, rope_problem(rope_dim, theta, scaling))
        vocab = f.integer("vocab_size", low=1, high=checkpoints.MAX_SIZE)
        n_layer = f.integer("num_hidden_layers", low=1, high=checkpoints.MAX_LAYERS)
        experts = f.integer("n_routed_experts", low=1, high=checkpoints.MAX_SIZE)
        if experts * n_layer > MAX_EXPERT_MLPS:
            raise f.error("n_routed_experts", f"is {experts}: over {n_layer} layers more than {MAX_EXPERT_MLPS} "
                                              "expert MLPs, which no model comes near")
        return f.build(cls, n_layer=n_layer, n_head=n_head,
                       n_embd=f.integer("hidden_size", low=1, high=checkpoints.MAX_SIZE), vocab_size=vocab,
                       intermediate_size=f.integer("intermediate_size", low=1, high=checkpoints.MAX_SIZE),
                       moe_intermediate_size=f.integer("moe_intermediate_size", low=1, high=checkpoints.MAX_SIZE),
                       n_routed_experts=experts,
                       n_shared_experts=f.integer("n_shared_experts", 2, low=1, high=checkpoints.MAX_SIZE),
                       num_experts_per_tok=f.integer("num_experts_per_tok", low=1, high=checkpoints.MAX_SIZE),
                       first_k_dense_replace=f.integer("first_k_dense_replace", 0, low=0, high=checkpoints.MAX_LAYERS),
                       routed_scaling_factor=f.number("routed_scaling_factor", 1.0, positive=True, high=MAX_FACTOR),
                       q_lora_rank=f.integer("q_lora_rank", None if "q_lora_rank" in f else 1536, low=1,
                                             high=checkpoints.MAX_SIZE),
                       kv_lora_rank=f.integer("kv_lora_rank", low=1, high=checkpoints.MAX_SIZE),
                       qk_nope_head_dim=f.integer("qk_nope_head_dim", low=1, high=checkpoints.MAX_SIZE),
                       qk_rope_head_dim=rope_dim,
                       v_head_dim=f.integer("v_head_dim", low=1, high=checkpoints.MAX_SIZE), max_position_embeddings=positions,
                       rope_theta=theta, rope_scaling=scaling, **checkpoints.common_fields(f, vocab))

    def to_hf_dict(self) -> dict:
        """A config.json that transformers' DeepseekV2ForCausalLM reads (the transformers 4 layout of the hub)."""
        scaling = None if self.rope_scaling is None else {"type": "yarn", **{
            k: v for k, v in dataclasses.asdict(self.rope_scaling).items() if v is not None}}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "num_hidden_layers": self.n_layer, "num_attention_heads": self.n_head,
                "num_key_value_heads": self.n_head, "hidden_size": self.n_embd, "vocab_size": self.vocab_size,
                "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
                "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
                "num_experts_per_tok": self.num_experts_per_tok, "first_k_dense_replace": self.first_k_dense_replace,
                "routed_scaling_factor": self.routed_scaling_factor, "topk_method": "greedy",
                "norm_topk_prob": False, "n_group": 1, "topk_group": 1, "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
                "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "rope_scaling": scaling, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id, "eos_token_id": eos}


# deepseek-ai/DeepSeek-V2-Lite's config.json on the Hugging Face hub (transformers 4.33 layout: rope_scaling
# {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
# "mscale": 0.707, "mscale_all_dim": 0.707}, rope_theta 10000, q_lora_rank null, norm_topk_prob false,
# topk_method "greedy", n_group 1, topk_group 1, scoring_func "softmax", moe_layer_freq 1), every value
# checked against a transformers 5.7 dump of DeepSeek-V2-Lite-Chat's config (same shapes; 15,706,484,224
# parameters in 5,291 tensors). The field defaults above are these values.
PRESETS: dict[str, DeepseekV2Config] = {
    "deepseek-v2-lite": DeepseekV2Config(),
}
