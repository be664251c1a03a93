"""tilekit.patch(model) / tilekit.unpatch(model): a Hugging Face causal LM of a family tilekit runs (GPT-2,
Llama, DeepSeek-V2) on tilekit's kernels.

patch swaps the forward of every norm, projection and MLP for a tilekit op on the same torch tensors
(no copies) and switches the model to a "tilekit" attention function, so `model(...)` and
`model.generate(...)` run on tilekit kernels; embeddings, RoPE and the KV cache stay Hugging Face's.
unpatch restores the model exactly. Which transformers class each family patches, and its rules (what it
refuses, which forwards it swaps), come from the families table (tilekit.models.families) and the family's
patch.py. Nothing here imports torch or transformers until patch is called.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from tilekit.models.families import FAMILIES, Family

ATTENTION = "tilekit"                 # the name of tilekit's attention function in transformers' registries
STATE = "_tilekit_patch"              # the model attribute holding what unpatch restores
DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class _Patched:
    """What patch changed on one model."""

    attn_implementation: str | None
    disable_compile: bool | None
    modules: list = field(default_factory=list)   # the modules given a tilekit forward


def patch(model: torch.nn.Module) -> torch.nn.Module:
    """Run a transformers GPT2LMHeadModel, LlamaForCausalLM or DeepseekV2ForCausalLM on tilekit kernels; returns
    the model.

    Swapped: LayerNorm -> layer_norm, LlamaRMSNorm -> rms_norm, nn.Linear (lm_head included) and
    GPT-2's Conv1D -> linear, GPT2MLP -> linear with GELU in its epilogue then linear, LlamaMLP ->
    swiglu_linear then linear, DeepSeek-V2's RMSNorm, MLP and MoE -> rms_norm, swiglu_linear then linear, and
    the MoE kernels, attention -> tilekit's causal flash attention (grouped-query too; values narrower than the
    queries, as in MLA, zero-padded).
    Where transformers builds an attention mask (padded batches, a static cache's decode steps), or a
    module asks for dropout or non-causal attention, that layer's attention falls back to transformers'
    own sdpa, which is correct for it; masks are built as for sdpa, so plain causal attention has none.
    generation_config.disable_compile is set (torch.compile cannot trace the kernels' launches).

    Inference only: the model must be in eval mode, every tensor on one CUDA device, every parameter
    of one dtype (bfloat16, float16 or float32), and the config something the kernels compute;
    otherwise a TypeError (not such a model) or ValueError naming every problem is raised before
    anything changed. Outputs carry no gradient. The first call with each new shape (for example
    each new key length of a dynamic cache) builds a launch plan; later calls reuse it.
    """
    family, modeling = _family(model)
    if vars(model).get(STATE) is not None:
        raise ValueError(f"this {type(model).__name__} is already patched (tilekit.unpatch(model) undoes it)")
    forwards = _forwards(family, modeling)
    problems = _problems(model, family, modeling, forwards)
    if problems:
        raise ValueError(f"tilekit.patch cannot patch this {type(model).__name__}: " + "; ".join(problems))
    _register_attention()
    generation = getattr(model, "generation_config", None)
    state = _Patched(model.config._attn_implementation, getattr(generation, "disable_compile", None))
    model.set_attn_implementation(ATTENTION)     # validated by transformers; raises before anything changed
    if model.config._attn_implementation != ATTENTION:
        raise RuntimeError(f"transformers kept attention {model.config._attn_implementation!r} for this "
                           f"{type(model).__name__}; nothing was patched")
    for module in model.modules():
        forward = forwards.get(type(module))
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            state.modules.append(module)
    if generation is not None:
        generation.disable_compile = True
    setattr(model, STATE, state)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo patch(model): every module's own forward, the previous attention implementation and
    generation_config.disable_compile come back; returns the model."""
    _family(model)
    state = vars(model).get(STATE)
    if state is None:
        raise ValueError(f"this {type(model).__name__} is not patched (tilekit.patch(model) patches it)")
    for module in state.modules:
        del module.forward
    model.config._attn_implementation = state.attn_implementation
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.disable_compile = state.disable_compile
    delattr(model, STATE)
    return model


def _family(model) -> tuple[Family, types.ModuleType]:
    """(family, its transformers modeling module) of a model patch supports (no modeling module is imported
    here: a model of one has imported it already), else TypeError naming what `model` is."""
    for family in FAMILIES.values():
        modeling = sys.modules.get(family.hf_module)
        if modeling is not None and isinstance(model, getattr(modeling, family.hf_class)):
            return family, modeling
    kind = type(model)
    raise TypeError(f"expected a transformers {' or '.join(f.hf_class for f in FAMILIES.values())}, got "
                    f"{kind.__module__}.{kind.__qualname__}")


def _problems(model, family: Family, modeling: types.ModuleType, forwards: dict) -> list[str]:
    """Everything that stops patch, each naming what is unsupported (empty: patch may go ahead)."""
    from tilekit.kernels.attention import MAX_HEAD_DIM
    config, problems = model.config, []
    if any(m.training for m in model.modules()):
        problems.append("it is in training mode (tilekit.patch is for inference: call model.eval() first)")
    devices = sorted({str(t.device) for t in (*model.parameters(), *model.buffers())})
    if len(devices) != 1 or not devices[0].startswith("cuda"):
        problems.append(f"its tensors are on {', '.join(devices) or 'no device'} (tilekit needs them all on one "
                        "CUDA device)")
    dtypes = {name: str(p.dtype).removeprefix("torch.") for name, p in model.named_parameters()}
    first = next(iter(dtypes.values()), "float32")
    odd = [name for name, dtype in dtypes.items() if dtype != first]
    if odd:
        problems.append(f"its parameters mix dtypes ({first} and {dtypes[odd[0]]}, e.g. {odd[0]})")
    elif first not in DTYPES:
        problems.append(f"dtype {first} (tilekit computes in {', '.join(DTYPES)})")
    problems += family.patch.config_problems(config)
    head_dim = family.patch.head_dim(config)
    if head_dim > MAX_HEAD_DIM:
        problems.append(f"head_dim {head_dim} (tilekit's attention takes at most {MAX_HEAD_DIM})")
    if not getattr(config, "is_causal", True):
        problems.append("is_causal=False (tilekit's attention is causal)")
    return problems + _module_problems(model, family, modeling, forwards)


def _module_problems(model, family: Family, modeling: types.ModuleType, forwards: dict) -> list[str]:
    """Modules patch cannot replace: a forward of their own already (hooks, another patch), a subclass of
    a class it replaces, a LayerNorm without affine parameters, an MLP whose projections are not plain."""
    from torch import nn
    mlp, plain, projections = family.patch.mlp(modeling)
    problems = []
    for name, module in model.named_modules():
        name, kind = name or "the model", type(module)
        if "forward" in vars(module):
            problems.append(f"{name} already has a forward of its own (a hook or another patch)")
        if kind not in forwards and isinstance(module, tuple(forwards)):
            problems.append(f"{name} is a {kind.__qualname__}, a subclass tilekit.patch does not know")
        if kind is nn.LayerNorm and (module.weight is None or module.bias is None
                                     or len(module.normalized_shape) != 1):
            problems.append(f"{name} is a LayerNorm without a weight and a bias over one dimension")
        if kind is mlp:
            problems += [f"{name}.{child} is a {type(getattr(module, child)).__qualname__}, not a {plain.__qualname__}"
                         for child in projections if type(getattr(module, child)) is not plain]
    return problems


def _forwards(family: Family, modeling: types.ModuleType) -> dict[type, Callable]:
    """Module class -> the tilekit forward that replaces its own: every nn.Linear's (the LM head's too) on
    `linear`, and the family's own (its patch.py)."""
    from torch import nn

    from tilekit.models.patching import linear_forward
    return {nn.Linear: linear_forward, **family.patch.forwards(modeling)}


@functools.cache
def _register_attention() -> None:
    """Register tilekit's attention function with transformers, with sdpa's mask function (None where
    the attention is plain causal, so only masked layers fall back)."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from tilekit.kernels import attention
    from tilekit.models.patching import last_contiguous

    def tilekit_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """(B, Tq, H, D) attention of (B, H, Tq, D) queries over (B, Hkv, Tk, D) keys and values, and None."""
        causal = kwargs.get("is_causal")
        if causal is None:
            causal = getattr(module, "is_causal", True)
        if attention_mask is not None or dropout or not causal:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        q_len = query.shape[2]
        if key.shape[2] > q_len > 1:    # an empty static cache's prefill: as sdpa, keep the first q_len keys
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        dv = value.shape[-1]
        if dv < query.shape[-1]:        # narrower values (MLA): zero-padded to the head dim, the output sliced
            value = torch.nn.functional.pad(value, (0, query.shape[-1] - dv))
        out = attention(last_contiguous(query), last_contiguous(key), last_contiguous(value), causal=True,
                        scale=scaling)
        return out[..., :dv].transpose(1, 2), None

    AttentionInterface.register(ATTENTION, tilekit_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
