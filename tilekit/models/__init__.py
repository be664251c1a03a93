"""Models on tilekit's GPU kernels, one folder per family (gpt2/, llama/, deepseek_v2/: config, weights, model,
reference, patch rules) and what they share: families.py (the table of families), base.py (weights, the shared
plumbing of the math, the cache a model asks for), quantization.py (FP8 / INT8 linears), reference.py (the NumPy
references), running.py (the calls into the engine that runs a model: tilekit.engine). Checkpoint files are
tilekit.checkpoints'.

The names below are imported on first use, so that importing tilekit.models (or tilekit.models.families)
imports no GPU library.
"""

import importlib

_EXPORTS = {
    "GPT": ("tilekit.models.gpt2.model", "GPT"),
    "GPTConfig": ("tilekit.models.gpt2.config", "GPTConfig"),
    "PRESETS": ("tilekit.models.gpt2.config", "PRESETS"),
    "ReferenceGPT": ("tilekit.models.gpt2.reference", "ReferenceGPT"),
    "Llama": ("tilekit.models.llama.model", "Llama"),
    "LlamaConfig": ("tilekit.models.llama.config", "LlamaConfig"),
    "LLAMA_PRESETS": ("tilekit.models.llama.config", "PRESETS"),
    "ReferenceLlama": ("tilekit.models.llama.reference", "ReferenceLlama"),
    "DeepseekV2": ("tilekit.models.deepseek_v2.model", "DeepseekV2"),
    "DeepseekV2Config": ("tilekit.models.deepseek_v2.config", "DeepseekV2Config"),
    "DEEPSEEK_V2_PRESETS": ("tilekit.models.deepseek_v2.config", "PRESETS"),
    "ReferenceDeepseekV2": ("tilekit.models.deepseek_v2.reference", "ReferenceDeepseekV2"),
    "load_model": ("tilekit.models.families", "load_model"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tilekit.models' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value          # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
