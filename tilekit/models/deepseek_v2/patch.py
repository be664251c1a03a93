"""tilekit.patch's rules for transformers' DeepseekV2ForCausalLM: what it refuses, and which module forwards it swaps
(DeepseekV2RMSNorm -> rms_norm, DeepseekV2MLP -> swiglu_linear then linear, DeepseekV2Moe -> moe_router,
moe_permute, moe_gate_up and moe_down_combine into a fixed-point sum, then the shared experts' MLP added by the
down projection's residual). Attention stays transformers' MLA (its latent cache, RoPE and key expansion) with
tilekit's attention function, which zero-pads the values to the query head dim."""

from __future__ import annotations

import types
from collections.abc import Callable

from tilekit.models.patching import last_contiguous


def head_dim(config) -> int:
    return config.qk_nope_head_dim + config.qk_rope_head_dim


def config_problems(config) -> list[str]:
    """What in a DeepseekV2Config the kernels do not compute, each named."""
    from tilekit.kernels.moe_router import MAX_EXPERTS
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (swiglu_linear and moe_gate_up compute silu)")
    if config.mlp_bias:
        problems.append("mlp_bias=True (swiglu_linear has no bias)")
    if config.topk_method != "greedy":
        problems.append(f"topk_method={config.topk_method!r} (moe_router picks the greedy top-k)")
    if config.n_routed_experts > MAX_EXPERTS:
        problems.append(f"n_routed_experts={config.n_routed_experts} (moe_router takes at most {MAX_EXPERTS})")
    return problems


def mlp(family: types.ModuleType) -> tuple[type, type, tuple[str, ...]]:
    """(the MLP class, the class its projections must be, their names)."""
    from torch import nn
    return family.DeepseekV2MLP, nn.Linear, ("gate_proj", "up_proj", "down_proj")


def forwards(family: types.ModuleType) -> dict[type, Callable]:
    """Module class -> the tilekit forward that replaces its own (nn.Linear's comes from tilekit.patch)."""
    import torch

    from tilekit.kernels import (fixed_cast, linear, moe_down_combine, moe_gate_up, moe_permute, moe_router,
                                 rms_norm, swiglu_linear)
    from tilekit.kernels.tiles import FIXED_DTYPE

    def rms_norm_forward(self, x):
        return rms_norm(x.contiguous(), self.weight, self.variance_epsilon)

    def swiglu_mlp_forward(self, x, residual=None):     # silu(x Wg^T) * (x Wu^T) in one kernel, then down_proj
        h = swiglu_linear(last_contiguous(x), self.gate_proj.weight, self.up_proj.weight)
        return linear(h, self.down_proj.weight, weight_layout="out_in", residual=residual)

    def moe_forward(self, hidden_states):
        """The routed experts' weighted sum in fixed point (the same bits every run), plus the shared experts."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).contiguous()
        gate = self.gate
        ids, weights = moe_router(x, gate.weight, gate.top_k, scale=gate.routed_scaling_factor)
        offsets, pairs = moe_permute(ids, gate.weight.shape[0])
        act = moe_gate_up(x, self.experts.gate_up_proj, offsets, pairs)
        acc = torch.zeros(x.shape, dtype=getattr(torch, FIXED_DTYPE), device=x.device)
        moe_down_combine(act, self.experts.down_proj, weights, offsets, pairs, acc)
        routed = fixed_cast(acc, torch.empty_like(x))
        return swiglu_mlp_forward(self.shared_experts, x, residual=routed).view(hidden_states.shape)

    return {family.DeepseekV2RMSNorm: rms_norm_forward, family.DeepseekV2MLP: swiglu_mlp_forward,
            family.DeepseekV2Moe: moe_forward}
