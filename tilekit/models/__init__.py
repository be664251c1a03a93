"""Models: GPT-2 on tilekit's GPU kernels, the Llama family's groundwork, their NumPy references, configs and
checkpoint I/O.

Llama has its config, checkpoint I/O and NumPy reference here; its GPU model comes with the Llama kernels
(RMSNorm, RoPE, SwiGLU, grouped-query attention).
"""

from tilekit.models.config import PRESETS, GPTConfig
from tilekit.models.gpt import GPT
from tilekit.models.llama_config import LLAMA_PRESETS, LlamaConfig
from tilekit.models.llama_reference import ReferenceLlama
from tilekit.models.reference import ReferenceGPT

__all__ = ["GPT", "GPTConfig", "LLAMA_PRESETS", "LlamaConfig", "PRESETS", "ReferenceGPT", "ReferenceLlama"]
