"""Models on tilekit's GPU kernels: GPT-2 and the Llama family, with their NumPy references, configs and
checkpoint I/O; runtime.py is what they share (CUDA graphs, KV cache, generation)."""

from tilekit.models.config import PRESETS, GPTConfig
from tilekit.models.gpt import GPT
from tilekit.models.llama import Llama
from tilekit.models.llama_config import LLAMA_PRESETS, LlamaConfig
from tilekit.models.llama_reference import ReferenceLlama
from tilekit.models.reference import ReferenceGPT

__all__ = ["GPT", "GPTConfig", "LLAMA_PRESETS", "Llama", "LlamaConfig", "PRESETS", "ReferenceGPT", "ReferenceLlama"]
