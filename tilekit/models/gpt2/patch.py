"""tilekit.patch's rules for transformers' GPT2LMHeadModel: what it refuses, and which module forwards it swaps
(Conv1D -> linear, LayerNorm -> layer_norm, GPT2MLP -> linear with GELU in its epilogue, then linear)."""

from __future__ import annotations

import types
from collections.abc import Callable

from tilekit.models.patching import last_contiguous

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")     # the GELU linear's epilogue computes


def head_dim(config) -> int:
    return config.n_embd // config.n_head


def config_problems(config) -> list[str]:
    """What in a GPT2Config the kernels do not compute, each named."""
    problems = []
    if config.activation_function not in GELU_TANH:
        problems.append(f"activation_function={config.activation_function!r} (tilekit's linear fuses the tanh "
                        f"GELU: {' or '.join(GELU_TANH)})")
    if config.add_cross_attention:
        problems.append("add_cross_attention=True (cross-attention is not supported)")
    return problems


def mlp(family: types.ModuleType) -> tuple[type, type, tuple[str, ...]]:
    """(the MLP class, the class its projections must be, their names)."""
    return family.GPT2MLP, family.Conv1D, ("c_fc", "c_proj")


def forwards(family: types.ModuleType) -> dict[type, Callable]:
    """Module class -> the tilekit forward that replaces its own (nn.Linear's comes from tilekit.patch)."""
    from torch import nn

    from tilekit.kernels import layer_norm, linear

    def conv1d_forward(self, x):                     # GPT-2's Conv1D: weight [in, out]
        return linear(last_contiguous(x), self.weight, self.bias)

    def layer_norm_forward(self, x):
        return layer_norm(x.contiguous(), self.weight, self.bias, self.eps)

    def gelu_mlp_forward(self, x):                   # c_fc with the GELU in its epilogue, then c_proj
        h = linear(last_contiguous(x), self.c_fc.weight, self.c_fc.bias, activation="gelu")
        return linear(h, self.c_proj.weight, self.c_proj.bias)

    return {family.Conv1D: conv1d_forward, nn.LayerNorm: layer_norm_forward, family.GPT2MLP: gelu_mlp_forward}
