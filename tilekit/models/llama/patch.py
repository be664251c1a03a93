"""tilekit.patch's rules for transformers' LlamaForCausalLM: what it refuses, and which module forwards it swaps
(LlamaRMSNorm -> rms_norm, LlamaMLP -> swiglu_linear, then linear)."""

from __future__ import annotations

import types
from collections.abc import Callable

from tilekit.models.patching import last_contiguous


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def config_problems(config) -> list[str]:
    """What in a LlamaConfig the kernels do not compute, each named."""
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (swiglu_linear computes silu)")
    if config.mlp_bias:
        problems.append("mlp_bias=True (swiglu_linear has no bias)")
    return problems


def mlp(family: types.ModuleType) -> tuple[type, type, tuple[str, ...]]:
    """(the MLP class, the class its projections must be, their names)."""
    from torch import nn
    return family.LlamaMLP, nn.Linear, ("gate_proj", "up_proj", "down_proj")


def forwards(family: types.ModuleType) -> dict[type, Callable]:
    """Module class -> the tilekit forward that replaces its own (nn.Linear's comes from tilekit.patch)."""
    from tilekit.kernels import linear, rms_norm, swiglu_linear

    def rms_norm_forward(self, x):
        return rms_norm(x.contiguous(), self.weight, self.variance_epsilon)

    def swiglu_mlp_forward(self, x):             # silu(x Wg^T) * (x Wu^T) in one kernel, then down_proj
        h = swiglu_linear(last_contiguous(x), self.gate_proj.weight, self.up_proj.weight)
        return linear(h, self.down_proj.weight, weight_layout="out_in")

    return {family.LlamaRMSNorm: rms_norm_forward, family.LlamaMLP: swiglu_mlp_forward}
